"""What ``Cluster.diff`` found: every op the statement called, its sharded output (and the gradient that reached
it in the backward) against the same op's in the single-device reference, and the first op that departs.

``DiffResult`` holds the data: ``get_ops()`` (one row per op output or gradient, in the order they happened:
the forward, then the backward in its own order), ``get_ranks()`` (per rank), ``get_skipped()`` (the calls
that have no single-device partner), ``first`` (the first departing row) and ``answer`` (one paragraph, also
the repr). Its view comes through ``sharddbg.rendering``. Pure data: no torch, no cluster.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import pandas as pd

from .. import rendering
from .check import CheckResult, whole_multiple

__all__ = ["DiffResult", "DepartingOp", "diff_tables", "OP_COLUMNS", "RANK_COLUMNS", "STATEMENT_SITE"]

STATEMENT_SITE = "<statement>"  # a call site in the diffed statement itself (engine.recorder.outputs)
# One row per op output (forward) or gradient (backward), over the ranks.
OP_COLUMNS = ["order", "phase", "op", "call", "site", "module", "tensor", "verdict", "max_abs", "max_rel", "ratio",
              "ranks", "rows", "rtol", "note", "key"]
# One row per op output or gradient and rank.
RANK_COLUMNS = ["key", "phase", "tensor", "rank", "ok", "max_abs", "max_rel", "ratio", "rtol", "atol", "shape",
                "reference_shape", "compared", "rows", "note", "seq"]
AGREES, DEPARTS, NOT_COMPARABLE = "agrees", "departs", "not comparable"


@dataclass(frozen=True)
class DepartingOp:
    """The first row of ``get_ops()`` that departs: which op, where, how much, on which ranks and rows, and
    what its inputs were doing (``inputs``: a sentence)."""

    phase: str
    op: str
    call: int
    site: str
    module: str | None
    tensor: str
    max_abs: float
    ranks: tuple[int, ...]
    rows: str
    boundaries: tuple[int, ...]
    inputs: str
    key: str
    rank: int | None = None  # the first departing rank, and its call of the op (the recorder's seq there):
    seq: int | None = None  # where the explorer opens (``DiffResult.explore()``)


def _ordinal(n: int) -> str:
    return f"{n}{'th' if 10 <= n % 100 <= 20 else {1: 'st', 2: 'nd', 3: 'rd'}.get(n % 10, 'th')}"


def _ranks_text(ranks) -> str:
    ranks = sorted(set(int(r) for r in ranks))
    if len(ranks) == 1:
        return f"rank {ranks[0]}"
    if len(ranks) > 2 and ranks == list(range(ranks[0], ranks[-1] + 1)):
        return f"ranks {ranks[0]}-{ranks[-1]}"
    return "ranks " + ", ".join(map(str, ranks))


def _row_ranges(rows) -> str:
    out, start, prev = [], None, None
    for r in sorted(set(rows)):
        if start is None:
            start = prev = r
        elif r == prev + 1:
            prev = r
        else:
            out.append(f"{start}-{prev}" if prev > start else f"{start}")
            start = prev = r
    if start is not None:
        out.append(f"{start}-{prev}" if prev > start else f"{start}")
    return ", ".join(out)


def _statement_line(line: int, stmt: str) -> str:
    lines = stmt.splitlines()
    code = lines[line - 1].strip() if 0 < line <= len(lines) else ""
    return f"line {line} of the statement" + (f" (`{code}`)" if code else "")


def _site_text(site, position: str | None, stmt: str, caller: int | None = None) -> str:
    """Where the op was called: the innermost line of the user's code (in a function of theirs: that function's
    line), then the statement's line that called it."""
    if not site:
        return "an unknown place"
    if site[0] == STATEMENT_SITE:
        where = _statement_line(int(site[1]), stmt)
        if site[2] != "<module>":
            where += f" in {site[2]}"
    else:
        where = position or f"{site[0]}:{site[1]}"
    if caller is not None and not (site[0] == STATEMENT_SITE and int(site[1]) == caller):
        where += f", called from {_statement_line(caller, stmt)}"
    return where


