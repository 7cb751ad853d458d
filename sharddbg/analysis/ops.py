"""Analyses of the op table (``Trace.get_ops()``): pure functions, DataFrame in, DataFrame out.

They need no cluster and no torch, so each is testable on a saved trace.
"""

from __future__ import annotations

import math
from operator import itemgetter
from typing import Any

import numpy as np
import pandas as pd

from ..schema import CELL_ERROR_FIELDS, FALLBACK_PATHS, OP_FIELDS
from .formatting import cyclic_gc_paused, format_location, numpy_huge_pages_unadvised

# what tables call the place of a collective or an exception outside every recorded op
NO_OP = "<outside recorded ops>"

# Calls that read a tensor's metadata (attribute reads reach __torch_function__ as ``Tensor.<name>.__get__``)
# or make a new view of the same data without computing: on a ShardTensor they take the DTensor fallback,
# cheaply and correctly, so get_fallbacks() lists them apart (``include_metadata=True``).
METADATA_ATTRIBUTES = frozenset({
    "shape", "ndim", "T", "mT", "H", "mH", "device", "dtype", "is_cuda", "is_cpu", "is_meta", "is_mps", "is_xpu",
    "is_sparse", "is_quantized", "is_nested", "is_mkldnn", "layout", "requires_grad", "is_leaf", "grad_fn", "names",
    "itemsize", "nbytes", "data", "grad", "output_nr", "_version", "_base"})
METADATA_METHODS = frozenset({
    "size", "dim", "ndimension", "numel", "nelement", "stride", "element_size", "detach", "detach_", "is_contiguous",
    "is_floating_point", "is_complex", "is_signed", "get_device", "storage_offset", "__len__", "data_ptr",
    "requires_grad_", "dim_order", "is_pinned", "is_shared", "untyped_storage", "type"})
METADATA_ATEN = frozenset({
    "aten.detach.default", "aten.alias.default", "aten.sym_size.int", "aten.sym_size.default",
    "aten.sym_stride.int", "aten.sym_stride.default", "aten.sym_numel.default", "aten.sym_storage_offset.default",
    "aten.is_contiguous.default", "aten.dim.default", "aten.size.default", "aten.size.int", "aten.stride.default",
    "aten.numel.default"})
# Calls that enter the autograd engine: their time is the whole backward pass (every node's own events are
# recorded apart), not a fallback's cost. ``ShardTensor.backward`` calls ``Tensor.backward`` itself.
AUTOGRAD_ENTRY_OPS = frozenset({"Tensor.backward", "ShardTensor.backward", "torch.autograd.backward",
                                "torch.autograd.grad", "torch.autograd.__init__.backward",
                                "torch.autograd.__init__.grad"})


def is_metadata_op(op) -> bool:
    """``op`` (a name of ``get_ops()``) reads metadata or makes a view without computing (the METADATA_*
    sets): ``Tensor.shape.__get__``, ``Tensor.size``, ``Tensor.detach``, ``aten.detach.default``, ..."""
    if not isinstance(op, str):
        return False
    if op in METADATA_ATEN:
        return True
    if op.startswith("Tensor."):
        rest = op[len("Tensor."):]
        if rest.endswith(".__get__"):
            return rest[: -len(".__get__")] in METADATA_ATTRIBUTES
        return rest in METADATA_METHODS
    if op.startswith("torch."):
        return op[len("torch."):] in ("numel", "is_tensor", "is_floating_point", "is_complex", "detach")
    return False

# get_ops() columns: rank, then the op record's fields up to error in schema order (error as
# "exc_type: message"), then its remaining fields and the error's parts.
OPS_COLUMNS = [
    "rank", "seq", "parent_seq", "depth", "op", "path", "handler", "phase", "autograd_node", "module",
    "user_frame", "in_local_shapes", "in_global_shapes", "out_local_shape", "out_global_shape",
    "placements", "dtype", "sharding_shapes", "in_bytes", "out_bytes", "t_start_ns", "t_end_ns",
    "host_ms", "device_ms", "mem_delta_bytes", "error",
]
OPS_EXTRA_COLUMNS = ["fwd_seq", "in_placements", "fallback", "not_implemented", "in_flight", "thread",
                     "exc_type", "traceback", "error_origin_seq", "unmasked", "promotions",
                     "user_cell", "user_code", "location", "local_ms", "message", "spec_mismatches", "spec_mismatch",
                     "error_handled"]
FALLBACK_COLUMNS = ["op", "path", "calls", "ranks", "host_ms_total", "user_frames", "via_handler", "bwd_host_ms_total",
                    "category", "locations"]
