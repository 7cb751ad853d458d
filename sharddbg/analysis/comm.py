"""Analyses of the collective records (schema ``collective``): pure functions, no torch, no cluster.

``collectives_frame`` builds ``Trace.get_collectives()``; the others take that frame (and the op table
of ``Trace.get_ops()``) and return DataFrames. Collectives issued outside any recorded op are counted
under ``NO_OP`` everywhere.

Definitions used throughout:
- ``duration_ms``: ``t_done_ns - t_issue_ns`` on the host (issue to the return of its wait); NaN when
  no wait was seen while recording.
- ``bandwidth_gbps``: effective bandwidth in GB/s (10^9 bytes per second) =
  ``max(bytes_sent, bytes_recv) / duration`` (``device_ms`` when measured, else ``duration_ms``).
- ``wait_ms`` (imbalance): how long this rank waited for the last rank of the group to arrive at the
  same collective (``max(t_issue of all ranks at that group_seq) - own t_issue``), on the aligned clock.
"""

from __future__ import annotations

import math

import pandas as pd

from ..schema import COLLECTIVE_FIELDS
from .ops import NO_OP

COLLECTIVE_COLUMNS = [
    "rank", "seq", "group_seq", "kind", "group_ranks", "mesh_dim", "bytes_sent", "bytes_recv", "t_issue_ns",
    "t_done_ns", "duration_ms", "async", "op", "op_seq", "outer_op", "outer_op_seq", "phase", "autograd_node",
    "param", "bandwidth_gbps",
]
COLLECTIVE_EXTRA_COLUMNS = [
    "group_name", "group_size", "peer", "root", "splits_sent", "splits_recv", "dtype", "shape", "api", "aten_op",
    "t_return_ns", "issue_ms", "wait_op_seq", "waited", "device_ms", "in_flight", "thread",
]
COMM_BY_OP_COLUMNS = ["op", "rank", "calls", "n_collectives", "kinds", "bytes_sent", "bytes_recv", "comm_ms", "op_ms",
                      "comm_share"]
COMM_BY_OP_KIND_COLUMNS = ["op", "kind", "calls", "bytes", "comm_ms"]
COMM_BY_CALL_COLUMNS = ["rank", "op_seq", "op", "path", "module", "n_collectives", "kinds", "bytes_sent", "bytes_recv",
                        "comm_ms", "op_ms", "comm_share", "user_frame"]
IMBALANCE_COLUMNS = ["op", "rank", "calls", "shard_elems", "host_ms", "comm_ms", "wait_ms", "n_collectives",
                     "shard_imbalance", "host_imbalance", "wait_ms_max"]
MISMATCH_COLUMNS = ["group_name", "group_seq", "mesh_dim", "problem", "ranks", "kinds", "detail"]


# kinds whose buffers must have the same size on every rank of the group
_SAME_SIZE = {"all_reduce", "all_reduce_coalesced", "all_gather_into_tensor", "all_gather",
              "all_gather_into_tensor_coalesced", "all_gather_coalesced", "reduce_scatter_tensor", "reduce_scatter",
              "reduce_scatter_tensor_coalesced", "reduce", "barrier"}
_P2P = {"send", "recv"}

assert {c for c in COLLECTIVE_COLUMNS[1:] + COLLECTIVE_EXTRA_COLUMNS
        if c not in ("kind", "duration_ms", "bandwidth_gbps", "issue_ms")} <= set(COLLECTIVE_FIELDS)