def diff_tables(ops: list[dict], records: list[dict], check: CheckResult, stmt: str) -> tuple[pd.DataFrame, pd.DataFrame]:
    """(``get_ops()``'s table, ``get_ranks()``'s table) from rank 0's kept calls (``ops``), the ranks' records
    of every kept output and gradient (``records``) and the check's result (whose parameter gradients are
    attributed to the op that read each parameter)."""
    per_rank = pd.DataFrame([{"key": r["key"], "phase": r["phase"], "tensor": "output" if r["phase"] == "forward"
                              else "gradient", "rank": r["rank"], "ok": bool(r["ok"]), "max_abs": r["max_abs"],
                              "max_rel": r["max_rel"], "ratio": r["ratio"], "rtol": r["rtol"], "atol": r["atol"],
                              "shape": r["shape"], "reference_shape": r["reference_shape"], "compared": r["compared"],
                              "rows": [(row, ok) for row, _, ok in r["rows"]], "note": r["note"],
                              "seq": r.get("seq"), "row_start": r["row_start"], "output": r["output"]}
                             for r in records], columns=RANK_COLUMNS + [
        "row_start", "output"])
    rows = []

    def add(phase: str, op: dict, tensor: str, part: pd.DataFrame, order: int) -> None:
        if part.empty:
            return
        compared = part[~part["max_abs"].isna()]
        notes = [n for n in dict.fromkeys(part["note"]) if n]
        if compared.empty or len(compared) < len(part) and compared["ok"].all():
            verdict = NOT_COMPARABLE
        else:
            verdict = AGREES if compared["ok"].all() else DEPARTS
        bad = part[~part["ok"] & ~part["max_abs"].isna()]
        failing_rows = sorted({row for rs in bad["rows"] for row, ok in rs if not ok})
        rows.append({"order": order, "phase": phase, "op": op["op"], "call": op["occurrence"],
                     "site": _site_text(op["site"], op.get("position"), stmt, op.get("caller")), "module": op.get("module"),
                     "tensor": tensor, "verdict": verdict,
                     "max_abs": float(compared["max_abs"].max()) if not compared.empty else math.nan,
                     "max_rel": float(compared["max_rel"].max()) if not compared.empty else math.nan,
                     "ratio": float(compared["ratio"].median()) if not compared.empty else math.nan,
                     "ranks": tuple(sorted(int(r) for r in bad["rank"])), "rows": _row_ranges(failing_rows),
                     "rtol": float(compared["rtol"].max()) if not compared.empty else math.nan,
                     "note": "; ".join(notes), "key": op["key"]})

    order = 0
    for op in ops:  # the forward, in the order the ops ran
        for index in range(op["outputs"]):
            part = per_rank[(per_rank["key"] == op["key"]) & (per_rank["phase"] == "forward")
                            & (per_rank["output"] == index)]
            add("forward", op, "output" if op["outputs"] == 1 else f"output {index}", part, order)
            order += 1
    params = check.table[check.table["kind"] == "parameter grad"]
    readers: dict[str, list[str]] = {}
    for op in ops:
        for source in op["sources"]:
            if source.startswith("param:"):
                readers.setdefault(source[len("param:"):], []).append(op["key"])
    for op in reversed(ops):  # the backward, in the order it reaches the ops
        part = per_rank[(per_rank["key"] == op["key"]) & (per_rank["phase"] == "backward")]
        add("backward", op, "gradient", part, order)
        order += 1
        for source in op["sources"]:
            name = source[len("param:"):] if source.startswith("param:") else None
            if name is None or readers.get(name, [None])[-1] != op["key"]:
                continue  # a parameter read by several ops: attributed to the first the backward reaches
            grads = params[params["tensor"] == f"{name}.grad"]
            part = pd.DataFrame({"key": op["key"], "phase": "backward", "tensor": f"{name}.grad", "rank": grads["rank"],
                                 "ok": grads["ok"], "max_abs": grads["max_abs"], "max_rel": grads["max_rel"],
                                 "ratio": grads["ratio"], "rtol": grads["rtol"], "atol": grads["atol"],
                                 "shape": grads["shape"], "reference_shape": grads["reference_shape"],
                                 "compared": grads["compared"], "rows": [[] for _ in range(len(grads))],
                                 "note": grads["note"], "row_start": None, "output": 0})
            add("backward", op, f"{name}.grad", part, order)
            order += 1
    table = pd.DataFrame(rows, columns=OP_COLUMNS)
    return table, per_rank


