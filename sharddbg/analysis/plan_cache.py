"""DTensor's redistribution plan cache while recording (``Trace.get_plan_cache()``), from each payload's
``meta["plan_cache"]`` (schema.PLAN_CACHE_FIELDS). No torch, no cluster.

A *stale* miss is a call whose spec changed after the call had cached it (``changed`` names the fields): that
entry is never hit again, the next equal call misses and adds another, and every entry keeps one hash, so
each lookup compares against all of them. ``analysis.findings.plan_cache_finding`` says so, cause first, when
such entries were still in the cache at the end of the recording (a cell that clears the cache after them
has none).
"""

from __future__ import annotations

from typing import NamedTuple

import pandas as pd


PLAN_CACHE_COLUMNS = ["rank", "op", "outer_op", "source", "target", "shape", "spec_type", "changed", "stale", "count",
                      "kept", "first_op_seq", "entries_start", "entries_end"]
# what clears the cache (a plan is recomputed on demand: cheap next to a step)
CLEAR_CALL = "torch.distributed.tensor._redistribute._gen_transform_infos.cache_clear()"


def plan_cache_frame(payloads: dict) -> pd.DataFrame:
    """One row per group of misses per rank (``changed``: the fields joined by ", ", "" for a first call;
    ``stale``: changed is not empty; ``kept``: how many of the group's entries were still cached at stop;
    ``entries_start`` / ``entries_end``: the cache's size when that rank's recording started and stopped).
    Ranks whose payload has no ``plan_cache`` (an older payload, a torch without the cache) have no rows."""
    rows = []
    for rank in sorted(payloads):
        p = payloads[rank]
        pc = (p or {}).get("meta", {}).get("plan_cache")
        if not pc:
            continue
        for g in pc["groups"]:
            rows.append({"rank": int(rank), "op": g["op"], "outer_op": g["outer_op"], "source": g["source"],
                         "target": g["target"], "shape": g["shape"], "spec_type": g["spec_type"],
                         "changed": ", ".join(g["changed"]), "stale": bool(g["changed"]), "count": int(g["count"]),
                         "kept": int(g["kept"]),
                         "first_op_seq": g["first_op_seq"], "entries_start": pc["entries_start"],
                         "entries_end": pc["entries_end"]})
    return pd.DataFrame(rows, columns=PLAN_CACHE_COLUMNS)


def plan_cache_growth(payloads: dict) -> pd.DataFrame:
    """Per rank: the cache's size at start and stop, the misses while recording, how many were stale, and
    how many times the cache was seen emptied."""
    rows = []
    for rank in sorted(payloads):
        pc = (payloads[rank] or {}).get("meta", {}).get("plan_cache")
        if pc:
            rows.append({"rank": int(rank), "entries_start": pc["entries_start"], "entries_end": pc["entries_end"],
                         "misses": int(pc["misses"]), "stale_misses": int(pc["stale_misses"]),
                         "clears": int(pc["clears"])})
    return pd.DataFrame(rows, columns=["rank", "entries_start", "entries_end", "misses", "stale_misses", "clears"])


def stale_left(frame: pd.DataFrame) -> pd.DataFrame:
    """The rows of ``plan_cache_frame`` whose stale entries were still in the cache at the end."""
    return frame[frame["stale"] & (frame["kept"] > 0)] if len(frame) else frame


class StaleSite(NamedTuple):
    """Where most stale entries came from: the call site, the placements, the changed fields, how many."""

    where: str  # "ShardTensor.redistribute (in ShardTensor.backward)"
    source: str
    target: str
    changed: str
    kept: int  # all ranks together
    ranks: list[int]
    kept_per_rank: dict[int, int]  # each rank's own cache holds its own entries


def main_stale_site(stale: pd.DataFrame) -> StaleSite:
    """The group of ``stale_left`` rows (over the ranks) that left the most entries."""
    by_group = stale.groupby(["op", "outer_op", "source", "target", "changed"], dropna=False, sort=False)
    (op, outer, src, dst, changed), g = max(by_group, key=lambda kv: kv[1]["kept"].sum())
    where = op if isinstance(op, str) else "outside every recorded op"
    if isinstance(outer, str) and outer != op:
        where += f" (in {outer})"
    per_rank = {int(r): int(k) for r, k in g.groupby("rank")["kept"].sum().items()}
    return StaleSite(where, src, dst, changed, int(g["kept"].sum()), sorted(per_rank), per_rank)
