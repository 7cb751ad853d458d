"""``Cluster.check``: a statement run sharded on the ranks against the same statement run unsharded in a
separate single process, outputs and gradients compared per tensor and rank.

The steps (the rank's side is ``sharddbg.engine.verify``, the single process ``sharddbg.engine.reference``):

1. every rank reads the names the statement uses; they agree that the request is sound before any data
   moves; each domain group's first rank writes what the reference needs into a private job folder: each
   input's ``full_tensor()``, the models with its weights, the other values the statement reads, its RNG
   state (``api.check_prepare``);
2. the statement runs as a cell on every rank, sharded (its output is shown as a cell's);
3. the loss (``loss``, default the sum of the mean squares of the outputs) and its backward on every rank;
   every compared tensor is placed in its global tensor (``api.check_backward``);
4. this process starts ``python -m sharddbg.engine.reference`` (the same Python; this process never imports
   torch), which runs the statement once per domain group on plain tensors, ``scatter`` as the identity;
5. every rank compares its local data with its slice of the reference (``api.check_compare``), and puts
   back the gradients and settings the check changed (``api.check_finish``, also after a failure).

The result is a :class:`CheckResult`.
"""

from __future__ import annotations

import json
import math
import numbers
import os
import shutil
import subprocess
import sys
import tempfile
import weakref
from dataclasses import dataclass

import pandas as pd

from ..engine import api
from ..errors import ClusterError, RankError, ShardDbgError, hide_own_frames
from . import arguments

__all__ = ["CheckError", "CheckResult", "BoundaryPattern", "run_check", "last_check", "whole_multiple",
           "TABLE_COLUMNS", "ROW_COLUMNS"]

# One row per tensor and rank.
TABLE_COLUMNS = ["tensor", "kind", "rank", "group", "ok", "max_abs", "max_rel", "ratio", "rtol", "atol", "bad",
                 "numel", "dtype", "shape", "reference_shape", "compared", "row_dim", "note"]
# One row per tensor, rank and row along the tensor's sharded dim.
ROW_COLUMNS = ["tensor", "group", "rank", "row", "max_abs", "ok"]
KIND_ORDER = {"output": 0, "input grad": 1, "parameter grad": 2}
# A failure is "near shard boundaries" when every failing row lies within this share of the smallest shard
# from a boundary (what a missing halo looks like: a few rows on each side of each cut).
NEAR_BOUNDARY_SHARE = 0.25

_LAST: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()  # cluster -> its last CheckResult


class CheckError(ShardDbgError, ValueError):
    """The check could not run as asked (bad arguments, names the ranks do not have, a reference that
    raised); nothing about the sharded model is known from it."""


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
        from ..views.check import check_html

        return check_html(self.verdict, self.ok, self.table, self.patterns())

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
        from ..views.check import plot_row_errors

        tolerances = {t: float(self.table.loc[self.table["tensor"] == t, "atol"].max()) for t in self.tensors()}
        with_rows = set(self.rows["tensor"])
        boundaries = {t: self.boundaries(t, group) for t in self.tensors() if t in with_rows}
        failing = [t for t in dict.fromkeys(self.failures()["tensor"]) if t in with_rows]
        return plot_row_errors(self.rows[self.rows["group"] == group], boundaries, tolerances,
                               tensor=tensor, failing=failing)

    def show(self):
        """The view: the verdict and the table (failures first, tinted), then the error per row."""
        from ..views.check import CheckView

        return CheckView(self.verdict, self.ok, self.table, self.patterns(),
                         self.plot_rows() if len(self.rows) else None)


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


# ---- arguments --------------------------------------------------------------------------------------------
def _names(what: str, value, *, allow_empty: bool) -> list[str] | None:
    """``value`` (None, "x", "x, y", or a list of names) as a list of identifiers."""
    if value is None:
        return None
    if isinstance(value, str):
        value = [v.strip() for v in value.replace(",", " ").split()]
    if not isinstance(value, (list, tuple)) or not all(isinstance(v, str) for v in value):
        raise CheckError(f"{what} must be a name or a list of names of variables on the ranks, got {value!r}")
    bad = [v for v in value if not v.isidentifier()]
    if bad:
        raise CheckError(f"{what}: {', '.join(map(repr, bad))} {'is' if len(bad) == 1 else 'are'} not a variable name")
    if not value and not allow_empty:
        raise CheckError(f"{what} names no variable")
    return list(dict.fromkeys(value))


def _tolerance(what: str, value) -> float | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or math.isnan(value) or math.isinf(value) \
            or value < 0:
        raise CheckError(f"{what} must be a finite number of at least 0, got {value!r}")
    return float(value)


def _source(what: str, text, mode: str) -> str:
    if not isinstance(text, str) or not text.strip():
        raise CheckError(f"{what} must be Python source text, got {text!r}")
    try:
        compile(text, f"<{what}>", mode)
    except SyntaxError as exc:
        raise CheckError(f"{what} is not valid Python ({exc.msg}, line {exc.lineno}): {text!r}") from None
    return text