ERROR_COLUMNS = ["rank", "seq", "op", "path", "exc_type", "message", "traceback", "user_frame", "phase", "unmasked",
                 "handled", "propagated_to", "cell_line", "cell_code", "location"]
CELL_ERROR_COLUMNS = ["rank", "seq", "t_ns", "exc_type", "message", "traceback", "origin_seq", "cell_line", "cell_code",
                      "cell", "user_frame", "user_code", "location"]

assert set(CELL_ERROR_COLUMNS[1:-1]) <= set(CELL_ERROR_FIELDS), "get_cell_errors columns must come from the schema"
PROMOTION_COLUMNS = ["rank", "seq", "op", "param", "shape", "dtype", "module", "user_frame"]

assert set(OPS_COLUMNS[1:]) <= set(OP_FIELDS), "get_ops columns must come from the schema"


def ops_frame(rows_by_rank: dict[int, list[dict]], offsets_ns: dict[int, int]) -> pd.DataFrame:
    """One row per op record per rank; times moved onto the reference clock (t - offset).

    Built a column at a time (a million records in seconds, not minutes): each field is read out of the
    records in one pass, what is derived from several fields (the error's parts, the location) is worked out
    once per distinct value, and the times move by the offsets as whole arrays. The table is exactly the one
    ``ops_frame_by_record`` builds a row at a time."""
    with cyclic_gc_paused(), numpy_huge_pages_unadvised():
        return _ops_frame(rows_by_rank, offsets_ns)


def _ops_frame(rows_by_rank: dict[int, list[dict]], offsets_ns: dict[int, int]) -> pd.DataFrame:
    ranks: list[int] = []
    offsets: list[int] = []
    ops: list[dict] = []
    for rank in sorted(rows_by_rank):
        own = [ev for ev in rows_by_rank[rank] if ev.get("kind") == "op"]
        ops.extend(own)
        ranks.extend([rank] * len(own))
        offsets.extend([int(offsets_ns.get(rank, 0))] * len(own))
    derived = {"rank", "t_start_ns", "t_end_ns", "error", "exc_type", "message", "traceback", "error_origin_seq",
               "unmasked", "error_handled", "location", "spec_mismatch"}
    wanted = [name for name in OPS_COLUMNS + OPS_EXTRA_COLUMNS if name not in derived]
    # every op record holds OP_FIELDS (an older one as this schema reads it): read in C, row tuples transposed
    held = [name for name in wanted if name in OP_FIELDS] + ["error", "t_start_ns", "t_end_ns"]
    cols: dict[str, Any] = dict(zip(held, map(list, zip(*map(itemgetter(*held), ops))))) if ops else {
        name: [] for name in held}
    for name in wanted:
        if name not in cols:  # the optional fields, present only where they say something
            cols[name] = [ev.get(name) for ev in ops]
    cols["rank"] = ranks
    errors = cols.pop("error")
    raised = [i for i, err in enumerate(errors) if err]  # few: the parts of an error are read where there is one
    for name, part in (("error", lambda e: f"{e['exc_type']}: {e['message']}"), ("exc_type", lambda e: e["exc_type"]),
                       ("message", lambda e: e["message"]), ("traceback", lambda e: e["traceback"]),
                       ("error_origin_seq", lambda e: e["origin_seq"]), ("error_handled", lambda e: e.get("handled"))):
        column: list = [None] * len(ops)
        for i in raised:
            column[i] = part(errors[i])
        cols[name] = column
    unmasked = [False] * len(ops)
    for i in raised:
        unmasked[i] = bool(errors[i]["unmasked"])
    cols["unmasked"] = unmasked
    places: dict[tuple, str | None] = {}  # (user_frame, user_cell, user_code) -> location: few distinct lines
    cols["location"] = [places[key] if key in places else places.setdefault(key, format_location(*key))
                        for key in zip(cols["user_frame"], cols["user_cell"], cols["user_code"])]
    cols["spec_mismatch"] = [spec_mismatch_text(found) if found else None for found in cols["spec_mismatches"]]
    columns = OPS_COLUMNS + OPS_EXTRA_COLUMNS
    df = pd.DataFrame({name: inferred_column(cols[name]) for name in columns}, columns=columns)
    shift = np.asarray(offsets, dtype=np.int64)
    for c in ("t_start_ns", "t_end_ns"):
        df[c] = df[c].astype("Int64") - shift
    for c in ("host_ms", "device_ms", "local_ms"):
        df[c] = pd.to_numeric(df[c], errors="coerce").astype(float)  # None (not measured) -> NaN
    df["mem_delta_bytes"] = pd.to_numeric(df["mem_delta_bytes"], errors="coerce").astype(float)
    for c in ("parent_seq", "fwd_seq", "error_origin_seq", "user_cell"):
        df[c] = df[c].astype("Int64")
    return df.sort_values(["rank", "seq"], kind="stable").reset_index(drop=True)