def collectives_frame(rows_by_rank: dict[int, list[dict]], offsets_ns: dict[int, int]) -> pd.DataFrame:
    """One row per collective record per rank; times on the reference clock (t - offset)."""
    rows = []
    for rank in sorted(rows_by_rank):
        off = int(offsets_ns.get(rank, 0))
        for ev in rows_by_rank[rank]:
            if ev.get("kind") != "collective":
                continue
            r = {k: ev.get(k) for k in COLLECTIVE_COLUMNS[1:] + COLLECTIVE_EXTRA_COLUMNS if k in COLLECTIVE_FIELDS}
            r["rank"] = rank
            r["kind"] = ev["coll"]
            for k in ("t_issue_ns", "t_return_ns", "t_done_ns"):
                r[k] = ev[k] - off if ev.get(k) is not None else None
            rows.append(r)
    df = pd.DataFrame(rows, columns=COLLECTIVE_COLUMNS + COLLECTIVE_EXTRA_COLUMNS)
    for c in ("t_issue_ns", "t_return_ns", "t_done_ns", "op_seq", "outer_op_seq", "wait_op_seq", "peer", "root",
              "group_size"):
        df[c] = df[c].astype("Int64")
    df["duration_ms"] = ((df["t_done_ns"] - df["t_issue_ns"]).astype("Float64") / 1e6).astype(float)
    df["issue_ms"] = ((df["t_return_ns"] - df["t_issue_ns"]).astype("Float64") / 1e6).astype(float)
    df["device_ms"] = pd.to_numeric(df["device_ms"], errors="coerce").astype(float)
    t_ms = df["device_ms"].where(df["device_ms"].notna(), df["duration_ms"])
    vol = df[["bytes_sent", "bytes_recv"]].max(axis=1).astype(float) if len(df) else pd.Series(dtype=float)
    df["bandwidth_gbps"] = (vol / (t_ms / 1e3) / 1e9).where(t_ms > 0)
    return df.sort_values(["rank", "seq"], kind="stable").reset_index(drop=True)


def _kinds(s: pd.Series) -> dict:
    return {str(k): int(v) for k, v in s.value_counts().sort_index().items()}


def _sum_ms(s: pd.Series) -> float:
    return float(s.sum()) if s.notna().any() else 0.0


def comm_by_op(colls: pd.DataFrame, ops: pd.DataFrame, by: str = "op") -> pd.DataFrame:
    """Communication per op name and rank (``by="op"``) or per op call (``by="call"``).

    Collectives count for the op they are attributed to (``op``: innermost recorded op at issue; in
    backward the forward op whose autograd node issued them). ``calls``: forward calls of the op on that
    rank; ``op_ms``: host time of those calls plus their backward events; ``comm_ms``: sum of the
    collectives' ``duration_ms`` (async ones may overlap each other and compute); ``comm_share`` =
    comm_ms / op_ms. Collectives issued outside any recorded op appear under ``NO_OP``.
    """
    if by not in ("op", "call"):
        raise ValueError(f"by must be 'op' or 'call', got {by!r}")
    c = colls.copy()
    c["op"] = c["op"].where(c["op"].notna(), NO_OP)
    if by == "call":
        return _comm_by_call(c, ops)
    rows = []
    fwd = ops[ops["phase"] == "forward"] if len(ops) else ops
    keys = set(zip(c["op"], c["rank"]))
    keys |= set(zip(fwd["op"], fwd["rank"])) if len(fwd) else set()
    for op, rank in sorted(keys, key=lambda k: (str(k[0]), int(k[1]))):
        g = c[(c["op"] == op) & (c["rank"] == rank)]
        o = ops[(ops["op"] == op) & (ops["rank"] == rank)] if len(ops) else ops
        calls = int((o["phase"] == "forward").sum()) if len(o) else 0
        op_ms = _sum_ms(o["host_ms"]) if len(o) else math.nan
        comm = _sum_ms(g["duration_ms"])
        rows.append({
            "op": op, "rank": int(rank), "calls": calls, "n_collectives": int(len(g)), "kinds": _kinds(g["kind"]),
            "bytes_sent": int(g["bytes_sent"].sum()), "bytes_recv": int(g["bytes_recv"].sum()),
            "comm_ms": comm, "op_ms": op_ms,
            "comm_share": comm / op_ms if op_ms and not math.isnan(op_ms) and op_ms > 0 else math.nan,
        })
    df = pd.DataFrame(rows, columns=COMM_BY_OP_COLUMNS)
    return df.sort_values(["comm_ms", "op", "rank"], ascending=[False, True, True], kind="stable").reset_index(drop=True)


