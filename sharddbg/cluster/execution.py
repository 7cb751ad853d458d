"""Running code on the ranks: ``%px`` cells and ``sharddbg.engine.api`` calls, with bounded waits that name
the cause of a failure.

``RankExecution`` holds the ipyparallel client of a running cluster and its engines in rank order. It
runs a cell (``run``) or calls an engine API function (``apply``) on chosen ranks and waits in short
slices up to a timeout; ``submit`` sends a cell without waiting and returns its ``PendingCell``, whose
``wait`` / ``get`` do the same wait later, within the cell's own time limit (counted from when it was
sent), and whose ranks take no new work meanwhile. Between slices it looks for what ends a wait early:

- the controller died: nothing can arrive any more (``ClusterError`` saying how it died);
- a rank's process died: the surviving ranks are released from any collective they wait in with it, and
  ``RankDiedError`` says which rank died and how, with what the others printed and raised;
- the controller unregistered a rank whose process lives (it missed the heartbeat: stopped, or starved):
  the others are released as for a dead rank, and ``RankLostError`` names it and the state of its process;
  every later call that needs it is refused with the same words (ipyparallel would raise ``KeyError``);
- a rank raised while others still run: if they wait for it in a collective (their Flight Recorder says
  so), they are released at once instead of waiting out the collective timeout, and the ``RankError``
  leads with the rank that raised, its exception and the line of the cell, then who waited where.

A cell that called ``exit()`` on a rank raises ``RankDiedError`` once that rank's process is gone. When every
rank that raised failed in a collective by itself (gloo's own timeout), the ranks' Flight Recorders name the
ranks that never issued it, and the ``RankError`` leads with them.

A rank still running at the timeout gives a ``RankTimeoutError`` whose hang report leads with the ranks
that raised, if any; its call is remembered so that new work for it is refused instead of queueing
behind it. A release, a collective that failed for want of a peer, or a desynchronised hang leaves the
process group broken (``broken``): cells are refused until ``Cluster.recover()`` builds a new one. Each
rank's output is collected as a ``RankOutput`` and shown in rank order (``show``: grouped as ipyparallel's
``--group-outputs``), or line by line as it arrives (``LiveOutput``, ``%px --stream``).

It uses ipyparallel's public API only, except for a cell's reply content (where IPython says that the cell
called ``exit()``); the control channel (answered while a rank is blocked) is ``control``.
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import sys
import threading
import time
from dataclasses import dataclass, field

from ..engine import api
from ..errors import (ClusterError, RankDiedError, RankError, RankFailure, RankLostError, RankTimeoutError,
                      ShardDbgError, hide_own_frames, short_message)
from . import arguments
from ..analysis import hang
from .control import ControlChannel
from ..analysis.hang import RECOVERY_HINT, HangReport, format_failures
from .processes import HEARTBEAT_LIMIT_S, ClusterProcesses

# How often a wait looks for dead ranks, a dead controller and failed ranks.
WAIT_SLICE_S = 0.25
# While a rank has failed and others still run: how often to ask whether they wait for it.
PROBE_EVERY_S = 0.5
# How long released ranks get to finish their cell once their collective was ended.
RELEASE_WAIT_S = 5.0
# Results can arrive before the ranks' last printed lines (iopub is a separate stream): wait this long for them.
OUTPUT_GRACE_S = 5.0
# How long a rank whose cell called exit() gets to end its process before the cell's error says so.
EXIT_WAIT_S = 10.0
# A question to the controller (which ranks are busy) must come back within this.
CONTROLLER_ANSWER_S = 10.0

# Lines engines print that say nothing about the user's program.
_NOISE = [
    re.compile(r"Warp CUDA warning: Could not find or load the NVIDIA CUDA driver"),
    re.compile(r"FutureWarning: .*all_gather_tensor"),
    re.compile(r"^\s*warnings\.warn\($"),
    re.compile(r"^\s*(return )?funcol\.all_gather_tensor"),
    # torch 2.13+ prefers TORCH_FR_BUFFER_SIZE; the older name is set too, for older torch on GPU hosts
    re.compile(r"Environment variable TORCH_NCCL_TRACE_BUFFER_SIZE is deprecated"),
]

_ANSI = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")
# What torch.distributed says when a collective failed for want of a peer (gloo, NCCL, the store).
_COMM_FAILURE = re.compile(
    r"Connection closed by peer|Connection reset by peer|Application timeout caused pair closure|Timed out waiting"
    r"|Broken pipe|connectFullMesh|Socket Timeout|NCCL (communicator|error)|ProcessGroup\w* (is )?(aborted|shut down)"
    r"|process group has been destroyed|Watchdog caught collective operation timeout")
_COMM_FAILURE_TYPES = {"DistBackendError", "DistNetworkError", "DistStoreError", "DistError"}


def filter_noise(text: str) -> str:
    """``text`` without the lines engines print that say nothing about the user's program."""
    return "".join(line for line in text.splitlines(keepends=True) if not any(p.search(line) for p in _NOISE))


def is_comm_failure(failure: RankFailure) -> bool:
    """The failure is a collective that failed for want of a peer (the process group is unusable after it)."""
    return failure.type_name in _COMM_FAILURE_TYPES or bool(_COMM_FAILURE.search(failure.message))


@dataclass
class RankOutput:
    """What one rank printed and returned for one call."""

    rank: int
    stdout: str = ""
    stderr: str = ""
    result: object = None
    error: RankFailure | None = None
    displays: list = field(default_factory=list)  # rich outputs (display() calls), as IPython publishes them


@dataclass
class BrokenGroup:
    """Why the process group cannot be used any more (until ``Cluster.recover()`` builds a new one)."""

    cause: str  # one line: what broke it, rank first

    def refusal(self, gone: dict[int, str] | None = None) -> str:
        """Why a cell is refused, and what goes on from here: ``recover()`` while every rank lives, only
        ``restart()`` once a rank is ``gone`` (rank -> dead or lost, and how)."""
        if gone:
            return (f"The process group broke at {self.cause}. {_ranks_text(gone).capitalize()} cannot take part "
                    f"any more ({'; '.join(f'rank {r}: {how}' for r, how in sorted(gone.items()))}), so "
                    f"cl.recover() cannot re-create the group: run cl.restart() (%shard_cluster restart) for new "
                    f"engines on every rank")
        return (f"The process group broke at {self.cause}. Its collectives would fail or hang: run cl.recover() "
                f"(%shard_cluster recover) to re-create it (ShardTensors made before must be made again), "
                f"or cl.restart() for new engines")


class CellStillRunningError(ShardDbgError, TimeoutError):
    """A wait shorter than the cell's own time limit ended while its ranks still run (``PendingCell.get(timeout)``):
    nothing was diagnosed or marked; get() or wait() again."""


