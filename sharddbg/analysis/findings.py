"""What a recording says is wrong, in the order to read it: one list of typed findings for every front end.

``trace_findings(trace)`` decides which findings a trace has, what each says and in which order they come:
by what a finding means (its ``category``, ``CATEGORIES``), then by severity, then by kind. Errors first (ranks
that never issued a collective the others waited in, exceptions that ended the cell, then the ones the cell
caught), then wrong results (results whose spec disagrees with their data, replicas that diverge, a collective
the pre-flight stopped), then hangs and incomplete recordings (collectives neither completed nor failed, ranks
whose recording is incomplete, events dropped), then performance (stale entries in DTensor's redistribution
plan cache, ops computed through a DTensor fallback, metadata reads through it), then facts (a trace without op
records and why, the checks that found nothing). A performance warning never sits above an exception.
``trace_overview(trace)`` holds the counts a header shows. The ``%%shard_trace`` summary line, the explorer, the
HTML report (and anything else that shows a trace) render these two and decide nothing themselves.

``Finding`` is also what each row of the pitfall doctor is (``analysis.doctor``): one type for everything
sharddbg finds. Pure data: no torch, no cluster, no plotting.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import pandas as pd

from .consistency import divergence_text
from .formatting import ranks_text
from .ops import NO_OP
from .plan_cache import CLEAR_CALL, main_stale_site, stale_left

if TYPE_CHECKING:
    from ..trace import Trace

__all__ = ["Finding", "TraceOverview", "SEVERITIES", "CATEGORIES", "CATEGORY_TITLES", "KIND_CATEGORIES",
           "TRACE_FINDING_KINDS", "FINDING_FIELDS", "trace_findings",
           "trace_overview", "finding_order_key", "plan_cache_finding", "findings_frame", "MAX_ERROR_FINDINGS", "MAX_FALLBACK_OPS"]

# How bad, in the order a list of findings is read: the mistake is there; a risk or a cost; a fact worth
# knowing; a check that found nothing wrong; nothing to examine.
SEVERITIES = ("fail", "warn", "info", "ok", "skip")
# What a finding means, in the order a list of findings is read (before severity): something raised or never
# came; a result is wrong; something did not finish; it is slow; a fact.
CATEGORIES = ("error", "wrong_result", "hang", "performance", "fact")
# Each category as a front end names it.
CATEGORY_TITLES = {"error": "error", "wrong_result": "wrong result", "hang": "hang / incomplete",
                   "performance": "performance", "fact": "fact"}
# A trace's findings, each kind in this order within its category and severity.
TRACE_FINDING_KINDS = (
    "collective_missing",  # ranks of a group never issued a collective others waited in: the cause, said first
    "error",  # an exception that ended the cell, per distinct (type, message, op); the ranks that raised it, where
    "error_handled",  # op calls that raised and the user's code caught (pytest.raises, try/except)
    "spec_mismatch",  # ShardTensor results whose spec disagrees with their local tensor (recorded spec check)
    "replica_divergence",  # tensors claiming Replicate whose ranks hold different values (replicas=True)
    "preflight_mismatch",  # a collective the pre-flight stopped: its group disagreed on shapes (preflight=True)
    "collective_unfinished",  # collectives issued and never completed while recording
    "incomplete_ranks",  # ranks whose recording did not finish (a hang, a dead rank)
    "dropped_events",  # events the recorder's full buffer could not keep
    "plan_cache",  # stale entries left in DTensor's redistribution plan cache: each step gets slower
    "fallback",  # ops computed through a DTensor fallback
    "metadata_fallback",  # metadata reads (shape, ndim, ...) through the fallback
    "no_recorded_ops",  # no op was recorded: why the tables are empty (plain DTensor / torch.distributed code)
    "preflight_ok",  # the pre-flight compared every collective (some may have been late)
    "replicas_agree",  # every digested replica agreed
)
MAX_ERROR_FINDINGS = 3  # distinct exceptions named one by one; the rest in one more finding
MAX_FALLBACK_OPS = 4  # ops named in the fallback finding
PLAN_CACHE_FIX = f"clear the cache now and then in the training loop (every 100 steps, say): {CLEAR_CALL}"
# The category of each kind of a trace's finding. A kind not here (a doctor's check) takes it from its severity.
KIND_CATEGORIES = {
    "collective_missing": "error", "error": "error", "error_handled": "error",
    "spec_mismatch": "wrong_result", "replica_divergence": "wrong_result", "preflight_mismatch": "wrong_result",
    "collective_unfinished": "hang", "incomplete_ranks": "hang", "dropped_events": "hang",
    "plan_cache": "performance", "fallback": "performance", "metadata_fallback": "performance",
    "no_recorded_ops": "fact", "preflight_ok": "fact", "replicas_agree": "fact",
}
_SEVERITY_CATEGORIES = {"fail": "error", "warn": "performance", "info": "fact", "ok": "fact", "skip": "fact"}
SUMMARY_CHARS = 160  # a first clause longer than this is cut at a comma, colon or parenthesis within it
# The fields of a finding as JSON (``Finding.as_dict``, ``findings_frame``), in order.
FINDING_FIELDS = ("kind", "severity", "category", "sentence", "fix", "ranks", "op", "location", "text", "summary",
                  "details")


@dataclass(frozen=True)
class Finding:
    """One thing sharddbg found, said once for every front end.

    A trace's findings (``Trace.findings``) and each row of the pitfall doctor are Findings. Frozen: the
    fields below are its attributes.

    Parameters
    ----------
    kind : str
        What was looked at: one of ``TRACE_FINDING_KINDS`` for a trace, the check's name for the doctor.
    severity : str
        One of ``SEVERITIES``: "fail", "warn", "info", "ok", "skip".
    sentence : str
        What was found, cause first (which ranks, which op, where), as one clause without a final period.
    fix : str
        What to do about it; "" when there is nothing to do or nothing sure to say.
    ranks : tuple of int
        The ranks concerned.
    op : str or None
        The op concerned, where one is.
    location : str or None
        Where in the user's code ("cell [6], line 5: `y = x + x`"), where known.
    category : str, default ""
        What it means, one of ``CATEGORIES`` (the first key of a list's order); "" takes the kind's
        (``KIND_CATEGORIES``), or for a kind not there the severity's ("fail": "error", "warn": "performance",
        else "fact").

    Raises
    ------
    ValueError
        ``severity`` is not one of ``SEVERITIES``, or ``category`` not one of ``CATEGORIES``.

    Examples
    --------
    >>> [f.kind for f in t.findings if f.severity == "fail"]
    >>> f = Finding("incomplete_ranks", "fail", "the recording of rank 3 is incomplete", ranks=(3,))
    >>> f.severity, f.category, f.fix
    ('fail', 'hang', '')
    """

    kind: str
    severity: str
    sentence: str
    fix: str = ""
    ranks: tuple[int, ...] = field(default=())
    op: str | None = None
    location: str | None = None
    category: str = ""

    def __post_init__(self) -> None:
        if self.severity not in SEVERITIES:
            raise ValueError(f"a finding's severity is one of {SEVERITIES}, got {self.severity!r}")
        if not self.category:  # frozen: the derived category is set once, here
            object.__setattr__(self, "category",
                               KIND_CATEGORIES.get(self.kind, _SEVERITY_CATEGORIES[self.severity]))
        if self.category not in CATEGORIES:
            raise ValueError(f"a finding's category is one of {CATEGORIES}, got {self.category!r}")

    def summary(self) -> str:
        """The finding's first clause: the one line a front end shows before the details are opened.

        The sentence up to its first "; "; when that is longer than ``SUMMARY_CHARS``, up to the last ", ",
        ": " or " (" within them. Never cut inside parentheses, brackets or `code`. The first letter is
        capitalised, as in ``text()``.

        Returns
        -------
        str
            The line, without a final period.

        Examples
        --------
        >>> Finding("dropped_events", "warn", "120 events dropped; rank 1", fix="raise max_events").summary()
        '120 events dropped'
        """
        head = self.sentence[:_clause_end(self.sentence)]
        return head[:1].upper() + head[1:]

    def details(self) -> str:
        """What ``summary()`` leaves out: the rest of the sentence, then the fix ("" when nothing is left).

        Returns
        -------
        str
            The rest of the sentence as it is (starting with its own "; ", " (" or ": "), then "; " and the
            fix when there is one; "" when the summary is the whole finding.

        Examples
        --------
        >>> Finding("dropped_events", "warn", "120 events dropped; rank 1", fix="raise max_events").details()
        'rank 1; raise max_events'
        """
        rest = self.sentence[_clause_end(self.sentence):].lstrip(";:, ").strip()
        if self.fix:
            rest = f"{rest}; {self.fix}" if rest else self.fix
        return rest

    def text(self) -> str:
        """The sentence and the fix, as one line that reads on its own (first letter capitalised).

        ``sentence``, then "; " and ``fix`` when there is one; only the line's first letter is changed (a
        fix keeps its own first letter), and no final period is added.

        Returns
        -------
        str
            The line.

        Examples
        --------
        >>> Finding("incomplete_ranks", "fail", "the recording of rank 3 is incomplete", ranks=(3,)).text()
        'The recording of rank 3 is incomplete'
        >>> Finding("dropped_events", "warn", "120 events dropped", fix="raise max_events").text()
        '120 events dropped; raise max_events'
        """
        text = self.sentence + (f"; {self.fix}" if self.fix else "")
        return text[:1].upper() + text[1:]

    def as_dict(self) -> dict:
        """The finding as JSON (``FINDING_FIELDS``): what a front end without Python reads.

        Returns
        -------
        dict
            ``kind``, ``severity``, ``category``, ``sentence``, ``fix``, ``ranks`` (a list of int), ``op``,
            ``location``, ``text`` (``text()``: the whole line), ``summary`` (``summary()``: the line a front
            end shows first) and ``details`` (``details()``: what opens under it), in that order.

        Examples
        --------
        >>> f = Finding("incomplete_ranks", "fail", "the recording of rank 3 is incomplete", ranks=(3,))
        >>> f.as_dict()["ranks"], list(f.as_dict()) == list(FINDING_FIELDS)
        ([3], True)
        """
        return {"kind": self.kind, "severity": self.severity, "category": self.category, "sentence": self.sentence,
                "fix": self.fix, "ranks": [int(r) for r in self.ranks], "op": self.op, "location": self.location,
                "text": self.text(), "summary": self.summary(), "details": self.details()}


def _clause_end(sentence: str) -> int:
    """Where the first clause of ``sentence`` ends (``Finding.summary``): its first "; ", or for a long one the
    last ", ", ": " or " (" within ``SUMMARY_CHARS``; only outside parentheses, brackets and `code`."""
    depth, code, stops, commas = 0, False, [], []
    for i, ch in enumerate(sentence):
        if ch == "`":
            code = not code
        elif not code and ch in "([":
            if ch == "(" and depth == 0 and i > 0 and sentence[i - 1] == " ":
                commas.append(i - 1)
            depth += 1
        elif not code and ch in ")]":
            depth = max(0, depth - 1)
        elif not code and depth == 0 and sentence[i:i + 2] in ("; ", ", ", ": "):
            (stops if ch == ";" else commas).append(i)
    end = stops[0] if stops else len(sentence)
    if end > SUMMARY_CHARS:
        within = [i for i in commas if 20 <= i <= SUMMARY_CHARS]
        end = within[-1] if within else end
    return end


@dataclass(frozen=True)
class TraceOverview:
    """The counts a trace's header shows: ranks, op calls and how many raised or fell back, collectives (the
    most any rank issued, the slowest rank's time in them), results whose spec disagrees with their data,
    incomplete ranks, dropped events.

    ``Trace.overview`` (``trace_overview``) builds it from a trace. Frozen: the fields below are its
    attributes.

    Parameters
    ----------
    ranks : tuple of int
        The trace's ranks.
    op_calls : int
        Op calls of every rank, forward and backward, nested ones included (the rows of ``get_ops()``).
    errors : int
        Op calls that raised an exception that was not handled (it ended the cell, or it is not known that it
        did not); an exception counts once for every recorded op it went through.
    fallback_calls : int
        Op calls, forward and backward, that took a compute fallback (metadata reads and calls that enter
        the autograd engine left out).
    fallback_ops : int
        Ops computed through a fallback: the rows of ``get_fallbacks()``.
    spec_mismatches : int
        Op calls whose result's spec disagrees with its local tensor.
    collectives : int
        Collective calls, all ranks together (the rows of ``get_collectives()``).
    collectives_recorded : bool
        Collectives were recorded (``Trace.collectives_recorded``).
    collectives_per_rank : int
        The most collectives any rank issued.
    comm_wall_ms : float
        The slowest rank's wall time in collectives (0.0 when none was timed).
    incomplete_ranks : tuple of int
        Ranks whose recording is incomplete.
    dropped : int
        Events lost to a full buffer, all ranks together.
    handled_errors : int, default 0
        Op calls that raised an exception the user's code caught (the cell went on), counted like ``errors``.

    Examples
    --------
    >>> t.overview.errors, t.overview.incomplete_ranks
    >>> o = TraceOverview(ranks=(0, 1), op_calls=6, errors=0, fallback_calls=2, fallback_ops=1, spec_mismatches=0,
    ...                   collectives=0, collectives_recorded=False, collectives_per_rank=0, comm_wall_ms=0.0,
    ...                   incomplete_ranks=(), dropped=0)
    >>> o.headline()
    '6 op calls on 2 ranks, 0 raised, 2 through a DTensor fallback, 0 collectives'
    """

    ranks: tuple[int, ...]
    op_calls: int
    errors: int  # op calls that raised
    fallback_calls: int
    fallback_ops: int
    spec_mismatches: int  # op calls whose result's spec disagrees with its local tensor
    collectives: int
    collectives_recorded: bool
    collectives_per_rank: int  # the most any rank issued
    comm_wall_ms: float  # the slowest rank's wall time in collectives
    incomplete_ranks: tuple[int, ...]
    dropped: int
    handled_errors: int = 0  # op calls that raised and the user's code caught

    def headline(self) -> str:
        """The counts in one line: what every header says first.

        "42 op calls on 4 ranks, 4 raised, 9 through a DTensor fallback, 8 collectives (at most 2 per rank,
        0.9 ms in collectives on the slowest rank)". "N raised" counts the calls whose exception was not
        handled; " (N more raised and handled)" follows it when the user's code caught some. The part about
        collectives in parentheses only when there are collectives; ", N results whose spec disagrees with their
        data" added when there are such results.

        Returns
        -------
        str
            The line, without a final period.

        Examples
        --------
        >>> print(t.overview.headline())
        """
        n = len(self.ranks)
        text = (f"{self.op_calls} op call{'s' if self.op_calls != 1 else ''} on {n} rank{'s' if n != 1 else ''}, "
                f"{self.errors} raised"
                + (f" ({self.handled_errors} more raised and handled)" if self.handled_errors else "")
                + f", {self.fallback_calls} "
                f"through a DTensor fallback, {self.collectives} collectives")
        if self.collectives:
            text += (f" (at most {self.collectives_per_rank} per rank, {self.comm_wall_ms:.1f} ms in collectives on "
                     f"the slowest rank)")
        if self.spec_mismatches:
            text += f", {self.spec_mismatches} results whose spec disagrees with their data"
        return text

    def as_dict(self) -> dict:
        """The overview as JSON.

        Returns
        -------
        dict
            Every field (``ranks`` and ``incomplete_ranks`` as lists), then ``headline``: ``ranks``,
            ``op_calls``, ``errors``, ``fallback_calls``, ``fallback_ops``, ``spec_mismatches``,
            ``collectives``, ``collectives_recorded``, ``collectives_per_rank``, ``comm_wall_ms``,
            ``incomplete_ranks``, ``dropped``, ``handled_errors``, ``headline``.

        Examples
        --------
        >>> o = t.overview
        >>> o.as_dict()["headline"] == o.headline()
        True
        """
        return {"ranks": list(self.ranks), "op_calls": self.op_calls, "errors": self.errors,
                "fallback_calls": self.fallback_calls, "fallback_ops": self.fallback_ops,
                "spec_mismatches": self.spec_mismatches, "collectives": self.collectives,
                "collectives_recorded": self.collectives_recorded, "collectives_per_rank": self.collectives_per_rank,
                "comm_wall_ms": self.comm_wall_ms, "incomplete_ranks": list(self.incomplete_ranks),
                "dropped": self.dropped, "handled_errors": self.handled_errors, "headline": self.headline()}


def trace_overview(trace: Trace) -> TraceOverview:
    """The counts of ``trace`` that a header shows."""
    ops = trace.get_ops()
    has_ops = len(ops) > 0
    from .ops import is_fallback

    per_rank = trace.get_comm_by_rank() if trace.collectives_recorded else pd.DataFrame()
    issued = int(per_rank["n_collectives"].max()) if len(per_rank) else 0
    wall = float(per_rank["comm_wall_ms"].max()) if len(per_rank) and issued else 0.0
    raised = ops["exc_type"].notna() if has_ops else pd.Series(dtype=bool)
    handled = raised & (ops["error_handled"] == True) if has_ops else raised  # noqa: E712 - None is not True
    return TraceOverview(
        ranks=tuple(int(r) for r in trace.ranks), op_calls=len(ops),
        errors=int((raised & ~handled).sum()), handled_errors=int(handled.sum()),
        fallback_calls=int(is_fallback(ops).sum()) if has_ops else 0,
        fallback_ops=len(trace.get_fallbacks()),
        spec_mismatches=int(ops["spec_mismatch"].notna().sum()) if has_ops else 0,
        collectives=len(trace.get_collectives()), collectives_recorded=trace.collectives_recorded,
        collectives_per_rank=issued, comm_wall_ms=0.0 if math.isnan(wall) else wall,
        incomplete_ranks=tuple(int(r) for r in trace.incomplete_ranks), dropped=int(trace.dropped))


def trace_findings(trace: Trace) -> list[Finding]:
    """Every finding of ``trace``: by category (``CATEGORIES``), then severity, then ``TRACE_FINDING_KINDS``."""
    found = [*_missing_collectives(trace), *_errors(trace), *_spec_mismatches(trace), *_replicas(trace),
             *_preflight(trace), *_unfinished_collectives(trace), *_incomplete(trace), *_dropped(trace),
             *_plan_cache(trace), *_fallbacks(trace), *_no_recorded_ops(trace)]
    return sorted(found, key=finding_order_key)


def finding_order_key(finding: Finding) -> tuple[int, int, int]:
    """Where ``finding`` goes in a list: by what it means, then how bad, then its kind.

    Parameters
    ----------
    finding : Finding
        The finding.

    Returns
    -------
    tuple of int
        Its category's index in ``CATEGORIES``, its severity's in ``SEVERITIES``, its kind's in
        ``TRACE_FINDING_KINDS`` (a kind not there after them all).

    Examples
    --------
    >>> sorted(findings, key=finding_order_key)
    """
    kinds = TRACE_FINDING_KINDS
    return (CATEGORIES.index(finding.category), SEVERITIES.index(finding.severity),
            kinds.index(finding.kind) if finding.kind in kinds else len(kinds))


def findings_frame(findings: list[Finding]) -> pd.DataFrame:
    """``findings`` as a DataFrame, one row each, columns ``FINDING_FIELDS``, in their order."""
    return pd.DataFrame([f.as_dict() for f in findings], columns=list(FINDING_FIELDS))


# ---- each kind ---------------------------------------------------------------------------------------------
def _first_line(message) -> str:
    return str(message).splitlines()[0] if isinstance(message, str) and message else str(message)


def _errors(trace: Trace) -> list[Finding]:
    errs = trace.get_errors()
    if errs.empty:
        return []
    handled = errs["handled"].fillna(False).astype(bool)  # not known: shown as a failure, as it may be one
    return [*_escaped_errors(errs[~handled]), *_handled_errors(errs[handled])]


@dataclass(frozen=True)
class _DistinctException:
    """The calls that raised one exception (type, message) in one op: on which ranks, first named where."""

    exc_type: str
    message: str
    op: str
    calls: pd.DataFrame
    ranks: tuple[int, ...]
    where: str | None


def _distinct_exceptions(errs: pd.DataFrame) -> list[_DistinctException]:
    """The distinct exceptions of ``errs``, in order of their first call."""
    return [_DistinctException(exc, message, op, g, tuple(sorted(int(r) for r in g["rank"].unique())),
                               next((w for w in g["location"] if isinstance(w, str)), None))
            for (exc, message, op), g in errs.groupby(["exc_type", "message", "op"], sort=False)]


def _handled_errors(errs: pd.DataFrame) -> list[Finding]:
    """One info finding for the exceptions the user's code caught: what each was, where, on which ranks."""
    if errs.empty:
        return []
    distinct = _distinct_exceptions(errs)
    parts = [f"{d.exc_type}: {_first_line(d.message)} in {d.op} on {ranks_text(d.ranks)}"
             + (f" ({d.where})" if d.where else "") for d in distinct[:MAX_ERROR_FINDINGS]]
    if len(distinct) > MAX_ERROR_FINDINGS:
        parts.append(f"{len(distinct) - MAX_ERROR_FINDINGS} more distinct exception(s)")
    n = len(errs)
    first = errs.iloc[0]
    ranks = tuple(sorted(int(r) for r in errs["rank"].unique()))
    return [Finding("error_handled", "info", f"{n} op call{'s' if n != 1 else ''} raised and the cell handled "
                    f"{'them' if n != 1 else 'it'}: " + "; ".join(parts), fix="t.get_errors() lists each (handled=True)",
                    ranks=ranks, op=str(first["op"]),
                    location=first["location"] if isinstance(first["location"], str) else None)]


