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
  holds a list or a dict (shapes, errors, promotions, ...) is a string column of its JSON text. ``extra``
  holds, as a JSON object, a record's keys that its kind's columns do not name (a ``meta`` record's ``name``,
  ``t_ns`` and ``data``), else null.

A record holds its kind's fields (an older payload's records as this schema reads them, ``current_events``)
and the optional fields where they say something. ``read_document`` turns the file back into the JSON
document, which ``load_trace`` then checks exactly as it checks a JSON file.
"""

from __future__ import annotations

import json
from functools import partial
from operator import itemgetter
from typing import Any

from . import schema

__all__ = ["COLUMNS_VERSION", "LAYOUT", "COLUMNS", "KIND_COLUMNS", "write_document", "read_document",
           "ColumnarProblem"]

LAYOUT = "columnar"
COLUMNS_VERSION = 1  # what the columns are; a reader refuses a newer one
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


def _arrow_type(pa, kind: str):
    return {"int": pa.int64(), "float": pa.float64(), "bool": pa.bool_(), "str": pa.large_string(),
            "json": pa.large_string()}[kind]


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
    import pyarrow as pa

    header = {k: v for k, v in doc.items() if k != "payloads"}
    header["layout"] = LAYOUT
    header["columns"] = COLUMNS_VERSION
    header["payloads"] = [None if p is None else {k: v for k, v in p.items() if k != "events"}
                          for p in doc["payloads"]]
    names = ("rank", *COLUMNS, "extra")
    values: dict[str, list] = {name: [] for name in names}
    for rank, p in zip(doc["ranks"], doc["payloads"]):
        if p is None:
            continue
        events = schema.current_events(p)
        kinds = [ev.get("kind") for ev in events]
        order: list[int] = []  # the records regrouped by kind below; their places, to put them back in order
        grouped: dict[str, list] = {name: [] for name in names}
        for kind in dict.fromkeys(kinds):
            rows = [i for i, k in enumerate(kinds) if k == kind]
            records = [events[i] for i in rows]
            own = KIND_COLUMNS.get(kind, ("kind", "seq"))
            known = set(own) | set(_OPTIONAL.get(kind, ()))
            try:  # every record of a known kind holds its fields (as this schema reads it): read in C
                held = dict(zip(own, map(list, zip(*map(itemgetter(*own), records)))))
            except KeyError:  # a record made by hand without some: None for what it lacks
                held = {name: [ev.get(name) for ev in records] for name in own}
            nothing = [None] * len(records)
            for name in COLUMNS:
                if name in held:
                    grouped[name].extend(held[name])
                elif name in known:  # an optional field: present only where it says something
                    grouped[name].extend([ev.get(name) for ev in records])
                else:
                    grouped[name].extend(nothing)
            extra = [None if len(ev) <= len(own) and ev.keys() <= known else
                     ({k: v for k, v in ev.items() if k not in known} or None) for ev in records]
            grouped["extra"].extend(extra)
            order.extend(rows)
        back = sorted(range(len(order)), key=order.__getitem__)  # the payload's own order again
        for name in names[1:]:
            values[name].extend(map(grouped[name].__getitem__, back))
        values["rank"].extend([rank] * len(events))
    arrays = []
    fields = []
    encode = _json_encoder()
    for name, column in values.items():
        kind = "json" if name == "extra" else COLUMNS.get(name, "int")
        if kind == "json":
            column = [None if v is None else "".join(encode(v, 0)) for v in column]
        elif kind == "float":
            for v in column:
                if v is not None and v - v != 0.0:
                    raise ValueError(f"Out of range float values are not JSON compliant: {v!r} in field {name!r}")
        arrays.append(pa.array(column, type=_arrow_type(pa, kind)))
        fields.append(pa.field(name, _arrow_type(pa, kind)))
    table = pa.Table.from_arrays(arrays, schema=pa.schema(fields, metadata={
        METADATA_KEY: json.dumps(header, separators=(",", ":"), allow_nan=False).encode()}))
    # zstd: a trace repeats itself (op names, shapes, lines of code); the columns shrink many times for little CPU
    with pa.ipc.new_file(sink, table.schema, options=pa.ipc.IpcWriteOptions(compression="zstd")) as writer:
        writer.write_table(table)


def read_document(raw: bytes) -> dict:
    """The trace document (``Trace.to_dict``'s form) a columnar file's bytes hold; ColumnarProblem when the
    file is not one (truncated, not Arrow, no sharddbg header, a column missing or of the wrong type)."""
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
    want = {"rank": "int", **COLUMNS, "extra": "json"}
    for name, kind in want.items():
        if name not in table.column_names:
            raise ColumnarProblem(f"column {name!r} is missing")
        got = table.schema.field(name).type
        if not got.equals(_arrow_type(pa, kind)):
            raise ColumnarProblem(f"column {name!r} is of type {got}, expected {_arrow_type(pa, kind)}")
    payloads = header.get("payloads")
    ranks = header.get("ranks")
    doc = {k: v for k, v in header.items() if k not in ("layout", "columns")}
    if not isinstance(payloads, list) or not isinstance(ranks, list):
        return doc  # the checks of the JSON document name what is wrong
    kinds = table.column("kind").to_pylist()
    records: list[dict | None] = [None] * table.num_rows
    for kind in set(kinds):
        rows = [i for i, k in enumerate(kinds) if k == kind]
        part = table.take(rows) if len(rows) < table.num_rows else table
        names = KIND_COLUMNS.get(kind, ("kind", "seq"))
        values = [_column_values(part, name, want[name]) for name in names]
        # one dict per record, built in C: its kind's fields in the schema's order
        for i, record in zip(rows, map(dict, map(partial(zip, names), zip(*values)))):
            records[i] = record
        for name in (*_OPTIONAL.get(kind, ()), "extra"):
            column = part.column(name)
            if column.null_count == len(column):
                continue  # the common case: nothing to add
            for i, value in zip(rows, _column_values(part, name, want[name])):
                if value is not None:
                    if name == "extra":
                        records[i].update(value)
                    else:
                        records[i][name] = value
    by_rank: dict[Any, list[dict]] = {}
    for rank, record in zip(table.column("rank").to_pylist(), records):
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