def engines_in_rank_order(client, n: int, timeout: float) -> list[int]:
    """The engine id of each of ``n`` ranks, in rank order: each engine is asked its rank (registration order
    is not rank order). A ClusterError names the engines that did not answer within ``timeout`` seconds."""
    from ipyparallel import error as ipp_error

    ar = client[:].apply_async(api.rank)
    try:
        ranks = ar.get(timeout=timeout)
    except ipp_error.TimeoutError:
        silent = [e for e, msg_id in zip(client.ids, ar.msg_ids) if msg_id in client.outstanding]
        raise ClusterError(f"engines {silent} (of {len(client.ids)}) did not say which rank they are within "
                           f"{timeout:g} s of starting: they are stuck or overloaded (their logs are in the "
                           f"cluster's log_dir)") from None
    by_rank = dict(zip(ranks, client.ids))
    return [by_rank[r] for r in range(n)]


class RankExecution:
    """Code and engine API calls on the ranks of one running cluster, in rank order, with bounded waits.

    It holds what a wait needs to name a cause: the engines' processes (``processes``: which died, and how)
    and their control channel (``control``: where each rank waits, answered while it is blocked; and the
    release of ranks blocked in a collective)."""

    def __init__(self, client, engine_ids: list[int], processes: ClusterProcesses, control: ControlChannel,
                 default_timeout: float):
        self.client = client
        self.engine_ids = engine_ids  # engine id of rank r at index r
        self.view = client.direct_view(engine_ids)  # every rank, in rank order
        self.view.block = False
        self.processes = processes
        self.control = control
        self.default_timeout = default_timeout
        self.broken: BrokenGroup | None = None
        self._stuck: dict[str, int] = {}  # message id -> rank, of calls that timed out and still run
        self._unwaited: dict[str, int] = {}  # message id -> rank, of cells sent by submit() that still run
        self.closed = False  # the client was closed (stop / restart): nothing sent through it can arrive
        self.closed_by = ""  # what closed it: "stopped (by cl.stop())", "restarted (by cl.restart())"

    def close(self, closed_by: str = "stopped (by cl.stop())") -> None:
        self.closed_by = self.closed_by or closed_by
        self.closed = True
        try:
            self.client.close()
        except Exception:
            pass

    # ------------------------------------------------------------------ which ranks
    @property
    def n(self) -> int:
        return len(self.engine_ids)

    def ranks(self, targets) -> list[int]:
        """``targets`` (None: every rank; an int; or ranks) as a checked list of live ranks."""
        __tracebackhide__ = hide_own_frames()
        ranks = arguments.ranks(targets, self.n)
        self.check_controller()  # a dead controller answers nothing: say so, not that no rank answered
        dead = {r: how for r, how in self.processes.dead_ranks().items() if r in ranks}
        if dead:
            alive = [r for r in range(self.n) if r not in self.processes.dead_ranks()]
            raise ClusterError(self.dead_message(dead) + (f" Ranks {alive} still answer (targets={alive})."
                                                           if alive else ""))
        self.refuse_lost(ranks)
        return ranks

    def dead_message(self, dead: dict[int, str]) -> str:
        who = "; ".join(f"rank {r} (pid {self.processes.pids.get(r)}) {how}" for r, how in sorted(dead.items()))
        return (f"{who}: its engine is gone. cl.restart() (%shard_cluster restart) starts new engines for every "
                f"rank.")

    # ------------------------------------------------------------------ ranks the controller let go
    def gone_ranks(self) -> dict[int, str]:
        """Ranks that can take no part in a process group any more: dead (how it ended) or lost (ipyparallel
        unregistered it; the state of its process)."""
        if self.closed:
            return {}
        gone = {r: f"dead, {how}" for r, how in self.processes.dead_ranks().items()}
        gone.update({r: f"lost to ipyparallel's heartbeat, its process {state}" for r, state in self.lost_ranks().items()})
        return gone

    def lost_ranks(self) -> dict[int, str]:
        """Ranks whose engine the controller unregistered while its process still exists (it stopped answering
        the heartbeat: stopped, or starved): rank -> the state of its process. One whose process ended is dead
        (``processes.dead_ranks``), not lost."""
        if self.closed:
            return {}
        registered = set(self.client.ids)
        lost = {}
        for rank, engine_id in enumerate(self.engine_ids):
            if engine_id not in registered:
                state = process_state(self.processes.pids.get(rank))
                if state is not None:
                    lost[rank] = state
        return lost

    def lost_message(self, lost: dict[int, str], what: str | None = None) -> str:
        """What happened to the ``lost`` ranks (``what``: while running it), and what ``restart()`` will do."""
        during = f" while running {what}" if what else ""
        who = "; ".join(f"rank {r} (pid {self.processes.pids.get(r)}) stopped answering ipyparallel's heartbeat "
                        f"for {HEARTBEAT_LIMIT_S:g} s{during}; its process is {state}" for r, state in sorted(lost.items()))
        return (f"{who}. The controller unregistered its engine, and ipyparallel never takes an unregistered engine "
                f"back, even once its process goes on: nothing can be sent to it any more. cl.restart() "
                f"(%shard_cluster restart) kills every engine, this one included, and starts new ones for every rank "
                f"(what the ranks held is lost).")

    def refuse_lost(self, ranks) -> None:
        """Raise RankLostError when one of ``ranks`` is lost (its engine cannot be reached any more)."""
        __tracebackhide__ = hide_own_frames()
        lost = {r: state for r, state in self.lost_ranks().items() if r in ranks}
        if lost:
            others = [r for r in range(self.n) if r not in lost and r not in self.processes.dead_ranks()]
            raise RankLostError(self.lost_message(lost) + (f" Ranks {others} still answer (targets={others})."
                                                           if others else ""), lost)

    def _after_loss(self, ar, ranks: list[int], lost: dict[int, str], what: str, display: bool) -> None:
        """A rank was unregistered while running ``ar``: release the others from any collective with it, collect
        what they did, raise RankLostError."""
        __tracebackhide__ = hide_own_frames()
        survivors = [r for r in ranks if r not in lost]
        if survivors:
            self.release(survivors)
        end = time.monotonic() + RELEASE_WAIT_S
        while time.monotonic() < end and any(r in survivors for r in self._unfinished(ar, ranks)):
            ar.wait(WAIT_SLICE_S)
        self.broken = BrokenGroup(f"{what}: " + "; ".join(f"rank {r} stopped answering ipyparallel's heartbeat"
                                                          for r in sorted(lost)))
        outputs = [o for o in self._outputs(ar, ranks, finished=False, partial=True) if o.rank not in lost]
        if display:
            show(outputs)
        message = self.lost_message(lost, what)
        failed = {o.rank: o.error for o in outputs if o.error}
        if failed:
            message += "\n\nWhat the other ranks raised:\n" + format_failures(failed, tracebacks=0)
        raise RankLostError(message, lost, outputs)

    def hang_report(self, timeout, finished, unfinished, what: str = "the cell", *, diagnose_timeout: float = 5.0,
                    failures=None) -> HangReport:
        """Where the ``unfinished`` ranks wait, after ``timeout`` seconds of ``what``, from each live rank's
        diagnosis (answered by its control thread within ``diagnose_timeout``); ``failures``: the ranks that
        raised meanwhile (rank -> RankFailure), which the report leads with."""
        gone = {**self.processes.dead_ranks(), **self.lost_ranks()}
        diagnoses = self.control.diagnose([r for r in range(self.n) if r not in gone], diagnose_timeout)
        return hang.build_report(timeout, finished, unfinished, diagnoses, self.processes.pids, what=what,
                                 failures=failures)

    def release(self, ranks=None) -> dict:
        """Every rank of ``ranks`` (None: every live rank) ends the collectives it waits in, answered by its
        control thread: its TCP connections to the other ranks shut, its NCCL communicators aborted. Rank ->
        what its control thread answered."""
        gone = {**self.processes.dead_ranks(), **self.lost_ranks()}
        pids = self.processes.pids
        answers = {}
        for rank in [r for r in (range(self.n) if ranks is None else ranks) if r not in gone]:
            peers = [pid for r, pid in pids.items() if r != rank]
            try:
                answers[rank] = self.control.request(rank, api.RELEASE_REQUEST, {"peer_pids": peers}, timeout=5.0)
            except ClusterError as exc:
                answers[rank] = {"status": "error", "evalue": str(exc)}
        return answers

    def view_of(self, ranks):
        __tracebackhide__ = hide_own_frames()
        self.refuse_lost(ranks)  # ipyparallel would raise KeyError for an unregistered engine
        view = self.client.direct_view([self.engine_ids[r] for r in ranks])
        view.block = False
        return view

    def check_open(self, what: str) -> None:
        """Raise ClusterError when the cluster was stopped or restarted (from another thread) while ``what``
        ran: its engines are gone on purpose, nothing sent before can be answered."""
        __tracebackhide__ = hide_own_frames()
        if self.closed:
            then = ("cl.start() starts new engines" if self.closed_by.startswith("stopped")
                    else "the new engines ran nothing of it")
            raise ClusterError(f"the cluster was {self.closed_by} while {what} ran: its engines were ended on "
                               f"purpose and its outcome is lost; {then}.")

    def check_controller(self) -> None:
        """Raise ClusterError when the controller process is gone: no call can be answered any more."""
        __tracebackhide__ = hide_own_frames()
        failure = self.processes.controller_failure()
        if failure:
            raise ClusterError(f"{failure}. Nothing sent to the engines can be answered any more: cl.restart() "
                               f"(%shard_cluster restart) rebuilds the cluster, cl.stop() ends it.")

    def busy_ranks(self) -> list[int]:
        """Live ranks whose engine is still running (or queued) work."""
        __tracebackhide__ = hide_own_frames()
        self.check_controller()
        gone = {**self.processes.dead_ranks(), **self.lost_ranks()}
        live = [r for r in range(self.n) if r not in gone]
        if not live:
            return []
        if not self.client.outstanding:
            # every request this client sent has its reply (only it sends work to these engines): the
            # controller's queue counts can lag a reply by a moment, so they are not asked
            return []
        targets = [self.engine_ids[r] for r in live]
        status = _bounded(lambda: self.client.queue_status(targets=targets, verbose=False), CONTROLLER_ANSWER_S,
                          f"the controller did not answer which ranks are busy within {CONTROLLER_ANSWER_S:g} s")
        return [r for r in live if status.get(self.engine_ids[r], {}).get("queue", 0)
                or status.get(self.engine_ids[r], {}).get("tasks", 0)]

    def check_not_stuck(self, ranks) -> None:
        """Refuse work for ranks still running a call that timed out: it would queue behind that call."""
        __tracebackhide__ = hide_own_frames()
        outstanding = self.client.outstanding
        for msg_id in list(self._stuck):
            if msg_id not in outstanding:
                del self._stuck[msg_id]
        blocked = sorted({r for r in self._stuck.values() if r in ranks})
        if blocked:
            raise ClusterError(
                f"ranks {blocked} are still running an earlier call that timed out; new work would queue behind "
                f"it. Call recover() (%shard_cluster recover) or restart() first")
        for msg_id in list(self._unwaited):
            if msg_id not in outstanding:
                del self._unwaited[msg_id]
        running = sorted({r for r in self._unwaited.values() if r in ranks})
        if running:
            raise ClusterError(
                f"ranks {running} are still running an earlier cell that nothing waits for (sent with %px "
                f"--noblock or Cluster.submit, or its wait was interrupted); new work would queue behind it and "
                f"spend its own time limit waiting. Wait for it with its handle's get() or %pxresult, or stop "
                f"it with recover() (%shard_cluster recover)")

    def check_group(self) -> None:
        """Refuse a cell while the process group is broken."""
        __tracebackhide__ = hide_own_frames()
        if self.broken is not None:
            raise ClusterError(self.broken.refusal(self.gone_ranks()))

    def forget_stuck(self) -> None:
        """The calls that timed out are over (their ranks were released)."""
        self._stuck.clear()
        self._unwaited.clear()

    def group_recovered(self) -> None:
        """A new process group is up on every rank."""
        self.broken = None
        self._stuck.clear()
        self._unwaited.clear()

    # ------------------------------------------------------------------ running
    def run(self, code: str, ranks: list[int], timeout: float | None, display: bool) -> list[RankOutput]:
        """Execute ``code`` on ``ranks``; each rank's output, in rank order."""
        __tracebackhide__ = hide_own_frames()
        self.check_group()
        self.check_not_stuck(ranks)
        self.check_controller()
        ar = _execute(self.view_of(ranks), code)
        with self.unwaited_if_interrupted(ar, ranks):
            return self.collect(ar, ranks, timeout, display=display, what="the cell")

    def submit(self, code: str, ranks: list[int], timeout: float | None) -> "PendingCell":
        """Send ``code`` to ``ranks`` and return at once: the cell's handle. Its time limit (``timeout``,
        default the cluster's) counts from now."""
        __tracebackhide__ = hide_own_frames()
        timeout = self.default_timeout if timeout is None else arguments.seconds("timeout", timeout)
        self.check_group()
        self.check_not_stuck(ranks)
        self.check_controller()
        ar = _execute(self.view_of(ranks), code)
        self._unwaited.update(zip(ar.msg_ids, ranks))
        return PendingCell(self, ar, ranks, timeout)

    def apply(self, fn, args: tuple, kwargs: dict, ranks: list[int], timeout: float | None, *,
              display: bool = True, what: str | None = None) -> list:
        """``fn(*args, **kwargs)`` on ``ranks``; results in rank order."""
        __tracebackhide__ = hide_own_frames()
        self.check_not_stuck(ranks)
        self.check_controller()
        ar = self.view_of(ranks).apply_async(fn, *args, **kwargs)
        what = what or f"{getattr(fn, '__name__', 'the call')}()"
        with self.unwaited_if_interrupted(ar, ranks):
            return [o.result for o in self.collect(ar, ranks, timeout, display=display, what=what)]

    def call(self, fn, *, ranks: list[int] | None = None, timeout: float | None = None, what: str, **kwargs) -> list:
        """``fn(**kwargs)`` on ``ranks`` (default: every rank): an engine API call the cluster makes for itself,
        not checked against stuck calls, nothing shown; results in rank order."""
        __tracebackhide__ = hide_own_frames()
        ranks = list(range(self.n)) if ranks is None else ranks
        self.check_controller()
        ar = self.view_of(ranks).apply_async(fn, **kwargs)
        with self.unwaited_if_interrupted(ar, ranks):
            return [o.result for o in self.collect(ar, ranks, timeout, display=False, what=what)]

    def queue_behind(self, fn, ranks: list[int], **kwargs) -> None:
        """``fn(**kwargs)`` on ``ranks``, queued behind what they run now, without waiting for it; remembered as
        unwaited work (new work for those ranks is refused until it is done, as after ``submit``)."""
        ar = self.view_of(ranks).apply_async(fn, **kwargs)
        self._unwaited.update(zip(ar.msg_ids, ranks))

    @contextlib.contextmanager
    def unwaited_if_interrupted(self, ar, ranks: list[int]):
        """A wait for ``ar`` that Ctrl-C ends leaves its ranks running it: they are remembered as running a cell
        nothing waits for, so that new work for them is refused at once (``check_not_stuck``, as after an
        interrupted ``%px``) instead of queueing behind it and spending its own time limit."""
        try:
            yield
        except KeyboardInterrupt:
            outstanding = self.client.outstanding
            self._unwaited.update({msg_id: r for r, msg_id in zip(ranks, ar.msg_ids) if msg_id in outstanding})
            raise

    def collect(self, ar, ranks: list[int], timeout: float | None, display: bool, what: str, *,
                sent_at: float | None = None, patience: float | None = None,
                live: "LiveOutput | None" = None) -> list[RankOutput]:
        """Wait for ``ar`` (one message per rank of ``ranks``, in that order) at most ``timeout`` seconds.

        ``sent_at``: when ``ar`` was sent (``time.monotonic()``); ``timeout`` counts from then (default: from
        now). ``patience``: stop waiting after this many seconds with ``CellStillRunningError`` while the
        ranks still run within ``timeout`` and nothing failed (nothing is reported or marked then).
        ``live``: prints the ranks' lines as they arrive."""
        __tracebackhide__ = hide_own_frames()
        timeout = self.default_timeout if timeout is None else arguments.seconds("timeout", timeout)
        t0 = time.monotonic() if sent_at is None else sent_at
        deadline = t0 + timeout
        give_up = None if patience is None else time.monotonic() + patience
        next_probe = time.monotonic()
        release = None  # (report, released ranks, seconds after the start) once ranks were released
        while True:
            until = deadline if give_up is None else min(deadline, give_up)
            finished_in_time = ar.wait(max(0.0, min(WAIT_SLICE_S, until - time.monotonic())))
            if live is not None:
                live.poll(ar)
            if finished_in_time:
                break
            self.check_open(what)
            self.check_controller()
            dead = {r: how for r, how in self.processes.dead_ranks().items() if r in ranks}
            if dead:
                self._after_death(ar, ranks, dead, what, display)
            self._check_lost(ar, ranks, what, display)
            now = time.monotonic()
            if now >= deadline:
                break
            impatient = give_up is not None and now >= give_up
            if release is None and (now >= next_probe or impatient):
                next_probe = now + PROBE_EVERY_S
                release = self._release_if_waiting_for_failed(ar, ranks, what, now - t0)
            if impatient and release is None:
                # ranks released from a collective finish within RELEASE_WAIT_S: their error is worth that wait
                failed = self._failures(ar, ranks)
                state = (f"{_first_failure(failed)}, and the others do not wait for it in a collective"
                         if failed else "nothing is wrong yet")
                raise CellStillRunningError(
                    f"ranks {self._unfinished(ar, ranks)} still run {what} after {patience:g} s of waiting "
                    f"({now - t0:.1f} s since it was sent; its time limit of {timeout:g} s ends in "
                    f"{deadline - now:.1f} s): {state}. get() waits again, up to that limit; wait(seconds) waits "
                    f"without raising")
        if finished_in_time:
            # an unregistered engine's call ends at once, with ipyparallel's "Engine 1 died"
            self._check_lost(ar, ranks, what, display, finished=True)
            ar.wait_for_output(OUTPUT_GRACE_S)
        outputs = self._outputs(ar, ranks, finished_in_time)
        if display:
            show(outputs)
        if finished_in_time:
            self._check_exited(ar, ranks, what, outputs)
        if not finished_in_time:
            unfinished = self._unfinished(ar, ranks)
            finished = [r for r in ranks if r not in unfinished]
            self._stuck.update({msg_id: r for r, msg_id in zip(ranks, ar.msg_ids) if msg_id in self.client.outstanding})
            report = self.hang_report(timeout, finished, unfinished, what, failures=self._failures(ar, ranks))
            if any(d.pending for d in report.ranks.values()) and self.broken is None:
                waiting = [r for r, d in sorted(report.ranks.items()) if d.pending]
                self.broken = BrokenGroup(
                    f"{what}: ranks {waiting} were left waiting in a collective after {timeout:g} s"
                    + (f" ({_first_failure(report.failures)})" if report.failures else ""))
            raise RankTimeoutError(report.format(), report)
        errors = {o.rank: o.error for o in outputs if o.error}
        if errors:
            raise self._rank_error(errors, ranks, what, release)
        return outputs

    # ------------------------------------------------------------------ failures
    def _check_lost(self, ar, ranks: list[int], what: str, display: bool, finished: bool = False) -> None:
        """Raise RankLostError when a rank of ``ar`` was unregistered before it answered (``finished``: only a rank
        whose answer is ipyparallel's own EngineError; one that answered first will be refused at the next call)."""
        __tracebackhide__ = hide_own_frames()
        lost = {r: state for r, state in self.lost_ranks().items() if r in ranks}
        if not lost:  # every round trip comes here: nothing more to look at
            return
        if finished:
            stranded = {r for r, value in zip(ranks, ar.get(0, return_exceptions=True))
                        if isinstance(value, Exception) and _failure(value).type_name == "EngineError"}
            lost = {r: state for r, state in lost.items() if r in stranded}
        if lost:
            self._after_loss(ar, ranks, lost, what, display)

    def _check_exited(self, ar, ranks: list[int], what: str, outputs: list[RankOutput]) -> None:
        """Ranks whose cell ended their kernel (``exit()`` / ``quit()``: the reply asks the client to let the
        kernel go, and the engine's process ends a moment later): wait for their processes to end, then raise
        RankDiedError, so that the cell itself says so and ``status()`` shows them dead at once."""
        __tracebackhide__ = hide_own_frames()
        exiting = [r for r, value in zip(ranks, ar.get(0, return_exceptions=True)) if _asked_to_exit(value)]
        if not exiting:
            return
        end = time.monotonic() + EXIT_WAIT_S
        dead = self.processes.dead_ranks()
        while any(r not in dead for r in exiting) and time.monotonic() < end:
            time.sleep(WAIT_SLICE_S)
            dead = self.processes.dead_ranks()
        lines = []
        for r in exiting:
            how = (f"its process {dead[r]}" if r in dead else
                   f"its process still runs {EXIT_WAIT_S:g} s later, shutting down")
            lines.append(f"rank {r} (pid {self.processes.pids.get(r)}) ended its engine: {what} called exit() or "
                         f"quit() there; {how}")
        self.broken = BrokenGroup(f"{what}: " + "; ".join(f"rank {r} exited (exit() in the cell)" for r in exiting))
        message = ("\n".join(lines) + ".\n\nIts engine is gone: cl.restart() (%shard_cluster restart) starts new "
                   "engines for every rank. (To stop the cell's work on a rank without ending it, raise an exception "
                   "instead.)")
        raise RankDiedError(message, {r: dead.get(r, "shutting down after exit()") for r in exiting},
                            [o for o in outputs if o.rank not in exiting])

    def _unfinished(self, ar, ranks: list[int]) -> list[int]:
        outstanding = self.client.outstanding
        return [r for r, msg_id in zip(ranks, ar.msg_ids) if msg_id in outstanding]

    def _failures(self, ar, ranks: list[int]) -> dict[int, RankFailure]:
        """The ranks of ``ar`` that already finished by raising, with their failure."""
        out = {}
        for rank, md in zip(ranks, ar.metadata):
            if md.get("status") == "error" and md.get("error") is not None:
                out[rank] = _failure(md["error"])
        return out

    def _release_if_waiting_for_failed(self, ar, ranks: list[int], what: str, elapsed: float):
        """When ranks raised and others wait for them in a collective, release those and return (report,
        released, elapsed); else None."""
        failed = self._failures(ar, ranks)
        if not failed:
            return None
        running = self._unfinished(ar, ranks)
        if not running:
            return None
        finished = [r for r in ranks if r not in running]
        report = self.hang_report(elapsed, finished, running, what, failures=failed, diagnose_timeout=2.0)
        waiting = [r for r in running if r in report.ranks and report.ranks[r].waits_for(failed)]
        if not waiting:
            return None
        self.release(None)
        self.broken = BrokenGroup(f"{what}: {_first_failure(failed)}; ranks {waiting} waited for it in a "
                                  f"collective and were released")
        end = time.monotonic() + RELEASE_WAIT_S
        while not ar.wait(WAIT_SLICE_S) and time.monotonic() < end:
            self.check_controller()
        return report, waiting, elapsed

    def _after_death(self, ar, ranks: list[int], dead: dict[int, str], what: str, display: bool) -> None:
        """A rank died: release the survivors from any collective with it, collect what they did, raise."""
        __tracebackhide__ = hide_own_frames()
        self.check_open(what)  # engines killed by a stop from another thread did not die
        survivors = [r for r in ranks if r not in dead]
        if survivors:
            try:
                self.release(survivors)
            except ClusterError:
                pass
        end = time.monotonic() + RELEASE_WAIT_S
        while time.monotonic() < end and any(r in survivors for r in self._unfinished(ar, ranks)):
            ar.wait(WAIT_SLICE_S)
        self.broken = BrokenGroup(f"{what}: " + "; ".join(f"rank {r} died ({how})" for r, how in sorted(dead.items())))
        outputs = [o for o in self._outputs(ar, ranks, finished=False, partial=True) if o.rank not in dead]
        if display:
            show(outputs)
        message = self.processes.describe_dead(dead, what)
        failed = {o.rank: o.error for o in outputs if o.error}
        if failed:
            message += "\n\nWhat the other ranks raised:\n" + format_failures(failed, tracebacks=0)
        message += "\n\n" + self.broken.refusal(self.gone_ranks()) + "."
        raise RankDiedError(message, dead, outputs)

    def _rank_error(self, errors: dict[int, RankFailure], ranks: list[int], what: str, release) -> RankError:
        """The RankError for ``errors``, leading with the ranks whose own failure started it."""
        comm = {r for r, f in errors.items() if is_comm_failure(f)}
        causes = {r: f for r, f in errors.items() if r not in comm} or errors
        released = release[1] if release is not None else []
        # every rank that raised failed in a collective by itself (gloo's own timeout): the cause is a rank that
        # never issued it, which the ranks' Flight Recorders tell
        unissued = self._unissued_collectives(errors) if release is None and comm == set(errors) else []
        lines = [format_failures(causes)]
        if unissued:
            lines = [".\n".join(u.describe() for u in unissued) + ".", "Then " + lines[0]]
        if release is not None:
            report, waited, elapsed = release
            where = []
            for r in waited:
                for p in report.ranks[r].pending[:1]:
                    where.append(f"rank {r} in {p.describe().splitlines()[0]}")
            after = {r: errors[r] for r in waited if r in errors}
            if after:
                how = f" (their collective then failed: {_first_line(next(iter(after.values())))})"
            else:  # NCCL: an aborted collective returns without an error
                how = (" (their collectives were aborted and returned without an error: what they computed after "
                       "that point is not valid)")
            lines.append(f"Ranks {waited} were waiting for {_ranks_text(causes)} in a collective; sharddbg released "
                         f"them {elapsed:.1f} s into {what}{how}:\n  " + "\n  ".join(where))
        elif set(causes) != set(errors):
            lines.append("Then " + "; ".join(f"rank {r}: {_first_line(errors[r])}" for r in sorted(comm)))
        n_failed = len(errors)
        lines.append(f"({n_failed} of {len(ranks)} ranks raised in {what}.)")
        if comm and self.broken is None:
            self.broken = BrokenGroup(f"{what}: {unissued[0].describe() if unissued else _first_failure(causes)}")
        if self.broken is not None:
            gone = self.gone_ranks()
            lines.append(self.broken.refusal(gone) + "." if gone else "The process group is broken now. " + RECOVERY_HINT)
        return RankError("\n\n".join(lines), errors, causes=causes, released=released,
                         report=release[0] if release is not None else None)

    def _unissued_collectives(self, errors: dict[int, RankFailure]) -> list[hang.UnissuedCollective]:
        """The collectives the ranks of ``errors`` failed in that other ranks never issued, from every live rank's
        Flight Recorder (answered by its control thread)."""
        gone = {**self.processes.dead_ranks(), **self.lost_ranks()}
        diagnoses = self.control.diagnose([r for r in range(self.n) if r not in gone], 2.0)
        return hang.unissued_collectives(diagnoses, errors)

    def _outputs(self, ar, ranks: list[int], finished: bool, partial: bool = False) -> list[RankOutput]:
        """Each rank's printed output, and its result or error where it finished (``partial``: some ranks
        may not have; their result stays None)."""
        # one value per message, an exception object where the rank raised
        values = ar.get(0, return_exceptions=True) if finished else [None] * len(ranks)
        outputs = []
        for rank, md, value in zip(ranks, ar.metadata, values):
            out = RankOutput(rank, stdout=md.get("stdout", ""), stderr=filter_noise(md.get("stderr", "")),
                             displays=list(md.get("outputs", [])))
            if partial and md.get("status") == "error" and md.get("error") is not None:
                value = md["error"]
            if isinstance(value, Exception):
                out.error = _failure(value)
            else:
                out.result = value
            execute_result = md.get("execute_result")
            if execute_result:
                out.result = execute_result.get("data", {}).get("text/plain", out.result)
            outputs.append(out)
        return outputs

    # ------------------------------------------------------------------ recovery
    def release_blocked(self, blocked: list[int], timeout: float) -> None:
        """Free ``blocked`` ranks: every rank ends the collectives it waits in (control thread: connections
        to its peers shut, NCCL communicators aborted); a rank still busy after that runs the user's code
        (a loop, a sleep) and is interrupted (SIGINT: KeyboardInterrupt in its cell). Raises when a rank
        stays busy even so."""
        __tracebackhide__ = hide_own_frames()
        self.release(None)
        still = self._wait_idle(min(timeout, RELEASE_WAIT_S))
        if still:
            self._interrupt(still)
            still = self._wait_idle(min(timeout, RELEASE_WAIT_S))
        if still:
            raise ClusterError(
                f"ranks {still} are still busy after they were released from their collectives and interrupted "
                f"(SIGINT): cl.restart() (%shard_cluster restart) replaces the engines")

    def _interrupt(self, ranks: list[int]) -> None:
        """SIGINT to the ranks' engines: the code running in their cell raises KeyboardInterrupt."""
        for rank in ranks:
            try:
                os.kill(self.processes.pids[rank], signal.SIGINT)
            except (KeyError, ProcessLookupError):
                continue

    def _wait_idle(self, timeout: float) -> list[int]:
        """Wait until no rank is busy, at most ``timeout`` seconds; the ranks still busy."""
        deadline = time.monotonic() + timeout
        busy = self.busy_ranks()
        while busy and time.monotonic() < deadline:
            time.sleep(0.05)
            busy = self.busy_ranks()
        return busy


