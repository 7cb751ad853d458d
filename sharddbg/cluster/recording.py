"""A cell run under the recorder on every rank, gathered into one :class:`sharddbg.trace.Trace`.

``CellTracer.trace`` starts the recorder on every rank (``engine.api.recording_start``), runs the cell,
stops the recorder where the cell finished (``recording_stop``) and, for a rank that hung, keeps the
events its control thread sent with the hang report's diagnosis (marked incomplete); then it measures
the ranks' clock offsets and builds the Trace on one clock. The Trace is kept (``last``) even when the
cell failed or timed out; the error is raised after.
"""

from __future__ import annotations

import time

from ..engine import api
from ..errors import ClusterError, RankDiedError, RankError, RankTimeoutError, hide_own_frames
from .control import ControlChannel
from .execution import RankExecution


class CellTracer:
    """Traces cells on one cluster and keeps the last Trace."""

    def __init__(self):
        self.last = None  # the Trace of the last traced cell (a failed one included); None before the first

    def trace(self, execution: RankExecution, control: ControlChannel, code: str, *, timeout: float | None,
              max_events: int, unmask: bool, display: bool, meta: dict):
        """Run ``code`` on every rank under the recorder; the Trace. ``meta``: what the trace records about
        the cluster (id, mesh, backend)."""
        __tracebackhide__ = hide_own_frames()
        from ..trace import Trace

        if not isinstance(max_events, int) or max_events < 1:
            raise ClusterError(f"max_events must be a positive integer, got {max_events!r}")
        every_rank = list(range(execution.n))
        execution.check_not_stuck(every_rank)
        execution.call(api.recording_start, max_events, unmask, what="recorder start")
        t0 = time.perf_counter()
        failure = None
        payloads: dict[int, dict | None] = {}
        incomplete: list[int] = []
        why_incomplete: dict[int, str] = {}
        try:
            execution.run(code, every_rank, timeout, display)
        except RankTimeoutError as exc:
            failure = exc
            for rank in exc.report.unfinished:
                payloads[rank] = (exc.report.diagnoses.get(rank) or {}).get("recording")
                incomplete.append(rank)
                why_incomplete[rank] = f"did not finish within {exc.report.timeout_s:g} s"
        except RankDiedError as exc:
            failure = exc
            for rank, how in exc.dead.items():
                payloads[rank] = None  # its events died with it
                incomplete.append(rank)
                why_incomplete[rank] = f"its process died ({how}); its events are lost"
            still = [r for r in execution.busy_ranks() if r not in exc.dead]
            if still:  # survivors that could not be released: what they recorded so far
                diagnoses = control.diagnose(still, 5.0)
                for rank in still:
                    payloads[rank] = (diagnoses.get(rank) or {}).get("recording")
                    incomplete.append(rank)
                    why_incomplete[rank] = "still running when a peer died"
        except RankError as exc:
            failure = exc
        wall_s = time.perf_counter() - t0
        done = [r for r in every_rank if r not in payloads]
        if done:
            payloads.update(zip(done, execution.call(api.recording_stop, ranks=done, what="recorder stop")))
        offsets = control.clock_offsets(ranks=[r for r in every_rank if r not in execution.processes.dead_ranks()])
        self.last = Trace.from_payloads(
            payloads, {r: o["offset_ns"] for r, o in offsets.items()},
            meta={"code": code, "wall_s": wall_s, **meta,
                  "clock_uncertainty_ns": {r: o["uncertainty_ns"] for r, o in offsets.items()},
                  "failed": None if failure is None else f"{type(failure).__name__}: {str(failure).splitlines()[0]}",
                  "incomplete_reasons": {str(r): why for r, why in why_incomplete.items()}},
            incomplete_ranks=incomplete)
        if failure is not None:
            raise failure
        return self.last