def _comm_by_call(c: pd.DataFrame, ops: pd.DataFrame) -> pd.DataFrame:
    rows = []
    fwd = ops[ops["phase"] == "forward"] if len(ops) else ops
    bwd = ops[ops["phase"] == "backward"] if len(ops) else ops
    with_coll = c[c["op_seq"].notna()]
    keys = set(zip(with_coll["rank"], with_coll["op_seq"].astype(int)))
    keys |= set(zip(fwd["rank"], fwd["seq"].astype(int))) if len(fwd) else set()
    fwd_idx = {(int(r), int(s)): row for r, s, row in zip(fwd["rank"], fwd["seq"], fwd.itertuples(index=False))} \
        if len(fwd) else {}
    bwd_ms: dict[tuple[int, int], float] = {}
    if len(bwd):
        for r, fs, ms in zip(bwd["rank"], bwd["fwd_seq"], bwd["host_ms"]):
            if not pd.isna(fs) and not pd.isna(ms):
                bwd_ms[(int(r), int(fs))] = bwd_ms.get((int(r), int(fs)), 0.0) + float(ms)
    for rank, seq in sorted(keys):
        g = with_coll[(with_coll["rank"] == rank) & (with_coll["op_seq"] == seq)]
        o = fwd_idx.get((rank, seq))
        op_ms = (float(o.host_ms) if o is not None and not pd.isna(o.host_ms) else 0.0) + bwd_ms.get((rank, seq), 0.0)
        comm = _sum_ms(g["duration_ms"])
        rows.append({
            "rank": int(rank), "op_seq": int(seq),
            "op": o.op if o is not None else (g["op"].iloc[0] if len(g) else None),
            "path": o.path if o is not None else None, "module": o.module if o is not None else None,
            "n_collectives": int(len(g)), "kinds": _kinds(g["kind"]),
            "bytes_sent": int(g["bytes_sent"].sum()), "bytes_recv": int(g["bytes_recv"].sum()),
            "comm_ms": comm, "op_ms": op_ms, "comm_share": comm / op_ms if op_ms > 0 else math.nan,
            "user_frame": o.user_frame if o is not None else None,
        })
    nc = c[c["op_seq"].isna()]
    for rank, g in nc.groupby("rank"):
        rows.append({"rank": int(rank), "op_seq": None, "op": NO_OP, "path": None, "module": None,
                     "n_collectives": int(len(g)), "kinds": _kinds(g["kind"]),
                     "bytes_sent": int(g["bytes_sent"].sum()), "bytes_recv": int(g["bytes_recv"].sum()),
                     "comm_ms": _sum_ms(g["duration_ms"]), "op_ms": math.nan, "comm_share": math.nan,
                     "user_frame": None})
    df = pd.DataFrame(rows, columns=COMM_BY_CALL_COLUMNS)
    df["op_seq"] = df["op_seq"].astype("Int64")
    return df.sort_values(["rank", "op_seq"], kind="stable").reset_index(drop=True)


def comm_by_op_kind(colls: pd.DataFrame) -> pd.DataFrame:
    """Communication per (op, collective kind), all ranks together: ``calls`` (collectives),
    ``bytes`` (sent + received), ``comm_ms`` (sum of ``duration_ms``; collectives not waited for add
    nothing). Largest ``bytes`` first, then largest ``comm_ms``."""
    if colls.empty:
        return pd.DataFrame(columns=COMM_BY_OP_KIND_COLUMNS)
    c = colls.assign(op=colls["op"].where(colls["op"].notna(), NO_OP),
                     bytes=colls["bytes_sent"].fillna(0) + colls["bytes_recv"].fillna(0))
    g = c.groupby(["op", "kind"], sort=False).agg(calls=("kind", "size"), bytes=("bytes", "sum"),
                                                  comm_ms=("duration_ms", "sum"))
    return g.reset_index().sort_values(["bytes", "comm_ms"], ascending=False, kind="stable").reset_index(drop=True)[
        COMM_BY_OP_KIND_COLUMNS]