class PendingCell:
    """A cell sent to the ranks without waiting for it (``Cluster.submit``, ``%px --noblock``), ipyparallel's
    AsyncResult in sharddbg's terms.

    Its time limit (``timeout``) counts from when it was sent, as for a cell that is waited for. ``wait(seconds)``
    waits at most that long and says whether the cell is over; ``get()`` waits until it is over (at most to the
    time limit), prints each rank's output once, in rank order, and returns the outputs or raises what ``run()``
    raises (``RankError``, ``RankTimeoutError`` past the limit with where every rank waits, ``RankDiedError``).
    A rank that raised while others wait for it in a collective gets them released, as in ``run()``. While the
    cell runs, new work for its ranks is refused (it would queue behind it).
    """

    def __init__(self, execution: RankExecution, ar, ranks: list[int], timeout: float):
        self.ranks = ranks
        self.timeout = timeout  # seconds, from sent_at
        self.sent_at = time.monotonic()
        self.groupby = "engine"  # how get() shows the output: one of GROUPINGS
        self.results = False  # get() also shows each rank's value of the cell's last expression
        self.stream = False  # waits print each rank's lines as they arrive, not in rank order at the end
        self._execution = execution
        self._ar = ar
        self._live: LiveOutput | None = None
        self._over_at: float | None = None
        self._outputs: list[RankOutput] = []
        self._error: Exception | None = None
        self._shown = False

    def __repr__(self) -> str:
        if self._over_at is None:
            state = f"running for {self.elapsed:.1f} s of its {self.timeout:g} s"
        else:
            state = "failed" if self._error is not None else "finished"
        return f"<PendingCell on ranks {self.ranks}: {state}>"

    @property
    def elapsed(self) -> float:
        """Seconds since the cell was sent (until it was over)."""
        return (self._over_at or time.monotonic()) - self.sent_at

    @property
    def shown(self) -> bool:
        """get() printed the output already (display_outputs() prints it again)."""
        return self._shown

    def done(self) -> bool:
        """Whether the cell is over: every rank finished it, or get() / wait() found it over.

        Over also means failed, or past its time limit. It never waits. ``ready()`` is the same method
        (ipyparallel's name).

        Returns
        -------
        bool
            True when every rank finished the cell, or a wait found it failed or past its time limit.

        Examples
        --------
        >>> cell = cl.submit("import time; time.sleep(5)")
        >>> cell.done()
        False
        >>> cell.wait()
        True
        >>> cell.done()
        True
        """
        return self._over_at is not None or self._ar.ready()

    ready = done  # ipyparallel's name

    def wait(self, timeout: float | None = None) -> bool:
        """Wait at most ``timeout`` seconds for the cell to be over; whether it is.

        Over: every rank finished, a rank failed or died, or the cell's time limit (counted from when it was sent)
        passed; get() then answers at once. A wait that ends while the ranks still run within their limit changes
        nothing and returns False. Meanwhile it does what ``run()`` does while it waits: ranks waiting in a
        collective for a rank that raised are released; past the time limit, where each rank waits is diagnosed
        (the ``RankTimeoutError`` get() raises) and new work for its ranks is refused until ``recover()``.
        Nothing is printed (with ``stream``, each rank's lines as they arrive); the cell's error is kept for
        get(), not raised here.

        Parameters
        ----------
        timeout : float or None
            Seconds to wait at most; None: up to the cell's time limit.

        Returns
        -------
        bool
            True when the cell is over (also when the cluster was stopped or restarted since it was sent), False
            when its ranks still run.

        Raises
        ------
        ClusterError
            ``timeout`` is not a finite number of seconds above 0.

        Examples
        --------
        >>> cell = cl.submit("import time; time.sleep(30)", timeout=60)
        >>> cell.wait(1)
        False
        >>> cell.wait()
        True
        """
        __tracebackhide__ = hide_own_frames()
        timeout = arguments.seconds("timeout", timeout, allow_none=True)
        if self._over_at is None:
            try:
                self._settle(timeout)
            except CellStillRunningError:
                return False
        return True

    def get(self, timeout: float | None = None) -> list[RankOutput]:
        """Wait until the cell is over; print each rank's output once; return the outputs or raise the cell's error.

        It waits at most ``timeout`` seconds (None: up to the cell's time limit); a shorter wait that ends first
        raises ``CellStillRunningError`` and changes nothing. The output is printed at the first get() only (also
        when the cell failed), in rank order, grouped as ``groupby`` says, with each rank's value of the cell's
        last expression when ``results`` is set (with ``stream``, the lines were printed as they came and are not
        printed again). A later get() returns the same outputs, or raises the same error, without printing.

        Parameters
        ----------
        timeout : float or None
            Seconds to wait at most; None: up to the cell's time limit.

        Returns
        -------
        list of RankOutput
            One per rank of the cell, in rank order (``rank``, ``stdout``, ``stderr``, ``result``, ``error``,
            ``displays``).

        Raises
        ------
        ClusterError
            ``timeout`` is not a finite number of seconds above 0; the cluster was stopped or restarted since the
            cell was sent (its outcome is lost); or the controller died.
        CellStillRunningError
            ``timeout`` ended before the cell, whose ranks still run within its time limit; get() or wait() again.
        RankError
            A rank raised (ranks that waited for it in a collective were released, as in ``run()``).
        RankTimeoutError
            A rank did not finish within the cell's time limit; its ``report`` says where each rank waits.
        RankDiedError
            A rank's process died while it ran the cell.

        Examples
        --------
        >>> cell = cl.submit("print(rank)")
        >>> outs = cell.get()
        [rank 0] 0
        [rank 1] 1
        [rank 2] 2
        [rank 3] 3
        >>> outs[2].stdout.strip()
        '2'
        """
        __tracebackhide__ = hide_own_frames()
        timeout = arguments.seconds("timeout", timeout, allow_none=True)
        if self._over_at is None:
            self._settle(timeout)
        if not self._shown:
            self._shown = True
            show(self._outputs, self.groupby, results=self.results, streams=self._live is None)
        if self._error is not None:
            raise self._error
        return self._outputs

    def display_outputs(self, groupby: str | None = None) -> None:
        """Print what every rank printed so far, in rank order.

        It can be called while the cell runs (the output up to now) and as often as wanted (get() prints once);
        when ``results`` is set, each finished rank's value of the cell's last expression is printed too.

        Parameters
        ----------
        groupby : str or None
            ``"engine"`` (each rank's output together), ``"type"`` (every rank's stdout, then every rank's stderr,
            then rich output, then values) or ``"order"`` (as ``"type"``, rich output collated); None: the cell's
            ``groupby``.

        Raises
        ------
        ClusterError
            ``groupby`` is not one of those.

        Examples
        --------
        >>> cell = cl.submit("print('started'); import time; time.sleep(30)")
        >>> cell.display_outputs()
        [rank 0] started
        [rank 1] started
        [rank 2] started
        [rank 3] started
        """
        outputs = self._outputs if self._over_at is not None else self._execution._outputs(
            self._ar, self.ranks, finished=False, partial=True)
        show(outputs, groupby or self.groupby, results=self.results)

    def _settle(self, patience: float | None) -> None:
        """Wait for the outcome (at most ``patience`` seconds, else CellStillRunningError) and keep it."""
        __tracebackhide__ = hide_own_frames()
        if self._execution.closed:
            error = ClusterError("the cluster this cell was sent to was stopped or restarted since: its outcome is "
                                 "lost")
            self._over(error, [])
            return
        if self.stream and self._live is None:
            self._live = LiveOutput(self.ranks)
        try:
            outputs = self._execution.collect(self._ar, self.ranks, self.timeout, False, "the cell",
                                              sent_at=self.sent_at, patience=patience, live=self._live)
        except CellStillRunningError:
            raise
        except Exception as exc:  # noqa: BLE001 - the cell's outcome, raised by get()
            # what every rank printed, the dead and the unfinished included
            self._over(exc, self._execution._outputs(self._ar, self.ranks, finished=self._ar.ready(), partial=True))
        else:
            self._over(None, outputs)
        if self._live is not None:
            self._live.poll(self._ar, final=True)

    def _over(self, error: Exception | None, outputs: list[RankOutput]) -> None:
        self._over_at = time.monotonic()
        self._error = error
        self._outputs = outputs


