"""Is what the ranks hold consistent? Analyses of the verification records (schema version 5): spec
mismatches, replica divergence, collective pre-flight. Pure functions over a Trace's DataFrames and records.

- ``spec_mismatches(ops)``: one row per ShardTensor result whose spec disagreed with its local tensor, at the
  op that made it, on the rank where it held (``Trace.get_spec_mismatches()``).
- ``replicas_frame`` / ``replica_divergence``: the digests of the tensors that claim Replicate, compared across
  the ranks of each replica group; one row per tensor whose digests differ, the earliest first, with the
  largest difference where the cluster gathered the values (``Trace.get_replica_divergence()``).
- ``preflight_frame``: what each rank found when its group compared a collective before issuing it
  (``Trace.get_preflight()``).
"""

from __future__ import annotations

import math
from collections import Counter

import pandas as pd

from .formatting import format_location

SPEC_MISMATCH_COLUMNS = ["rank", "seq", "op", "path", "phase", "depth", "output", "check", "mesh_dim", "spec_shape",
                         "local_shape", "global_shape", "placements", "detail", "t_start_ns", "first", "module",
                         "location"]
REPLICA_COLUMNS = ["rank", "seq", "op", "key", "what", "digest", "shape", "dtype", "group_ranks", "kept",
                   "t_start_ns", "location"]
DIVERGENCE_COLUMNS = ["key", "op", "what", "group_ranks", "ranks_differing", "reference_ranks", "n_versions",
                      "missing_ranks", "shape", "dtype", "t_start_ns", "first", "max_abs_diff", "max_abs_diff_by_rank",
                      "note", "location"]
PREFLIGHT_COLUMNS = ["rank", "seq", "group_seq", "kind", "group_name", "mesh_dim", "group_ranks", "op", "phase",
                     "status", "ms", "detail", "late_ranks", "location"]


def spec_mismatches(ops: pd.DataFrame) -> pd.DataFrame:
    """One row per finding of the ops' ``spec_mismatches`` (``get_ops()``), in time order; ``first``: the
    earliest finding of the trace (where to look first: later ones often follow from it)."""
    rows = []
    if len(ops):
        for r in ops[ops["spec_mismatches"].map(bool)].itertuples(index=False):
            for m in r.spec_mismatches:
                rows.append({"rank": r.rank, "seq": r.seq, "op": r.op, "path": r.path, "phase": r.phase,
                             "depth": r.depth, "output": m["output"], "check": m["check"], "mesh_dim": m["mesh_dim"],
                             "spec_shape": _tuple(m["spec_shape"]), "local_shape": _tuple(m["local_shape"]),
                             "global_shape": _tuple(m["global_shape"]), "placements": m["placements"],
                             "detail": m["detail"], "t_start_ns": r.t_start_ns, "first": False, "module": r.module,
                             "location": r.location})
    out = pd.DataFrame(rows, columns=SPEC_MISMATCH_COLUMNS)
    if len(out):
        out = out.sort_values(["t_start_ns", "rank", "seq"], kind="stable").reset_index(drop=True)
        out.loc[0, "first"] = True
    return out


def _tuple(v):
    return tuple(v) if isinstance(v, list) else v


def replicas_frame(rows_by_rank: dict[int, list[dict]], offsets_ns: dict[int, int]) -> pd.DataFrame:
    """One row per tensor digested after an op, per rank (the ``replicas`` of op records); ``t_start_ns``: its
    op's start on the reference clock."""
    rows = []
    for rank in sorted(rows_by_rank):
        off = int(offsets_ns.get(rank, 0))
        for ev in rows_by_rank[rank]:
            if ev.get("kind") != "op" or not ev.get("replicas"):
                continue
            where = format_location(ev["user_frame"], ev.get("user_cell"), ev.get("user_code"))
            for d in ev["replicas"]:
                rows.append({"rank": rank, "seq": ev["seq"], "op": ev["op"], "key": d["key"], "what": d["what"],
                             "digest": d["digest"], "shape": tuple(d["shape"]), "dtype": d["dtype"],
                             "group_ranks": tuple(d["group_ranks"]), "kept": d["kept"],
                             "t_start_ns": ev["t_start_ns"] - off, "location": where})
    return pd.DataFrame(rows, columns=REPLICA_COLUMNS)