def ops_frame_from_columns(table: Any, offsets_ns: dict[int, int]) -> pd.DataFrame:
    """``ops_frame`` built from the op rows of a trace held as columns (``columnar.EventColumns.of_kind("op")``, a
    ``pyarrow.Table``) without making a dict per record: exactly the table ``ops_frame`` builds from the same
    records.

    Parameters
    ----------
    table : pyarrow.Table
        The op rows, every rank's, grouped by rank in ascending order (the columnar file's columns).
    offsets_ns : dict of int to int
        Rank -> its clock offset, ns.

    Returns
    -------
    pandas.DataFrame
        ``Trace.get_ops()``.

    Examples
    --------
    >>> ops_frame_from_columns(columns.of_kind("op"), {0: 0}).equals(ops_frame(records_by_rank, {0: 0}))
    True
    """
    if not table.num_rows:
        return ops_frame({}, offsets_ns)
    with cyclic_gc_paused(), numpy_huge_pages_unadvised():
        return _ops_frame_from_columns(table, offsets_ns)


def _ops_frame_from_columns(table: Any, offsets_ns: dict[int, int]) -> pd.DataFrame:
    n = table.num_rows
    derived = {"rank", "error", "exc_type", "message", "traceback", "error_origin_seq", "unmasked", "error_handled",
               "location", "spec_mismatch"}
    columns = OPS_COLUMNS + OPS_EXTRA_COLUMNS
    numbers = {"host_ms", "device_ms", "local_ms", "mem_delta_bytes"}  # made float below
    cols: dict[str, Any] = {name: arrow_or_json_column(table, name) if name not in numbers else np.zeros(n)
                            for name in columns if name not in derived}
    rank = table.column("rank").to_numpy()
    cols["rank"] = rank
    errors = json_column(table.column("error"))
    raised = [i for i in np.flatnonzero(table.column("error").is_valid().to_numpy(zero_copy_only=False))
              if errors[i]]  # few: the parts of an error are read where there is one
    for name, part in (("error", lambda e: f"{e['exc_type']}: {e['message']}"), ("exc_type", lambda e: e["exc_type"]),
                       ("message", lambda e: e["message"]), ("traceback", lambda e: e["traceback"]),
                       ("error_origin_seq", lambda e: e["origin_seq"]), ("error_handled", lambda e: e.get("handled"))):
        cols[name] = sparse_column(n, raised, [part(errors[i]) for i in raised])
    unmasked = np.zeros(n, dtype=bool)
    for i in raised:
        unmasked[i] = bool(errors[i]["unmasked"])
    cols["unmasked"] = unmasked
    cols["location"] = locations_of_columns(table)
    found = json_column(table.column("spec_mismatches"))
    checked = np.flatnonzero(table.column("spec_mismatches").is_valid().to_numpy(zero_copy_only=False))
    cols["spec_mismatch"] = sparse_column(n, checked, [spec_mismatch_text(found[i]) for i in checked])
    df = pd.DataFrame({name: cols[name] for name in columns}, columns=columns)
    shift = offsets_per_row(rank, offsets_ns)
    for c in ("t_start_ns", "t_end_ns"):
        df[c] = df[c].astype("Int64") - shift
    for c in ("host_ms", "device_ms", "local_ms", "mem_delta_bytes"):  # None (not measured) -> NaN
        df[c] = table.column(c).cast("float64").to_numpy()
    for c in ("t_start_ns", "t_end_ns", "parent_seq", "fwd_seq", "error_origin_seq", "user_cell"):
        df[c] = df[c].astype("Int64")
    return sorted_by_rank_and_seq(df)