def _escaped_errors(errs: pd.DataFrame) -> list[Finding]:
    if errs.empty:
        return []
    out = []
    distinct = _distinct_exceptions(errs)
    for d in distinct[:MAX_ERROR_FINDINGS]:
        inside = "outside every recorded op" if d.op == NO_OP else f"in {d.op}"
        sentence = f"{ranks_text(d.ranks)} raised {d.exc_type}: {_first_line(d.message)} {inside}"
        if d.where:
            sentence += f" ({d.where})"
        if bool(d.calls["unmasked"].any()):
            sentence += "; PyTorch would have hidden it behind \u201cunsupported operand type(s)\u201d"
        out.append(Finding("error", "fail", sentence, ranks=d.ranks, op=None if d.op == NO_OP else str(d.op),
                           location=d.where))
    if len(distinct) > MAX_ERROR_FINDINGS:
        rest = distinct[MAX_ERROR_FINDINGS:]
        ranks = tuple(sorted({r for d in rest for r in d.ranks}))
        out.append(Finding("error", "fail", f"{len(rest)} more distinct exception(s) on {ranks_text(ranks)}",
                           fix="t.get_errors() lists every one", ranks=ranks))
    return out


def _spec_mismatches(trace: Trace) -> list[Finding]:
    found = trace.get_spec_mismatches()
    if found.empty:
        return []
    first = found.iloc[0]
    ranks = tuple(sorted({int(r) for r in found["rank"]}))
    location = first["location"] if isinstance(first["location"], str) else None
    return [Finding("spec_mismatch", "fail",
                    f"{len(found)} result(s) whose spec disagrees with the local tensor on {ranks_text(ranks)}, first "
                    f"at {first['op']} on rank {int(first['rank'])}: {first['detail']}",
                    fix="the first is usually where the rest come from: t.get_spec_mismatches() lists each",
                    ranks=ranks, op=str(first["op"]), location=location)]