def replica_divergence(replicas: pd.DataFrame, differences: list[dict] | None = None) -> pd.DataFrame:
    """One row per tensor (digest key and replica group) whose ranks hold different values, the earliest
    first (``first``). ``reference_ranks``: the ranks holding the most common version (on a tie, the lowest
    rank's); ``ranks_differing``: the others; ``n_versions``: distinct digests; ``missing_ranks``: ranks of
    the group that digested no such tensor (they did not run that op call). ``max_abs_diff`` (the largest over
    the differing ranks) and ``max_abs_diff_by_rank`` come from ``differences``, what the cluster gathered for
    the first op that diverged (``{"key", "group_ranks", "by_rank": {rank: float | None}, "note"}``); NaN
    where no values were gathered, and ``note`` says why."""
    if replicas.empty:
        return pd.DataFrame(columns=DIVERGENCE_COLUMNS)
    gathered = {(d["key"], tuple(d["group_ranks"])): d for d in differences or ()}
    rows = []
    for (key, group), g in replicas.groupby(["key", "group_ranks"], sort=False):
        versions = Counter(g["digest"])
        if len(versions) < 2:
            continue
        by_digest = {dig: sorted(int(r) for r in g.loc[g["digest"] == dig, "rank"]) for dig in versions}
        top = max(versions.values())
        ref = min((ranks for dig, ranks in by_digest.items() if versions[dig] == top), key=lambda rs: rs[0])
        differing = sorted(int(r) for r in g["rank"] if int(r) not in ref)
        first_row = g.sort_values("t_start_ns", kind="stable").iloc[0]
        got = gathered.get((key, tuple(group)))
        by_rank = {int(r): v for r, v in (got or {}).get("by_rank", {}).items()}
        values = [by_rank[r] for r in differing if by_rank.get(r) is not None]
        note = (got or {}).get("note")
        if got is None:
            note = "values not gathered (only the first op that diverged is gathered)"
        rows.append({
            "key": key, "op": first_row["op"], "what": first_row["what"], "group_ranks": tuple(group),
            "ranks_differing": differing, "reference_ranks": ref, "n_versions": len(versions),
            "missing_ranks": sorted(set(group) - {int(r) for r in g["rank"]}),
            "shape": first_row["shape"], "dtype": first_row["dtype"], "t_start_ns": int(g["t_start_ns"].min()),
            "first": False, "max_abs_diff": max(values) if values else math.nan,
            "max_abs_diff_by_rank": by_rank or None, "note": note, "location": first_row["location"]})
    out = pd.DataFrame(rows, columns=DIVERGENCE_COLUMNS)
    if len(out):
        out = out.sort_values(["t_start_ns", "key"], kind="stable").reset_index(drop=True)
        out.loc[0, "first"] = True
        out["max_abs_diff"] = out["max_abs_diff"].astype(float)
    return out


def first_divergence(replicas: pd.DataFrame) -> pd.DataFrame:
    """The rows of ``replica_divergence`` that belong to the first op call where ranks diverge (every tensor of
    that call whose replicas differ): what the cluster gathers values for."""
    div = replica_divergence(replicas)
    if div.empty:
        return div
    call = div.loc[0, "key"].split("/", 1)[0]  # "<op>#<k>"
    return div[div["key"].map(lambda k: k.split("/", 1)[0] == call)].reset_index(drop=True)


def divergence_text(div: pd.DataFrame) -> str | None:
    """One line on the first divergence: 'replicas diverge first at torch.conv2d (parameter 0.weight, cell [4],
    line 2: `y = net(x)`): rank 2 differs from ranks 0, 1, 3 by up to 0.53'; None when none."""
    if div.empty:
        return None
    r = div.iloc[0]
    where = f", {r['location']}" if isinstance(r["location"], str) else ""
    ranks = r["ranks_differing"]
    who = (f"rank {ranks[0]} differs" if len(ranks) == 1 else "ranks " + ", ".join(map(str, ranks)) + " differ")
    ref = r["reference_ranks"]
    against = f"rank {ref[0]}" if len(ref) == 1 else "ranks " + ", ".join(map(str, ref))
    by = f" by up to {r['max_abs_diff']:.3g}" if not math.isnan(r["max_abs_diff"]) else ""
    more = f" ({len(div) - 1} more tensor(s) diverge later)" if len(div) > 1 else ""
    return f"replicas diverge first at {r['op']} ({r['what']}{where}): {who} from {against}{by}{more}"


def preflight_frame(rows_by_rank: dict[int, list[dict]], ops: pd.DataFrame | None = None) -> pd.DataFrame:
    """One row per collective whose group compared it before it was issued, per rank (the ``preflight`` of
    collective records); ``status`` "mismatch" rows carry what disagreed (``detail``); ``location``: where the
    user's code called the op that issued it (from ``ops``, ``get_ops()``)."""
    where = {}
    if ops is not None and len(ops):
        where = dict(zip(zip(ops["rank"].astype(int), ops["seq"].astype(int)), ops["location"]))
    rows = []
    for rank in sorted(rows_by_rank):
        for ev in rows_by_rank[rank]:
            if ev.get("kind") != "collective" or not ev.get("preflight"):
                continue
            pf = ev["preflight"]
            rows.append({"rank": rank, "seq": ev["seq"], "group_seq": ev["group_seq"], "kind": ev["coll"],
                         "group_name": ev["group_name"], "mesh_dim": ev["mesh_dim"],
                         "group_ranks": tuple(ev["group_ranks"]) if ev["group_ranks"] is not None else None,
                         "op": ev["op"], "phase": ev["phase"], "status": pf["status"], "ms": float(pf["ms"]),
                         "detail": pf["detail"], "late_ranks": list(pf["late_ranks"]),
                         "location": format_location(ev.get("user_frame"), ev.get("user_cell"), ev.get("user_code"))
                         or (where.get((rank, ev["op_seq"])) if ev["op_seq"] is not None else None)})
    return pd.DataFrame(rows, columns=PREFLIGHT_COLUMNS)
