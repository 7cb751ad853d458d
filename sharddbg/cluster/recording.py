"""A cell run under the recorder on every rank, gathered into one :class:`sharddbg.trace.Trace`.

``CellTracer.trace`` starts the recorder on every rank (``engine.api.recording_start``, with the recording's
``RecordingOptions``), runs the cell, stops the recorder where the cell finished (``recording_stop``) and, for
a rank that hung, keeps the events its control thread sent with the hang report's diagnosis (marked
incomplete). It then gathers what the Trace is made of, and only then builds it, once: the ranks' clock
offsets and, with ``replicas``, the largest difference of the first op call whose replicas differ (its
values gathered on the ranks of each replica group, ``api.replica_differences``: a broadcast from a rank of the
majority; the ranks' copies are released after). The Trace is kept (``last``) even when the cell failed or
timed out; the error is raised after. Ctrl-C during the cell keeps what was recorded until then as a Trace
marked interrupted (meta ``interrupted``), raised with ``TraceInterrupted``; where the cell still runs, the
recorder is stopped right after it (``_recorded_so_far``).

Every key of the Trace's meta is one of ``schema.TRACE_META_FIELDS``.
"""

from __future__ import annotations

import time
import uuid

from .. import columnar, schema
from ..analysis.consistency import first_divergence, replicas_frame
from ..engine import api
from ..errors import (RankDiedError, RankError, RankLostError, RankTimeoutError, ShardDbgError, TraceInterrupted,
                      hide_own_frames)
from ..options import RecordingOptions
from .control import ControlChannel
from .execution import RankExecution


# A rank that recorded this many records or more sends them as Arrow columns (``columnar.payload_as_columns``),
# which the client reads and checks a column at a time; fewer go as dicts, which cost less below this size
# (bench/RESULTS.md, "Gathering from live engines as columns")
COLUMNS_FROM = 2000