class LiveOutput:
    """Prints each rank's stdout and stderr as it arrives (``%px --stream``), every line prefixed with its rank;
    a line is printed once it is complete (or when the cell is over)."""

    def __init__(self, ranks: list[int]):
        self.ranks = ranks
        self.printed: dict[tuple[int, str], int] = {}  # (rank, stream name) -> characters printed so far

    def poll(self, ar, final: bool = False) -> None:
        """Print what arrived since the last poll (``final``: the unfinished last lines too)."""
        for rank, md in zip(self.ranks, ar.metadata):
            for name, sink, label in (("stdout", sys.stdout, f"[rank {rank}] "),
                                      ("stderr", sys.stderr, f"[rank {rank} stderr] ")):
                text = md.get(name) or ""
                start = self.printed.get((rank, name), 0)
                end = len(text) if final else text.rfind("\n", start) + 1
                if end > start:
                    chunk = text[start:end]
                    sink.write(_prefix(label, filter_noise(chunk) if name == "stderr" else chunk))
                    self.printed[(rank, name)] = end
        sys.stdout.flush()
        sys.stderr.flush()


def process_state(pid: int | None) -> str | None:
    """How the process ``pid`` is, in words ("stopped (SIGSTOP, or a debugger holds it)", "alive (sleeping)");
    None when it no longer runs."""
    import psutil

    if pid is None:
        return None
    try:
        status = psutil.Process(pid).status()
    except psutil.NoSuchProcess:
        return None
    if status in (psutil.STATUS_ZOMBIE, psutil.STATUS_DEAD):
        return None
    if status in (psutil.STATUS_STOPPED, psutil.STATUS_TRACING_STOP):
        return "stopped (SIGSTOP, or a debugger holds it)"
    return f"alive ({status})"


