"""What ``Cluster.check`` found: each compared tensor against the unsharded reference, per rank and per row
along its sharded dim, and where the failing rows lie relative to the shard boundaries.

``CheckResult`` holds the data (its tables, the verdict, the boundary patterns); its views come through
``sharddbg.rendering``. ``check_tables`` builds its tables from the ranks' comparison records
(``engine.api.check_compare``). Pure data: no torch, no cluster.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import pandas as pd

from .. import rendering

__all__ = ["CheckResult", "BoundaryPattern", "check_tables", "whole_multiple", "TABLE_COLUMNS", "ROW_COLUMNS",
           "KIND_ORDER", "NEAR_BOUNDARY_SHARE"]

# One row per tensor and rank.
TABLE_COLUMNS = ["tensor", "kind", "rank", "group", "ok", "max_abs", "max_rel", "ratio", "rtol", "atol", "bad",
                 "numel", "dtype", "shape", "reference_shape", "compared", "row_dim", "note"]
# One row per tensor, rank and row along the tensor's sharded dim.
ROW_COLUMNS = ["tensor", "group", "rank", "row", "max_abs", "ok"]
KIND_ORDER = {"output": 0, "input grad": 1, "parameter grad": 2}
# A failure is "near shard boundaries" when every failing row lies within this share of the smallest shard
# from a boundary (what a missing halo looks like: a few rows on each side of each cut).
NEAR_BOUNDARY_SHARE = 0.25


@dataclass(frozen=True)
class BoundaryPattern:
    """Where a tensor's failing rows lie relative to the shard boundaries of one domain group.

    ``boundaries``: the first row of each shard after the first; ``distances``: for each failing row, how
    many rows it is from the nearest boundary (the row just before or just at a cut is 1 away);
    ``near_boundaries``: every failing row lies within ``NEAR_BOUNDARY_SHARE`` of the smallest shard from a
    cut (the signature of a missing halo)."""

    tensor: str
    group: int
    failing_rows: tuple[int, ...]
    boundaries: tuple[int, ...]
    distances: tuple[int, ...]
    near_boundaries: bool

    @property
    def max_distance(self) -> int | None:
        return max(self.distances) if self.distances else None


class CheckResult:
    """What ``Cluster.check`` found. ``ok``; ``table`` (one row per tensor and rank, ``TABLE_COLUMNS``);
    ``rows`` (the error per row along each tensor's sharded dim, ``ROW_COLUMNS``); ``failures()``;
    ``boundaries(tensor)`` and ``boundary_pattern(tensor)``; ``unsynced`` (plain parameters whose values differ
    across the ranks of a domain group); ``verdict`` (one line, also the repr);
    ``show()`` (the view) and ``plot_rows(tensor)`` (the error per row, shard boundaries marked)."""

    def __init__(self, stmt: str, table: pd.DataFrame, rows: pd.DataFrame, *, inputs: list[str], outputs: list[str],
                 models: list[str], backward: str, backward_note: str, loss: float | None,
                 reference_loss: float | None, tf32: dict, groups: list[int], unsynced=()):
        self.stmt = stmt
        self.table = table
        self.rows = rows
        self.inputs = inputs
        self.outputs = outputs
        self.models = models
        self.backward = backward  # how the gradients came about: check, statement, none, skipped, failed
        self.backward_note = backward_note
        self.loss = loss  # the sharded loss (rank 0), None without a backward by the check
        self.reference_loss = reference_loss
        self.tf32 = tf32  # rank 0's TF32 settings before the check (off during it)
        self.groups = groups
        # plain parameters whose values differ across the ranks of a domain group (the reference has the first's)
        self.unsynced = list(unsynced)

    # ---- the verdict ----------------------------------------------------------------------------------
    @property
    def ok(self) -> bool:
        """Every compared tensor within tolerance on every rank, and the gradients were compared when asked."""
        return bool(len(self.table)) and bool(self.table["ok"].all()) and self.backward not in ("skipped", "failed")

    @property
    def tf32_was_on(self) -> bool:
        """TF32 was on on the ranks before the check (it is off during it; it exists on CUDA only)."""
        return bool(self.tf32.get("was_on"))

    def failures(self) -> pd.DataFrame:
        """The rows of ``table`` that are not within tolerance."""
        return self.table[~self.table["ok"]]

    def tensors(self) -> list[str]:
        """The compared tensors, outputs first, then input and parameter gradients."""
        return list(dict.fromkeys(self.table["tensor"]))

    def boundaries(self, tensor: str, group: int = 0) -> list[int]:
        """The first row of each shard after the first, along ``tensor``'s sharded dim, in domain group
        ``group`` ([] for a tensor compared whole)."""
        part = self.rows[(self.rows["tensor"] == tensor) & (self.rows["group"] == group)]
        if part.empty:
            return []
        starts = part.groupby("rank")["row"].min()
        return sorted(int(s) for s in starts if s > 0)

    def boundary_pattern(self, tensor: str, group: int = 0) -> BoundaryPattern:
        """Where ``tensor``'s failing rows lie relative to the shard boundaries of ``group``."""
        part = self.rows[(self.rows["tensor"] == tensor) & (self.rows["group"] == group)]
        cuts = self.boundaries(tensor, group)
        failing = sorted(int(r) for r in part.loc[~part["ok"], "row"].unique())
        distances = tuple(min((c - r if r < c else r - c + 1) for c in cuts) for r in failing) if cuts else ()
        near = False
        if failing and cuts:
            shard_rows = part.groupby("rank")["row"].nunique()
            limit = max(1, int(shard_rows.min() * NEAR_BOUNDARY_SHARE))
            near = max(distances) <= limit and len(failing) < part["row"].nunique()
        return BoundaryPattern(tensor, group, tuple(failing), tuple(cuts), distances, near)

    @property
    def verdict(self) -> str:
        """One line: passed or failed, and for a failure which tensors, where and how."""
        n = len(self.tensors())
        ranks = sorted(set(self.table["rank"])) if len(self.table) else []
        settings = self._settings_text()
        if self.ok:
            worst = self.table.sort_values("max_rel", ascending=False).iloc[0]
            return (f"check passed: {n} tensors (outputs and gradients) on {len(ranks)} ranks agree with the unsharded "
                    f"reference (largest error {worst['max_rel']:.2g} of the tensor's scale, {worst['tensor']}; "
                    f"{_tolerance_text(self.table)}); {settings}")
        if not len(self.table):
            return f"check FAILED: nothing was compared ({self.backward_note or 'no outputs'}); {settings}"
        failing = self.failures()
        parts = [self._failure_text(tensor, failing[failing["tensor"] == tensor]) for tensor in
                 dict.fromkeys(failing["tensor"])]
        shown = parts[:3] + ([f"{len(parts) - 3} more"] if len(parts) > 3 else [])
        pieces = [f"{len(parts)} of {n} tensors differ from the unsharded reference: " + "; ".join(shown)] if parts else \
            [f"every tensor compared ({n}) agrees with the unsharded reference"]
        if self.backward in ("skipped", "failed"):
            pieces.append(self.backward_note)
        if self.unsynced:
            names = ", ".join(self.unsynced[:3]) + (f" and {len(self.unsynced) - 3} more" if len(self.unsynced) > 3 else "")
            pieces.append(f"the ranks of a domain group hold different values of {names} (the reference has the "
                          f"group's first rank's): weights not broadcast at start-up? (cl.doctor())")
        # the reason it failed first when every compared tensor agrees
        order = pieces if parts else pieces[1:] + pieces[:1]
        return "check FAILED: " + "; ".join(order) + f"; {settings}"

    def _failure_text(self, tensor: str, rows: pd.DataFrame) -> str:
        first = rows.iloc[0]
        text = f"{tensor} ({first['kind']}, {_ranks_text(sorted(rows['rank']))}"
        if not math.isnan(first["max_abs"]):
            text += f", max abs {rows['max_abs'].max():.3g}"
        multiple = whole_multiple(rows["ratio"])
        if multiple:
            text += f", {multiple}x the reference: reduced once more than it should be?"
        pattern = self.boundary_pattern(tensor, int(first["group"]))
        if pattern.near_boundaries:
            text += (f", only in rows near the shard boundaries {', '.join(map(str, pattern.boundaries))} (within "
                     f"{pattern.max_distance} rows): a missing halo?")
        notes = [n for n in dict.fromkeys(rows["note"]) if n]
        if notes and not multiple and not pattern.near_boundaries:
            text += f": {notes[0]}"
        return text + ")"

    def _settings_text(self) -> str:
        if not self.tf32.get("applies"):
            return "TF32 does not apply (CPU ranks)"
        return "TF32 was on before, off for the check" if self.tf32_was_on else "TF32 off"

    def __repr__(self) -> str:
        return self.verdict

    def _repr_html_(self) -> str:
        return rendering.check_html(self)

    def patterns(self) -> list[BoundaryPattern]:
        """The boundary pattern of every failing tensor compared by rows, per group."""
        failing = self.failures()
        out = []
        for tensor in dict.fromkeys(failing["tensor"]):
            for group in sorted(set(failing.loc[failing["tensor"] == tensor, "group"])):
                pattern = self.boundary_pattern(tensor, int(group))
                if pattern.failing_rows:
                    out.append(pattern)
        return out

    # ---- the view --------------------------------------------------------------------------------------
    def plot_rows(self, tensor: str | None = None, group: int = 0):
        """Plotly Figure: the largest error per row along the sharded dim, one trace per rank, shard
        boundaries as dashed lines; a menu picks the tensor (default: the first failing one with rows)."""
        return rendering.check_rows_figure(self, tensor, group)

    def show(self):
        """The view: the verdict and the table (failures first, tinted), then the error per row."""
        return rendering.check_view(self)


def whole_multiple(ratios: pd.Series) -> int | None:
    """k when every ratio is within 2 % of the same whole number k >= 2 (a gradient reduced k times)."""
    values = [float(r) for r in ratios if not math.isnan(float(r))]
    if not values:
        return None
    k = round(values[0])
    if k < 2 or any(abs(v - k) > 0.02 * k for v in values):
        return None
    return int(k)


def _ranks_text(ranks: list[int]) -> str:
    ranks = sorted(set(int(r) for r in ranks))
    if len(ranks) == 1:
        return f"rank {ranks[0]}"
    if ranks == list(range(ranks[0], ranks[-1] + 1)):
        return f"ranks {ranks[0]}-{ranks[-1]}"
    return "ranks " + ", ".join(map(str, ranks))


def _tolerance_text(table: pd.DataFrame) -> str:
    by_dtype = table.dropna(subset=["dtype"]).groupby("dtype")["rtol"].first()
    return ", ".join(f"{str(d).replace('torch.', '')} rtol {r:.0e}" for d, r in by_dtype.items())


def check_tables(records: list[list[dict]]) -> tuple[pd.DataFrame, pd.DataFrame]:
    """The table (one row per tensor and rank, ``TABLE_COLUMNS``) and the rows (one per tensor, rank and row
    along its sharded dim, ``ROW_COLUMNS``) of the ranks' comparison records (``engine.api.check_compare``)."""
    flat = [r for rank_records in records for r in rank_records]
    order = {name: i for i, name in enumerate(dict.fromkeys(r["tensor"] for r in flat))}
    flat.sort(key=lambda r: (KIND_ORDER.get(r["kind"], 9), order[r["tensor"]], r["rank"]))
    table = pd.DataFrame([{c: r.get(c) for c in TABLE_COLUMNS} for r in flat], columns=TABLE_COLUMNS)
    for column in ("max_abs", "max_rel", "ratio", "rtol", "atol"):
        table[column] = table[column].astype(float)
    table["ok"] = table["ok"].astype(bool)
    rows = pd.DataFrame([{"tensor": r["tensor"], "group": r["group"], "rank": r["rank"], "row": row, "max_abs": err,
                          "ok": ok} for r in flat for row, err, ok in r["rows"]], columns=ROW_COLUMNS)
    rows["max_abs"] = rows["max_abs"].astype(float)
    rows["ok"] = rows["ok"].astype(bool)
    return table, rows