class CellTracer:
    """Traces cells on one cluster and keeps the last Trace."""

    def __init__(self):
        self.last = None  # the Trace of the last traced cell (a failed one included); None before the first

    def trace(self, execution: RankExecution, control: ControlChannel, code: str, *, options: RecordingOptions,
              timeout: float | None, display: bool, cluster: dict):
        """Run ``code`` on every rank under the recorder with ``options``; the Trace. ``cluster``: what the trace
        records about the cluster (``cluster_id``, ``mesh``, ``backend``)."""
        __tracebackhide__ = hide_own_frames()
        from ..trace import Trace

        every_rank = list(range(execution.n))
        execution.check_not_stuck(every_rank)
        token = uuid.uuid4().hex[:12] if options.preflight else None
        try:
            execution.call(api.recording_start, options=options.as_dict(), preflight_token=token,
                           what="recorder start")
        except KeyboardInterrupt:
            execution.queue_behind(api.recording_stop, every_rank)  # the recorder must not outlive this trace
            raise
        t0 = time.perf_counter()
        failure = None
        interrupted = None  # what Ctrl-C interrupted, when it did
        running: list[int] = []  # ranks still running the cell when Ctrl-C ended the wait
        payloads: dict[int, dict | None] = {}
        why_incomplete: dict[int, str] = {}
        try:
            execution.run(code, every_rank, timeout, display)
        except KeyboardInterrupt:
            dead = execution.processes.dead_ranks()
            running = [r for r in execution.busy_ranks() if r not in dead]
            interrupted = f"the wait for the cell was interrupted (Ctrl-C) after {time.perf_counter() - t0:.1f} s"
            if running:
                interrupted += f"; ranks {running} still ran it"
            for rank in dead:
                payloads[rank] = None
                why_incomplete[rank] = "its process is gone; its events are lost"
            self._recorded_so_far(execution, control, running, payloads, why_incomplete,
                                  "still running the cell when its wait was interrupted (Ctrl-C)")
        except RankTimeoutError as exc:
            failure = exc
            for rank in exc.report.unfinished:
                payloads[rank] = (exc.report.diagnoses.get(rank) or {}).get("recording")
                why_incomplete[rank] = f"did not finish within {exc.report.timeout_s:g} s"
        except (RankDiedError, RankLostError) as exc:
            failure = exc
            gone = exc.dead if isinstance(exc, RankDiedError) else exc.lost
            for rank, how in gone.items():
                payloads[rank] = None  # its events died with it, or cannot be reached any more
                why_incomplete[rank] = (f"its process died ({how}); its events are lost" if isinstance(exc, RankDiedError)
                                        else f"ipyparallel unregistered its engine (it stopped answering the "
                                             f"heartbeat; its process is {how}); its events are lost")
            still = [r for r in execution.busy_ranks() if r not in gone]
            if still:  # survivors that could not be released: what they recorded so far
                self._recorded_so_far(execution, control, still, payloads, why_incomplete,
                                      "still running when a peer died")
        except RankError as exc:
            failure = exc
        wall_s = time.perf_counter() - t0
        done = [r for r in every_rank if r not in payloads]
        if done:
            payloads.update(zip(done, execution.call(api.recording_stop, ranks=done, what="recorder stop",
                                                     columns_from=COLUMNS_FROM)))
        unreachable = {**execution.processes.dead_ranks(), **execution.lost_ranks()}
        offsets = control.clock_offsets(ranks=[r for r in every_rank if r not in unreachable])
        offsets_ns = {r: o["offset_ns"] for r, o in offsets.items()}
        differences = None
        if options.replicas and failure is None and interrupted is None:
            differences = gather_replica_differences(execution, payloads, offsets_ns, timeout)
            execution.call(api.replica_release, what="replica copies released")
        self.last = Trace.from_payloads(
            payloads, offsets_ns, incomplete_ranks=list(why_incomplete),
            meta={"code": code, "wall_s": wall_s, **cluster,
                  "clock_uncertainty_ns": {str(r): o["uncertainty_ns"] for r, o in offsets.items()},
                  "failed": None if failure is None else f"{type(failure).__name__}: {str(failure).splitlines()[0]}",
                  "incomplete_reasons": {str(r): why for r, why in why_incomplete.items()},
                  "replica_differences": differences, "interrupted": interrupted})
        if interrupted is not None:
            raise TraceInterrupted(
                f"{interrupted}. What was recorded until then is kept, marked interrupted: cl.last_trace() "
                f"(sharddbg.last_trace(); also this exception's .trace)." + (
                    f" Ranks {running} still run the cell (their recorder stops when it ends there); new work for "
                    f"them is refused until then: cl.recover() interrupts it." if running else ""),
                self.last) from None
        if failure is not None:
            raise failure
        return self.last

    @staticmethod
    def _recorded_so_far(execution: RankExecution, control: ControlChannel, running: list[int],
                         payloads: dict[int, dict | None], why_incomplete: dict[int, str], why: str) -> None:
        """Ranks still running the traced cell, which nothing waits for any more: what each recorded so far
        (asked of its control thread) into ``payloads``, and its recorder stopped as soon as the cell ends
        there (a stop queued behind it), so that no recorder outlives the trace."""
        if not running:
            return
        diagnoses = control.diagnose(running, 5.0)
        for rank in running:
            payloads[rank] = (diagnoses.get(rank) or {}).get("recording")
            why_incomplete[rank] = why
        execution.queue_behind(api.recording_stop, running)


def gather_replica_differences(execution: RankExecution, payloads: dict[int, dict | None], offsets_ns: dict[int, int],
                               timeout: float | None) -> list[dict]:
    """For every tensor of the first op call whose replicas differ (in the digests of ``payloads``): the largest
    difference of each rank of its group to a rank of the majority, gathered on the ranks
    (``api.replica_differences``, one call per replica group and reference rank). Entries as
    ``schema.REPLICA_DIFFERENCE_FIELDS`` describes them (``analysis.consistency.replica_divergence`` reads them)."""
    __tracebackhide__ = hide_own_frames()
    payloads = {r: _with_records(p) for r, p in payloads.items()}
    for p in payloads.values():
        if p is not None:
            schema.validate_payload(p)
    digests = replicas_frame({r: p["events"] if p else [] for r, p in payloads.items()}, offsets_ns)
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
            per_rank = execution.call(api.replica_differences, keys=keys, src=int(reference), group_ranks=list(group),
                                      ranks=list(group), timeout=timeout, what="gathering the first diverging replicas")
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


def _with_records(payload: dict | None) -> dict | None:
    """``payload`` with its records as dicts, also where they came as columns (``columnar.EVENTS_AS_COLUMNS``);
    a stream that cannot be read leaves it as it came (the Trace built from it says why)."""
    if not (isinstance(payload, dict) and columnar.EVENTS_AS_COLUMNS in payload):
        return payload
    try:
        records = columnar.records_of(columnar.table_of_stream(payload[columnar.EVENTS_AS_COLUMNS]))
    except columnar.ColumnarProblem:
        records = []
    head = {k: v for k, v in payload.items() if k != columnar.EVENTS_AS_COLUMNS}
    return dict(head, events=records)
