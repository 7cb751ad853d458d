"""Analyses of the op table (``Trace.get_ops()``): pure functions, DataFrame in, DataFrame out.

They need no cluster and no torch, so each is testable on a saved trace.
"""

from __future__ import annotations

import math

import pandas as pd

from ..schema import FALLBACK_PATHS, OP_FIELDS

# get_ops() columns: rank, then the op record's fields up to error in schema order (error as
# "exc_type: message"), then its remaining fields and the error's parts.
OPS_COLUMNS = [
    "rank", "seq", "parent_seq", "depth", "op", "path", "handler", "phase", "autograd_node", "module",
    "user_frame", "in_local_shapes", "in_global_shapes", "out_local_shape", "out_global_shape",
    "placements", "dtype", "sharding_shapes", "in_bytes", "out_bytes", "t_start_ns", "t_end_ns",
    "host_ms", "device_ms", "mem_delta_bytes", "error",
]
OPS_EXTRA_COLUMNS = ["fwd_seq", "in_placements", "fallback", "not_implemented", "in_flight", "thread",
                     "exc_type", "traceback", "error_origin_seq", "unmasked", "promotions"]
FALLBACK_COLUMNS = ["op", "path", "calls", "ranks", "host_ms_total", "user_frames", "via_handler", "bwd_host_ms_total"]
ERROR_COLUMNS = ["rank", "seq", "op", "path", "exc_type", "message", "traceback", "user_frame", "phase", "unmasked", "propagated_to"]
PROMOTION_COLUMNS = ["rank", "seq", "op", "param", "shape", "dtype", "module", "user_frame"]

assert set(OPS_COLUMNS[1:]) <= set(OP_FIELDS), "get_ops columns must come from the schema"


def ops_frame(rows_by_rank: dict[int, list[dict]], offsets_ns: dict[int, int]) -> pd.DataFrame:
    """One row per op record per rank; times moved onto the reference clock (t - offset)."""
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
            r["traceback"] = err["traceback"] if err else None
            r["error_origin_seq"] = err["origin_seq"] if err else None
            r["unmasked"] = bool(err["unmasked"]) if err else False
            rows.append(r)
    df = pd.DataFrame(rows, columns=OPS_COLUMNS + OPS_EXTRA_COLUMNS)
    for c in ("host_ms", "device_ms"):
        df[c] = pd.to_numeric(df[c], errors="coerce").astype(float)  # None (not measured) -> NaN
    df["mem_delta_bytes"] = pd.to_numeric(df["mem_delta_bytes"], errors="coerce").astype(float)
    for c in ("t_start_ns", "t_end_ns", "parent_seq", "fwd_seq", "error_origin_seq"):
        df[c] = df[c].astype("Int64")
    return df.sort_values(["rank", "seq"], kind="stable").reset_index(drop=True)


def is_fallback(ops: pd.DataFrame) -> pd.Series:
    """Per row of ``get_ops()``: the call ran through a DTensor fallback, as its path (one of
    ``schema.FALLBACK_PATHS``) or from inside its handler (``fallback``)."""
    return ops["path"].isin(FALLBACK_PATHS) | ops["fallback"].astype(bool)


def fallbacks(ops: pd.DataFrame) -> pd.DataFrame:
    """Ops that ran through a DTensor fallback, per (op, path): forward calls, ranks, host time.

    ``via_handler``: the op had a handler that itself called the fallback (e.g. linear on a sharded
    feature dim); then ``path`` is the handler path. ``bwd_host_ms_total``: time of their backward
    events (the output node only).
    """
    if ops.empty:
        return pd.DataFrame(columns=FALLBACK_COLUMNS)
    fb = ops[is_fallback(ops)]
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
            "user_frames": sorted({f for f in g["user_frame"] if isinstance(f, str)}),
            "via_handler": bool(via),
            "bwd_host_ms_total": float(b["host_ms"].sum()) if len(b) else 0.0,
        })
    return pd.DataFrame(out, columns=FALLBACK_COLUMNS).sort_values(
        ["host_ms_total", "calls"], ascending=False, kind="stable").reset_index(drop=True)


def errors(ops: pd.DataFrame, include_propagated: bool = False) -> pd.DataFrame:
    """The real exceptions, one row per rank and origin (the innermost op that raised it).

    ``propagated_to``: seqs of the enclosing ops the same exception went through.
    ``include_propagated=True`` keeps those rows too.
    """
    if ops.empty:
        return pd.DataFrame(columns=ERROR_COLUMNS)
    e = ops[ops["exc_type"].notna()].copy()
    if e.empty:
        return pd.DataFrame(columns=ERROR_COLUMNS)
    e["message"] = [s.split(": ", 1)[1] if ": " in s else s for s in e["error"]]
    origin = e["error_origin_seq"] == e["seq"]
    prop = {}
    for (rank, o), g in e[~origin].groupby(["rank", "error_origin_seq"]):
        prop[(rank, o)] = sorted(int(s) for s in g["seq"])
    sel = e if include_propagated else e[origin]
    sel = sel.assign(propagated_to=[prop.get((r, s), []) for r, s in zip(sel["rank"], sel["seq"])])
    return sel[ERROR_COLUMNS].reset_index(drop=True)


def promotions(ops: pd.DataFrame) -> pd.DataFrame:
    """Plain tensors promoted to Replicate DTensors, one row per promotion."""
    rows = []
    for r in ops.itertuples(index=False):
        for p in r.promotions or ():
            rows.append({"rank": r.rank, "seq": r.seq, "op": r.op, "param": p["param"], "shape": tuple(p["shape"]),
                         "dtype": p["dtype"], "module": r.module, "user_frame": r.user_frame})
    return pd.DataFrame(rows, columns=PROMOTION_COLUMNS)
