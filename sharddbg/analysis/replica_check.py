"""What ``Cluster.check_replicas`` found: is each parameter and buffer of a model the same on every rank of
each group along a mesh dim?

``compare_digests`` compares the ranks' digests (``engine.api.parameter_digests``) group by group;
``ReplicaCheck`` holds the table (with the largest differences the cluster gathered for what differs), the
verdict and the view, which comes through ``sharddbg.rendering``. Pure data: no torch, no cluster.
"""

from __future__ import annotations

import math
from typing import Any

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
    """What ``Cluster.check_replicas`` found: is each parameter and buffer the same on every rank of each group?

    ``ok`` says every replicated parameter and buffer is the same across each group; ``table`` has one row
    per parameter (or buffer) and group (``TABLE_COLUMNS``: name, kind, group_ranks, state, ranks_differing,
    reference_rank, max_abs_diff, shape, dtype, placements, detail), those that differ first; ``differing``
    names those that differ somewhere; ``verdict`` is one line, also the repr; ``show()`` the view. The
    constructor's arguments stay as attributes of the same names. ``Cluster.check_replicas`` builds it; its
    view comes through ``sharddbg.rendering``.

    Parameters
    ----------
    table : pandas.DataFrame
        One row per name and group, ``TABLE_COLUMNS``: ``state`` is ``"same"`` (the same bytes on every rank
        of the group), ``"differs"``, ``"sharded"`` (a distributed parameter sharded over the mesh dim: not
        compared) or ``"mismatch"`` (absent on some ranks, or another shape or dtype there);
        ``max_abs_diff`` the largest difference to the group's first rank (``reference_rank``), NaN where
        nothing was gathered.
    model : str
        The expression that names the nn.Module on the ranks.
    mesh_dim : str
        The mesh dim whose groups were compared, ``"domain"`` or ``"ddp"``.
    groups : list of list of int
        The groups of global ranks along ``mesh_dim``.

    Examples
    --------
    >>> chk = cl.check_replicas("net")
    >>> chk.ok
    False
    >>> chk  # doctest: +NORMALIZE_WHITESPACE
    net: 2 of 4 parameters and buffers differ across the ranks of a domain group (first: 0.weight: ranks 1, 2,
    3 differ from rank 0 by up to 0.735); broadcast the parameters from domain rank 0 at start-up (before any
    wrapper)
    >>> chk.table[["name", "state", "ranks_differing", "max_abs_diff"]]
           name    state ranks_differing  max_abs_diff
    0  0.weight  differs       [1, 2, 3]         0.735
    1  2.weight  differs       [1, 2, 3]         0.412
    2    0.bias     same              []           NaN
    3    2.bias     same              []           NaN
    """

    def __init__(self, table: pd.DataFrame, model: str, mesh_dim: str, groups: list[list[int]]):
        self.table = table
        self.model = model
        self.mesh_dim = mesh_dim
        self.groups = groups

    @property
    def ok(self) -> bool:
        """Every row is ``"same"`` or ``"sharded"``: no replicated parameter or buffer differs, none is missing
        or of another shape or dtype on some rank."""
        return bool(self.table["state"].isin(STATES_OK).all())

    @property
    def differing(self) -> list[str]:
        """The names of the parameters and buffers that differ (or mismatch) in some group, each once, in the
        table's order."""
        bad = self.table[~self.table["state"].isin(STATES_OK)]
        return list(dict.fromkeys(bad["name"]))

    @property
    def verdict(self) -> str:
        """One line, also the repr: the model, then either that every parameter and buffer is the same on every
        rank of each group (and how many are sharded, not compared), or how many differ, the first of them with
        its ranks and largest difference (or what does not match), and, over the domain axis, the fix."""
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

    def show(self) -> Any:
        """The view: the verdict, then one row per parameter and group, those that differ first.

        Returns
        -------
        sharddbg.views.replicas.ReplicaCheckView
            Static HTML in a notebook; ``html()`` and ``text()`` give it as HTML and plain text.

        Examples
        --------
        >>> chk = cl.check_replicas("net")
        >>> chk.show()  # doctest: +SKIP
        >>> print(chk.show().text())  # doctest: +ELLIPSIS
        net: 2 of 4 parameters and buffers differ across the ranks of a domain group (first: 0.weight: ...
        parameter  ranks       state      differing ranks  max |diff|  shape         dtype    detail
        0.weight   0, 1, 2, 3  ✖ differs  1, 2, 3          0.735       (8, 3, 3, 3)  float32
        ...
        """
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
