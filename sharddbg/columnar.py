"""The columnar trace file (``.sdtrace.arrow``): the records of every rank as one Apache Arrow table.

JSON (``.sdtrace.json``) is the readable form of a trace; a big one (a million records) is written and read
far faster as columns. The file is an Arrow IPC file (``pyarrow.ipc``), one row per record, every rank's in
one table:

- the table's schema metadata holds, under the key ``sharddbg``, the JSON trace document without the
  records: ``format`` ("sharddbg.trace"), ``version``, ``schema_version``, ``meta``, ``clock_offsets_ns``,
  ``incomplete_ranks``, ``ranks``, and ``payloads`` whose ``events`` are left out (null for a rank that sent
  nothing), plus ``layout`` ("columnar") and ``columns`` (``COLUMNS_VERSION``);
- the columns: ``rank``, then every field of the op, collective and error records (``schema.OP_FIELDS``,
  ``COLLECTIVE_FIELDS``, ``CELL_ERROR_FIELDS``, ``OPTIONAL_FIELDS``), one column per name. A field holding a
  number, a string or a bool is a typed column (int64, float64, string, bool; null for None); a field that
  holds a list or a dict (shapes, errors, promotions, ...) is a string column of its JSON text. Every string
  column is dictionary-encoded (columns version 2; version 1, plain ``large_string``, still reads). ``extra``
  holds, as a JSON object, a record's keys that its kind's columns do not name (a ``meta`` record's ``name``,
  ``t_ns`` and ``data``), else null.

A record holds its kind's fields (an older payload's records as this schema reads them, ``current_events``)
and the optional fields where they say something. ``load_trace`` keeps the table (``EventColumns``): its
checks run on whole columns (``plainly_valid``), the trace's tables are built from the columns, and a rank's
records are made as dicts only when asked for (``LazyRecords``). Where a column check finds anything,
``read_document`` turns the file back into the JSON document, which ``load_trace`` checks exactly as it checks
a JSON file, naming what is wrong.
"""

from __future__ import annotations

import gc
import json
import threading
from contextlib import contextmanager
from functools import partial
from operator import itemgetter
from collections.abc import Iterator, Sequence
from typing import Any

from . import schema

__all__ = ["COLUMNS_VERSION", "LAYOUT", "COLUMNS", "KIND_COLUMNS", "write_document", "read_document", "read_table",
           "write_table", "cyclic_gc_paused", "numpy_huge_pages_unadvised", "table_of_payloads", "table_of_records", "table_holding_records", "table_of_few_records", "RecordRows", "concat_tables", "file_table", "records_of", "decoded_json", "distinct_json", "EventColumns",
           "LazyRecords", "header_of", "EVENTS_AS_COLUMNS", "payload_as_columns", "table_of_stream",
           "ColumnarProblem"]

LAYOUT = "columnar"
# what the columns are; a reader refuses a newer one. 1: text in large_string columns; 2: text (and JSON text)
# dictionary-encoded (int32 indices into each column's distinct texts): a million records' op names, paths and
# shapes held once each, a few MiB in memory instead of hundreds
COLUMNS_VERSION = 2
METADATA_KEY = b"sharddbg"

# the record kinds with columns of their own, and their fields in the schema's order
KIND_FIELDS: dict[str, dict] = {
    schema.KIND_OP: schema.OP_FIELDS,
    schema.KIND_COLLECTIVE: schema.COLLECTIVE_FIELDS,
    schema.KIND_ERROR: schema.CELL_ERROR_FIELDS,
}


def _column_type(types: set[type]) -> str:
    """The column a field of these JSON types is kept in: 'json' for lists, dicts and mixed text."""
    types = types - {type(None)}
    if types & {list, dict} or (str in types and len(types) > 1):
        return "json"
    if float in types:
        return "float"
    if int in types:
        return "int"
    if bool in types:
        return "bool"
    return "str"


def _columns() -> dict[str, str]:
    allowed: dict[str, set[type]] = {"kind": {str}, "seq": {int}}
    for kind, fields in KIND_FIELDS.items():
        for name, (types, _doc) in {**fields, **schema.OPTIONAL_FIELDS.get(kind, {})}.items():
            allowed.setdefault(name, set()).update(types)
    return {name: _column_type(types) for name, types in allowed.items()}


COLUMNS: dict[str, str] = _columns()  # field -> "int", "float", "bool", "str" or "json"
# kind -> the fields its records always hold; the optional ones are added where not null
KIND_COLUMNS: dict[str, tuple[str, ...]] = {kind: tuple(fields) for kind, fields in KIND_FIELDS.items()}
KIND_COLUMNS[schema.KIND_META] = ("kind", "seq")
_OPTIONAL = {kind: tuple(schema.OPTIONAL_FIELDS.get(kind, {})) for kind in KIND_COLUMNS}


class ColumnarProblem(Exception):
    """What is wrong in a columnar file (load_trace adds the file's name)."""


def _arrow_type(pa, kind: str, version: int = COLUMNS_VERSION):
    made = _ARROW_TYPES.get((kind, version))
    if made is None:  # made once: a type is asked for per column of every table
        text = pa.large_string() if version < 2 else pa.dictionary(pa.int32(), pa.large_string())
        made = _ARROW_TYPES[kind, version] = {"int": pa.int64(), "float": pa.float64(), "bool": pa.bool_(),
                                              "str": text, "json": text}[kind]
    return made


_ARROW_TYPES: dict[tuple[str, int], Any] = {}


def file_table(table) -> Any:
    """``table`` with the column types of this version's file (text dictionary-encoded) and one chunk per column:
    an IPC file holds one dictionary per column.

    Parameters
    ----------
    table : pyarrow.Table
        Columns of records, their text plain (``large_string``) or dictionary-encoded.

    Returns
    -------
    pyarrow.Table
        The same rows, text dictionary-encoded, one chunk per column.

    Examples
    --------
    >>> file_table(plain).schema.field("op").type
    DictionaryType(dictionary<values=large_string, indices=int32, ordered=0>)
    """
    import pyarrow as pa

    for i, field in enumerate(table.schema):
        if field.type == pa.large_string():
            table = table.set_column(i, pa.field(field.name, _arrow_type(pa, "str")),
                                     table.column(i).dictionary_encode())
    return table.combine_chunks()


