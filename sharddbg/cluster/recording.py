"""A cell run under the recorder on every rank, gathered into one :class:`sharddbg.trace.Trace`.

``CellTracer.trace`` starts the recorder on every rank (``engine.api.recording_start``), runs the cell,
stops the recorder where the cell finished (``recording_stop``) and, for a rank that hung, keeps the
events its control thread sent with the hang report's diagnosis (marked incomplete); then it measures
the ranks' clock offsets and builds the Trace on one clock. The Trace is kept (``last``) even when the
cell failed or timed out; the error is raised after.

Verification options (``Recorder``'s): ``spec_check`` (on by default), ``preflight`` (one store token per
traced cell, the same on every rank) and ``replicas``: after a cell that finished, the first op call whose
replicas differ is looked up in the digests and its values are gathered on the ranks of each replica group
(``api.replica_differences``, a broadcast from a rank of the majority) for the largest difference, kept in the
trace's meta ``replica_differences`` (``Trace.get_replica_divergence()``); the ranks' copies are then released.
"""

from __future__ import annotations

import time
import uuid

from ..analysis.consistency import first_divergence
from ..engine import api
from ..errors import ClusterError, RankDiedError, RankError, RankTimeoutError, ShardDbgError, hide_own_frames
from .control import ControlChannel
from .execution import RankExecution


class CellTracer:
    """Traces cells on one cluster and keeps the last Trace."""

    def __init__(self):
        self.last = None  # the Trace of the last traced cell (a failed one included); None before the first

    def trace(self, execution: RankExecution, control: ControlChannel, code: str, *, timeout: float | None,
              max_events: int, unmask: bool, display: bool, meta: dict, spec_check: bool = True,
              replicas: bool = False, preflight: bool = False, memory: bool = False):
        """Run ``code`` on every rank under the recorder; the Trace. ``meta``: what the trace records about
        the cluster (id, mesh, backend)."""
        __tracebackhide__ = hide_own_frames()
        from ..trace import Trace

        if not isinstance(max_events, int) or max_events < 1:
            raise ClusterError(f"max_events must be a positive integer, got {max_events!r}")
        for name, value in (("spec_check", spec_check), ("replicas", replicas), ("preflight", preflight),
                            ("memory", memory)):
            if not isinstance(value, bool):
                raise ClusterError(f"{name} must be True or False, got {value!r}")
        every_rank = list(range(execution.n))
        execution.check_not_stuck(every_rank)
        token = uuid.uuid4().hex[:12] if preflight else None
        execution.call(api.recording_start, max_events, unmask, True, spec_check, replicas, preflight, token,
                       memory, what="recorder start")
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
        if replicas and failure is None:
            self.last.meta["replica_differences"] = gather_replica_differences(execution, self.last, timeout)
            execution.call(api.replica_release, what="replica copies released")
        if failure is not None:
            raise failure
        return self.last


def gather_replica_differences(execution: RankExecution, trace, timeout: float | None) -> list[dict]:
    """For every tensor of the first op call whose replicas differ: the largest difference of each rank of its
    group to a rank of the majority, gathered on the ranks (``api.replica_differences``, one call per replica
    group and reference rank). Entries as ``analysis.consistency.replica_divergence`` reads them."""
    __tracebackhide__ = hide_own_frames()
    digests = trace.get_replica_digests()
    first = first_divergence(digests)
    out = []
    if first.empty:
        return out
    references = first["reference_ranks"].map(lambda ranks: ranks[0])
    for (group, reference), rows in first.groupby([first["group_ranks"], references], sort=False):
        keys = list(rows["key"])
        mine = digests[digests["key"].isin(keys) & digests["group_ranks"].map(lambda g: g == group)]
        not_kept = sorted({int(r) for r in mine.loc[~mine["kept"].astype(bool), "rank"]}
                          | {int(r) for ranks in rows["missing_ranks"] for r in ranks})
        entry = {"group_ranks": list(group), "reference_rank": int(reference)}
        if not_kept:
            note = (f"values not gathered: rank(s) {not_kept} kept no copy (the copy budget was spent, or the rank "
                    "never ran the op)")
            out += [dict(entry, key=k, by_rank={}, note=note) for k in keys]
            continue
        try:
            per_rank = execution.call(api.replica_differences, keys, int(reference), list(group), ranks=list(group),
                                      timeout=timeout, what="gathering the first diverging replicas")
        except ShardDbgError as exc:
            note = f"values not gathered: {str(exc).splitlines()[0]}"
            out += [dict(entry, key=k, by_rank={}, note=note) for k in keys]
            continue
        for i, k in enumerate(keys):
            found = {rank: res[i] for rank, res in zip(group, per_rank)}
            notes = sorted({f["note"] for f in found.values() if f["note"]})
            out.append(dict(entry, key=k, by_rank={str(r): f["max_abs_diff"] for r, f in found.items()},
                            note="; ".join(notes) or None))
    return out