def _replicas(trace: Trace) -> list[Finding]:
    if not trace.checks["replicas"]:
        return []
    div = trace.get_replica_divergence()
    text = divergence_text(div)
    if text is None:
        return [Finding("replicas_agree", "ok", "replicas agree on every rank")]
    first = div.iloc[0]
    ranks = tuple(sorted({int(r) for ranks in div["ranks_differing"] for r in ranks}))
    return [Finding("replica_divergence", "fail", text, fix="t.get_replica_divergence() lists every tensor that "
                    "diverges", ranks=ranks, op=str(first["op"]),
                    location=first["location"] if isinstance(first["location"], str) else None)]


def _preflight(trace: Trace) -> list[Finding]:
    if not trace.checks["preflight"]:
        return []
    pf = trace.get_preflight()
    bad = pf[pf["status"] == "mismatch"]
    if len(bad):
        first = bad.iloc[0]
        ranks = tuple(sorted({int(r) for r in bad["rank"]}))
        return [Finding("preflight_mismatch", "fail",
                        f"pre-flight stopped {first['op'] or 'a collective'}: {first['detail']}",
                        fix="the ranks of its group were about to issue different collectives (it would have hung); "
                            "t.get_preflight() shows each rank's", ranks=ranks, op=first["op"] or None,
                        location=first["location"] if isinstance(first["location"], str) else None)]
    if not len(pf):
        return []
    late = pf[pf["status"] == "late"]
    text = f"pre-flight: {int((pf['status'] == 'ok').sum())} collective checks ok" + (
        f", {len(late)} late (issued unchecked)" if len(late) else "")
    return [Finding("preflight_ok", "warn" if len(late) else "ok", text,
                    ranks=tuple(sorted({int(r) for r in late["rank"]})))]