# ---- the check --------------------------------------------------------------------------------------------
def run_check(cluster, stmt: str, *, inputs=None, outputs=None, model=None, loss: str | None = None,
              rtol: float | None = None, atol: float | None = None, grads: bool = True,
              timeout: float | None = None, display: bool = True) -> CheckResult:
    """``Cluster.check``: see the module docstring."""
    __tracebackhide__ = hide_own_frames()
    stmt = _source("the statement", stmt, "exec")
    inputs = _names("inputs", inputs, allow_empty=True)
    outputs = _names("outputs", outputs, allow_empty=False)
    models = _names("model", model, allow_empty=True)
    loss = None if loss is None else _source("loss", loss, "eval")
    rtol, atol = _tolerance("rtol", rtol), _tolerance("atol", atol)
    if not isinstance(grads, bool):
        raise CheckError(f"grads must be True or False, got {grads!r}")
    timeout = arguments.seconds("timeout", timeout, allow_none=True) or cluster.timeout
    overlap = sorted(set(inputs or ()) & set(models or ()))
    if overlap:
        raise CheckError(f"{', '.join(overlap)} cannot be both an input and a model")
    if not cluster.running:
        raise ClusterError("this cluster is not running; start() it first")
    if cluster.broken:
        raise ClusterError(f"the process group is broken ({cluster.broken}): the check's collectives would fail; "
                           f"cl.recover() first")
    job_dir = tempfile.mkdtemp(prefix="sharddbg-check-")  # private (0700): the engines run as this user
    try:
        prepared = _on_ranks(cluster, api.check_prepare, job_dir, stmt, loss, inputs, outputs, models, grads,
                             timeout=timeout)
        cluster.run(stmt, timeout=timeout, display=display)
        after = _on_ranks(cluster, api.check_backward, timeout=timeout)
        first = prepared[0]
        job = {"stmt": stmt, "loss": loss, "outputs": after[0]["outputs"], "backward": after[0]["backward"],
               "groups": sorted({p["group"] for p in prepared})}
        reference_losses = _run_reference(job_dir, job, timeout)
        records = _on_ranks(cluster, api.check_compare, rtol, atol, timeout=timeout)
    finally:
        _finish(cluster, timeout)
        shutil.rmtree(job_dir, ignore_errors=True)
    table, rows = _frames(records)
    result = CheckResult(stmt, table, rows, inputs=first["inputs"], outputs=after[0]["outputs"],
                         models=first["models"], backward=after[0]["backward"], backward_note=after[0]["note"],
                         loss=after[0]["loss"], reference_loss=reference_losses.get(0), tf32=first["tf32"],
                         groups=job["groups"], unsynced=list(dict.fromkeys(n for p in prepared for n in p["unsynced"])))
    _LAST[cluster] = result
    return result


def last_check(cluster) -> CheckResult | None:
    """The result of the last check on ``cluster`` (None before the first)."""
    return _LAST.get(cluster)


def _on_ranks(cluster, fn, *args, timeout: float):
    """``fn(*args)`` on every rank; a refusal the ranks agreed on (CheckSetupError) as a CheckError."""
    __tracebackhide__ = hide_own_frames()
    try:
        return cluster.apply(fn, *args, timeout=timeout)
    except RankError as exc:
        causes = [exc.errors[r] for r in exc.causes if r in exc.errors]
        if causes and all(c.type_name == "CheckSetupError" for c in causes):
            raise CheckError(causes[0].message) from None
        raise


def _finish(cluster, timeout: float) -> None:
    """Every live rank puts back what the check changed; a rank that cannot answer (dead, stuck) is left."""
    if not cluster.running:
        return
    alive = [r for r in range(cluster.n) if r not in cluster.dead_ranks()]
    try:
        if alive:
            cluster.apply(api.check_finish, timeout=min(timeout, 30.0), targets=alive)
    except ShardDbgError:
        pass


def _run_reference(job_dir: str, job: dict, timeout: float) -> dict[int, float | None]:
    """The reference process over ``job``; each group's reference loss."""
    from ..engine import reference

    with open(os.path.join(job_dir, reference.JOB_FILE), "w") as f:
        json.dump(job, f)
    command = [sys.executable, "-m", "sharddbg.engine.reference", job_dir]
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        raise CheckError(f"the unsharded reference ({' '.join(command[:3])}) did not finish within {timeout:g} s; "
                         f"pass a larger timeout= (the ranks' part finished)") from None
    error_file = os.path.join(job_dir, reference.ERROR_FILE)
    if done.returncode != 0:
        if os.path.exists(error_file):
            with open(error_file) as f:
                failure = json.load(f)
            where = f" (line {failure['line']} of the statement: `{failure['code']}`)" if failure.get("line") else ""
            if failure["what"] == "the loss":
                where = f" (the loss: `{job['loss']}`)" if job.get("loss") else ""
            raise CheckError(
                f"the unsharded reference raised {failure['message']} in {failure['what']}{where}. It runs the "
                f"statement in one process, on plain tensors: code that needs the ranks (torch.distributed, the "
                f"mesh, ShardTensor methods) cannot run there.\n{_user_lines(failure['traceback'])}")
        raise CheckError(f"the unsharded reference process failed (exit status {done.returncode}): "
                         f"{(done.stderr or '').strip()[-2000:]}")
    with open(os.path.join(job_dir, reference.LOSSES_FILE)) as f:
        return {int(group): loss for group, loss in json.load(f).items()}


def _user_lines(traceback_text: str) -> str:
    """The traceback's part that shows the user's statement (from its first frame in it on)."""
    from ..engine.reference import LOSS_FILENAME, STATEMENT_FILENAME

    lines = traceback_text.splitlines()
    for i, line in enumerate(lines):
        if STATEMENT_FILENAME in line or LOSS_FILENAME in line:
            return "\n".join(["Traceback (the reference):"] + lines[i:])
    return traceback_text


def _frames(records: list[list[dict]]) -> tuple[pd.DataFrame, pd.DataFrame]:
    """The table (one row per tensor and rank) and the rows (one per tensor, rank and row)."""
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
