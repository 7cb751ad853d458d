"""What ``Cluster.check_replicas`` found: is each parameter and buffer of a model the same on every rank of
each group along a mesh dim?

``compare_digests`` compares the ranks' digests (``engine.api.parameter_digests``) group by group;
``ReplicaCheck`` holds the table (with the largest differences the cluster gathered for what differs), the
verdict and the view, which comes through ``sharddbg.rendering``. Pure data: no torch, no cluster.
"""

from __future__ import annotations

import math

import pandas as pd

from .. import rendering

__all__ = ["ReplicaCheck", "compare_digests", "mesh_groups", "TABLE_COLUMNS", "SAME", "DIFFERS", "SHARDED", "MISMATCH",
           "STATES_OK"]

TABLE_COLUMNS = ["name", "kind", "group_ranks", "state", "ranks_differing", "reference_rank", "max_abs_diff",
                 "shape", "dtype", "placements", "detail"]
# state of a parameter in one group
SAME = "same"  # the same bytes on every rank of the group
DIFFERS = "differs"  # some ranks hold other values
SHARDED = "sharded"  # a distributed parameter sharded over the mesh dim: its ranks hold different parts
MISMATCH = "mismatch"  # absent on some ranks, or another shape or dtype there: the models differ
STATES_OK = (SAME, SHARDED)


class ReplicaCheck:
    """What ``Cluster.check_replicas`` found: ``ok`` (every replicated parameter and buffer the same across each
    group), ``table`` (one row per parameter and group, ``TABLE_COLUMNS``), ``differing`` (the names that
    differ somewhere), ``verdict`` (one line, also the repr), ``show()`` (the view)."""

    def __init__(self, table: pd.DataFrame, model: str, mesh_dim: str, groups: list[list[int]]):
        self.table = table
        self.model = model
        self.mesh_dim = mesh_dim
        self.groups = groups

    @property
    def ok(self) -> bool:
        return bool(self.table["state"].isin(STATES_OK).all())

    @property
    def differing(self) -> list[str]:
        bad = self.table[~self.table["state"].isin(STATES_OK)]
        return list(dict.fromkeys(bad["name"]))

    @property
    def verdict(self) -> str:
        names = sorted(set(self.table["name"]))
        where = f"{len(self.groups)} {self.mesh_dim} group{'s' if len(self.groups) > 1 else ''}"
        if self.ok:
            sharded = sorted(set(self.table.loc[self.table["state"] == SHARDED, "name"]))
            extra = f" ({len(sharded)} sharded over {self.mesh_dim}, not compared)" if sharded else ""
            return (f"{self.model}: all {len(names)} parameters and buffers are the same on every rank of each of "
                    f"{where}{extra}")
        bad = self.table[~self.table["state"].isin(STATES_OK)]
        first = bad.iloc[0]
        ranks = first["ranks_differing"]
        who = f"rank {ranks[0]}" if len(ranks) == 1 else "ranks " + ", ".join(map(str, ranks))
        size = f" by up to {first['max_abs_diff']:.3g}" if not math.isnan(first["max_abs_diff"]) else ""
        what = (f"{who} differ{'s' if len(ranks) == 1 else ''} from rank {first['reference_rank']}{size}"
                if first["state"] == DIFFERS else first["detail"])
        fix = (f"; broadcast the parameters from {self.mesh_dim} rank 0 at start-up (before any wrapper)"
               if self.mesh_dim == "domain" else "")
        return (f"{self.model}: {len(self.differing)} of {len(names)} parameters and buffers differ across the ranks "
                f"of a {self.mesh_dim} group (first: {first['name']}: {what}){fix}")

    def __repr__(self) -> str:
        return self.verdict

    def show(self):
        """The view: the verdict, then one row per parameter and group, those that differ first."""
        return rendering.replica_check_view(self)


def mesh_groups(mesh, mesh_dim: str) -> list[list[int]]:
    """The groups of global ranks along ``mesh_dim`` of the cluster's (ddp, domain) mesh (rank r at
    (r // domain, r % domain))."""
    ddp, domain = mesh.shape
    if mesh_dim == "domain":
        return [[d * domain + j for j in range(domain)] for d in range(ddp)]
    return [[d * domain + j for d in range(ddp)] for j in range(domain)]


def compare_digests(digests: dict[int, list[dict]], groups: list[list[int]], mesh_dim: str) -> pd.DataFrame:
    """The table of a ReplicaCheck before any value is gathered (``max_abs_diff`` NaN): per group and name,
    whether every rank holds the same bytes. ``digests``: rank -> ``api.parameter_digests`` rows."""
    rows = []
    for group in groups:
        by_name: dict[str, dict[int, dict]] = {}
        for r in group:
            for row in digests[r]:
                by_name.setdefault(row["name"], {})[r] = row
        for name, found in by_name.items():
            ref = found.get(group[0]) or next(iter(found.values()))
            row = {"name": name, "kind": ref["kind"], "group_ranks": tuple(group), "state": SAME,
                   "ranks_differing": [], "reference_rank": group[0], "max_abs_diff": math.nan,
                   "shape": tuple(ref["shape"]), "dtype": ref["dtype"], "placements": ref["placements"],
                   "detail": None}
            missing = [r for r in group if r not in found]
            layouts = {r: (tuple(f["shape"]), f["dtype"]) for r, f in found.items()}
            if missing:
                row.update(state=MISMATCH, ranks_differing=missing,
                           detail=f"absent on rank{'s' if len(missing) > 1 else ''} {', '.join(map(str, missing))}")
            elif len(set(layouts.values())) > 1:
                odd = [r for r in group if layouts[r] != layouts[group[0]]]
                row.update(state=MISMATCH, ranks_differing=odd,
                           detail="shape or dtype differs: " + ", ".join(
                               f"rank {r} {layouts[r][0]} {layouts[r][1]}" for r in group))
            elif any(mesh_dim in f["sharded_over"] for f in found.values()):
                row.update(state=SHARDED, detail=f"{ref['placements']}: each rank holds its own part")
            else:
                odd = [r for r in group if found[r]["digest"] != found[group[0]]["digest"]]
                if odd:
                    row.update(state=DIFFERS, ranks_differing=odd)
            rows.append(row)
    table = pd.DataFrame(rows, columns=TABLE_COLUMNS)
    table["max_abs_diff"] = table["max_abs_diff"].astype(float)
    return table