def _unfinished_collectives(trace: Trace) -> list[Finding]:
    """Collectives neither completed nor failed (a hang, or never waited); a failed one is not among them: the
    exception it raised is an error finding."""
    if not trace.collectives_recorded:
        return []
    colls = trace.get_collectives()
    stuck = colls[colls["in_flight"].astype(bool)] if len(colls) else colls
    if not len(stuck):
        return []
    ranks = tuple(sorted({int(r) for r in stuck["rank"]}))
    return [Finding("collective_unfinished", "fail", f"{len(stuck)} collective(s) never completed, on "
                    f"{ranks_text(ranks)}", ranks=ranks)]


def _missing_collectives(trace: Trace) -> list[Finding]:
    """Ranks of a group that never issued a collective the others issued and did not complete (they waited in
    it until it failed, gloo's own timeout say, or until the recording ended): the cause of what those ranks
    raised, so said before it. A rank that skipped it because it raised is left out: its exception is the cause,
    an error finding of its own. One finding per such collective, the first few."""
    if not trace.collectives_recorded:
        return []
    missing = trace.get_collective_mismatches()
    missing = missing[missing["problem"] == "missing"] if len(missing) else missing
    if not len(missing):
        return []
    colls = trace.get_collectives()
    errs = trace.get_errors()
    raised = {int(r) for r in errs.loc[~errs["handled"].fillna(False).astype(bool), "rank"]} if len(errs) else set()
    out = []
    for m in missing.itertuples(index=False):
        issued = colls[(colls["group_name"] == m.group_name) & (colls["group_seq"] == m.group_seq)
                       & colls["rank"].isin(m.ranks)]
        waiting = issued[issued["state"] != "completed"]
        if not len(waiting):
            continue  # the others completed it: a recording that lost the rank's record, not a rank that skipped it
        members = issued["group_ranks"].iloc[0]
        members = [int(r) for r in members] if isinstance(members, (list, tuple)) else []
        absent = sorted((set(members) - {int(r) for r in m.ranks} - raised) & {int(r) for r in trace.ranks})
        if not absent:
            continue
        first = waiting.iloc[0]
        waiters = tuple(sorted(int(r) for r in waiting["rank"]))
        kind = str(first["kind"])
        group = f"'{m.mesh_dim}'" if isinstance(m.mesh_dim, str) else f"process group {m.group_name}"
        failed = set(waiting["state"]) == {"failed"}  # else some still waited when the recording ended (a hang)
        sentence = (f"{ranks_text(absent)} never issued the {kind} {ranks_text(waiters)} "
                    f"{'waited in until it failed' if failed else 'waited in'} (group_seq {int(m.group_seq)} "
                    f"on {group})")
        if isinstance(first["location"], str):
            sentence += f", issued at {first['location']}"
        elif isinstance(first["op"], str):
            sentence += f", issued in {first['op']}"
        out.append(Finding("collective_missing", "fail", sentence,
                           fix=f"{'what ' + ranks_text(waiters) + ' raised' if failed else 'the hang'} follows from "
                               f"it: find why {ranks_text(absent)} skipped it (a branch on rank, an exception caught "
                               "there); "
                               "t.get_collective_mismatches() lists every collective that does not line up",
                           ranks=tuple(absent), op=first["op"] if isinstance(first["op"], str) else None,
                           location=first["location"] if isinstance(first["location"], str) else None))
        if len(out) >= MAX_ERROR_FINDINGS:
            break
    return out