def _json_encoder():
    """json's C encoder, made once: ``"".join(encode(value, 0))`` is ``json.dumps(value, separators=(",", ":"),
    allow_nan=False)`` without building an encoder per value (a third of the time on a million)."""
    from json.encoder import c_make_encoder, encode_basestring_ascii

    if c_make_encoder is None:  # a Python without the C accelerator
        return lambda value, _level: (json.dumps(value, separators=(",", ":"), allow_nan=False),)

    def refuse(value):
        raise TypeError(f"Object of type {type(value).__name__} is not JSON serializable")

    return c_make_encoder(None, refuse, encode_basestring_ascii, None, ":", ",", False, False, False)


def write_document(doc: dict, sink) -> None:
    """Write the trace document ``doc`` (``Trace.to_dict``) to ``sink`` (a binary file) as the columnar file.

    Raises ValueError for a NaN or infinite number, as JSON does."""
    write_table(doc, table_of_payloads(doc["ranks"], doc["payloads"]), sink)


def header_of(doc: dict) -> dict:
    """The file's sharddbg header for the trace document ``doc``: the document without its records."""
    header = {k: v for k, v in doc.items() if k != "payloads"}
    header["layout"] = LAYOUT
    header["columns"] = COLUMNS_VERSION
    header["payloads"] = [None if p is None else {k: v for k, v in p.items() if k != "events"}
                          for p in doc["payloads"]]
    return header


def write_table(doc: dict, table, sink) -> None:
    """Write ``table`` (the columns of ``doc``'s records, ``table_of_payloads``) under ``doc``'s header to ``sink``
    as the columnar file; ``doc``'s payloads' records are not read (they may be left out)."""
    import pyarrow as pa

    header = header_of(doc)
    table = file_table(table).replace_schema_metadata({
        METADATA_KEY: json.dumps(header, separators=(",", ":"), allow_nan=False).encode()})
    # zstd: a trace repeats itself (op names, shapes, lines of code); the columns shrink many times for little CPU
    with pa.ipc.new_file(sink, table.schema, options=pa.ipc.IpcWriteOptions(compression="zstd")) as writer:
        writer.write_table(table)


def table_of_payloads(ranks: list, payloads: list):
    """The columns (a ``pyarrow.Table``, the file's schema) of the records of ``payloads`` (one per rank of
    ``ranks``, None for a rank that sent nothing), built a column at a time: a field's values read in C, a JSON
    field's text made once per distinct value.

    Raises ValueError for a NaN or infinite number, as JSON does."""
    with cyclic_gc_paused():
        tables = [table_of_records(rank, schema.current_events(p)) for rank, p in zip(ranks, payloads)
                  if p is not None]
    if not tables:
        return table_of_records(0, [])
    return concat_tables(tables)


def concat_tables(tables: list):
    """The tables of several ranks (``table_of_records``, each rank's rows together, ranks ascending) as one table
    of one chunk per column, their dictionaries unified."""
    import pyarrow as pa

    return tables[0] if len(tables) == 1 else pa.concat_tables(tables).combine_chunks(memory_pool=_building_pool(pa))


def table_of_records(rank: int, events: list):
    """The columns (``table_of_payloads``' schema) of one rank's records ``events`` (as this schema reads them),
    in their order.

    Raises ValueError for a NaN or infinite number, as JSON does."""
    import numpy as np
    import pyarrow as pa

    with cyclic_gc_paused():
        return _table_of_records(rank, events)


def table_holding_records(records_by_rank: list, values_from_json: bool = False) -> Any:
    """The columns of several ranks' records (``table_of_payloads``' table) when they hold them exactly, else None:
    ``records_of`` gives back dicts equal to them, each value of its own type (an int stays an int in a float field, a
    tuple is not made a list, an optional field holding None is not left out), and every record holds its kind's
    fields. What makes a trace of dicts keep its records as columns (``trace.RECORDS_AS_COLUMNS_FROM``): where this
    gives None, the records stay dicts and their checks name what is odd, if anything is wrong.

    Parameters
    ----------
    records_by_rank : list of (int, list)
        Each rank (ascending) and its records, as this schema reads them.
    values_from_json : bool, default False
        The records are what ``json.loads`` made: their values are of JSON's types only (no tuple, no numpy
        scalar, no subclass), so that Arrow's reading of a column tells its types apart (an int among floats
        excepted, looked for apart); else every value's type is looked at.

    Returns
    -------
    pyarrow.Table or None
        Their columns, or None where the columns would not give them back as they are (or cannot be built: a NaN,
        a value JSON cannot write, a record that is not a dict).

    Examples
    --------
    >>> records_of(table_holding_records([(0, [{"kind": "meta", "seq": 0, "name": "cell"}])]))
    [{'kind': 'meta', 'seq': 0, 'name': 'cell'}]
    >>> table_holding_records([(0, [{"kind": "meta", "seq": True}])]) is None
    True
    """
    import pyarrow as pa

    with cyclic_gc_paused():
        try:
            # a table per rank, put together: each rank's records made into columns while they are in the cache
            exact = _EXACT_JSON if values_from_json else _EXACT_PYTHON
            tables = [_table_of_records(rank, records, exact) for rank, records in records_by_rank if records]
            return concat_tables(tables) if tables else _table_of_records(0, [])
        except (_NotExact, ValueError, TypeError, KeyError, AttributeError, OverflowError, RecursionError,
                pa.ArrowException):
            return None


class _NotExact(Exception):
    """The columns would not give the records back as they are (``table_holding_records``)."""


# how closely a table's build looks at the records it is given (the ``exact`` of ``_table_of_records``): None, not at
# all (``table_of_records``: the records as this schema reads them, types as they are); where the columns give them
# back as they are, with values json.loads made (JSON's types only), or with values of any Python type
_EXACT_JSON = "values from JSON"
_EXACT_PYTHON = "values of any type"


# a column's kind -> the one Python type its values have (besides None) where the column gives them back as they are
_EXACT_TYPE = {"int": int, "float": float, "bool": bool, "str": str}


def _same_value(made: Any, value: Any) -> bool:
    """``made`` (a value read back from its JSON text) is ``value``: equal, and of the same types all the way down
    (1 is not 1.0 nor True, a tuple is not a list, a dict's keys in the same order)."""
    if type(made) is not type(value):
        return False
    if type(value) is list:
        return len(made) == len(value) and all(map(_same_value, made, value))
    if type(value) is dict:
        return list(made) == list(value) and all(map(_same_value, made.values(), value.values()))
    return made == value