def arrival_wait_ms(colls: pd.DataFrame) -> pd.Series:
    """Per collective row: ms this rank waited for the group's last arrival at the same
    (group_name, group_seq), from the aligned ``t_issue_ns``. NaN when only one rank recorded it."""
    if colls.empty:
        return pd.Series(dtype=float)
    t = colls["t_issue_ns"].astype("Float64")
    last = t.groupby([colls["group_name"], colls["group_seq"]]).transform("max")
    n = t.groupby([colls["group_name"], colls["group_seq"]]).transform("count")
    w = ((last - t) / 1e6).astype(float)
    return w.where(n.astype(int) > 1)


def imbalance(ops: pd.DataFrame, colls: pd.DataFrame) -> pd.DataFrame:
    """Per op name and rank: shard volume (``shard_elems``: elements of the local data of every
    distributed argument, ShardTensor or DTensor, of its forward calls; plain tensors, such as weights
    promoted to Replicate during the call, are left out) beside host time (forward and backward events),
    comm time of its collectives and the time spent waiting for other ranks to arrive (``wait_ms``).
    ``shard_imbalance`` / ``host_imbalance``: max over ranks / mean over ranks of that op (1.0 =
    balanced); ``wait_ms_max``: the largest per-rank wait of that op."""
    c = colls.copy()
    c["wait_ms"] = arrival_wait_ms(c) if len(c) else pd.Series(dtype=float)
    c["op"] = c["op"].where(c["op"].notna(), NO_OP)
    rows = []
    keys = set(zip(ops["op"], ops["rank"])) if len(ops) else set()
    keys |= set(zip(c["op"], c["rank"]))
    for op, rank in sorted(keys, key=lambda k: (str(k[0]), int(k[1]))):
        o = ops[(ops["op"] == op) & (ops["rank"] == rank)] if len(ops) else ops
        f = o[o["phase"] == "forward"] if len(o) else o
        g = c[(c["op"] == op) & (c["rank"] == rank)]
        rows.append({
            "op": op, "rank": int(rank), "calls": int(len(f)),
            "shard_elems": _shard_elems(f),
            "host_ms": _sum_ms(o["host_ms"]) if len(o) else 0.0,
            "comm_ms": _sum_ms(g["duration_ms"]), "wait_ms": _sum_ms(g["wait_ms"]), "n_collectives": int(len(g)),
        })
    df = pd.DataFrame(rows, columns=IMBALANCE_COLUMNS)
    if len(df):
        grp = df.groupby("op")
        for src, dst in (("shard_elems", "shard_imbalance"), ("host_ms", "host_imbalance")):
            mean = grp[src].transform("mean").astype(float)
            df[dst] = (grp[src].transform("max").astype(float) / mean).where(mean > 0)
        df["wait_ms_max"] = grp["wait_ms"].transform("max")
    return df.sort_values(["op", "rank"], kind="stable").reset_index(drop=True)


def _shard_elems(f: pd.DataFrame) -> int:
    total = 0
    for shapes, pls in zip(f["in_local_shapes"], f["in_placements"]):
        for shp, pl in zip(shapes or (), pls or ()):
            if pl is not None and shp is not None:
                total += math.prod(int(d) for d in shp)
    return int(total)