def sorted_by_rank_and_seq(df: pd.DataFrame) -> pd.DataFrame:
    """``df`` sorted by ``rank``, then ``seq`` (stable), with a fresh index; not copied when in that order already
    (a payload's records are, mostly).

    Parameters
    ----------
    df : pandas.DataFrame
        Rows with ``rank`` and ``seq`` (integers, no missing values).

    Returns
    -------
    pandas.DataFrame
        The rows in that order, indexed 0, 1, ...

    Examples
    --------
    >>> sorted_by_rank_and_seq(pd.DataFrame({"rank": [1, 0], "seq": [0, 5]}))["rank"].tolist()
    [0, 1]
    """
    rank, seq = df["rank"].to_numpy(), df["seq"].to_numpy()
    if len(df) < 2 or ((np.diff(rank) > 0) | ((np.diff(rank) == 0) & (np.diff(seq) >= 0))).all():
        return df.reset_index(drop=True)
    return df.sort_values(["rank", "seq"], kind="stable").reset_index(drop=True)


def sparse_column(n: int, rows: Any, values: list) -> Any:
    """``inferred_column`` of a column of ``n`` values that are None except at ``rows``, which hold ``values``:
    built without going through the Nones one by one (a trace's errors and spec mismatches are few).

    Parameters
    ----------
    n : int
        The column's length.
    rows : sequence of int
        Where the values are, ascending.
    values : list
        The values there.

    Returns
    -------
    numpy.ndarray or pandas.api.extensions.ExtensionArray
        The column, as ``inferred_column`` types it.

    Examples
    --------
    >>> sparse_column(3, [1], ["x"]).tolist()
    [nan, 'x', nan]
    """
    import pyarrow as pa

    if len(rows) == n or all(v is None for v in values):
        column = np.full(n, None, dtype=object)
        column[np.asarray(rows, dtype=np.int64)] = np.fromiter(values, dtype=object, count=len(values))
        return column if len(rows) < n else inferred_column(list(values))
    kind = inferred_column(list(values) + [None]).dtype
    rows = np.asarray(rows, dtype=np.int64)
    if kind == np.float64:
        column = np.full(n, np.nan)
        column[rows] = np.asarray(pd.to_numeric(pd.Series(values, dtype=object), errors="coerce"), dtype=float)
        return column
    if isinstance(kind, pd.StringDtype):
        where = np.full(n, len(values), dtype=np.int64)
        where[rows] = np.arange(len(values))
        text = pa.array(list(values) + [None], type=pa.large_string()).take(pa.array(where))
        return pd.array(text, dtype=kind)
    column = np.full(n, None, dtype=object)
    column[rows] = np.fromiter(values, dtype=object, count=len(values))
    return inferred_column(column)


def arrow_or_json_column(table: Any, name: str) -> Any:
    """Column ``name`` of rows held as columns, typed as ``inferred_column`` types its values: a JSON-text column
    (``columnar.COLUMNS``) decoded, any other read as it is (``arrow_column_as_inferred``).

    Parameters
    ----------
    table : pyarrow.Table
        The rows (the columnar file's columns).
    name : str
        The field.

    Returns
    -------
    numpy.ndarray or pandas.api.extensions.ExtensionArray
        The column, to put in a DataFrame.

    Examples
    --------
    >>> arrow_or_json_column(columns.of_kind("op"), "in_local_shapes")[0]
    [[1, 3, 17, 32]]
    """
    from ..columnar import COLUMNS

    if COLUMNS.get(name) == "json":
        from ..columnar import decoded_json_and_values

        decoded, values = decoded_json_and_values(table.column(name))
        if all(type(v) in (list, dict) for v in values):
            return decoded  # lists, dicts and None: objects, as inferred_column leaves them
        return inferred_column(decoded)
    return arrow_column_as_inferred(table.column(name))


def offsets_per_row(rank: np.ndarray, offsets_ns: dict[int, int]) -> np.ndarray:
    """Each row's clock offset (ns, int64), from its rank.

    Parameters
    ----------
    rank : numpy.ndarray
        The rank of each row.
    offsets_ns : dict of int to int
        Rank -> its clock offset; a rank left out has 0.

    Returns
    -------
    numpy.ndarray
        int64, one per row.

    Examples
    --------
    >>> offsets_per_row(np.array([0, 1, 1]), {1: 5}).tolist()
    [0, 5, 5]
    """
    shift = np.zeros(len(rank), dtype=np.int64)
    for r, off in offsets_ns.items():
        if off:
            shift[rank == r] = int(off)
    return shift


def json_column(column: Any) -> np.ndarray:
    """A JSON-text column of the columnar trace, decoded (``columnar.decoded_json``): a numpy object array.

    Parameters
    ----------
    column : pyarrow.ChunkedArray
        The column.

    Returns
    -------
    numpy.ndarray
        One value per row, None for a null; rows of the same text share one value.

    Examples
    --------
    >>> json_column(pyarrow.chunked_array([['[1, 2]', None]])).tolist()
    [[1, 2], None]
    """
    from ..columnar import decoded_json

    return decoded_json(column)