def _exact_text(value: Any, text: str) -> str:
    """``text``, the JSON text of ``value``, where it reads back as ``value`` (``_same_value``); _NotExact else."""
    if not _same_value(json.loads(text), value):
        raise _NotExact
    return text


def table_of_few_records(rank: int, records: list) -> Any:
    """The columns of ``records`` (``table_of_records``' rows and types), made a record at a time (``RecordRows``):
    for a few hundred records, what costs is the number of columns, not of rows, and this makes each column once,
    where ``table_of_records`` makes every column of every record kind and puts the kinds back in order. A None in
    ``records`` is a row null in every column but ``rank``.

    Parameters
    ----------
    rank : int
        The ``rank`` column's value.
    records : list of dict or None
        Records as this schema reads them, in order.

    Returns
    -------
    pyarrow.Table
        ``rank``, every field's column, ``extra``; text dictionary-encoded.

    Raises
    ------
    ValueError
        A NaN or an infinite number, which JSON does not hold.

    Examples
    --------
    >>> table_of_few_records(0, [{"kind": "meta", "seq": 0}, None]).num_rows
    2
    """
    rows = RecordRows(rank)
    for record in records:
        rows.add(record)
    return rows.table()


class RecordRows:
    """Records added one at a time (``add``: their values put in per-column lists, JSON text made for lists and
    dicts), made into a table at the end (``table``, the file's column types): the work per record can be spread over
    pieces of time, and only the last step (an Arrow array per column) is done at once.

    Parameters
    ----------
    rank : int
        The ``rank`` column's value.

    Examples
    --------
    >>> rows = RecordRows(0)
    >>> rows.add({"kind": "meta", "seq": 0})
    >>> rows.table().num_rows
    1
    """

    def __init__(self, rank: int) -> None:
        self.rank = rank
        self._encode = _json_encoder()
        self._clear()

    def _clear(self) -> None:
        self.count = 0
        self._values: list[list] = [[] for _name in _ROW_COLUMNS]

    def add(self, record: dict | None) -> None:
        """Add a record (None: a row null in every column but ``rank``).

        Parameters
        ----------
        record : dict or None
            A record as this schema reads it.

        Raises
        ------
        ValueError
            A NaN or an infinite number in a field that holds a list or a dict.
        TypeError
            A value JSON cannot write, in such a field.

        Examples
        --------
        >>> RecordRows(0).add({"kind": "meta", "seq": 0})
        """
        self.count += 1
        if record is None:
            for column in self._values:
                column.append(None)
            return
        own = _KNOWN.get(record.get("kind"), _KNOWN[None])
        get = record.get
        encode = self._encode
        for (name, is_json), column in zip(_ROW_COLUMNS, self._values):
            if name == "extra":
                value = None if record.keys() <= own else ({k: v for k, v in record.items() if k not in own} or None)
            else:
                value = get(name) if name in own else None
            if is_json and value is not None:
                value = "".join(encode(value, 0))
            column.append(value)

    def table(self) -> Any:
        """The records added so far as a table (``table_of_few_records``' columns); the rows are then forgotten.

        Returns
        -------
        pyarrow.Table
            ``rank``, every field's column, ``extra``; text dictionary-encoded.

        Raises
        ------
        ValueError
            A NaN or an infinite number in a float field.

        Examples
        --------
        >>> rows.table().column_names[:3]
        ['rank', 'kind', 'seq']
        """
        import pyarrow as pa

        arrays = [pa.array([self.rank] * self.count, pa.int64())]
        fields = [pa.field("rank", pa.int64())]
        for (name, _is_json), column in zip(_ROW_COLUMNS, self._values):
            kind = "json" if name == "extra" else COLUMNS[name]
            if kind == "float":
                for v in column:
                    if v is not None and v - v != 0.0:
                        raise ValueError(f"Out of range float values are not JSON compliant: {v!r} in field {name!r}")
            array = pa.array(column, _arrow_type(pa, kind, 1))
            arrays.append(array.dictionary_encode() if kind in ("str", "json") else array)
            fields.append(pa.field(name, _arrow_type(pa, kind)))
        self._clear()
        return pa.Table.from_arrays(arrays, schema=pa.schema(fields))


_ROW_COLUMNS = [(name, COLUMNS.get(name, "json") == "json") for name in (*COLUMNS, "extra")]


# record kind -> the fields its records hold (its own and its optional ones); None: a kind of no columns of its own
_KNOWN: dict[Any, frozenset] = {kind: frozenset(KIND_COLUMNS[kind]) | frozenset(_OPTIONAL.get(kind, ()))
                                for kind in KIND_COLUMNS}
_KNOWN[None] = frozenset(("kind", "seq"))


def _table_of_records(rank: int, events: list, exact: str | None = None):
    """``table_of_records``; with ``exact`` (``_EXACT_JSON`` or ``_EXACT_PYTHON``), _NotExact where the columns would
    not give the records back as they are (``table_holding_records``)."""
    import numpy as np
    import pyarrow as pa
    import pyarrow.compute as pc

    n = len(events)
    try:
        kinds = list(map(itemgetter("kind"), events))
    except (KeyError, TypeError):
        if exact:
            raise _NotExact from None
        kinds = [ev.get("kind") for ev in events]
    parts = []  # one table per record kind: its rows, every column but rank (null where the kind has no such field)
    placed = []  # the rows of each part in ``events``
    kind_array = None
    for kind in dict.fromkeys(kinds):
        if kinds.count(kind) == n:
            records = events
            placed.append(None)
        else:
            if kind_array is None:
                kind_array = np.fromiter(kinds, dtype=object, count=n)
            rows = np.flatnonzero(kind_array == kind)
            records = list(map(events.__getitem__, rows.tolist()))
            placed.append(rows)
        parts.append(_kind_table(kind, records, exact))
    if not parts:
        table = _kind_table(None, [])
    elif len(parts) == 1:
        table = parts[0]
    else:
        # the parts' rows back in the records' order: one take, in C
        order = np.argsort(np.concatenate(placed), kind="stable")
        pool = _building_pool(pa)
        table = pc.take(pa.concat_tables(parts).combine_chunks(memory_pool=pool), order, memory_pool=pool)
    return table.add_column(0, pa.field("rank", pa.int64()),
                            pa.array([rank] * n, pa.int64(), memory_pool=_building_pool(pa)))