class DiffResult:
    """What ``Cluster.diff`` found: each op of the statement against the same op in the single-device run.

    ``answer`` (one paragraph, also the repr) names the first op whose result departs, where it was called,
    how far it departs, on which ranks and rows, and whether its inputs agreed; ``ok`` is True when every
    compared op agrees. ``get_ops()`` has one row per op output (forward, in call order) and per gradient
    (backward, in the order the backward reached the ops: the gradient arriving at each op's output, then
    the gradients of the parameters it read); ``get_ranks()`` the same per rank; ``get_skipped()`` the calls
    with no single-device partner (ShardTensor-internal ops and methods); ``first`` the first departing row.
    ``check`` is the ``CheckResult`` of the same run (the statement's outputs and gradients). ``blame``: the
    re-run without sharddbg, when asked. ``Cluster.diff`` builds it; its view comes through
    ``sharddbg.rendering``.

    Parameters
    ----------
    stmt : str
        The statement.
    ops : pandas.DataFrame
        ``OP_COLUMNS`` (``diff_tables``).
    ranks : pandas.DataFrame
        ``RANK_COLUMNS`` (``diff_tables``).
    check : CheckResult
        The check of the same run.
    skipped : dict
        Op name -> calls made inside other ops or by ShardTensor's own methods (rank 0).
    inputs_of : dict
        Op key -> its sources (``"op:<key>"`` and ``"param:<name>"``).
    memory : dict
        ``rank_bytes`` (the most any rank kept), ``reference_bytes`` (the whole outputs the reference kept),
        ``limit``.
    blame : object, optional
        The ``analysis.blame.Blame`` of a re-run without sharddbg, or None.
    trace : Trace or callable, optional
        The sharded run as the recorder saw it (the diff's own recording), for ``explore()``, or a function
        that builds it when first asked for; None when the diff ran inside a recording of the user's (its
        events are there).

    Examples
    --------
    >>> r = cl.diff("with sharddbg.engine.without_patches(F.conv2d):\\n    y = net(x)")
    >>> r.first.op, r.first.call
    ('torch.conv2d', 1)
    >>> r.get_ops()[["op", "call", "verdict"]].head(2)
               op  call    verdict
    0  torch.conv2d     1    departs
    1  torch.nn.functional.relu     1    departs
    """

    def __init__(self, stmt: str, ops: pd.DataFrame, ranks: pd.DataFrame, *, check: CheckResult, skipped: dict,
                 inputs_of: dict, memory: dict, blame: Any = None, trace: Any = None):
        self.stmt = stmt
        self._ops = ops
        self._ranks = ranks
        self.check = check
        self.skipped = dict(skipped)
        self.inputs_of = inputs_of
        self.memory = memory
        self.blame = blame
        self._trace = trace  # a Trace, or a function that builds it (on first use: most diffs never open it)

    @property
    def has_trace(self) -> bool:
        """Whether ``trace`` (and so ``explore()``) is there, without building it."""
        return self._trace is not None

    @property
    def trace(self) -> Any:
        """The sharded run as the diff's own recording saw it (a ``Trace``), or None (see ``explore``)."""
        if callable(self._trace):
            self._trace = self._trace()
        return self._trace

    # ---- tables ----------------------------------------------------------------------------------------
    def get_ops(self, phase: str | None = None) -> pd.DataFrame:
        """Every compared op output and gradient, in the order they happened.

        Parameters
        ----------
        phase : str or None
            ``"forward"`` or ``"backward"`` only; None: both.

        Returns
        -------
        pandas.DataFrame
            ``OP_COLUMNS``: order, phase, op, call (the op's n-th call at that site), site, module, tensor
            (``output``, ``gradient`` or a parameter's ``.grad``), verdict (agrees / departs / not comparable),
            max_abs, max_rel, ratio (sharded norm over reference norm), ranks (those that depart), rows (the
            departing rows along the sharded dim), rtol, note, key.

        Raises
        ------
        ValueError
            ``phase`` is neither None, ``"forward"`` nor ``"backward"``.

        Examples
        --------
        >>> r.get_ops("forward")["verdict"].tolist()
        ['departs', 'departs', 'departs', 'departs', 'departs']
        """
        if phase not in (None, "forward", "backward"):
            raise ValueError(f"phase must be None, 'forward' or 'backward', got {phase!r}")
        table = self._ops if phase is None else self._ops[self._ops["phase"] == phase]
        return table.reset_index(drop=True).copy()

    def get_ranks(self) -> pd.DataFrame:
        """Every compared op output and gradient per rank.

        Returns
        -------
        pandas.DataFrame
            ``RANK_COLUMNS``: key, phase, tensor, rank, ok, max_abs, max_rel, ratio, rtol, atol, shape,
            reference_shape, compared, rows ((row, ok) along the sharded dim), note.

        Examples
        --------
        >>> r.get_ranks()[["rank", "ok"]].head(1)
           rank     ok
        0     0  False
        """
        return self._ranks[RANK_COLUMNS].copy()

    def get_skipped(self) -> pd.DataFrame:
        """The calls with no single-device partner: made inside another op (a handler's own ops and
        collectives) or ShardTensor's own methods (``full_tensor``, ``redistribute``), counted on rank 0.

        Returns
        -------
        pandas.DataFrame
            ``op``, ``calls``, most calls first.

        Examples
        --------
        >>> r.get_skipped().head(1)
                          op  calls
        0  aten.convolution.default      3
        """
        rows = sorted(self.skipped.items(), key=lambda kv: (-kv[1], kv[0]))
        return pd.DataFrame(rows, columns=["op", "calls"])

    # ---- the answer ------------------------------------------------------------------------------------
    @property
    def ok(self) -> bool:
        """True when some op was compared and every compared op output and gradient agrees."""
        verdicts = set(self._ops["verdict"])
        return AGREES in verdicts and DEPARTS not in verdicts

    @property
    def first(self) -> DepartingOp | None:
        """The first departing row of ``get_ops()`` (the forward first), or None when none departs."""
        bad = self._ops[self._ops["verdict"] == DEPARTS]
        if bad.empty:
            return None
        row = bad.iloc[0]
        part = self._ranks[self._ranks["key"] == row["key"]]
        starts = sorted({int(s) for s in part["row_start"] if s is not None and not pd.isna(s)})
        rank = int(row["ranks"][0]) if len(row["ranks"]) else None
        call = part[part["rank"] == rank]["seq"].dropna() if rank is not None else part["seq"].iloc[:0]
        return DepartingOp(phase=row["phase"], op=row["op"], call=int(row["call"]), site=row["site"],
                           module=row["module"], tensor=row["tensor"], max_abs=float(row["max_abs"]),
                           ranks=tuple(row["ranks"]), rows=row["rows"], boundaries=tuple(starts[1:]),
                           inputs=self._inputs_text(row), key=row["key"], rank=rank,
                           seq=int(call.iloc[0]) if len(call) else None)

    def _verdict_of(self, key: str, phase: str, tensor: str | None = None) -> pd.Series | None:
        rows = self._ops[(self._ops["key"] == key) & (self._ops["phase"] == phase)]
        if tensor is not None:
            rows = rows[rows["tensor"] == tensor]
        return rows.iloc[0] if len(rows) else None

    def _inputs_text(self, row: pd.Series) -> str:
        sources = self.inputs_of.get(row["key"], [])
        if row["phase"] == "forward":
            ops = [s[3:] for s in sources if s.startswith("op:")]
            params = [s[6:] for s in sources if s.startswith("param:")]
            parts, worst, departing, unknown = [], 0.0, [], []
            for key in ops:
                before = self._verdict_of(key, "forward")
                if before is None:
                    continue
                name = f"{before['op']} ({_ordinal(int(before['call']))} call)"
                if before["verdict"] == DEPARTS:
                    departing.append(name)
                elif before["verdict"] == NOT_COMPARABLE:
                    unknown.append(name)
                if not math.isnan(before["max_abs"]):
                    worst = max(worst, float(before["max_abs"]))
            if departing:
                return f"its inputs departed already ({', '.join(departing)})"
            if unknown:
                return f"its inputs could not all be compared (the output of {', '.join(unknown)} has no single-device " \
                       f"partner): the op that broke it may be that one"
            if ops:
                parts.append(f"the outputs of the {len(ops)} op{'s' if len(ops) > 1 else ''} before it (max abs {worst:.3g})")
            else:
                parts.append("the statement's inputs (gathered whole)")
            if params:
                parts.append(f"parameters {', '.join(params)} (the same values)")
            return "its inputs agreed: " + "; ".join(parts)
        if row["tensor"] != "gradient":
            grad = self._verdict_of(row["key"], "backward", "gradient")
            if grad is None:
                return "no gradient reached its output"
            if grad["verdict"] == DEPARTS:
                return "the gradient reaching its output departed already"
            ratio = float(row["ratio"])
            k = whole_multiple(pd.Series([ratio])) if not math.isnan(ratio) else None
            extra = f"; {k}x the reference: reduced once more than it should be?" if k else ""
            return f"the gradient reaching its output agreed (max abs {float(grad['max_abs']):.3g}){extra}"
        consumers = [key for key, sources in self.inputs_of.items() if f"op:{row['key']}" in sources]
        later = [self._verdict_of(key, "backward", "gradient") for key in consumers]
        later = [v for v in later if v is not None]
        if later and all(v["verdict"] != DEPARTS for v in later):
            return f"the gradients of the {len(later)} op{'s' if len(later) > 1 else ''} that read its output agreed"
        return "the gradient of the loss with respect to it"

    @property
    def answer(self) -> str:
        """One paragraph: the first departing op (where, how much, ranks, rows, its inputs), or that every op
        agrees; the calls skipped; the blame when there is one."""
        compared = self._ops[self._ops["verdict"] != NOT_COMPARABLE]
        skipped = sum(self.skipped.values())
        skipped_text = (f"; {skipped} call{'s' if skipped != 1 else ''} inside other ops or ShardTensor methods "
                        f"skipped (no single-device partner: {', '.join(list(self.skipped)[:4])}"
                        f"{', ...' if len(self.skipped) > 4 else ''})" if skipped else "")
        first = self.first
        if first is None:
            if compared.empty:
                text = "diff compared nothing: no op of the statement had a single-device partner"
            else:
                text = (f"every op agrees with the single-device run: {len(compared)} op outputs and gradients "
                        f"compared on {self._ranks['rank'].nunique()} ranks")
            if not self.check.ok:
                text += f" (the check of the same run: {self.check.verdict})"
        else:
            what = ("output" if first.phase == "forward" else
                    "gradient reaching its output" if first.tensor == "gradient" else f"gradient of {first.tensor[:-5]}")
            module = f", module {first.module}" if first.module else ""
            rows = ""
            if first.rows:
                cuts = f" (the shard boundaries are at rows {', '.join(map(str, first.boundaries))})" \
                    if first.boundaries else ""
                rows = f", rows {first.rows}{cuts}"
            phase = "op that departs" if first.phase == "forward" else "op whose backward departs"
            text = (f"the first {phase}: `{first.op}` ({_ordinal(first.call)} call) at {first.site}{module}: "
                    f"{what} max abs {first.max_abs:.3g} on {_ranks_text(first.ranks)}{rows}: {first.inputs}")
        text += skipped_text
        if self.blame is not None:
            text += f". Without sharddbg: {self.blame.summary}"
        return text

    def __repr__(self) -> str:
        return self.answer

    def _repr_html_(self) -> str:
        return rendering.diff_html(self)

    def explore(self) -> Any:
        """The trace explorer of the sharded run, opened on the first departing op: its call on the first
        departing rank selected, its detail shown (the op summary row holding it expanded).

        Returns
        -------
        sharddbg.views.explorer.TraceExplorer
            The widget; ``selected`` is [rank, seq] of that call ([] when no op departs).

        Raises
        ------
        ValueError
            The diff has no trace: it ran inside a recording of the user's (its events are in that one).

        Examples
        --------
        >>> r.explore().selected  # doctest: +SKIP
        [0, 12]
        """
        if not self.has_trace:
            raise ValueError("this diff ran inside your own recording: its ops are in that recording's trace "
                             "(the first departing op's seq on each rank: r.get_ranks()['seq'])")
        first = self.first
        selected = [first.rank, first.seq] if first is not None and first.seq is not None else []
        return rendering.explorer(self.trace, selected=selected)

    def show(self) -> Any:
        """The view: the answer first, then the table of every compared op (departing rows tinted).

        Returns
        -------
        sharddbg.views.diff.DiffView
            Displays in a notebook (static HTML); ``html()`` and ``text()`` give it as HTML and text.

        Examples
        --------
        >>> print(r.show().text())  # doctest: +ELLIPSIS
        the first op that departs: `torch.conv2d` (1st call) at line 2 of the statement ...
        """
        return rendering.diff_view(self)
