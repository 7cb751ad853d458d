"""The op summary (``Trace.get_op_summary()``): one row per (op, dispatch path, phase), the table to read first.

Pure function of ``get_ops()`` and ``get_collectives()``; no torch, no cluster.

Definitions:
- The calls of a forward row are the user's own calls (depth 0: called by the user's code or a module's
  forward, not from inside another recorded op); ``nested=True`` adds every nested call as rows of its own.
  Backward rows are the backward events (and forward-path ops the autograd engine called).
- First call: the first call of that op on that rank with those local input shapes (what a first call pays:
  caches, sharding propagation, allocations); ``first_ms_median`` over those. ``steady_*``: every other call.
- ``n_collectives`` / ``comm_ms`` / ``bytes``: exclusive, the collectives attributed to the calls themselves;
  ``*_inclusive``: also those of the recorded ops they ran (``ShardTensor.full_tensor`` owns the all_gather
  of the ``redistribute`` it calls). A backward row counts the backward collectives of the row's forward
  calls. Sums over every call on every rank; a collective that never completed is counted in
  ``n_in_flight``, never timed.
- ``local_ms_median``: the local computation of one call: ``device_ms`` on CUDA, ``local_ms`` on CPU (the same
  function timed on plain tensors of the call's local shapes after recording; NaN where not measured).
  ``dispatch_ms_median``: median over the steady calls (all calls when there are none) of host time minus the
  call's own communication (inclusive) minus that local time: what ShardTensor's host dispatch adds.
  ``dispatch_bound``: even the least dispatch time of those calls exceeds the local computation (host time is
  more than twice what the device, or the plain local op, needs). The least, not the median: a busy host only
  ever adds time, and ``local_ms`` is itself the least of a few runs.
"""

from __future__ import annotations

import math

import pandas as pd

from .comm import attributed
from .ops import AUTOGRAD_ENTRY_OPS, FALLBACK_PATHS, is_metadata_op

SUMMARY_COLUMNS = [
    "op", "path", "phase", "calls", "ranks", "first_calls", "first_ms_median", "steady_calls", "steady_ms_median",
    "steady_ms_p95", "host_ms_total", "device_ms_median", "local_ms_median", "dispatch_ms_median", "dispatch_bound",
    "n_collectives", "comm_ms", "bytes", "n_collectives_inclusive", "comm_ms_inclusive", "bytes_inclusive",
    "n_in_flight", "errors", "fallback", "category", "locations",
]


def _median(s: pd.Series) -> float:
    s = s.dropna()
    return float(s.median()) if len(s) else math.nan


def _category(op: str) -> str:
    if op in AUTOGRAD_ENTRY_OPS:
        return "autograd"
    return "metadata" if is_metadata_op(op) else "compute"


def _comm_per_call(colls: pd.DataFrame, ops: pd.DataFrame, inclusive: bool) -> dict[tuple, list]:
    """(rank, forward seq, phase) -> [n collectives, comm ms, bytes, n in flight] of that call."""
    out: dict[tuple, list] = {}
    if colls.empty:
        return out
    c = attributed(colls, ops, inclusive)
    c = c[c["op_seq"].notna()]
    phase = c["phase"].where(c["phase"] == "backward", "forward")
    for r, s, ph, ms, b, fl in zip(c["rank"], c["op_seq"], phase, c["duration_ms"],
                                   c["bytes_sent"] + c["bytes_recv"], c["in_flight"]):
        a = out.setdefault((int(r), int(s), ph), [0, 0.0, 0, 0])
        a[0] += 1
        a[1] += 0.0 if pd.isna(ms) else float(ms)
        a[2] += int(b)
        a[3] += int(bool(fl))
    return out


def op_summary(ops: pd.DataFrame, colls: pd.DataFrame, nested: bool = False) -> pd.DataFrame:
    """One row per (op, path, phase); see the module docstring for every column's meaning."""
    if ops.empty:
        return pd.DataFrame(columns=SUMMARY_COLUMNS)
    o = ops.copy()
    backward = o["phase"] == "backward"
    if not nested:
        o = o[backward | (o["depth"] == 0)]
        backward = o["phase"] == "backward"
    # the forward call a row's communication belongs to: the call itself, a backward event's forward op
    o["call_seq"] = o["seq"].where(~backward | o["fwd_seq"].isna(), o["fwd_seq"]).astype("Int64")
    excl = _comm_per_call(colls, ops, False)
    incl = _comm_per_call(colls, ops, True)
    zero = [0, 0.0, 0, 0]

    # several backward events of one forward call share its backward communication: counted once
    once = ~(o.duplicated(["rank", "call_seq", "phase"]) & backward)
    for prefix, table in (("c_", excl), ("i_", incl)):
        per_row = [table.get((int(r), int(s), ph), zero) if first and not pd.isna(s) else zero
                   for r, s, ph, first in zip(o["rank"], o["call_seq"], o["phase"], once)]
        for k, col in enumerate(("n", "ms", "b", "fl")):
            o[prefix + col] = [v[k] for v in per_row]
    shapes = o["in_local_shapes"].map(lambda v: repr(v))
    o["first"] = ~pd.concat([o["rank"], o["op"], o["path"], o["phase"], shapes], axis=1).duplicated()
    local = o["device_ms"].where(o["device_ms"].notna(), o["local_ms"])
    o["local"] = local
    o["dispatch"] = o["host_ms"] - o["i_ms"].astype(float) - local
    rows = []
    for (op, path, phase), g in o.groupby(["op", "path", "phase"], sort=False):
        first, steady = g[g["first"]], g[~g["first"]]
        basis = steady if len(steady) else g
        disp = _median(basis["dispatch"])
        least_disp = float(basis["dispatch"].min()) if basis["dispatch"].notna().any() else math.nan
        loc = _median(basis["local"])
        fallback = bool(path in FALLBACK_PATHS or g["fallback"].astype(bool).any())
        rows.append({
            "op": op, "path": path, "phase": phase, "calls": int(len(g)),
            "ranks": sorted(int(r) for r in g["rank"].unique()),
            "first_calls": int(len(first)), "first_ms_median": _median(first["host_ms"]),
            "steady_calls": int(len(steady)), "steady_ms_median": _median(steady["host_ms"]),
            "steady_ms_p95": float(steady["host_ms"].dropna().quantile(0.95)) if steady["host_ms"].notna().any()
            else math.nan,
            "host_ms_total": float(g["host_ms"].sum()) if g["host_ms"].notna().any() else math.nan,
            "device_ms_median": _median(g["device_ms"]), "local_ms_median": _median(g["local"]),
            "dispatch_ms_median": disp,
            "dispatch_bound": bool(not math.isnan(least_disp) and not math.isnan(loc) and least_disp > loc),
            "n_collectives": int(g["c_n"].sum()), "comm_ms": float(g["c_ms"].sum()), "bytes": int(g["c_b"].sum()),
            "n_collectives_inclusive": int(g["i_n"].sum()), "comm_ms_inclusive": float(g["i_ms"].sum()),
            "bytes_inclusive": int(g["i_b"].sum()),
            "n_in_flight": int(g["i_fl"].sum()),
            "errors": int(g["exc_type"].notna().sum()),
            "fallback": fallback, "category": _category(op),
            "locations": list(dict.fromkeys(w for w in g["location"] if isinstance(w, str))),
        })
    df = pd.DataFrame(rows, columns=SUMMARY_COLUMNS)
    return df.sort_values(["host_ms_total", "calls"], ascending=False, kind="stable", na_position="last") \
        .reset_index(drop=True)