_huge_pages_lock = threading.Lock()
_huge_pages_holders = 0  # blocks in numpy_huge_pages_unadvised now, on every thread
_huge_pages_advised_before: bool | None = None


@contextmanager
def numpy_huge_pages_unadvised() -> Iterator[None]:
    """numpy's advice to the kernel to back its big arrays with huge pages held off for the block (and put back as it
    was when the last such block on any thread ends).

    Where transparent huge pages are given on advice (``/sys/kernel/mm/transparent_hugepage/enabled`` "madvise",
    common), each big array numpy makes while a million records' tables are built is advised so, and the kernel
    compacts memory to find huge pages for it as it is first touched: system time that swung ``get_ops()`` of a
    million records between 0.4 and 2 s on this project's machine, against 0.41-0.43 s without the advice
    (bench/RESULTS.md). A numpy without the switch (a private one since numpy 1.20) is left as it is.

    Yields
    ------
    None

    Examples
    --------
    >>> with numpy_huge_pages_unadvised():
    ...     ops = ops_frame_from_columns(table, offsets)
    """
    global _huge_pages_holders, _huge_pages_advised_before
    switch = _madvise_hugepage_switch()
    if switch is None:
        yield
        return
    with _huge_pages_lock:
        if _huge_pages_holders == 0:
            _huge_pages_advised_before = bool(switch(False))
        _huge_pages_holders += 1
    try:
        yield
    finally:
        with _huge_pages_lock:
            _huge_pages_holders -= 1
            if _huge_pages_holders == 0:
                switch(_huge_pages_advised_before)


def _madvise_hugepage_switch() -> Any:
    """numpy's ``_set_madvise_hugepage`` (sets the advice on or off, returns what it was), or None."""
    try:
        from numpy._core import multiarray
    except ImportError:  # numpy before 2
        try:
            from numpy.core import multiarray
        except ImportError:
            return None
    return getattr(multiarray, "_set_madvise_hugepage", None)


@contextmanager
def cyclic_gc_paused() -> Iterator[None]:
    """Python's cyclic garbage collector held off for the block (and put back as it was).

    Building a table or reading a file makes millions of small objects; each batch of them starts a collection
    that walks every live object, the trace's million records included: about half the time of building
    ``get_ops()`` for a million records. What these blocks make holds no reference cycles; plain reference
    counting frees it.

    Yields
    ------
    None

    Examples
    --------
    >>> with cyclic_gc_paused():
    ...     rows = [{"seq": i} for i in range(1_000_000)]
    """
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()


def _kind_table(kind: Any, records: list, exact: str | None = None):
    """The columns of ``records``, all of record kind ``kind``; with ``exact``, _NotExact where they would not give
    the records back as they are."""
    import pyarrow as pa

    if exact and type(kind) is not str:
        raise _NotExact
    n = len(records)
    own = KIND_COLUMNS.get(kind, ("kind", "seq"))
    optional = _OPTIONAL.get(kind, ())
    known = {*own, *optional}
    values: dict[str, list] = {}
    try:  # every record of a known kind holds its fields (as this schema reads it): read in C
        values.update(zip(own, _fields_of(own, records)))
        complete = True
    except KeyError:  # a record made by hand without some: None for what it lacks
        if exact:
            raise _NotExact from None
        values.update((name, [ev.get(name) for ev in records]) for name in own)
        complete = False
    # the records with keys beyond their kind's own (optional fields that say something, a meta record's data)
    width = len(own)
    odd = [i for i, ev in enumerate(records) if len(ev) != width] if complete else range(n)
    if odd:
        for name in (*optional, "extra"):
            if name == "extra":
                found = [{k: v for k, v in records[i].items() if k not in known} or None for i in odd]
            else:
                found = [records[i].get(name, _ABSENT) for i in odd]
                if exact and None in found:  # present and None: a column's null reads back as absent
                    raise _NotExact
                found = [None if v is _ABSENT else v for v in found]
            if any(v is not None for v in found):
                column = [None] * n
                for i, v in zip(odd, found):
                    column[i] = v
                values[name] = column
    if exact:
        for name, column in values.items():
            column_kind = COLUMNS.get(name, "json")
            # JSON's values: Arrow's reading tells an int, a bool and a text apart (_arrow_column), not an int from a float
            if column_kind != "json" and (exact == _EXACT_PYTHON or column_kind == "float"):
                if not set(map(type, column)) <= {_EXACT_TYPE[column_kind], type(None)}:
                    raise _NotExact
    made = _json_columns(pa, [name for name in own if COLUMNS[name] == "json"], values, n, exact)
    arrays = []
    fields = []
    for name in (*COLUMNS, "extra"):
        column_kind = "json" if name == "extra" else COLUMNS[name]
        arrays.append(made[name] if name in made else
                      _arrow_column(pa, name, column_kind, values.get(name), n, exact))
        fields.append(pa.field(name, _arrow_type(pa, column_kind)))
    return pa.Table.from_arrays(arrays, schema=pa.schema(fields))


# records read at a time by _fields_of: their rows of values stay in the processor's cache while they are turned into
# columns (a rank's rows at once did not: 0.98 against 0.70 s for 700,000 op records)
_ROWS_AT_A_TIME = 1024


def _fields_of(names: tuple, records: list) -> list[list]:
    """The values of the fields ``names`` of every record, a list per field (KeyError where a record lacks one):
    read in C, a block of records at a time."""
    get = itemgetter(*names)
    columns: list[list] = [[] for _name in names]
    for start in range(0, len(records), _ROWS_AT_A_TIME):
        for column, values in zip(columns, zip(*map(get, records[start:start + _ROWS_AT_A_TIME]))):
            column.extend(values)
    return columns