def arrow_column_as_inferred(column: Any) -> Any:
    """One column of the columnar trace, typed as ``inferred_column`` types the same values made into Python
    objects, without making them: ints (float with NaN where null), floats, bools, text (pandas' ``str``), a
    JSON-text column decoded (objects); a column of nulls only is None objects.

    Parameters
    ----------
    column : pyarrow.ChunkedArray
        The column (int64, float64, bool or large_string; text of a JSON column's kind is decoded).

    Returns
    -------
    numpy.ndarray or pandas.api.extensions.ExtensionArray
        The column, to put in a DataFrame.

    Examples
    --------
    >>> arrow_column_as_inferred(pyarrow.chunked_array([[1, None]])).dtype
    dtype('float64')
    """
    import pyarrow as pa

    n = len(column)
    if column.null_count == n:
        return np.full(n, None, dtype=object)
    t = column.type
    if pa.types.is_integer(t):
        return column.to_numpy() if not column.null_count else column.cast(pa.float64()).to_numpy()
    if pa.types.is_floating(t):
        return column.to_numpy()
    if pa.types.is_boolean(t):
        return column.to_numpy() if not column.null_count else np.array(column.to_pylist(), dtype=object)
    if pa.types.is_dictionary(t):
        column = column.cast(t.value_type)
    return pd.array(column, dtype=pd.StringDtype("pyarrow", na_value=np.nan))


def locations_of_columns(table: Any) -> Any:
    """The ``location`` column (``format_location``) of rows held as columns: worked out once per distinct
    (user_frame, user_cell, user_code).

    Parameters
    ----------
    table : pyarrow.Table
        Rows with the columns ``user_frame``, ``user_cell``, ``user_code``.

    Returns
    -------
    pandas.api.extensions.ExtensionArray or numpy.ndarray
        One location per row, typed as ``inferred_column`` types it.

    Examples
    --------
    >>> locations_of_columns(columns.of_kind("op"))[0]
    'cell [3], line 2: `y = conv(x)`'
    """
    import pyarrow as pa

    codes, distinct = distinct_rows(table, ("user_frame", "user_cell", "user_code"))
    texts = [format_location(*key) for key in distinct]
    if all(t is None for t in texts):
        return np.full(table.num_rows, None, dtype=object)
    if any(t is None for t in texts):
        return inferred_column(np.array(texts, dtype=object)[codes])
    return pd.array(pa.array(texts, type=pa.large_string()).take(pa.array(codes)),
                    dtype=pd.StringDtype("pyarrow", na_value=np.nan))


def distinct_rows(table: Any, names: tuple[str, ...]) -> tuple[np.ndarray, list[tuple]]:
    """The distinct rows of some columns of ``table`` (nulls as None) and, per row, which of them it is.

    Parameters
    ----------
    table : pyarrow.Table
        The rows.
    names : tuple of str
        The columns that make a row's key.

    Returns
    -------
    tuple of numpy.ndarray and list of tuple
        A code per row (an index into the list) and the distinct keys, first seen first.

    Examples
    --------
    >>> distinct_rows(pyarrow.table({"a": ["x", "y", "x"]}), ("a",))
    (array([0, 1, 0]), [('x',), ('y',)])
    """
    n = table.num_rows
    combined = np.zeros(n, dtype=np.int64)
    values: list[list] = []
    for name in names:
        column = table.column(name)
        column = column.combine_chunks() if column.num_chunks != 1 else column.chunk(0)
        encoded = column.dictionary_encode()
        size = len(encoded.dictionary) + 1  # the last: null
        values.append(encoded.dictionary.to_pylist() + [None])
        combined = combined * size + encoded.indices.fill_null(size - 1).to_numpy(zero_copy_only=False)
    codes, uniques = pd.factorize(combined)
    first = np.empty(len(uniques), dtype=np.int64)
    first[codes[::-1]] = np.arange(n - 1, -1, -1)  # the first row of each key: the last write wins
    distinct = []
    for row in first.tolist():
        key, rest = [], int(combined[row])
        for name_values in reversed(values):
            rest, index = divmod(rest, len(name_values))
            key.append(name_values[index])
        distinct.append(tuple(reversed(key)))
    return codes, distinct