def collective_mismatches(colls: pd.DataFrame, traced_ranks=None) -> pd.DataFrame:
    """Collectives that do not line up across the ranks of their group.

    At each (group_name, group_seq) every rank of the group must have issued the same collective:
    ``problem`` is ``"kind"`` (different kinds; send/recv count as one point-to-point kind),
    ``"dtype"``, ``"size"`` (different buffer sizes for a kind whose sizes must agree, or a broadcast
    with different sizes or roots), ``"splits"`` (all_to_all: what rank i sends to j differs from what j
    expects from i), or ``"missing"`` (a rank of the group never issued a collective with this group_seq:
    it recorded fewer on the group, or none at all). ``traced_ranks``: the ranks the trace holds (a rank of
    the group outside them is not counted missing); None: every rank of the group. Point-to-point calls
    are not counted: a send and its recv are one pair of ranks, not the whole group.
    """
    rows = []
    if colls.empty:
        return pd.DataFrame(columns=MISMATCH_COLUMNS)
    traced = None if traced_ranks is None else {int(r) for r in traced_ranks}
    for (gname, gseq), d in colls.groupby(["group_name", "group_seq"], sort=True):
        d = d.sort_values("rank")
        ranks = [int(r) for r in d["rank"]]
        kinds = [str(k) for k in d["kind"]]
        mesh_dim = d["mesh_dim"].iloc[0]
        base = {"group_name": gname, "group_seq": int(gseq), "mesh_dim": mesh_dim, "ranks": ranks, "kinds": kinds}
        gr = d["group_ranks"].iloc[0]
        members = [int(x) for x in gr] if isinstance(gr, (list, tuple)) else ranks
        missing = sorted(set(members) - set(ranks) - (set() if traced is None else set(members) - traced))
        if missing and not all(k in _P2P for k in kinds):
            where = mesh_dim if isinstance(mesh_dim, str) else f"process group {gname}"
            rows.append({**base, "problem": "missing", "detail": "; ".join(
                f"rank {r} never issued group_seq {int(gseq)}: {kinds[0]} on {where}" for r in missing)})
        classes = {("p2p" if k in _P2P else k) for k in kinds}
        if len(classes) > 1:
            rows.append({**base, "problem": "kind", "detail": ", ".join(f"rank {r}: {k}" for r, k in zip(ranks, kinds))})
            continue
        kind = kinds[0]
        if kind in _P2P:
            continue
        dts = {str(x) for x in d["dtype"] if isinstance(x, str)}
        if len(dts) > 1:
            rows.append({**base, "problem": "dtype", "detail": ", ".join(f"rank {r}: {x}" for r, x in zip(ranks, d["dtype"]))})
        if kind in _SAME_SIZE:
            sizes = [int(x) for x in d["bytes_sent"]]
            if len(set(sizes)) > 1:
                rows.append({**base, "problem": "size",
                             "detail": ", ".join(f"rank {r}: {s} B sent" for r, s in zip(ranks, sizes))})
        elif kind == "broadcast":
            sizes = [max(int(a), int(b)) for a, b in zip(d["bytes_sent"], d["bytes_recv"])]
            roots = {int(x) for x in d["root"] if not pd.isna(x)}
            if len(set(sizes)) > 1 or len(roots) > 1:
                rows.append({**base, "problem": "size", "detail": ", ".join(
                    f"rank {r}: {s} B root {ro}" for r, s, ro in zip(ranks, sizes, d["root"]))})
        elif kind in ("all_to_all_single", "all_to_all"):
            pos = {g: i for i, g in enumerate(members)}
            sent = {int(r): s for r, s in zip(d["rank"], d["splits_sent"]) if isinstance(s, (list, tuple))}
            recv = {int(r): s for r, s in zip(d["rank"], d["splits_recv"]) if isinstance(s, (list, tuple))}
            bad = []
            for i in sent:
                for j in recv:
                    if i in pos and j in pos and pos[j] < len(sent[i]) and pos[i] < len(recv[j]):
                        if int(sent[i][pos[j]]) != int(recv[j][pos[i]]):
                            bad.append(f"{i}->{j}: sends {sent[i][pos[j]]} B, {j} expects {recv[j][pos[i]]} B")
            if bad:
                rows.append({**base, "problem": "splits", "detail": "; ".join(bad)})
    return pd.DataFrame(rows, columns=MISMATCH_COLUMNS)
