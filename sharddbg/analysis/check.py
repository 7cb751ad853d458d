"""What ``Cluster.check`` found: each compared tensor against the unsharded reference, per rank and per row
along its sharded dim, and where the failing rows lie relative to the shard boundaries.

``CheckResult`` holds the data (its tables, the verdict, the boundary patterns); its views come through
``sharddbg.rendering``. ``check_tables`` builds its tables from the ranks' comparison records
(``engine.api.check_compare``). Pure data: no torch, no cluster.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import pandas as pd

from .. import rendering

if TYPE_CHECKING:
    import plotly.graph_objects as go

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
        """The largest of ``distances`` (how far the farthest failing row lies from a cut); None when no row
        fails or the tensor has no boundary."""
        return max(self.distances) if self.distances else None


class CheckResult:
    """What ``Cluster.check`` found: every compared tensor against the unsharded reference, per rank and row.

    ``ok`` says whether it passed; ``table`` has one row per tensor and rank (``TABLE_COLUMNS``: tensor,
    kind, rank, group, ok, max_abs, max_rel, ratio, rtol, atol, bad, numel, dtype, shape, reference_shape,
    compared, row_dim, note); ``rows`` the error per row along each tensor's sharded dim (``ROW_COLUMNS``:
    tensor, group, rank, row, max_abs, ok); ``failures()`` the rows of ``table`` that failed;
    ``boundaries(tensor)`` and ``boundary_pattern(tensor)`` where the shard boundaries and the failing rows
    lie; ``unsynced`` the plain parameters whose values differ across the ranks of a domain group (the
    reference has the group's first rank's); ``verdict`` one line, also the repr; ``show()`` the view and
    ``plot_rows(tensor)`` the error per row with the shard boundaries marked. The constructor's arguments
    stay as attributes of the same names. ``Cluster.check`` builds it; its views come through
    ``sharddbg.rendering``.

    Parameters
    ----------
    stmt : str
        The statement that was checked.
    table : pandas.DataFrame
        One row per tensor and rank, ``TABLE_COLUMNS`` (``check_tables``).
    rows : pandas.DataFrame
        One row per tensor, rank and row along the tensor's sharded dim, ``ROW_COLUMNS`` (``check_tables``).
    inputs : list of str
        The names bound to their ``full_tensor()`` in the reference.
    outputs : list of str
        The names compared after the statement.
    models : list of str
        The modules copied to the reference whose parameter gradients were compared.
    backward : str
        How the gradients came about: ``"check"`` (the check ran the loss's backward), ``"statement"`` (the
        statement ran its own), ``"none"`` (no gradient compared), ``"skipped"`` (not run: an output's spec
        disagrees with its data) or ``"failed"`` (the backward raised on every rank).
    backward_note : str
        Why, in words ("" when there is nothing to say).
    loss : float or None
        The sharded loss as rank 0 computed it; None when the check computed none (it does so only to run
        its own backward).
    reference_loss : float or None
        The reference's loss for domain group 0; None without one.
    tf32 : dict
        Rank 0's TF32 settings before the check (TF32 is off during it): ``was_on``, ``applies`` (CUDA
        only), ``cuda_matmul_allow_tf32``, ``cudnn_allow_tf32``, ``float32_matmul_precision``.
    groups : list of int
        The domain groups (their ddp index), one reference each.
    unsynced : sequence of str, optional
        The plain parameters (``"model.param"``) whose values differ across the ranks of a domain group.

    Examples
    --------
    >>> r = cl.check("y = net(x)", inputs=["x"], outputs=["y"], model="net", grads=False)
    >>> r.ok
    False
    >>> r  # doctest: +NORMALIZE_WHITESPACE
    check FAILED: 1 of 1 tensors differ from the unsharded reference: y (output, ranks 0-3, max abs 0.26,
    only in rows near the shard boundaries 17, 34, 50 (within 1 rows): a missing halo?); TF32 does not
    apply (CPU ranks)
    >>> r.table[["tensor", "rank", "ok", "max_abs"]]
      tensor  rank     ok  max_abs
    0      y     0  False     0.26
    1      y     1  False     0.26
    2      y     2  False     0.26
    3      y     3  False     0.26
    """

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
        self.blame = None  # analysis.blame.Blame of a re-run without sharddbg (check(blame=True) of a failure)

    # ---- the verdict ----------------------------------------------------------------------------------
    @property
    def ok(self) -> bool:
        """True when something was compared, every compared tensor is within tolerance on every rank, and the
        gradients were compared when asked (the backward neither skipped nor failed)."""
        return bool(len(self.table)) and bool(self.table["ok"].all()) and self.backward not in ("skipped", "failed")

    @property
    def tf32_was_on(self) -> bool:
        """Whether TF32 was on before the check, as rank 0 had it (it is off during the check, and exists on CUDA
        only)."""
        return bool(self.tf32.get("was_on"))

    def failures(self) -> pd.DataFrame:
        """The rows of ``table`` that are not within tolerance.

        Returns
        -------
        pandas.DataFrame
            Those rows of ``table``, with its columns (``TABLE_COLUMNS``) and index; empty when the check
            passed (or nothing was compared).

        Examples
        --------
        >>> r = cl.check("y = net(x)", inputs=["x"], outputs=["y"], model="net", grads=False)
        >>> r.failures()[["tensor", "kind", "rank", "max_abs"]]
          tensor    kind  rank  max_abs
        0      y  output     0     0.26
        1      y  output     1     0.26
        2      y  output     2     0.26
        3      y  output     3     0.26
        """
        return self.table[~self.table["ok"]]

    def _known(self, tensor: str) -> None:
        if tensor not in set(self.table["tensor"]):
            raise KeyError(f"no compared tensor named {tensor!r}; this check compared {self.tensors()}")

    def tensors(self) -> list[str]:
        """The names of the compared tensors, each once: outputs first, then input and parameter gradients.

        Returns
        -------
        list of str
            In ``table``'s order: outputs (``"y"``), input gradients (``"x.grad"``), parameter gradients
            (``"net.0.weight.grad"``).

        Examples
        --------
        ``x`` scattered with ``requires_grad=True``, ``net`` a one-conv ``nn.Sequential``:

        >>> r = cl.check("y = net(x)", inputs=["x"], outputs=["y"], model="net")
        >>> r.tensors()
        ['y', 'x.grad', 'net.0.weight.grad', 'net.0.bias.grad']
        """
        return list(dict.fromkeys(self.table["tensor"]))

    def boundaries(self, tensor: str, group: int = 0) -> list[int]:
        """Where the shards of ``tensor`` meet: the first row of each shard after the first.

        Read from ``rows`` (the smallest row each rank holds along the tensor's sharded dim).

        Parameters
        ----------
        tensor : str
            A compared tensor, as ``tensors()`` names it.
        group : int, default 0
            The domain group (its ddp index).

        Returns
        -------
        list of int
            The rows, ascending; ``[]`` for a tensor compared whole.

        Raises
        ------
        KeyError
            ``tensor`` is not one this check compared.

        Examples
        --------
        66 rows over 4 ranks (17, 17, 16, 16):

        >>> r = cl.check("y = net(x)", inputs=["x"], outputs=["y"], model="net", grads=False)
        >>> r.boundaries("y")
        [17, 34, 50]
        """
        self._known(tensor)
        part = self.rows[(self.rows["tensor"] == tensor) & (self.rows["group"] == group)]
        if part.empty:
            return []
        starts = part.groupby("rank")["row"].min()
        return sorted(int(s) for s in starts if s > 0)

    def boundary_pattern(self, tensor: str, group: int = 0) -> BoundaryPattern:
        """Where ``tensor``'s failing rows lie relative to the shard boundaries of ``group``.

        A row fails when it fails on any rank. The failure is near the boundaries (what a missing halo looks
        like) when some but not all rows fail and every failing row lies within ``NEAR_BOUNDARY_SHARE`` of
        the smallest shard (at least one row) from a cut.

        Parameters
        ----------
        tensor : str
            A compared tensor, as ``tensors()`` names it.
        group : int, default 0
            The domain group (its ddp index).

        Returns
        -------
        BoundaryPattern
            The failing rows, the boundaries, each failing row's distance to the nearest one (the row just
            before or just at a cut is 1 away) and ``near_boundaries``; empty tuples and False for a tensor
            compared whole or a name not in ``rows``.

        Raises
        ------
        KeyError
            ``tensor`` is not one this check compared.

        Examples
        --------
        >>> r = cl.check("y = net(x)", inputs=["x"], outputs=["y"], model="net", grads=False)
        >>> p = r.boundary_pattern("y")
        >>> p.failing_rows, p.boundaries, p.near_boundaries
        ((16, 17, 33, 34, 49, 50), (17, 34, 50), True)
        """
        self._known(tensor)
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
        """One line, also the repr: passed or failed; for a failure which tensors (three at most, then how many
        more), on which ranks, by how much, and what it looks like (a whole multiple of the reference: reduced
        once too often; rows near the shard boundaries only: a missing halo), a skipped or failed backward,
        parameters not synced across a domain group; last, the TF32 settings."""
        n = len(self.tensors())
        ranks = sorted(set(self.table["rank"])) if len(self.table) else []
        settings = self._settings_text()
        if self.ok:
            worst = self.table.sort_values("max_rel", ascending=False).iloc[0]  # NaN (nothing to compare) last
            largest = ("no element held a value to compare" if math.isnan(worst["max_rel"]) else
                       f"largest error {worst['max_rel']:.2g} of the tensor's scale, {worst['tensor']}")
            return (f"check passed: {n} tensors (outputs and gradients) on {len(ranks)} ranks agree with the unsharded "
                    f"reference ({largest}; {_tolerance_text(self.table)}); {settings}")
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
        blame = f". Without sharddbg: {self.blame.summary}" if self.blame is not None else ""
        return "check FAILED: " + "; ".join(order) + f"; {settings}{blame}"

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

    def _repr_mimebundle_(self, include=None, exclude=None):
        # the HTML and the payload the JupyterLab extension draws from (the view's table); the plain text stays
        # the verdict, as repr() gives it (the whole text is str() and show())
        bundle = self.show()._repr_mimebundle_(include, exclude)
        bundle["text/plain"] = repr(self)
        return bundle

    def patterns(self) -> list[BoundaryPattern]:
        """The boundary pattern of every failing tensor compared by rows, per group.

        Returns
        -------
        list of BoundaryPattern
            One per failing tensor and domain group where it fails, in ``table``'s order, those with at least
            one failing row only (a tensor compared whole has none); ``[]`` when the check passed.

        Examples
        --------
        >>> r = cl.check("y = net(x)", inputs=["x"], outputs=["y"], model="net", grads=False)
        >>> [(p.tensor, p.group, p.near_boundaries) for p in r.patterns()]
        [('y', 0, True)]
        """
        failing = self.failures()
        out = []
        for tensor in dict.fromkeys(failing["tensor"]):
            for group in sorted(set(failing.loc[failing["tensor"] == tensor, "group"])):
                pattern = self.boundary_pattern(tensor, int(group))
                if pattern.failing_rows:
                    out.append(pattern)
        return out

    # ---- the view --------------------------------------------------------------------------------------
    def plot_rows(self, tensor: str | None = None, group: int = 0) -> go.Figure:
        """The largest error per row along the sharded dim, one trace per rank, for one tensor at a time.

        Failing rows are marked red, the shard boundaries dashed, the absolute tolerance dotted; a menu picks
        the tensor. Needs plotly (imported when called).

        Parameters
        ----------
        tensor : str or None, default None
            The tensor shown first; None (or a tensor without rows): the first failing one with rows, else the
            first with rows.
        group : int, default 0
            The domain group (its ddp index) whose rows are drawn.

        Returns
        -------
        plotly.graph_objects.Figure
            The figure; one that only says so when no tensor was compared row by row.

        Raises
        ------
        KeyError
            ``tensor`` is not one this check compared.

        Examples
        --------
        >>> r = cl.check("y = net(x)", inputs=["x"], outputs=["y"], model="net", grads=False)
        >>> r.plot_rows("y")  # doctest: +SKIP
        """
        if tensor is not None:
            self._known(tensor)
        return rendering.check_rows_figure(self, tensor, group)

    def show(self) -> Any:
        """The view: the verdict and the table (failures first, tinted), then the error per row.

        Returns
        -------
        sharddbg.views.check.CheckView
            Displays in a notebook (static HTML, then ``plot_rows()``'s figure when some tensor has rows);
            ``html()`` and ``text()`` give it as HTML and plain text.

        Examples
        --------
        >>> r = cl.check("y = net(x)", inputs=["x"], outputs=["y"], model="net", grads=False)
        >>> r.show()  # doctest: +SKIP
        >>> print(r.show().text())  # doctest: +ELLIPSIS
        check FAILED: 1 of 1 tensors differ from the unsharded reference: y (output, ranks 0-3, ...
        y: failing rows 16-17, 33-34, 49-50 (shard boundaries at rows 17, 34, 50); all within 1 rows of ...
        tensor  kind    rank  ok  ...
        ...
        """
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