def _asked_to_exit(value) -> bool:
    """The reply of a cell that called exit() or quit(): IPython's "ask_exit" payload (ipyparallel keeps the
    reply's content, payload included, in its ExecuteReply)."""
    content = getattr(value, "_content", None)
    return isinstance(content, dict) and any(isinstance(p, dict) and p.get("source") == "ask_exit"
                                             for p in content.get("payload") or [])


def _failure(error) -> RankFailure:
    tb = getattr(error, "traceback", None) or ""
    return RankFailure(getattr(error, "ename", type(error).__name__), getattr(error, "evalue", str(error)),
                       _user_traceback(_strip_ansi(tb)))


def _first_line(f: RankFailure) -> str:
    """ "RuntimeError: Connection closed by peer [127.0.0.1]:16061" """
    return f"{f.type_name}: {short_message(f.message)}"


def _first_failure(failures: dict[int, RankFailure]) -> str:
    rank = min(failures)
    return failures[rank].headline(rank)


def _ranks_text(failures: dict) -> str:
    ranks = sorted(failures)
    return f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {ranks}"


def _bounded(fn, timeout: float, message: str):
    """``fn()`` in a helper thread, waited for at most ``timeout`` seconds (ClusterError ``message`` then)."""
    box: dict = {}

    def run():
        try:
            box["value"] = fn()
        except BaseException as exc:  # noqa: BLE001 - handed to the caller
            box["error"] = exc

    worker = threading.Thread(target=run, name="sharddbg-bounded-call", daemon=True)
    worker.start()
    worker.join(timeout)
    if worker.is_alive():
        raise ClusterError(message)
    if "error" in box:
        raise box["error"]
    return box["value"]