def _incomplete(trace: Trace) -> list[Finding]:
    if not trace.incomplete_ranks:
        return []
    reasons = trace.incomplete_reasons
    ranks = tuple(int(r) for r in trace.incomplete_ranks)
    why = "; ".join(f"rank {r} {reasons[r]}" for r in ranks if r in reasons)
    return [Finding("incomplete_ranks", "fail", f"the recording of {ranks_text(ranks)} is incomplete"
                    + (f" ({why})" if why else ""), ranks=ranks)]


def _dropped(trace: Trace) -> list[Finding]:
    if not trace.dropped:
        return []
    per_rank = trace.dropped_by_rank
    return [Finding("dropped_events", "warn", f"{trace.dropped} events dropped: the recorder's buffer was full on "
                    f"{ranks_text(per_rank)}", fix="raise max_events (%%shard_trace --max-events) to keep them all",
                    ranks=tuple(sorted(per_rank)))]


def plan_cache_finding(frame: pd.DataFrame, growth: pd.DataFrame) -> Finding | None:
    """The plan cache finding of ``get_plan_cache()`` / ``get_plan_cache_growth()`` rows when stale entries were
    left in the cache: where, which spec field, on which ranks, how many on each rank (every rank has a cache of
    its own: no count is summed over ranks), what it costs; None otherwise."""
    stale = stale_left(frame)
    if not len(stale):
        return None
    site = main_stale_site(stale)
    # every rank has a cache of its own: counts are per rank, never summed over ranks
    others = {r: k - site.kept_per_rank.get(r, 0) for r, k in stale.groupby("rank")["kept"].sum().items()}
    others = {r: k for r, k in others.items() if k}
    fields = " and ".join(f"its {c.split('.')[0]} spec's {c.split('.', 1)[1]}" for c in site.changed.split(", "))
    entries = growth.dropna(subset=["entries_end"])
    now = (f" ({_per_rank(entries['entries_end'], 'entries', 'in the cache')} now)" if len(entries) else "")
    sentence = (f"{ranks_text(site.ranks)}: {site.where}, {site.source} -> {site.target}, changed {fields} after "
                f"DTensor's redistribution plan cache had stored it, "
                f"{_per_rank(site.kept_per_rank.values(), 'times')}"
                + (f" ({_per_rank(others.values(), 'more stale entries')} from other calls)" if others else "")
                + ": those entries are never hit again, each call adds one and every lookup compares against all of "
                f"them (they share one hash), so each step gets slower{now}")
    return Finding("plan_cache", "warn", sentence, fix=PLAN_CACHE_FIX, ranks=tuple(site.ranks), op=site.where)