def _json_columns(pa, names: list[str], values: dict, n: int, exact: str | None = None) -> dict:
    """The JSON-text columns ``names`` of a kind's records, made together: a record's values of all of them are
    told apart at once (marshal's bytes of the tuple, in C), so that each field's text is made once per distinct
    combination, and the rows of a combination point at it; a trace repeats its shapes and placements, so the
    combinations are few."""
    import marshal
    from itertools import repeat

    import pyarrow.compute as pc

    if len(names) < 2:
        return {}
    pool = _building_pool(pa)
    rows = list(zip(*(values[name] for name in names)))
    try:
        keys = pc.dictionary_encode(pa.array(list(map(marshal.dumps, rows, repeat(2, n))), pa.binary(), memory_pool=pool),
                                    memory_pool=pool)
    except ValueError:  # a value marshal cannot write: each column on its own, whose encoder names it
        return {}
    combinations = [marshal.loads(k) for k in keys.dictionary.to_pylist()]
    encode = _json_encoder()
    made = {}
    for j, name in enumerate(names):
        texts: dict[bytes, int] = {}  # marshal's bytes of a distinct value -> its place among the texts
        places = []
        for combination in combinations:
            value = combination[j]
            if value is None:
                places.append(None)
                continue
            key = marshal.dumps(value, 2)
            place = texts.get(key)
            if place is None:
                place = texts[key] = len(texts)
            places.append(place)
        if not texts:  # null in every row
            made[name] = pa.nulls(n, _arrow_type(pa, "json"), memory_pool=pool)
            continue
        text_of = (lambda v: _exact_text(v, "".join(encode(v, 0)))) if exact else (lambda v: "".join(encode(v, 0)))
        dictionary = pa.array([text_of(marshal.loads(k)) for k in texts], pa.large_string(), memory_pool=pool)
        indices = pc.take(pa.array(places, pa.int32(), memory_pool=pool), keys.indices, memory_pool=pool)
        made[name] = pa.DictionaryArray.from_arrays(indices, dictionary)
    return made


def _building_pool(pa) -> Any:
    """The Arrow memory pool a table built from records is made in: the C library's (malloc). Arrow's default pool
    (mimalloc) hands each freed block back to the system at once, and building a big table a rank at a time frees and
    makes many blocks of a few hundred KiB: in a fresh process, the system's time to map them again was 1.2-1.9 s of
    a million records' 5.6-6.0 s (bench/RESULTS.md, "A big trace of dicts")."""
    return pa.system_memory_pool()


def _arrow_column(pa, name: str, kind: str, column, n: int, exact: str | None = None):
    """The Arrow array of the file's type for one column's values (a sequence, or None: all null)."""
    import marshal
    from itertools import repeat

    import pyarrow.compute as pc

    pool = _building_pool(pa)
    if column is None:
        return pa.nulls(n, _arrow_type(pa, kind), memory_pool=pool)
    if kind == "json":
        # a field holding lists or dicts: its JSON text made once per distinct value, told apart by marshal's bytes
        # (made in C, exact: 1, 1.0 and True differ, as their JSON does)
        try:
            keys = pc.dictionary_encode(pa.array(list(map(marshal.dumps, column, repeat(2, n))), pa.binary(),
                                                 memory_pool=pool), memory_pool=pool)
        except ValueError:  # a value marshal cannot write, so neither can JSON: the encoder names it
            encode = _json_encoder()
            for v in column:
                "".join(encode(v, 0))
            raise
        distinct = keys.dictionary.to_pylist()
        encode = _json_encoder()
        # None's entry is never pointed at (its rows are made null) but must not be null: dictionaries with a null
        # cannot be unified when the ranks' tables are put together
        text_of = (lambda v: _exact_text(v, "".join(encode(v, 0)))) if exact else (lambda v: "".join(encode(v, 0)))
        texts = pa.array([text_of(marshal.loads(k)) for k in distinct], pa.large_string(), memory_pool=pool)
        indices = keys.indices
        if _MARSHAL_NONE in distinct:
            indices = pc.if_else(pc.equal(indices, distinct.index(_MARSHAL_NONE)), pa.scalar(None, pa.int32()),
                                 indices, memory_pool=pool)
        return pa.DictionaryArray.from_arrays(indices, texts)
    if exact == _EXACT_JSON and kind in ("int", "bool", "str"):
        # the column's type as Arrow reads it: of JSON's values, only a column of ints reads as int64, of bools as bool,
        # of texts as string (a float, an int among bools, a list: another type, or ArrowInvalid)
        array = pa.array(column, memory_pool=pool)
        if array.null_count == n:
            return pa.nulls(n, _arrow_type(pa, kind), memory_pool=pool)
        if kind == "str" and array.type == pa.string():
            encoded = pc.dictionary_encode(array, memory_pool=pool)
            return pa.DictionaryArray.from_arrays(encoded.indices, encoded.dictionary.cast(pa.large_string()))
        if array.type != _arrow_type(pa, kind):
            raise _NotExact
        return array
    array = pa.array(column, type=_arrow_type(pa, kind, 1), memory_pool=pool)
    if kind == "str":
        return pc.dictionary_encode(array, memory_pool=pool)
    if kind == "float" and array.null_count < n and not pc.all(pc.is_finite(array.drop_null())).as_py():
        bad = next(v for v in column if v is not None and v - v != 0.0)
        raise ValueError(f"Out of range float values are not JSON compliant: {bad!r} in field {name!r}")
    return array


_MARSHAL_NONE = b"N"  # marshal's bytes of None: a null row
_ABSENT = object()  # a key a record does not hold


# A payload whose records travel as columns (``payload_as_columns``) holds, instead of ``events``, this key: an Arrow
# IPC stream of the rank's rows (``table_of_records``' columns, one record batch)
EVENTS_AS_COLUMNS = "events_as_columns"


def payload_as_columns(payload: dict) -> dict:
    """``payload`` (``schema.PAYLOAD_FIELDS``) with its records as columns: its ``events`` replaced by
    ``EVENTS_AS_COLUMNS``, the Arrow IPC stream bytes of their columns (``table_of_records``). A rank's big payload
    is shipped so: the client reads the columns as they are, where a list of dicts is pickled, unpickled and
    checked record by record.

    Parameters
    ----------
    payload : dict
        A rank's payload, its records in ``events``.

    Returns
    -------
    dict
        The payload without ``events``, with ``EVENTS_AS_COLUMNS``.

    Raises
    ------
    ValueError
        A record holds a NaN or an infinite number, which a trace file cannot hold.

    Examples
    --------
    >>> shipped = payload_as_columns(recorder.stop())
    >>> table_of_stream(shipped[EVENTS_AS_COLUMNS]).num_rows == len(payload["events"])
    True
    """
    import pyarrow as pa

    table = _null_columns_untyped(pa, table_of_records(payload["rank"], schema.current_events(payload)))
    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, table.schema) as writer:
        writer.write_table(table)
    shipped = {k: v for k, v in payload.items() if k != "events"}
    shipped[EVENTS_AS_COLUMNS] = sink.getvalue().to_pybytes()
    return shipped