# How show() groups the ranks' output (ipyparallel's --group-outputs): "engine": each rank's whole output together;
# "type": every rank's stdout, then every rank's stderr, then rich outputs, then values; "order": as "type", with
# rich outputs collated (each rank's first, then each rank's second, ...). Ranks in rank order in every grouping.
GROUPINGS = ("engine", "type", "order")


def show(outputs: list[RankOutput], groupby: str = "engine", *, results: bool = False, streams: bool = True) -> None:
    """Print each rank's output in rank order, every line prefixed with its rank; publish rich outputs.

    ``groupby``: one of ``GROUPINGS``. ``results``: also each rank's value of the cell's last expression
    (``[rank 0 Out] 42``). ``streams=False``: leave stdout and stderr out (they were printed as they came)."""
    if groupby not in GROUPINGS:
        raise ClusterError(f"groupby must be one of {', '.join(GROUPINGS)}, got {groupby!r}")
    if groupby == "engine":
        for out in outputs:
            if streams:
                _write_streams(out)
            _publish(out.displays)
            if results:
                _write_result(out)
    else:
        if streams:
            for out in outputs:
                _write_streams(out, stderr=False)
            for out in outputs:
                _write_streams(out, stdout=False)
        if groupby == "type":
            for out in outputs:
                _publish(out.displays)
        else:
            for i in range(max((len(out.displays) for out in outputs), default=0)):
                _publish([out.displays[i] for out in outputs if i < len(out.displays)])
        if results:
            for out in outputs:
                _write_result(out)
    sys.stdout.flush()