def inferred_column(values: list) -> Any:
    """One column of values, typed as ``pandas.DataFrame(list of dicts)`` types it: the same inference (numbers,
    bools and text typed; lists, dicts, None-only and mixed columns left as objects), a column at a time.

    Parameters
    ----------
    values : list
        The column's values, one per row; a list or a dict stays one value.

    Returns
    -------
    numpy.ndarray or pandas.api.extensions.ExtensionArray
        The column, to put in a DataFrame.

    Examples
    --------
    >>> inferred_column([1, 2]).dtype
    dtype('int64')
    >>> inferred_column([[1, 2], None]).dtype
    dtype('O')
    """
    from pandas.core.internals.construction import convert_object_array

    column = values if isinstance(values, np.ndarray) and values.dtype == object else np.fromiter(
        values, dtype=object, count=len(values))  # lists stay one value each
    return convert_object_array([column], dtype=None, dtype_backend="numpy", coerce_float=False)[0]


def ops_frame_by_record(rows_by_rank: dict[int, list[dict]], offsets_ns: dict[int, int]) -> pd.DataFrame:
    """``ops_frame`` built a row at a time, as it was before it read columns: kept to check that both build the
    same table."""
    rows = []
    for rank in sorted(rows_by_rank):
        off = int(offsets_ns.get(rank, 0))
        for ev in rows_by_rank[rank]:
            if ev.get("kind") != "op":
                continue
            err = ev["error"]
            r = {k: ev.get(k) for k in OPS_COLUMNS[1:]}
            r["rank"] = rank
            r["t_start_ns"] = ev["t_start_ns"] - off
            r["t_end_ns"] = ev["t_end_ns"] - off if ev["t_end_ns"] is not None else None
            r["error"] = f"{err['exc_type']}: {err['message']}" if err else None
            for k in OPS_EXTRA_COLUMNS:
                r[k] = ev.get(k)
            r["exc_type"] = err["exc_type"] if err else None
            r["message"] = err["message"] if err else None
            r["traceback"] = err["traceback"] if err else None
            r["error_origin_seq"] = err["origin_seq"] if err else None
            r["unmasked"] = bool(err["unmasked"]) if err else False
            r["error_handled"] = err.get("handled") if err else None
            r["location"] = format_location(ev["user_frame"], ev.get("user_cell"), ev.get("user_code"))
            r["spec_mismatch"] = spec_mismatch_text(r["spec_mismatches"])
            rows.append(r)
    df = pd.DataFrame(rows, columns=OPS_COLUMNS + OPS_EXTRA_COLUMNS)
    for c in ("host_ms", "device_ms", "local_ms"):
        df[c] = pd.to_numeric(df[c], errors="coerce").astype(float)  # None (not measured) -> NaN
    df["mem_delta_bytes"] = pd.to_numeric(df["mem_delta_bytes"], errors="coerce").astype(float)
    for c in ("t_start_ns", "t_end_ns", "parent_seq", "fwd_seq", "error_origin_seq", "user_cell"):
        df[c] = df[c].astype("Int64")
    return df.sort_values(["rank", "seq"], kind="stable").reset_index(drop=True)


def spec_mismatch_text(found: list | None) -> str | None:
    """One line for an op's ``spec_mismatches`` (the explorer's mark, the ``spec_mismatch`` column of
    ``get_ops()``): 'output 0: spec says (313, 3), the local tensor is (313, 17, 3) (...)'; None when its
    results' specs agree with their local tensors (or were not checked)."""
    if not found:
        return None
    return "; ".join(f"output {m['output']}: {m['detail']}" for m in found)


def took_fallback_path(ops: pd.DataFrame) -> pd.Series:
    """Per row of ``get_ops()``: the call ran through a DTensor fallback, as its path (one of
    ``schema.FALLBACK_PATHS``) or from inside its handler (``fallback``), whatever it does."""
    return ops["path"].isin(FALLBACK_PATHS) | ops["fallback"].astype(bool)


def is_fallback(ops: pd.DataFrame, include_metadata: bool = False) -> pd.Series:
    """Per row of ``get_ops()``: a compute fallback, the calls ``get_fallbacks()`` counts: it took a DTensor
    fallback (``took_fallback_path``), and is neither a call that enters the autograd engine
    (``AUTOGRAD_ENTRY_OPS``) nor, unless ``include_metadata``, a metadata read (``is_metadata_op``)."""
    fb = took_fallback_path(ops) & ~ops["op"].isin(AUTOGRAD_ENTRY_OPS)
    if not include_metadata and len(ops):
        # each distinct name asked once (a million rows hold a few hundred names)
        fb &= ~ops["op"].isin([o for o in ops["op"].dropna().unique() if is_metadata_op(o)])
    return fb


