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


def op_summary(ops: pd.DataFrame, colls: pd.DataFrame, nested: bool = False) -> pd.DataFrame:
    """One row per (op, path, phase); see the module docstring for every column's meaning."""
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