def _null_columns_untyped(pa, table):
    """``table`` with each column that is null in every row made of Arrow's null type, which has no buffers to send:
    most columns of a rank's table are the fields of another record kind (two thirds of the bytes of 10,000 op
    records). ``table_of_stream`` gives them their types back."""
    n = table.num_rows
    if not n:
        return table
    fields, columns = [], []
    for field, column in zip(table.schema, table.columns):
        if column.null_count == n:
            field, column = pa.field(field.name, pa.null()), pa.nulls(n)
        fields.append(field)
        columns.append(column)
    return pa.Table.from_arrays(columns, schema=pa.schema(fields))


def _null_columns_typed(pa, table):
    """``table`` with each column of Arrow's null type that the file names (``_null_columns_untyped``') made of its
    file type, still null in every row."""
    if not any(pa.types.is_null(field.type) for field in table.schema):
        return table
    n = table.num_rows
    fields, columns = [], []
    for field, column in zip(table.schema, table.columns):
        if pa.types.is_null(field.type) and field.name in _WANT:
            kind = _arrow_type(pa, _WANT[field.name])
            field, column = pa.field(field.name, kind), pa.nulls(n, kind)
        fields.append(field)
        columns.append(column)
    return pa.Table.from_arrays(columns, schema=pa.schema(fields))


def table_of_stream(raw: bytes):
    """The table an Arrow IPC stream ``raw`` holds (``payload_as_columns``'); ColumnarProblem when it is not one
    or its columns are not the file's.

    Parameters
    ----------
    raw : bytes
        The stream's bytes.

    Returns
    -------
    pyarrow.Table
        Its rows: ``rank``, every field's column, ``extra``.

    Raises
    ------
    ColumnarProblem
        Not a readable Arrow IPC stream, or a column missing or of another type.

    Examples
    --------
    >>> table_of_stream(shipped[EVENTS_AS_COLUMNS]).column_names[:3]
    ['rank', 'kind', 'seq']
    """
    import pyarrow as pa

    try:
        table = pa.ipc.open_stream(pa.BufferReader(raw)).read_all()
    except (pa.ArrowInvalid, pa.ArrowException, OSError, TypeError) as e:
        raise ColumnarProblem(f"not a readable Arrow IPC stream ({e})") from None
    table = _null_columns_typed(pa, table)
    _check_columns(pa, table, COLUMNS_VERSION)
    return table.select(list(_WANT))


def _check_columns(pa, table, version: int) -> None:
    types = dict(zip(table.schema.names, table.schema.types))  # made once: the table's own lists are new each call
    if len(types) < table.num_columns:
        twice = next(name for name in types if table.schema.names.count(name) > 1)
        raise ColumnarProblem(f"column {twice!r} appears more than once")
    for name, kind in _WANT.items():
        if name not in types:
            raise ColumnarProblem(f"column {name!r} is missing")
        got = types[name]
        if not got.equals(_arrow_type(pa, kind, version)):
            raise ColumnarProblem(f"column {name!r} is of type {got}, expected {_arrow_type(pa, kind, version)}")


def read_table(raw: bytes) -> tuple[dict, Any]:
    """The sharddbg header and the table of a columnar file's bytes; ColumnarProblem when the file is not one
    (truncated, not Arrow, no sharddbg header, a column missing or of the wrong type)."""
    import pyarrow as pa

    try:
        table = pa.ipc.open_file(pa.BufferReader(raw)).read_all()
    except (pa.ArrowInvalid, pa.ArrowException, OSError) as e:
        raise ColumnarProblem(f"not a readable Arrow IPC file ({e}); the file is corrupt or truncated") from None
    meta = table.schema.metadata or {}
    if METADATA_KEY not in meta:
        raise ColumnarProblem("an Arrow file without the sharddbg header (schema metadata 'sharddbg'): not a "
                              "sharddbg trace")
    try:
        header = json.loads(meta[METADATA_KEY])
    except (UnicodeDecodeError, ValueError) as e:
        raise ColumnarProblem(f"its sharddbg header is not valid JSON ({e})") from None
    if not isinstance(header, dict):
        raise ColumnarProblem("its sharddbg header is not a JSON object")
    if header.get("layout") != LAYOUT:
        raise ColumnarProblem(f'its sharddbg header says "layout" {header.get("layout")!r}, not "{LAYOUT}"')
    cols = header.get("columns")
    if type(cols) is not int or cols < 1:
        raise ColumnarProblem(f'its sharddbg header has a missing or invalid "columns" version ({cols!r})')
    if cols > COLUMNS_VERSION:
        raise ColumnarProblem(f'its columns are of version {cols}, written by a newer sharddbg; this one reads up '
                              f"to {COLUMNS_VERSION}: upgrade sharddbg")
    _check_columns(pa, table, cols)
    table = table.select(list(_WANT)).replace_schema_metadata(None)
    return header, (file_table(table) if cols < 2 else table)


_WANT = {"rank": "int", **COLUMNS, "extra": "json"}  # every column of the file, and its kind


def read_document(raw: bytes) -> dict:
    """The trace document (``Trace.to_dict``'s form) a columnar file's bytes hold, one dict per record;
    ColumnarProblem when the file is not one (``read_table``) or its columns contradict its header."""
    header, table = read_table(raw)
    payloads = header.get("payloads")
    ranks = header.get("ranks")
    doc = {k: v for k, v in header.items() if k not in ("layout", "columns")}
    if not isinstance(payloads, list) or not isinstance(ranks, list):
        return doc  # the checks of the JSON document name what is wrong
    by_rank: dict[Any, list[dict]] = {}
    for rank, record in zip(table.column("rank").to_pylist(), records_of(table)):
        by_rank.setdefault(rank, []).append(record)
    listed = {r for r in ranks if type(r) is int}
    for rank in by_rank:
        if rank not in listed:
            raise ColumnarProblem(f'column "rank" holds rank {rank!r}, which "ranks" {ranks} does not list')
    doc["payloads"] = [p if not isinstance(p, dict) else dict(p, events=by_rank.get(r, []))
                       for r, p in zip(ranks, payloads)]
    for r, p in zip(ranks, payloads):
        if p is None and by_rank.get(r):
            raise ColumnarProblem(f"rank {r} has no payload (null) but {len(by_rank[r])} records")
    return doc


