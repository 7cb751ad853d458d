"""The op summary (``Trace.get_op_summary()``): one row per (op, dispatch path, phase), the table to read first.

Pure function of ``get_ops()`` and ``get_collectives()``; no torch, no cluster.

Definitions:
- The calls of a forward row are the user's own calls (depth 0: called by the user's code or a module's
  forward, not from inside another recorded op); ``nested=True`` adds every nested call (the
  ``ShardTensor.redistribute`` inside ``full_tensor``), in rows of their own. ``nested_calls``: how many of a
  row's calls were made from inside another recorded op (on forward rows 0 unless ``nested=True``). Backward
  rows are the backward events (and forward-path ops the autograd engine called), nested or not.
  ``Trace.get_comm_by_op()`` counts every call of an op and says which were the user's own (``own_calls``,
  ``own_n_collectives``) and which nested.
- First call: the first call of that op on that rank with those local input shapes (what a first call pays:
  caches, sharding propagation, allocations); ``first_ms_median`` over those. ``steady_*``: every other call.
- ``n_collectives`` / ``comm_ms`` / ``bytes``: self (exclusive), the collectives attributed to the calls
  themselves; ``*_inclusive``: total, also those of the recorded ops they ran (``ShardTensor.full_tensor``
  owns the all_gather of the ``redistribute`` it calls). With ``nested=True`` every collective issued inside a
  recorded op is in the self columns of exactly one row: they add up to the trace's collectives less those
  outside every recorded op. A backward row counts the backward collectives of the row's forward calls. Sums
  over every call on every rank; a collective that never completed is counted in ``n_in_flight``, never timed.
- ``comm_ms_within_host`` / ``comm_ms_outside_host``: ``comm_ms_inclusive`` split by where its collectives
  were issued. Within: while one of the row's timed calls ran, so their time is part of ``host_ms_total``
  (compare the two). Outside: none of the row's calls was running: on a backward row, the collectives of the
  op's other autograd nodes (a backward event times the node behind the op's output only; conv2d's halo
  gradient and weight reductions run in nodes of their own), whose time includes waiting for the other ranks
  and runs beside the rest of the backward pass: compare it with the backward pass's host time (the
  ``Tensor.backward`` / ``ShardTensor.backward`` row), not with the row's ``host_ms_total``.
- ``local_ms_median``: the local computation of one call: ``device_ms`` on CUDA, ``local_ms`` on CPU (the same
  function timed on plain tensors of the call's local shapes after recording; NaN where not measured).
  ``dispatch_ms_median``: median over the steady calls (all calls when there are none) of host time minus the
  communication within it (``comm_ms_within_host``) minus that local time: what ShardTensor's host dispatch
  adds.
  ``dispatch_bound``: even the least dispatch time of those calls exceeds the local computation (host time is
  more than twice what the device, or the plain local op, needs). The least, not the median: a busy host only
  ever adds time, and ``local_ms`` is itself the least of a few runs.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import pandas as pd

from .comm import collective_calls, op_parents_and_names
from .ops import AUTOGRAD_ENTRY_OPS, FALLBACK_PATHS, is_metadata_op

SUMMARY_COLUMNS = [
    "op", "path", "phase", "calls", "nested_calls", "ranks", "first_calls", "first_ms_median", "steady_calls",
    "steady_ms_median", "steady_ms_p95", "host_ms_total", "device_ms_median", "local_ms_median", "dispatch_ms_median",
    "dispatch_bound", "n_collectives", "comm_ms", "bytes", "n_collectives_inclusive", "comm_ms_inclusive",
    "bytes_inclusive", "comm_ms_within_host", "comm_ms_outside_host", "n_in_flight", "errors", "fallback", "category", "locations",
]

# the columns of get_ops() the summary reads
_INPUT_COLUMNS = ["rank", "seq", "op", "path", "phase", "depth", "fwd_seq", "in_local_shapes", "host_ms", "device_ms",
                  "local_ms", "fallback", "exc_type", "location"]


def _nanmedian(values: np.ndarray) -> float:
    known = values[~np.isnan(values)]
    return float(np.median(known)) if len(known) else math.nan


def _category(op: str) -> str:
    if op in AUTOGRAD_ENTRY_OPS:
        return "autograd"
    return "metadata" if is_metadata_op(op) else "compute"


@dataclass
class _CallComm:
    """The communication of one call in one phase (a forward call's own, or its backward's)."""

    n: int = 0  # collectives
    ms: float = 0.0  # their duration_ms, summed (never-completed ones add nothing)
    bytes: int = 0  # sent + received
    in_flight: int = 0  # never completed
    ms_within_host: float = 0.0  # of ``ms``: collectives issued while one of the call's timed events ran
    ms_outside_host: float = 0.0  # the rest of ``ms``: issued while none of them ran (other autograd nodes)


@dataclass
class _Call:
    """One call of a summary row, with what the row sums and takes medians of."""

    rank: int
    nested: bool  # made from inside another recorded op
    first: bool  # the first on its rank with its op, path, phase and local input shapes
    host_ms: float
    device_ms: float
    local_ms: float  # device time on CUDA, else the plain local op's time
    dispatch_ms: float  # host time less the communication within it and the local computation
    own: _CallComm  # its communication, exclusive (nothing for a backward event after its call's first)
    total: _CallComm  # and inclusive
    fallback: bool
    raised: bool
    location: str | None


def _missing(v) -> bool:
    return v is None or v is pd.NA or v != v  # NaN is the one value unequal to itself


def _timed_spans(ops: pd.DataFrame) -> dict[tuple, list[tuple[int, float]]]:
    """(rank, forward seq, phase) -> the [start, end] spans (ns) of the events timed for it: the forward call
    itself, or the backward events of that call (an event still running at snapshot time has no end)."""
    spans: dict[tuple, list[tuple[int, float]]] = {}
    for r, s, fs, ph, t0, t1 in zip(ops["rank"].tolist(), ops["seq"].tolist(), ops["fwd_seq"].tolist(),
                                    ops["phase"].tolist(), ops["t_start_ns"].tolist(), ops["t_end_ns"].tolist()):
        if _missing(t0):
            continue
        key = (int(r), int(fs), ph) if ph == "backward" and not _missing(fs) else \
            (int(r), int(s), "backward" if ph == "backward" else "forward")
        spans.setdefault(key, []).append((int(t0), math.inf if _missing(t1) else int(t1)))
    return spans


def _comm_per_call(colls: pd.DataFrame, ops: pd.DataFrame) -> tuple[dict[tuple, _CallComm], dict[tuple, _CallComm]]:
    """(rank, forward seq, phase) -> the communication of that call: its own (exclusive) and with its nested
    ops' (inclusive), as ``comm.collective_calls`` attributes them (a collective counts once for each op name on
    its chain of enclosing calls, in the outermost call of that name). Plain Python over the rows: on tables of a trace's size it is many times faster
    than pandas."""
    exclusive: dict[tuple, _CallComm] = {}
    inclusive: dict[tuple, _CallComm] = {}
    if colls.empty:
        return exclusive, inclusive
    spans = _timed_spans(ops)
    parent, name = op_parents_and_names(ops)
    for r, s, c_op, ph, ms, sent, recv, fl, t in zip(
            colls["rank"].tolist(), colls["op_seq"].tolist(), colls["op"].tolist(), colls["phase"].tolist(),
            colls["duration_ms"].tolist(), colls["bytes_sent"].tolist(), colls["bytes_recv"].tolist(),
            colls["in_flight"].tolist(), colls["t_issue_ns"].tolist()):
        if _missing(s):
            continue
        r, s = int(r), int(s)
        ph = "backward" if ph == "backward" else "forward"
        done_ms = 0.0 if _missing(ms) else float(ms)
        moved = (0 if _missing(sent) else int(sent)) + (0 if _missing(recv) else int(recv))
        counts_for = collective_calls(r, s, parent, name)  # the one rule of attribution (analysis.comm)
        for table, calls in ((exclusive, (counts_for.own,)), (inclusive, counts_for.counted)):
            for call in calls:
                key = (r, call, ph)
                a = table.setdefault(key, _CallComm())
                a.n += 1
                a.ms += done_ms
                a.bytes += moved
                a.in_flight += bool(fl)
                if not _missing(t) and any(t0 <= int(t) <= t1 for t0, t1 in spans.get(key, ())):
                    a.ms_within_host += done_ms
                else:
                    a.ms_outside_host += done_ms
    return exclusive, inclusive


# below this many op calls the summary is worked out a call at a time: on a small trace that is quicker than the
# fixed cost of the groupbys and merges (about 0.1 s)
_CALLS_BY_COLUMNS = 20_000


def op_summary(ops: pd.DataFrame, colls: pd.DataFrame, nested: bool = False) -> pd.DataFrame:
    """One row per (op, path, phase); see the module docstring for every column's meaning.

    On whole columns (``op_summary_by_columns``) for a big trace, a call at a time (``op_summary_by_call``) for
    a small one: the same table, its sums added in another order."""
    if len(ops) < _CALLS_BY_COLUMNS:
        return _op_summary_by_call(ops, colls, nested)
    return op_summary_by_columns(ops, colls, nested)


def op_summary_by_columns(ops: pd.DataFrame, colls: pd.DataFrame, nested: bool = False) -> pd.DataFrame:
    """``op_summary`` worked out on whole columns (groupbys and merges, no Python per call): for big traces.

    Parameters
    ----------
    ops : pandas.DataFrame
        ``Trace.get_ops()``.
    colls : pandas.DataFrame
        ``Trace.get_collectives()``.
    nested : bool
        As ``op_summary``.

    Returns
    -------
    pandas.DataFrame
        ``Trace.get_op_summary(nested)``: the table ``op_summary_by_call`` gives, its sums added in another
        order.

    Examples
    --------
    >>> op_summary_by_columns(t.get_ops(), t.get_collectives()).columns[0]
    'op'
    """
    if ops.empty:
        return pd.DataFrame(columns=SUMMARY_COLUMNS)
    as_int = _keys_fit(ops, colls)
    excl, incl = _comm_per_call_frames(colls, ops, as_int)
    is_backward = (ops["phase"] == "backward").fillna(False).to_numpy(dtype=bool)
    depth = ops["depth"].to_numpy(dtype=np.int64)
    keep = ops["op"].notna().to_numpy() & ops["path"].notna().to_numpy() & ops["phase"].notna().to_numpy()
    if not nested:
        keep &= is_backward | (depth == 0)
    rows = np.flatnonzero(keep)  # the rows read; each column is taken at them alone (no copy of the whole table)
    if not len(rows):
        return pd.DataFrame(columns=SUMMARY_COLUMNS)

    def column(name: str, dtype, na_value=None) -> np.ndarray:
        values = ops[name].to_numpy(dtype=dtype, na_value=na_value) if na_value is not None else \
            ops[name].to_numpy(dtype=dtype)
        return values[rows]

    backward = is_backward[rows]
    rank = column("rank", np.int64)
    fwd = ops["fwd_seq"].notna().to_numpy()[rows]
    call = np.where(backward & fwd, column("fwd_seq", np.int64, 0), column("seq", np.int64))
    host = column("host_ms", np.float64, np.nan)
    device = column("device_ms", np.float64, np.nan)
    local = np.where(np.isnan(device), column("local_ms", np.float64, np.nan), device)
    # one integer per (op, path, phase), numbered in order of first appearance: the groups' order, as a groupby on the
    # three text columns with sort=False gives it
    group = np.zeros(len(rows), dtype=np.int64)
    for name in ("op", "path", "phase"):
        codes, distinct = pd.factorize(ops[name].take(rows))
        group = group * (len(distinct) + 1) + codes
    group, _ = pd.factorize(group)
    key = _call_key(rank, call, backward, as_int)
    # several backward events of one forward call share its backward communication: counted on the first only
    counted = ~(backward & key.duplicated())
    shapes = _shape_codes(ops["in_local_shapes"].to_numpy(dtype=object)[rows])
    first = ~pd.DataFrame({"rank": rank, "group": group, "shapes": shapes}).duplicated().to_numpy()
    steady = ~first
    comm = {}
    for prefix, table in (("own_", excl), ("total_", incl)):
        found = table.reindex(key) if len(table) else pd.DataFrame(index=key, columns=list(_CALL_COMM))
        for name in _CALL_COMM:
            values = found[name].to_numpy(dtype=np.float64, na_value=np.nan)
            comm[prefix + name] = np.where(counted & ~np.isnan(values), values, 0.0)
    dispatch = host - comm["total_ms_within_host"] - local
    calls = pd.DataFrame({
        "group": group, "rank": rank, "nested": column("depth", np.int64) > 0, "first": first, "steady": steady,
        "host_ms": host, "device_ms": device, "local_ms": local, "dispatch_ms": dispatch,
        "first_host_ms": np.where(first, host, np.nan), "steady_host_ms": np.where(steady, host, np.nan),
        "steady_dispatch_ms": np.where(steady, dispatch, np.nan), "steady_local_ms": np.where(steady, local, np.nan),
        "fallback": ops["fallback"].fillna(False).to_numpy(dtype=bool)[rows],
        "raised": ops["exc_type"].notna().to_numpy()[rows], **comm})
    groups = calls.groupby("group", sort=True)
    agg = groups.agg(
        calls=("rank", "size"), nested_calls=("nested", "sum"), first_calls=("first", "sum"),
        steady_calls=("steady", "sum"), first_ms_median=("first_host_ms", "median"),
        steady_ms_median=("steady_host_ms", "median"), steady_ms_p95=("steady_host_ms", lambda v: _p95(v)),
        host_ms_total=("host_ms", "sum"), host_known=("host_ms", "count"),
        device_ms_median=("device_ms", "median"), local_ms_median=("local_ms", "median"),
        dispatch_all_median=("dispatch_ms", "median"), dispatch_all_min=("dispatch_ms", "min"),
        dispatch_steady_median=("steady_dispatch_ms", "median"), dispatch_steady_min=("steady_dispatch_ms", "min"),
        local_all_median=("local_ms", "median"), local_steady_median=("steady_local_ms", "median"),
        n_collectives=("own_n", "sum"), comm_ms=("own_ms", "sum"), bytes=("own_bytes", "sum"),
        n_collectives_inclusive=("total_n", "sum"), comm_ms_inclusive=("total_ms", "sum"),
        bytes_inclusive=("total_bytes", "sum"), comm_ms_within_host=("total_ms_within_host", "sum"),
        comm_ms_outside_host=("total_ms_outside_host", "sum"), n_in_flight=("total_in_flight", "sum"),
        errors=("raised", "sum"), any_fallback=("fallback", "any"))
    agg = agg.reset_index(drop=True)
    # each group's op, path and phase: those of its first row
    _, first_row = np.unique(group, return_index=True)
    for name in ("op", "path", "phase"):
        agg.insert(0 if name == "op" else 1 if name == "path" else 2, name, ops[name].take(rows[first_row]).array)
    steady_any = agg["steady_calls"].to_numpy() > 0
    agg["host_ms_total"] = agg["host_ms_total"].where(agg["host_known"] > 0)
    agg["dispatch_ms_median"] = np.where(steady_any, agg["dispatch_steady_median"], agg["dispatch_all_median"])
    least = np.where(steady_any, agg["dispatch_steady_min"], agg["dispatch_all_min"])
    loc = np.where(steady_any, agg["local_steady_median"], agg["local_all_median"])
    agg["dispatch_bound"] = ~np.isnan(least) & ~np.isnan(loc) & (least > loc)
    # the ranks of each group: the distinct (group, rank) pairs, sorted, cut at each group's start
    pairs = np.unique(group * (int(rank.max()) + 1) + rank)
    pair_group, pair_rank = np.divmod(pairs, int(rank.max()) + 1)
    starts = np.searchsorted(pair_group, np.arange(len(agg) + 1))
    agg["ranks"] = [pair_rank[starts[k]:starts[k + 1]].tolist() for k in range(len(agg))]
    location = ops["location"].take(rows)
    text = location.notna().to_numpy() if pd.api.types.is_string_dtype(location.dtype) else np.array(
        [isinstance(v, str) for v in location.tolist()], dtype=bool)  # an object column: None only, or a few
    where = pd.DataFrame({"group": group, "location": location.array})[text].groupby(
        "group", sort=True)["location"].unique()
    agg["locations"] = [list(where.get(k, [])) for k in range(len(agg))]
    agg["fallback"] = agg["path"].isin(FALLBACK_PATHS).to_numpy() | agg["any_fallback"].to_numpy()
    agg["category"] = [_category(op) for op in agg["op"]]
    for name in ("calls", "nested_calls", "first_calls", "steady_calls", "n_collectives", "bytes",
                 "n_collectives_inclusive", "bytes_inclusive", "n_in_flight", "errors"):
        agg[name] = agg[name].astype(np.int64)
    df = agg[SUMMARY_COLUMNS]
    return df.sort_values(["host_ms_total", "calls"], ascending=False, kind="stable", na_position="last") \
        .reset_index(drop=True)


def _shape_codes(shapes: np.ndarray) -> np.ndarray:
    """A code per row that is the same where the local input shapes are (their ``repr`` is): worked out once per
    distinct object (a trace held as columns shares one list among the rows of the same shapes)."""
    codes, distinct = pd.factorize(np.fromiter(map(id, shapes), dtype=np.int64, count=len(shapes)))
    first = np.empty(len(distinct), dtype=np.int64)
    first[codes[::-1]] = np.arange(len(shapes) - 1, -1, -1)
    texts = np.array([repr(shapes[i]) for i in first.tolist()], dtype=object)
    return pd.factorize(texts)[0][codes]


def _p95(values: pd.Series) -> float:
    known = values.to_numpy(dtype=np.float64)
    known = known[~np.isnan(known)]
    return float(np.quantile(known, 0.95)) if len(known) else math.nan


def _op_summary_by_call(ops: pd.DataFrame, colls: pd.DataFrame, nested: bool = False) -> pd.DataFrame:
    """``op_summary_by_call``."""
    if ops.empty:
        return pd.DataFrame(columns=SUMMARY_COLUMNS)
    excl, incl = _comm_per_call(colls, ops)
    none = _CallComm()
    # plain Python over the calls: pandas per group costs far more than the sums themselves
    groups: dict[tuple, list[_Call]] = {}
    shared_seen: set = set()  # (rank, forward call, phase) whose communication a row already counts
    first_seen: set = set()  # (rank, op, path, phase, local input shapes) already called
    for r, s, op, path, ph, depth, fs, shapes, host, dev, loc, fb, exc, where in zip(
            *(ops[k].tolist() for k in _INPUT_COLUMNS)):
        if not nested and ph != "backward" and depth != 0:
            continue
        if _missing(op) or _missing(path) or _missing(ph):
            continue
        call = int(fs) if ph == "backward" and not _missing(fs) else int(s)
        key = (int(r), call, ph)
        # several backward events of one forward call share its backward communication: counted once
        counted = ph != "backward" or key not in shared_seen
        shared_seen.add(key)
        own, total = (excl.get(key, none), incl.get(key, none)) if counted else (none, none)
        shape_key = (int(r), op, path, ph, repr(shapes))
        host = math.nan if _missing(host) else float(host)
        local = float(dev) if not _missing(dev) else math.nan if _missing(loc) else float(loc)
        groups.setdefault((op, path, ph), []).append(_Call(
            rank=int(r), nested=depth > 0, first=shape_key not in first_seen, host_ms=host,
            device_ms=math.nan if _missing(dev) else float(dev), local_ms=local,
            dispatch_ms=host - total.ms_within_host - local, own=own, total=total,
            fallback=not _missing(fb) and bool(fb), raised=not _missing(exc), location=where))
        first_seen.add(shape_key)
    rows = []
    for (op, path, phase), calls in groups.items():
        first = [c for c in calls if c.first]
        steady = [c for c in calls if not c.first]
        basis = steady or calls
        dispatch = np.array([c.dispatch_ms for c in basis])
        least_disp = float(np.nanmin(dispatch)) if not np.isnan(dispatch).all() else math.nan
        loc = _nanmedian(np.array([c.local_ms for c in basis]))
        host = np.array([c.host_ms for c in calls])
        steady_host = np.array([c.host_ms for c in steady])
        steady_known = steady_host[~np.isnan(steady_host)]
        rows.append({
            "op": op, "path": path, "phase": phase, "calls": len(calls),
            "nested_calls": sum(c.nested for c in calls),
            "ranks": sorted({c.rank for c in calls}),
            "first_calls": len(first), "first_ms_median": _nanmedian(np.array([c.host_ms for c in first])),
            "steady_calls": len(steady), "steady_ms_median": _nanmedian(steady_host),
            "steady_ms_p95": float(np.quantile(steady_known, 0.95)) if len(steady_known) else math.nan,
            "host_ms_total": float(np.nansum(host)) if not np.isnan(host).all() else math.nan,
            "device_ms_median": _nanmedian(np.array([c.device_ms for c in calls])),
            "local_ms_median": _nanmedian(np.array([c.local_ms for c in calls])),
            "dispatch_ms_median": _nanmedian(dispatch),
            "dispatch_bound": bool(not math.isnan(least_disp) and not math.isnan(loc) and least_disp > loc),
            "n_collectives": sum(c.own.n for c in calls), "comm_ms": sum(c.own.ms for c in calls),
            "bytes": sum(c.own.bytes for c in calls),
            "n_collectives_inclusive": sum(c.total.n for c in calls),
            "comm_ms_inclusive": sum(c.total.ms for c in calls), "bytes_inclusive": sum(c.total.bytes for c in calls),
            "comm_ms_within_host": sum(c.total.ms_within_host for c in calls),
            "comm_ms_outside_host": sum(c.total.ms_outside_host for c in calls),
            "n_in_flight": sum(c.total.in_flight for c in calls),
            "errors": sum(c.raised for c in calls),
            "fallback": bool(path in FALLBACK_PATHS or any(c.fallback for c in calls)), "category": _category(op),
            "locations": list(dict.fromkeys(c.location for c in calls if isinstance(c.location, str))),
        })
    df = pd.DataFrame(rows, columns=SUMMARY_COLUMNS)
    return df.sort_values(["host_ms_total", "calls"], ascending=False, kind="stable", na_position="last") \
        .reset_index(drop=True)


def op_summary_by_call(ops: pd.DataFrame, colls: pd.DataFrame, nested: bool = False) -> pd.DataFrame:
    """``op_summary`` worked out a call at a time in plain Python, as it was before it read whole columns: kept to
    check that both give the same table.

    Parameters
    ----------
    ops : pandas.DataFrame
        ``Trace.get_ops()``.
    colls : pandas.DataFrame
        ``Trace.get_collectives()``.
    nested : bool
        As ``op_summary``.

    Returns
    -------
    pandas.DataFrame
        ``Trace.get_op_summary(nested)``.

    Examples
    --------
    >>> op_summary_by_call(t.get_ops(), t.get_collectives()).columns[0]
    'op'
    """
    return _op_summary_by_call(ops, colls, nested)


_CALL_COMM = ("n", "ms", "bytes", "in_flight", "ms_within_host", "ms_outside_host")


def _chains(colls: pd.DataFrame, ops: pd.DataFrame) -> tuple[np.ndarray, list[np.ndarray], list[np.ndarray]]:
    """For the collectives issued in a recorded call: their rows, and per level of the chain of enclosing calls
    (0: the call that issued it), each one's call there (-1 past the chain's end) and whether it counts there
    (``comm.collective_calls``: each op name once, in its outermost call on the chain)."""
    has_call = colls["op_seq"].notna().to_numpy()
    rows = np.flatnonzero(has_call)
    rank = colls["rank"].to_numpy(dtype=np.int64)[rows]
    seq = colls["op_seq"].to_numpy(dtype=np.int64, na_value=0)[rows]
    keyed = pd.DataFrame({"rank": ops["rank"].to_numpy(dtype=np.int64), "seq": ops["seq"].to_numpy(dtype=np.int64),
                          "parent": ops["parent_seq"].to_numpy(dtype=np.float64, na_value=np.nan),
                          # op names as codes (>= 0); a call without a record is named by its seq (below: < 0)
                          "op": pd.factorize(ops["op"], use_na_sentinel=False)[0].astype(np.int64)}
                         ).drop_duplicates(["rank", "seq"], keep="last")
    index = pd.MultiIndex.from_arrays([keyed["rank"].to_numpy(), keyed["seq"].to_numpy()])
    parents = keyed["parent"].to_numpy()
    names = keyed["op"].to_numpy()
    calls, named = [], []
    cur = seq.copy()
    alive = np.ones(len(rows), dtype=bool)
    for _level in range(256):  # nesting is shallow; the bound is for a corrupt file
        if not alive.any():
            break
        at = index.get_indexer(pd.MultiIndex.from_arrays([rank, cur]))
        level_name = np.where(at >= 0, names[np.maximum(at, 0)] if len(names) else -1, -1 - cur)
        calls.append(np.where(alive, cur, -1))
        named.append(level_name)
        parent = parents[np.maximum(at, 0)] if len(parents) else np.full(len(rows), np.nan)
        alive = alive & (at >= 0) & ~np.isnan(parent)
        cur = np.where(alive, np.nan_to_num(parent).astype(np.int64), -1)
    counts = []
    for k in range(len(calls)):
        outer = np.zeros(len(rows), dtype=bool)  # the same name further out on the chain
        for j in range(k + 1, len(calls)):
            outer |= (calls[j] >= 0) & (named[j] == named[k])
        counts.append((calls[k] >= 0) & ~outer)
    return rows, calls, counts


def _comm_per_call_frames(colls: pd.DataFrame, ops: pd.DataFrame, as_int: bool) -> tuple[pd.DataFrame, pd.DataFrame]:
    """``_comm_per_call`` on whole columns: the exclusive and inclusive communication per (rank, call, phase), as
    frames indexed by those three with the columns ``_CALL_COMM``."""
    empty = pd.DataFrame(columns=["key", *_CALL_COMM]).set_index("key") if as_int else pd.DataFrame(
        columns=["rank", "call", "bwd", *_CALL_COMM]).set_index(["rank", "call", "bwd"])
    if colls.empty:
        return empty, empty
    rows, calls, counts = _chains(colls, ops)
    if not len(rows):
        return empty, empty
    rank = colls["rank"].to_numpy(dtype=np.int64)[rows]
    bwd = (colls["phase"] == "backward").fillna(False).to_numpy(dtype=bool)[rows]
    ms = np.nan_to_num(colls["duration_ms"].to_numpy(dtype=np.float64, na_value=np.nan)[rows], nan=0.0)
    sent_recv = (colls["bytes_sent"].fillna(0).to_numpy(dtype=np.int64)
                 + colls["bytes_recv"].fillna(0).to_numpy(dtype=np.int64))[rows]
    in_flight = colls["in_flight"].fillna(False).to_numpy(dtype=bool).astype(np.int64)[rows]
    t_issue = colls["t_issue_ns"].fillna(0).to_numpy(dtype=np.int64)[rows]
    t_known = colls["t_issue_ns"].notna().to_numpy()[rows]
    spans = _timed_spans_frame(ops)
    out = []
    for levels in ([(calls[0], np.ones(len(rows), dtype=bool))], list(zip(calls, counts))):
        # one row per (collective, enclosing call it counts for), level after level
        at = np.concatenate([np.flatnonzero(counted) for _call, counted in levels])
        call = np.concatenate([call[counted] for call, counted in levels])
        p_rank, p_bwd, p_ms = rank[at], bwd[at], ms[at]
        if as_int:
            key = np.asarray(_call_key(p_rank, call, p_bwd, True))
            within = _issued_within(key, t_issue[at], t_known[at], spans)
        else:
            within = _issued_within_by_merge(p_rank, call, p_bwd, t_issue[at], t_known[at], spans)
        pairs = pd.DataFrame({
            "n": np.ones(len(at), dtype=np.int64), "ms": p_ms, "bytes": sent_recv[at], "in_flight": in_flight[at],
            "ms_within_host": np.where(within, p_ms, 0.0), "ms_outside_host": np.where(within, 0.0, p_ms)})
        if as_int:
            pairs["key"] = key
            out.append(pairs.groupby("key", sort=False)[list(_CALL_COMM)].sum())
        else:
            pairs["rank"], pairs["call"], pairs["bwd"] = p_rank, call, p_bwd
            out.append(pairs.groupby(["rank", "call", "bwd"], sort=False)[list(_CALL_COMM)].sum())
    return out[0], out[1]


def _issued_within(key: np.ndarray, t: np.ndarray, t_known: np.ndarray, spans: pd.DataFrame) -> np.ndarray:
    """For each collective (its call's one-integer key and issue time): whether one of that call's timed spans
    (``_timed_spans_frame``) contains its issue time. Spans sorted by key; a call has few (its backward events),
    so they are compared a position at a time for all collectives together."""
    within = np.zeros(len(key), dtype=bool)
    if not len(spans):
        return within
    span_key = np.asarray(_call_key(spans["rank"].to_numpy(), spans["call"].to_numpy(), spans["bwd"].to_numpy(), True))
    order = np.argsort(span_key, kind="stable")
    span_key = span_key[order]
    t0, t1 = spans["t0"].to_numpy()[order], spans["t1"].to_numpy()[order]
    still_open = spans["open"].to_numpy()[order]
    first = np.searchsorted(span_key, key, side="left")
    end = np.searchsorted(span_key, key, side="right")
    for offset in range(int((end - first).max(initial=0))):
        at = first + offset
        there = t_known & (at < end)
        j = np.minimum(at, len(span_key) - 1)
        within |= there & (t0[j] <= t) & ((t <= t1[j]) | still_open[j])
    return within


def _issued_within_by_merge(rank: np.ndarray, call: np.ndarray, bwd: np.ndarray, t: np.ndarray, t_known: np.ndarray,
                            spans: pd.DataFrame) -> np.ndarray:
    """``_issued_within`` for keys that do not fit one integer: a merge on the three columns."""
    within = np.zeros(len(rank), dtype=bool)
    if not len(spans):
        return within
    pairs = pd.DataFrame({"pair": np.arange(len(rank)), "rank": rank, "call": call, "bwd": bwd, "t_int": t,
                          "t_known": t_known})
    joined = pairs.merge(spans, on=["rank", "call", "bwd"], how="inner")
    inside = joined["t_known"].to_numpy() & (joined["t0"].to_numpy() <= joined["t_int"].to_numpy()) & (
        (joined["t_int"].to_numpy() <= joined["t1"].to_numpy()) | joined["open"].to_numpy())
    within[np.unique(joined["pair"].to_numpy()[inside])] = True
    return within


def _keys_fit(ops: pd.DataFrame, colls: pd.DataFrame) -> bool:
    """Every rank and call seq of the two tables fits ``_call_key``'s one integer (ranks below 2**16, seqs
    within [0, 2**46): the sizes traces have)."""
    for values, bound in ((ops["rank"], 2**16), (colls["rank"], 2**16), (ops["seq"], 2**46),
                          (ops["fwd_seq"], 2**46), (ops["parent_seq"], 2**46), (colls["op_seq"], 2**46)):
        if len(values) and values.notna().any() and not (0 <= values.min() and values.max() < bound):
            return False
    return True


def _call_key(rank: np.ndarray, call: np.ndarray, backward: np.ndarray, as_int: bool) -> pd.Index:
    """One key per (rank, call, phase): one integer where ``_keys_fit`` (an index on one integer is many times
    quicker than on three columns), else the three together."""
    rank, call = rank.astype(np.int64), call.astype(np.int64)
    if as_int:
        return pd.Index((call << 17) | (rank << 1) | backward.astype(np.int64))
    return pd.MultiIndex.from_arrays([rank, call, backward.astype(bool)])


def _timed_spans_frame(ops: pd.DataFrame) -> pd.DataFrame:
    """``_timed_spans`` as a frame: rank, call, phase, t0, t1 (``open``: still running at snapshot time)."""
    t0 = ops["t_start_ns"]
    known = t0.notna().to_numpy()
    o = ops[["rank", "seq", "fwd_seq", "phase", "t_start_ns", "t_end_ns"]][known]
    backward = (o["phase"] == "backward").fillna(False).to_numpy(dtype=bool)
    fwd = o["fwd_seq"].notna().to_numpy()
    call = np.where(backward & fwd, o["fwd_seq"].to_numpy(dtype=np.int64, na_value=0),
                    o["seq"].to_numpy(dtype=np.int64))
    return pd.DataFrame({"rank": o["rank"].to_numpy(dtype=np.int64), "call": call,
                         "bwd": backward,
                         "t0": o["t_start_ns"].to_numpy(dtype=np.int64),
                         "t1": o["t_end_ns"].fillna(0).to_numpy(dtype=np.int64),
                         "open": o["t_end_ns"].isna().to_numpy()})