def _per_rank(counts, noun: str, where: str = "") -> str:
    """Counts of each rank's own, as one phrase: '3 times on each rank', '30 to 36 entries in the cache per rank'
    ('1 time', '1 more stale entry')."""
    counts = sorted(int(c) for c in counts)
    lo, hi = counts[0], counts[-1]
    if hi == 1:
        noun = noun.replace("times", "time").replace("entries", "entry")
    place = f" {where}" if where else ""
    return f"{lo:,} {noun}{place} on each rank" if lo == hi else f"{lo:,} to {hi:,} {noun}{place} per rank"


def _plan_cache(trace: Trace) -> list[Finding]:
    found = plan_cache_finding(trace.get_plan_cache(), trace.get_plan_cache_growth())
    return [found] if found is not None else []


# why a trace without op records has none: ShardTensor's calls are always recorded, plain DTensor's only with
# RecordingOptions.dtensor, the user's own torch.distributed calls as collectives only
NOT_RECORDED_AS_OPS = ("plain DTensor calls are recorded only with dtensor=True, torch.distributed calls made by the "
                       "user's code never are")


def _no_recorded_ops(trace: Trace) -> list[Finding]:
    if len(trace.get_ops()) or trace.incomplete_ranks:  # a rank that died or hung says why itself
        return []
    colls = trace.get_collectives()
    if not len(colls):
        what = "no collective ran" if trace.collectives_recorded else "collectives were not recorded"
        return [Finding("no_recorded_ops", "info", f"no ShardTensor op was called and {what} "
                        f"({NOT_RECORDED_AS_OPS})")]
    per_rank = colls.groupby("rank").size()
    ranks = tuple(sorted(int(r) for r in per_rank.index))
    each = (f"{int(per_rank.iloc[0])} per rank" if per_rank.nunique() == 1 and len(ranks) == len(trace.ranks)
            else f"at most {int(per_rank.max())} per rank")
    return [Finding("no_recorded_ops", "info",
                    f"no ShardTensor op was called: {len(colls)} collectives ({each}) ran outside recorded ops "
                    f"({NOT_RECORDED_AS_OPS})", fix="t.get_collectives() lists them, with bytes, times and where "
                    "in the cell", ranks=ranks)]


def _fallbacks(trace: Trace) -> list[Finding]:
    out = []
    fb = trace.get_fallbacks()
    if len(fb):
        ops = list(fb["op"])
        shown = ", ".join(map(str, ops[:MAX_FALLBACK_OPS])) + (", ..." if len(ops) > MAX_FALLBACK_OPS else "")
        ranks = tuple(sorted({int(r) for rs in fb["ranks"] for r in rs}))
        out.append(Finding("fallback", "warn", f"{len(ops)} op(s) computed through a DTensor fallback ({shown})",
                           fix="t.get_fallbacks() shows what each cost and where it was called", ranks=ranks,
                           op=str(ops[0])))
    every = trace.get_fallbacks(include_metadata=True)
    metadata = every[every["category"] == "metadata"] if len(every) else every
    if len(metadata):
        ranks = tuple(sorted({int(r) for rs in metadata["ranks"] for r in rs}))
        out.append(Finding("metadata_fallback", "info",
                           f"{int(metadata['calls'].sum())} metadata reads through the fallback", ranks=ranks))
    return out
