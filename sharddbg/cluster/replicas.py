"""Are a model's parameters the same on every rank of a mesh dim? The stand-alone replica check.

Neither DDP nor FSDP2 synchronises plain parameters over the domain axis: a model built on every rank from
its own random state trains "fine" and wrong unless its weights are broadcast from domain rank 0 at start-up.
``check_replicas`` asks every rank for a digest of each parameter and buffer of the model
(``api.parameter_digests``, no communication), compares them within each group of the mesh dim, and for the
ones that differ gathers the values (``api.parameter_differences``: a broadcast from the group's first rank,
on every rank) for the largest difference. The answer is a ``ReplicaCheck``: ``ok``, a table (one row per
parameter and group), a view, and a verdict line.
"""

from __future__ import annotations

import math

import pandas as pd

from ..engine import api
from ..errors import ClusterError, hide_own_frames
from .execution import RankExecution

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
        from ..views.replicas import ReplicaCheckView

        return ReplicaCheckView(self.table, self.verdict, self.mesh_dim)


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


def check_replicas(cluster, execution: RankExecution, model: str, *, mesh_dim: str = "domain",
                   timeout: float | None = None) -> ReplicaCheck:
    """``Cluster.check_replicas``: see the module docstring."""
    __tracebackhide__ = hide_own_frames()
    if not isinstance(model, str) or not model.strip():
        raise ClusterError(f"model must name an nn.Module on the ranks (a variable or an expression), got {model!r}")
    axes = cluster.mesh.as_dict()
    if mesh_dim not in axes:
        raise ClusterError(f"mesh_dim must be one of {sorted(axes)} (the cluster's mesh {cluster.mesh}), got {mesh_dim!r}")
    groups = mesh_groups(cluster.mesh, mesh_dim)
    ranks = list(range(execution.n))
    per_rank = execution.call(api.parameter_digests, model, ranks=ranks, timeout=timeout,
                              what=f"digests of {model}'s parameters")
    table = compare_digests(dict(zip(ranks, per_rank)), groups, mesh_dim)
    differ = table[table["state"] == DIFFERS]
    if len(differ):
        # the same list on every rank: every group broadcasts each name, whether it differs there or not
        names = sorted(set(differ["name"]) - set(table.loc[table["state"] == MISMATCH, "name"]))
        if names:
            found = execution.call(api.parameter_differences, model, names, mesh_dim, ranks=ranks, timeout=timeout,
                                   what=f"gathering the differing parameters of {model}")
            by_rank = dict(zip(ranks, found))
            for i in differ.index:
                name = table.at[i, "name"]
                if name not in names:
                    continue
                k = names.index(name)
                values = [by_rank[r][k]["max_abs_diff"] for r in table.at[i, "ranks_differing"]]
                known = [v for v in values if v is not None]
                table.at[i, "max_abs_diff"] = max(known) if known else math.nan
                notes = sorted({by_rank[r][k]["note"] for r in table.at[i, "group_ranks"] if by_rank[r][k]["note"]})
                if notes:
                    table.at[i, "detail"] = "; ".join(notes)
                elif known and max(known) == 0:
                    table.at[i, "detail"] = "the same numbers, different bytes (-0.0 against 0.0, or NaN payloads)"
    order = table["state"].map({MISMATCH: 0, DIFFERS: 1, SHARDED: 2, SAME: 3})
    table = table.assign(_order=order).sort_values(["_order"], kind="stable").drop(columns="_order")
    return ReplicaCheck(table.reset_index(drop=True), model, mesh_dim, groups)