def _write_streams(out: RankOutput, stdout: bool = True, stderr: bool = True) -> None:
    if stdout and out.stdout:
        sys.stdout.write(_prefix(f"[rank {out.rank}] ", out.stdout))
    if stderr and out.stderr:
        sys.stderr.write(_prefix(f"[rank {out.rank} stderr] ", out.stderr))


def _write_result(out: RankOutput) -> None:
    # a cell's value is the text IPython shows for its last expression (_outputs takes it from execute_result);
    # a cell without one has ipyparallel's reply object there instead
    if isinstance(out.result, str):
        sys.stdout.write(_prefix(f"[rank {out.rank} Out] ", out.result))


def _publish(displays: list) -> None:
    if not displays:
        return
    try:
        from IPython.display import publish_display_data
    except ImportError:
        return
    for item in displays:
        publish_display_data(item.get("data", {}), item.get("metadata", {}))


def _execute(view, code: str):
    """``view.execute(code)`` without waiting, the notebook's execution count of the cell sending it in the
    request's metadata: the ranks name their cell by it (``engine.recorder.cells``), not by their own count."""
    from ipyparallel import AsyncResult

    from ..engine.requests import NOTEBOOK_CELL_KEY  # not engine.recorder's: that package imports torch

    metadata = {"label": view.label, NOTEBOOK_CELL_KEY: _notebook_cell()}
    idents, targets = view.client._build_targets(view.targets)
    futures = [view.client.send_execute_request(view._socket, code, silent=False, ident=ident, metadata=metadata)
               for ident in idents]
    return AsyncResult(view.client, futures, fname="execute", targets=targets, owner=True)