def records_of(table) -> list[dict]:
    """One dict per row of ``table`` (the file's columns), in its order: its kind's fields in the schema's order,
    the optional ones where not null, and what ``extra`` holds."""
    kinds = table.column("kind").to_pylist()
    records: list[dict | None] = [None] * table.num_rows
    for kind in set(kinds):
        rows = [i for i, k in enumerate(kinds) if k == kind]
        part = table.take(rows) if len(rows) < table.num_rows else table
        names = KIND_COLUMNS.get(kind, ("kind", "seq"))
        values = [_column_values(part, name, _WANT[name]) for name in names]
        # one dict per record, built in C: its kind's fields in the schema's order
        for i, record in zip(rows, map(dict, map(partial(zip, names), zip(*values)))):
            records[i] = record
        for name in (*_OPTIONAL.get(kind, ()), "extra"):
            column = part.column(name)
            if column.null_count == len(column):
                continue  # the common case: nothing to add
            for i, value in zip(rows, _column_values(part, name, _WANT[name])):
                if value is not None:
                    if name == "extra":
                        records[i].update(value)
                    else:
                        records[i][name] = value
    return records  # type: ignore[return-value]


def _column_values(table, name: str, kind: str) -> list:
    values = table.column(name).to_pylist()
    return [_decode(text, name) for text in values] if kind == "json" else values


def _decode(text: str | None, column: str) -> Any:
    if text is None:
        return None
    try:
        return json.loads(text)
    except ValueError as e:
        raise ColumnarProblem(f"column {column!r} holds {text[:60]!r}, not JSON ({e})") from None


def decoded_json(column) -> Any:
    """A JSON-text column (a ``pyarrow`` array or chunked array) decoded, as a numpy object array: each distinct
    text is decoded once and its rows share the value (a trace repeats its shapes, errors and lines many times).
    Null rows hold None. ValueError for a text that is not JSON."""
    return decoded_json_and_values(column)[0]


def decoded_json_and_values(column) -> tuple[Any, list]:
    """``decoded_json`` of ``column`` and the distinct values decoded (the nulls' None left out)."""
    import numpy as np
    import pyarrow as pa

    if isinstance(column, pa.ChunkedArray):
        column = column.combine_chunks() if column.num_chunks != 1 else column.chunk(0)
    n = len(column)
    if column.null_count == n:
        return np.full(n, None, dtype=object), []
    encoded = column if pa.types.is_dictionary(column.type) else column.dictionary_encode()
    values = [json.loads(text) for text in encoded.dictionary.to_pylist()]
    distinct = np.empty(len(values) + 1, dtype=object)  # the last one: None, for null rows
    distinct[:-1] = values
    return distinct[encoded.indices.fill_null(len(values)).to_numpy(zero_copy_only=False)], values


def distinct_json(column) -> list:
    """The distinct values a JSON-text column holds, decoded (nulls left out). ValueError for a text that is
    not JSON."""
    import pyarrow.compute as pc

    return [json.loads(text) for text in pc.unique(column.drop_null()).to_pylist()]


class EventColumns:
    """The records of every rank of a trace as one Arrow table (the columnar file's columns: ``rank``, then every
    field, ``extra``), rows grouped by rank in ascending order; a rank's records are made as dicts only when asked
    for (``records``).

    Parameters
    ----------
    table : pyarrow.Table
        The columns (``read_table``'s or ``table_of_payloads``'); its ``rank`` column ascending.

    Examples
    --------
    >>> header, table = read_table(raw)
    >>> EventColumns(table).count(0)
    18
    """

    def __init__(self, table) -> None:
        import numpy as np

        self.table = table
        ranks = table.column("rank").to_numpy()
        starts = np.flatnonzero(np.diff(ranks)) + 1 if len(ranks) else np.array([], dtype=np.int64)
        bounds = np.concatenate([[0], starts, [len(ranks)]]).tolist()
        self._bounds = {int(ranks[a]): (a, b) for a, b in zip(bounds[:-1], bounds[1:]) if b > a}

    def count(self, rank: int) -> int:
        """The number of records of ``rank`` (0 for a rank it does not hold).

        Parameters
        ----------
        rank : int
            The rank.

        Returns
        -------
        int
            Its records.

        Examples
        --------
        >>> columns.count(0)
        18
        """
        start, stop = self._bounds.get(rank, (0, 0))
        return stop - start

    def rows(self, rank: int) -> Any:
        """The rows of ``rank``, a zero-copy slice of the table.

        Parameters
        ----------
        rank : int
            The rank.

        Returns
        -------
        pyarrow.Table
            Its rows, in its payload's order (none for a rank it does not hold).

        Examples
        --------
        >>> columns.rows(0).num_rows
        18
        """
        start, stop = self._bounds.get(rank, (0, 0))
        return self.table.slice(start, stop - start)

    def records(self, rank: int) -> list[dict]:
        """The records of ``rank`` as dicts (``records_of``), made now.

        Parameters
        ----------
        rank : int
            The rank.

        Returns
        -------
        list of dict
            Its records in its payload's order.

        Examples
        --------
        >>> columns.records(0)[0]["kind"]
        'op'
        """
        return records_of(self.rows(rank))

    def of_kind(self, kind: str) -> Any:
        """The rows of one record kind, every rank's, in the table's order.

        Parameters
        ----------
        kind : str
            "op", "collective", "error" or "meta".

        Returns
        -------
        pyarrow.Table
            Those rows: ``rank``, the kind's columns, its optional ones and ``extra``.

        Examples
        --------
        >>> columns.of_kind("op").num_rows
        72
        """
        import pyarrow.compute as pc

        # the kind's own columns only: a copy of every column would double the memory of a big trace
        names = dict.fromkeys(("rank", *KIND_COLUMNS.get(kind, ("kind", "seq")), *_OPTIONAL.get(kind, ()), "extra"))
        return self.table.select(list(names)).filter(pc.equal(self.table.column("kind"), kind))


