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

from ..analysis.replica_check import (DIFFERS, MISMATCH, SAME, SHARDED, STATES_OK, TABLE_COLUMNS, ReplicaCheck,
                                      compare_digests, mesh_groups)
from ..engine import api
from ..errors import ClusterError, hide_own_frames
from .execution import RankExecution
from .mesh import MeshSpec

__all__ = ["ReplicaCheck", "check_replicas", "compare_digests", "mesh_groups", "TABLE_COLUMNS", "SAME", "DIFFERS",
           "SHARDED", "MISMATCH", "STATES_OK"]


def check_replicas(execution: RankExecution, mesh: MeshSpec, model: str, *, mesh_dim: str = "domain",
                   timeout: float | None = None) -> ReplicaCheck:
    """``Cluster.check_replicas`` on the ranks of ``execution``, on the cluster's ``mesh``: see the module
    docstring."""
    __tracebackhide__ = hide_own_frames()
    if not isinstance(model, str) or not model.strip():
        raise ClusterError(f"model must name an nn.Module on the ranks (a variable or an expression), got {model!r}")
    axes = mesh.as_dict()
    if mesh_dim not in axes:
        raise ClusterError(f"mesh_dim must be one of {sorted(axes)} (the cluster's mesh {mesh}), got {mesh_dim!r}")
    groups = mesh_groups(mesh, mesh_dim)
    ranks = list(range(execution.n))
    per_rank = execution.call(api.parameter_digests, expression=model, ranks=ranks, timeout=timeout,
                              what=f"digests of {model}'s parameters")
    table = compare_digests(dict(zip(ranks, per_rank)), groups, mesh_dim)
    differ = table[table["state"] == DIFFERS]
    if len(differ):
        # the same list on every rank: every group broadcasts each name, whether it differs there or not
        names = sorted(set(differ["name"]) - set(table.loc[table["state"] == MISMATCH, "name"]))
        if names:
            found = execution.call(api.parameter_differences, expression=model, names=names, mesh_dim=mesh_dim,
                                   ranks=ranks, timeout=timeout, what=f"gathering the differing parameters of {model}")
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