def fallbacks(ops: pd.DataFrame, include_metadata: bool = False) -> pd.DataFrame:
    """Ops whose computation ran through a DTensor fallback, per (op, path): forward calls, ranks, host time.

    Left out: calls that enter the autograd engine (``Tensor.backward`` takes the fallback path, but its time
    is the whole backward pass, whose nodes are recorded on their own), and metadata reads (``category``
    "metadata": ``shape``, ``ndim``, ``dtype``, ``detach``, ..., see ``is_metadata_op``), which are listed
    only with ``include_metadata=True``. ``via_handler``: the op had a handler that itself called the
    fallback (e.g. linear on a sharded feature dim); then ``path`` is the handler path.
    ``bwd_host_ms_total``: time of their backward events (the output node only). ``locations``: where the
    user's code made the calls (``format_location``).
    """
    if ops.empty:
        return pd.DataFrame(columns=FALLBACK_COLUMNS)
    # the columns read, then the rows: a mask moves every column it is given (a big trace's cost)
    fb = ops[["op", "path", "phase", "rank", "host_ms", "user_frame", "location"]][is_fallback(ops, include_metadata)]
    fwd = fb[fb["phase"] == "forward"].copy()
    bwd = fb[fb["phase"] == "backward"]
    if fwd.empty:
        return pd.DataFrame(columns=FALLBACK_COLUMNS)
    fwd["via_handler"] = ~fwd["path"].isin(FALLBACK_PATHS)
    out = []
    for (op, path, via), g in fwd.groupby(["op", "path", "via_handler"], sort=False):
        b = bwd[(bwd["op"] == op) & (bwd["path"] == path)]
        out.append({
            "op": op,
            "path": path,
            "calls": int(len(g)),
            "ranks": sorted(int(r) for r in g["rank"].unique()),
            "host_ms_total": float(g["host_ms"].sum(min_count=1)) if g["host_ms"].notna().any() else math.nan,
            "user_frames": sorted({f for f in g["user_frame"].unique() if isinstance(f, str)}),
            "via_handler": bool(via),
            "bwd_host_ms_total": float(b["host_ms"].sum()) if len(b) else 0.0,
            "category": "metadata" if is_metadata_op(op) else "compute",
            "locations": sorted({w for w in g["location"].unique() if isinstance(w, str)}),
        })
    return pd.DataFrame(out, columns=FALLBACK_COLUMNS).sort_values(
        ["host_ms_total", "calls"], ascending=False, kind="stable").reset_index(drop=True)


def cell_errors_frame(rows_by_rank: dict[int, list[dict]], offsets_ns: dict[int, int]) -> pd.DataFrame:
    """One row per "error" record (an exception that ended the cell on a rank); ``t_ns`` on the reference
    clock."""
    rows = []
    for rank in sorted(rows_by_rank):
        off = int(offsets_ns.get(rank, 0))
        for ev in rows_by_rank[rank]:
            if ev.get("kind") == "error":
                r = {k: ev.get(k) for k in CELL_ERROR_COLUMNS[1:]}
                r["rank"] = rank
                r["t_ns"] = ev["t_ns"] - off
                r["location"] = error_location(r)
                rows.append(r)
    df = pd.DataFrame(rows, columns=CELL_ERROR_COLUMNS)
    for c in ("seq", "t_ns", "origin_seq", "cell_line", "cell"):
        df[c] = df[c].astype("Int64")
    return df


def in_a_script(user_frame) -> bool:
    """An error record's ``user_frame`` names a file of a script ('train.py:47 in train_step'), not a cell ('cell
    [6], line 5 in f', 'cell sent by cl.run, line 4 in <module>')."""
    return isinstance(user_frame, str) and not user_frame.startswith("cell ")


def error_location(row: dict) -> str | None:
    """Where an exception that ended the cell (or a script) went through the user's code: the cell's line
    ('cell [6], line 5: `y = x + x`'); in a script, which has no cell, its innermost frame of the user's code
    ('train.py:47 in train_step: `dist.all_reduce(g)`')."""
    cell = row.get("cell")
    line = row.get("cell_line")
    if in_a_script(row.get("user_frame")):
        code = row.get("user_code")
        return f"{row['user_frame']}: `{code}`" if isinstance(code, str) and code else row["user_frame"]
    return cell_location(cell, line, row.get("cell_code"))