class LazyRecords(Sequence):
    """A rank's records held as columns (``EventColumns``), made into dicts on first use and kept: what a payload
    of a trace loaded from a columnar file holds as its ``events``. ``len`` does not make them.

    Parameters
    ----------
    columns : EventColumns
        The trace's columns.
    rank : int
        Whose records.

    Examples
    --------
    >>> events = LazyRecords(columns, 0)
    >>> len(events), events[0]["kind"]
    (18, 'op')
    """

    def __init__(self, columns: EventColumns, rank: int) -> None:
        self.columns = columns
        self.rank = rank
        self._made: list[dict] | None = None

    @property
    def made(self) -> bool:
        """The records were made as dicts already."""
        return self._made is not None

    def as_list(self) -> list[dict]:
        """The records as a list: those made already, else made now without keeping them (to write them out).

        Returns
        -------
        list of dict
            The rank's records.

        Examples
        --------
        >>> LazyRecords(columns, 0).as_list()[0]["kind"]
        'op'
        """
        return list(self._made) if self._made is not None else self.columns.records(self.rank)

    def _records(self) -> list[dict]:
        if self._made is None:
            self._made = self.columns.records(self.rank)
        return self._made

    def __len__(self) -> int:
        return len(self._made) if self._made is not None else self.columns.count(self.rank)

    def __getitem__(self, i):
        return self._records()[i]

    def __iter__(self):
        return iter(self._records())

    def __eq__(self, other) -> bool:
        return list(self) == list(other) if isinstance(other, (list, Sequence)) else NotImplemented

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        return f"<{len(self)} records of rank {self.rank}, held as columns>"


def plainly_valid(table, ranks: list, payloads: list, max_abs_int: int, max_nesting: int) -> bool:
    """The checks ``load_trace`` runs on every record, run on whole columns: True when every record of ``table``
    is one that ``schema.validate_payload`` accepts, every integer lies within +-``max_abs_int``, every float is
    finite, a JSON value nests less than ``max_nesting`` deep, and the rows of each rank (ascending, contiguous)
    belong to a payload of ``ranks``. False means only "look closer": the records are then made and checked one
    by one, which names what is wrong (the header, ``ranks`` and ``payloads``, is checked apart).

    Parameters
    ----------
    table : pyarrow.Table
        The columns, ``read_table``'s.
    ranks, payloads : list
        The header's ``ranks`` and ``payloads`` (in ``ranks`` order, None for a rank that sent nothing).
    max_abs_int, max_nesting : int
        The bounds of a trace file (``trace.MAX_ABS_INT``, ``trace.MAX_NESTING``).

    Returns
    -------
    bool
        Whether the columns pass every check.

    Examples
    --------
    >>> header, table = read_table(raw)
    >>> plainly_valid(table, header["ranks"], header["payloads"], 2**61, 64)
    True
    """
    import numpy as np
    import pyarrow as pa
    import pyarrow.compute as pc

    if not table.num_rows:
        return True
    rank = table.column("rank")
    kind = table.column("kind")
    if rank.null_count or kind.null_count or table.column("seq").null_count:
        return False
    rank_values = rank.to_numpy()
    if (np.diff(rank_values) < 0).any():
        return False
    sending = {r for r, p in zip(ranks, payloads) if isinstance(p, dict)}
    if not set(np.unique(rank_values).tolist()) <= sending:
        return False
    kinds = set(pc.unique(kind).to_pylist())
    if not kinds <= set(schema.KINDS):
        return False
    # bounds of the typed columns, over every row
    for name, column_kind in _WANT.items():
        column = table.column(name)
        if column.null_count == len(column):
            continue
        if column_kind == "int":
            low, high = pc.min_max(column).values()
            if low.as_py() < -max_abs_int or high.as_py() > max_abs_int:
                return False
        elif column_kind == "float":
            if not pc.all(pc.is_finite(column.drop_null())).as_py():
                return False
    python_type = {"int": int, "float": float, "bool": bool, "str": str}
    for record_kind in kinds & set(KIND_FIELDS):
        mask = pc.equal(kind, record_kind)  # a column at a time: a copy of the whole table would double the memory
        own = KIND_FIELDS[record_kind]
        optional = schema.OPTIONAL_FIELDS.get(record_kind, {})
        n_rows = pc.sum(mask).as_py()
        for name in COLUMNS:
            known = name in own or name in optional
            types = (own.get(name) or optional[name])[0] if known else ()
            column = table.column(name)
            if column.null_count == len(column):  # null in these rows too
                if name in own and type(None) not in types and n_rows:
                    return False
                continue
            column = column.filter(mask)
            if not known:
                if column.null_count != len(column):
                    return False  # a field of another kind: the record's own keys would say it (extra)
                continue
            if name in own and column.null_count and type(None) not in types:
                return False
            if column.null_count == len(column):
                continue
            if COLUMNS[name] != "json":
                if python_type[COLUMNS[name]] not in types:
                    return False
                continue
            for value in distinct_json(column):
                if type(value) not in types or not _nests_within(value, max_nesting - 5, max_abs_int):
                    return False
                if not _items_valid(record_kind, name, value):
                    return False
        if record_kind in (schema.KIND_OP, schema.KIND_COLLECTIVE):
            if not set(pc.unique(table.column("phase").filter(mask)).to_pylist()) <= set(schema.PHASES):
                return False
        if record_kind == schema.KIND_OP:
            if not set(pc.unique(table.column("path").filter(mask)).to_pylist()) <= set(schema.PATHS):
                return False
        if record_kind == schema.KIND_COLLECTIVE:
            for name in ("bytes_sent", "bytes_recv"):
                if pc.min(table.column(name).filter(mask)).as_py() < 0:
                    return False
    extra = table.column("extra")
    if extra.null_count != len(extra):
        for value in distinct_json(extra):
            if type(value) is not dict or not _nests_within(value, max_nesting - 5, max_abs_int):
                return False
    return True


def _nests_within(value: Any, levels: int, max_abs_int: int) -> bool:
    """``value``'s containers nest at most ``levels`` deep, its integers lie within +-``max_abs_int`` and its
    floats are finite."""
    stack = [(value, 1)]
    while stack:
        node, depth = stack.pop()
        t = type(node)
        if t is dict or t is list:
            if depth > levels:
                return False
            stack.extend((v, depth + 1) for v in (node.values() if t is dict else node))
        elif t is float and node - node != 0.0:
            return False
        elif t is int and not -max_abs_int <= node <= max_abs_int:
            return False
    return True


def _items_valid(kind: str, name: str, value: Any) -> bool:
    """The records nested in a field (an op's error and promotions, the optional fields' items) hold their
    fields, as ``schema.validate_event`` checks them."""
    try:
        schema.validate_nested(kind, name, value)
    except (schema.SchemaError, KeyError, TypeError):
        return False
    return True
