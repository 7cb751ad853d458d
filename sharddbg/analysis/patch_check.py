"""What ``Cluster.check_patch`` found: one op run without and with a handler, side by side.

For each side: the op's dispatch path, its host time per call, the collectives issued inside its calls (per call
and rank), all read from a trace of the statement, and the numerical check against one device (outputs and
gradients, ``CheckResult``). ``PatchCheck.verdict`` says it in one sentence first. Pure data: no torch, no
cluster; its view comes through ``sharddbg.rendering``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import pandas as pd

from .. import rendering
from .formatting import format_bytes

if TYPE_CHECKING:
    from ..trace import Trace
    from .check import CheckResult

__all__ = ["CollectiveUse", "PatchSide", "PatchCheck", "patch_side", "HANDLER_PATHS"]

HANDLER_PATHS = ("function_handler", "dispatch_handler")


@dataclass(frozen=True)
class CollectiveUse:
    """One kind of collective issued inside the op's calls: how many per call and rank, and the bytes each rank
    received per call (``bytes_recv``; for a halo exchange, the halo rows only)."""

    kind: str
    per_call: float
    bytes_per_call: int


@dataclass(frozen=True)
class PatchSide:
    """The op on one side (``"before"``: without the handler, ``"after"``: with it).

    ``paths``: the dispatch paths its top-level forward calls took; ``calls``: forward calls per rank;
    ``ms_per_call``: the median host time of a call (the first call on each rank left out when there are more),
    NaN when not recorded; ``collectives``: per kind; ``check``: the numerical check of the statement."""

    label: str
    paths: tuple[str, ...]
    handlers: tuple[str, ...]
    calls: int
    ms_per_call: float
    collectives: tuple[CollectiveUse, ...]
    check: "CheckResult"

    @property
    def bytes_per_call(self) -> int:
        """Bytes each rank received per call, over every collective kind."""
        return sum(c.bytes_per_call for c in self.collectives)

    def collectives_text(self) -> str:
        """'1 all_gather_into_tensor (480 B)' per call and rank, or 'no collective'."""
        if not self.collectives:
            return "no collective"
        return ", ".join(f"{_count(c.per_call)} {c.kind} ({format_bytes(c.bytes_per_call)})" for c in self.collectives)


def _count(n: float) -> str:
    return str(int(n)) if float(n).is_integer() else f"{n:.2g}"


def patch_side(label: str, op: str, ops: pd.DataFrame, collectives: pd.DataFrame, check: "CheckResult") -> PatchSide:
    """The op ``op`` in one side's trace (``get_ops()``, ``get_collectives()``) with that side's check."""
    calls = ops[(ops["op"] == op) & (ops["phase"] == "forward") & (ops["depth"] == 0)] if len(ops) else ops
    paths = tuple(sorted(set(calls["path"]))) if len(calls) else ()
    handlers = tuple(sorted({h for h in calls["handler"] if isinstance(h, str)})) if len(calls) else ()
    per_rank = int(calls.groupby("rank").size().max()) if len(calls) else 0
    times = []
    for _, g in calls.groupby("rank"):
        g = g.sort_values("seq")
        times += list((g.iloc[1:] if len(g) > 1 else g)["host_ms"].dropna())
    ms = float(pd.Series(times).median()) if times else math.nan
    uses: list[CollectiveUse] = []
    if len(calls) and collectives is not None and len(collectives):
        keys = set(zip(calls["rank"].astype(int), calls["seq"].astype(int)))
        c = collectives[collectives["phase"] == "forward"]
        inside = [(int(r), int(o)) in keys if not pd.isna(o) else False
                  for r, o in zip(c["rank"], c["outer_op_seq"])]
        c = c[inside]
        n_ranks = max(int(calls["rank"].nunique()), 1)
        for kind, g in c.groupby("kind"):
            uses.append(CollectiveUse(str(kind), len(g) / (per_rank * n_ranks),
                                      int(g["bytes_recv"].sum()) // (per_rank * n_ranks)))
    return PatchSide(label, paths, handlers, per_rank, ms, tuple(uses), check)


class PatchCheck:
    """What ``Cluster.check_patch`` found: the op without the handler (``before``) and with it (``after``).

    ``before`` is None when the fallback was not run (``check_patch(..., before=False)``) or raised
    (``before_error`` says what: an op DTensor has no sharding strategy for cannot run without a handler).
    ``ok``: the handler took the op (its path is a handler path on every rank) and the statement's outputs and
    gradients agree with one device. ``verdict``: one sentence, also the repr. ``table``: the two sides in
    columns. ``traces``: the two traces, for the explorer.
    """

    def __init__(self, op: str, kind: str, stmt: str, handler: str, before: PatchSide | None, after: PatchSide,
                 traces: "dict[str, Trace] | None" = None, before_error: str | None = None):
        self.op = op
        self.kind = kind
        self.stmt = stmt
        self.handler = handler
        self.before = before
        self.after = after
        self.traces = dict(traces or {})
        self.before_error = before_error  # the statement raised without the handler (then ``before`` is None)

    @property
    def handled(self) -> bool:
        """The handler took every recorded call of the op (its path is ``function_handler`` or
        ``dispatch_handler``)."""
        return bool(self.after.paths) and all(p in HANDLER_PATHS for p in self.after.paths)

    @property
    def ok(self) -> bool:
        """The handler took the op and the check passed with it."""
        return self.handled and self.after.check.ok

    @property
    def speedup(self) -> float:
        """Host time per call before over after (above 1: faster with the handler); NaN when not measured."""
        if self.before is None:
            return math.nan
        b, a = self.before.ms_per_call, self.after.ms_per_call
        return b / a if a and not math.isnan(a) and not math.isnan(b) else math.nan

    def _speed_text(self) -> str:
        s = self.speedup
        if math.isnan(s):
            return "time not measured"
        return f"{s:.1f}x faster" if s >= 1 else f"{1 / s:.1f}x slower"

    def _moved_text(self) -> str:
        b, a = self.before, self.after
        if not b.collectives and not a.collectives:
            return "no collective before or after"
        if not a.collectives:
            return f"{b.collectives_text()} per call removed"
        if not b.collectives:
            return f"{a.collectives_text()} per call added"
        return f"{b.collectives_text()} replaced by {a.collectives_text()} per call and rank"

    @property
    def verdict(self) -> str:
        """One sentence: "patched: correct, 3.1x faster, 1 all_gather_into_tensor (480 B) replaced by 1
        all_to_all_single (24 B) per call and rank", or what is wrong first."""
        if not self.handled:
            return (f"not patched: {self.op} took {', '.join(self.after.paths) or 'no recorded call'} with the handler "
                    f"registered (is the statement calling {self.op}, and is it the function ShardTensor receives?)")
        if not self.after.check.ok:
            before = "" if self.before is None else \
                (" (correct before)" if self.before.check.ok else " (wrong before too)")
            return f"patched: WRONG{before}; {self.after.check.verdict}"
        if self.before is None:
            ms = self.after.ms_per_call
            why = f"; {self.before_error}" if self.before_error else " (the fallback was not run)"
            return f"patched: correct, {ms:.3g} ms per call, {self.after.collectives_text()} per call and rank{why}"
        note = "" if self.before.check.ok else " (the fallback was wrong: it fails the check)"
        return f"patched: correct{note}, {self._speed_text()}, {self._moved_text()}"

    @property
    def table(self) -> pd.DataFrame:
        """The two sides in columns ``before`` and ``after``: path, handler, calls per rank, ms per call,
        collectives and bytes per call and rank, the check's verdict."""
        rows = {}
        for side in (s for s in (self.before, self.after) if s is not None):
            rows[side.label] = {
                "path": ", ".join(side.paths) or "-",
                "handler": ", ".join(side.handlers) or "-",
                "calls per rank": side.calls,
                "ms per call": round(side.ms_per_call, 3) if not math.isnan(side.ms_per_call) else None,
                "collectives per call": side.collectives_text(),
                "bytes per call and rank": side.bytes_per_call,
                "check": "passed" if side.check.ok else "FAILED",
            }
        return pd.DataFrame(rows)

    def __repr__(self) -> str:
        return self.verdict

    def _repr_html_(self) -> str:
        return rendering.patch_check_html(self)

    def show(self) -> Any:
        """The view: the verdict, the two sides side by side, then each side's check.

        Returns
        -------
        sharddbg.views.patch_check.PatchCheckView
            Static HTML in a notebook; ``text()`` gives it as plain text.

        Examples
        --------
        >>> r = cl.check_patch("torch.diff", "y = torch.diff(x, dim=2)", handler=diff_handler)
        >>> print(r.show().text())  # doctest: +ELLIPSIS
        patched: correct, ...
        """
        return rendering.patch_check_view(self)