def _notebook_cell() -> int | None:
    """The execution count (``In[n]``) of the notebook cell running now; None outside IPython (a plain script).

    The running cell's result holds its count: the shell's ``execution_count`` is already the next cell's
    while a cell runs (IPython counts up before running it)."""
    try:
        from IPython import get_ipython
    except ImportError:
        return None
    shell = get_ipython()
    if shell is None:
        return None
    running = getattr(getattr(shell, "displayhook", None), "exec_result", None)
    count = getattr(running, "execution_count", None)
    return count if isinstance(count, int) and not isinstance(count, bool) else None


def _strip_ansi(text) -> str:
    if isinstance(text, list):
        text = "\n".join(text)
    return _ANSI.sub("", text or "")


def _user_traceback(text: str) -> str:
    """Drop ipyparallel's own frame (the exec of an apply request) from an engine traceback."""
    blocks = re.split(r"\n(?=File |Cell In|Cell sent by)", text)
    kept = [b for b in blocks if "ipyparallel/engine/kernel.py" not in b.split("\n", 1)[0]
            and "Could not get source, probably due dynamically evaluated source code" not in b]
    if hide_own_frames():
        kept = [_one_line_if_library(b) for b in kept]
    return "\n".join(kept)


_LIBRARY_FRAME = re.compile(r"^File (?P<file>.+?):(?P<line>\d+), in (?P<function>[^(\n]+)")


def _one_line_if_library(block: str) -> str:
    """A library's frame (torch, physicsnemo, ...) of an engine traceback as one line, "file:line, in
    function", without its source around it: the user's frames stand out (``SHARDDBG_DEBUG=1``: as IPython
    showed it)."""
    from ..engine.frames import is_library_file

    m = _LIBRARY_FRAME.match(block)
    if m is None or not is_library_file(m["file"]):
        return block
    _frame, blank, rest = block.partition("\n\n")  # the last frame's block ends with the exception itself
    return f"File {m['file']}:{m['line']}, in {m['function'].strip()}" + (blank + rest if rest.strip() else "")


def _prefix(prefix: str, text: str) -> str:
    return "".join(f"{prefix}{line}\n" for line in text.splitlines())