def cell_location(cell, line, code) -> str | None:
    """'cell [6], line 5: `y = x + x`' for a line of the traced cell ('line 5 of the cell' when the cell's
    execution count was not recorded)."""
    if line is None or pd.isna(line):
        return None
    where = f"cell [{int(cell)}], line {int(line)}" if cell is not None and not pd.isna(cell) else \
        f"line {int(line)} of the cell"
    return f"{where}: `{code}`" if isinstance(code, str) and code else where


def errors(ops: pd.DataFrame, include_propagated: bool = False, cell_errors: pd.DataFrame | None = None) -> pd.DataFrame:
    """The real exceptions, one row per rank and origin: the innermost recorded op that raised it, or, for
    an exception raised outside every recorded op (``cell_errors`` rows whose ``origin_seq`` is None), the
    cell itself (``op`` is ``NO_OP``, ``user_frame`` the cell's line).

    ``handled``: True when the user's code caught it and the cell went on, False when it (or an exception it
    was chained into) ended the cell, missing when not known (a rank's snapshot while the cell ran, a trace of
    schema version 7 or older that has no error record for it).
    ``propagated_to``: seqs of the enclosing ops the same exception went through.
    ``include_propagated=True`` keeps those rows too. ``cell_line`` / ``cell_code``: the statement of the
    cell the exception ended (when the trace recorded it).
    """
    parts = []
    cells = cell_errors if cell_errors is not None and len(cell_errors) else None
    where = {}  # (rank, origin seq) -> (cell line, code): which cell statement an op's exception ended
    if cells is not None:
        for r in cells.itertuples(index=False):
            if not pd.isna(r.origin_seq):
                where[(int(r.rank), int(r.origin_seq))] = (r.cell_line, r.cell_code)
    if not ops.empty:
        e = ops[ops["exc_type"].notna()].copy()
        if not e.empty:
            origin = e["error_origin_seq"] == e["seq"]
            prop = {}
            for (rank, o), g in e[~origin].groupby(["rank", "error_origin_seq"]):
                prop[(rank, o)] = sorted(int(s) for s in g["seq"])
            sel = e if include_propagated else e[origin]
            sel = sel.assign(
                handled=sel["error_handled"],
                propagated_to=[prop.get((r, s), []) for r, s in zip(sel["rank"], sel["seq"])],
                cell_line=[where.get((int(r), int(o)), (None, None))[0] for r, o in zip(sel["rank"], sel["error_origin_seq"])],
                cell_code=[where.get((int(r), int(o)), (None, None))[1] for r, o in zip(sel["rank"], sel["error_origin_seq"])])
            parts.append(sel[ERROR_COLUMNS])
    if cells is not None:
        own = cells[cells["origin_seq"].isna()]
        if len(own):
            parts.append(pd.DataFrame({
                "rank": own["rank"].to_numpy(), "seq": own["seq"].to_numpy(), "op": NO_OP, "path": None,
                "exc_type": own["exc_type"].to_numpy(), "message": own["message"].to_numpy(),
                "traceback": own["traceback"].to_numpy(),
                # a script has no cell: its innermost frame of the user's code
                "user_frame": [f if in_a_script(f) else f"line {int(n)} of the cell" if not pd.isna(n)
                               else "the cell" for f, n in zip(own["user_frame"], own["cell_line"])],
                "phase": "cell", "unmasked": False, "handled": False, "propagated_to": [[] for _ in range(len(own))],
                "cell_line": own["cell_line"].to_numpy(), "cell_code": own["cell_code"].to_numpy(),
                "location": own["location"].to_numpy()}))
    if not parts:
        return pd.DataFrame(columns=ERROR_COLUMNS)
    out = pd.concat(parts, ignore_index=True) if len(parts) > 1 else parts[0]
    out["cell_line"] = out["cell_line"].astype("Int64")
    out["handled"] = out["handled"].astype("boolean")  # missing: not known (a snapshot, an older trace)
    return out.sort_values(["rank", "seq"], kind="stable").reset_index(drop=True)


def promotions(ops: pd.DataFrame) -> pd.DataFrame:
    """Plain tensors promoted to Replicate DTensors, one row per promotion."""
    rows = []
    for r in ops.itertuples(index=False):
        for p in r.promotions or ():
            rows.append({"rank": r.rank, "seq": r.seq, "op": r.op, "param": p["param"], "shape": tuple(p["shape"]),
                         "dtype": p["dtype"], "module": r.module, "user_frame": r.user_frame})
    return pd.DataFrame(rows, columns=PROMOTION_COLUMNS)
