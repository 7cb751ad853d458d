"""Running code on the ranks: ``%px`` cells and ``sharddbg.engine.api`` calls, with bounded waits.

``RankExecution`` holds the ipyparallel client of a running cluster and its engines in rank order. It
runs a cell (``run``) or calls an engine API function (``apply``) on chosen ranks and waits in short
slices up to a timeout: a rank whose process died ends the wait at once (``ClusterError`` saying how it
died); a rank still running at the timeout gives a ``RankTimeoutError`` with the hang report, and its
call is remembered so that new work for it is refused instead of queueing behind it. Each rank's output
is collected as a ``RankOutput`` and shown in rank order; exceptions on ranks become one ``RankError``.

It uses ipyparallel's public API only; the control channel (answered while a rank is blocked) is
``control``.
"""

from __future__ import annotations

import re
import sys
import time
from dataclasses import dataclass, field
from typing import Callable

from ..engine import api
from ..errors import ClusterError, RankError, RankFailure, RankTimeoutError
from .hang import HangReport
from .processes import ClusterProcesses

# How often a wait looks for dead ranks.
WAIT_SLICE_S = 0.25
# Results can arrive before the ranks' last printed lines (iopub is a separate stream): wait this long for them.
OUTPUT_GRACE_S = 5.0

# Lines engines print that say nothing about the user's program.
_NOISE = [
    re.compile(r"Warp CUDA warning: Could not find or load the NVIDIA CUDA driver"),
    re.compile(r"FutureWarning: .*all_gather_tensor"),
    re.compile(r"^\s*warnings\.warn\($"),
    re.compile(r"^\s*(return )?funcol\.all_gather_tensor"),
]
_ANSI = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")


def filter_noise(text: str) -> str:
    """``text`` without the lines engines print that say nothing about the user's program."""
    return "".join(line for line in text.splitlines(keepends=True) if not any(p.search(line) for p in _NOISE))


@dataclass
class RankOutput:
    """What one rank printed and returned for one call."""

    rank: int
    stdout: str = ""
    stderr: str = ""
    result: object = None
    error: RankFailure | None = None
    displays: list = field(default_factory=list)  # rich outputs (display() calls), as IPython publishes them


# (timeout_s, finished ranks, unfinished ranks, what) -> the report a RankTimeoutError carries
HangReporter = Callable[[float, list, list, str], HangReport]


class RankExecution:
    """Code and engine API calls on the ranks of one running cluster, in rank order, with bounded waits."""

    def __init__(self, client, engine_ids: list[int], processes: ClusterProcesses, hang_report: HangReporter,
                 default_timeout: float):
        self.client = client
        self.engine_ids = engine_ids  # engine id of rank r at index r
        self.view = client.direct_view(engine_ids)  # every rank, in rank order
        self.view.block = False
        self.processes = processes
        self.hang_report = hang_report
        self.default_timeout = default_timeout
        self._stuck: dict[str, int] = {}  # message id -> rank, of calls that timed out and still run

    @classmethod
    def connect(cls, client, n: int, processes: ClusterProcesses, hang_report: HangReporter,
                default_timeout: float) -> "RankExecution":
        """Map ``client``'s engines to ranks by asking each its rank (registration order is not rank order)."""
        ranks = client[:].apply_async(api.rank).get(timeout=default_timeout)
        by_rank = dict(zip(ranks, client.ids))
        return cls(client, [by_rank[r] for r in range(n)], processes, hang_report, default_timeout)

    def close(self) -> None:
        try:
            self.client.close()
        except Exception:
            pass

    # ------------------------------------------------------------------ which ranks
    @property
    def n(self) -> int:
        return len(self.engine_ids)

    def ranks(self, targets) -> list[int]:
        """``targets`` (None: every rank; an int; or ranks) as a checked list of ranks."""
        if targets is None:
            return list(range(self.n))
        ranks = [targets] if isinstance(targets, int) else list(targets)
        bad = [r for r in ranks if not isinstance(r, int) or not 0 <= r < self.n]
        if bad:
            raise ClusterError(f"ranks {bad} do not exist; this cluster has ranks 0..{self.n - 1}")
        return ranks

    def view_of(self, ranks):
        view = self.client.direct_view([self.engine_ids[r] for r in ranks])
        view.block = False
        return view

    def busy_ranks(self) -> list[int]:
        """Ranks whose engine is still running (or queued) work."""
        status = self.client.queue_status(targets=self.engine_ids, verbose=False)
        return [r for r, eid in enumerate(self.engine_ids)
                if status.get(eid, {}).get("queue", 0) or status.get(eid, {}).get("tasks", 0)]

    def check_not_stuck(self, ranks) -> None:
        """Refuse work for ranks still running a call that timed out: it would queue behind that call."""
        outstanding = self.client.outstanding
        for msg_id in list(self._stuck):
            if msg_id not in outstanding:
                del self._stuck[msg_id]
        blocked = sorted({r for r in self._stuck.values() if r in ranks})
        if blocked:
            raise ClusterError(
                f"ranks {blocked} are still running an earlier call that timed out; new work would queue behind "
                f"it. Call recover() (%shard_cluster recover) or restart() first")

    def forget_stuck(self) -> None:
        """The calls that timed out are over (their ranks were released)."""
        self._stuck.clear()

    # ------------------------------------------------------------------ running
    def run(self, code: str, ranks: list[int], timeout: float | None, display: bool) -> list[RankOutput]:
        """Execute ``code`` on ``ranks``; each rank's output, in rank order."""
        self.check_not_stuck(ranks)
        ar = self.view_of(ranks).execute(code, silent=False, block=False)
        return self.collect(ar, ranks, timeout, display=display, what="the cell")

    def apply(self, fn, args: tuple, kwargs: dict, ranks: list[int], timeout: float | None, *,
              display: bool = True, what: str | None = None) -> list:
        """``fn(*args, **kwargs)`` on ``ranks``; results in rank order."""
        self.check_not_stuck(ranks)
        ar = self.view_of(ranks).apply_async(fn, *args, **kwargs)
        what = what or f"{getattr(fn, '__name__', 'the call')}()"
        return [o.result for o in self.collect(ar, ranks, timeout, display=display, what=what)]

    def call(self, fn, *args, ranks: list[int] | None = None, timeout: float | None = None, what: str) -> list:
        """An engine API call the cluster makes for itself: not checked against stuck calls, nothing shown."""
        ranks = list(range(self.n)) if ranks is None else ranks
        ar = self.view_of(ranks).apply_async(fn, *args)
        return [o.result for o in self.collect(ar, ranks, timeout, display=False, what=what)]

    def collect(self, ar, ranks: list[int], timeout: float | None, display: bool, what: str) -> list[RankOutput]:
        """Wait for ``ar`` (one message per rank of ``ranks``, in that order) at most ``timeout`` seconds."""
        timeout = self.default_timeout if timeout is None else float(timeout)
        # Wait in slices, so that a rank whose process died ends the wait at once instead of at the timeout.
        deadline = time.monotonic() + timeout
        while True:
            finished_in_time = ar.wait(max(0.0, min(WAIT_SLICE_S, deadline - time.monotonic())))
            if finished_in_time:
                break
            dead = self.processes.dead_ranks()
            if dead:
                raise ClusterError(self.processes.describe_dead(dead, what))
            if time.monotonic() >= deadline:
                break
        if finished_in_time:
            ar.wait_for_output(OUTPUT_GRACE_S)
        outputs = self._outputs(ar, ranks, finished_in_time)
        if display:
            show(outputs)
        if not finished_in_time:
            outstanding = self.client.outstanding
            unfinished = [r for r, msg_id in zip(ranks, ar.msg_ids) if msg_id in outstanding]
            finished = [r for r in ranks if r not in unfinished]
            self._stuck.update({msg_id: r for r, msg_id in zip(ranks, ar.msg_ids) if msg_id in outstanding})
            report = self.hang_report(timeout, finished, unfinished, what)
            raise RankTimeoutError(report.format(), report)
        errors = {o.rank: o.error for o in outputs if o.error}
        if errors:
            lines = [f"{len(errors)} of {len(ranks)} ranks raised in {what}:"]
            for rank, failure in sorted(errors.items()):
                lines.append(f"[rank {rank}] {failure.type_name}: {failure.message}")
            first_rank = min(errors)
            lines.append(f"\nTraceback on rank {first_rank}:\n{errors[first_rank].traceback}")
            raise RankError("\n".join(lines), errors)
        return outputs

    def _outputs(self, ar, ranks: list[int], finished: bool) -> list[RankOutput]:
        """Each rank's printed output, and when every rank finished, its result or error."""
        # one value per message, an exception object where the rank raised
        values = ar.get(0, return_exceptions=True) if finished else [None] * len(ranks)
        outputs = []
        for rank, md, value in zip(ranks, ar.metadata, values):
            out = RankOutput(rank, stdout=md.get("stdout", ""), stderr=filter_noise(md.get("stderr", "")),
                             displays=list(md.get("outputs", [])))
            if isinstance(value, Exception):
                tb = getattr(value, "traceback", None) or ""
                out.error = RankFailure(getattr(value, "ename", type(value).__name__),
                                        getattr(value, "evalue", str(value)), _user_traceback(_strip_ansi(tb)))
            else:
                out.result = value
            execute_result = md.get("execute_result")
            if execute_result:
                out.result = execute_result.get("data", {}).get("text/plain", out.result)
            outputs.append(out)
        return outputs

    # ------------------------------------------------------------------ recovery
    def release_blocked(self, blocked: list[int], timeout: float) -> None:
        """Free ``blocked`` ranks (waiting in a collective) by tearing the process group down on the others.

        The idle ranks shut their connections to the blocked ones first, so the pending collective fails
        at once ("Connection closed by peer"). Raises when the blocked ranks stay busy: they are not
        waiting in a collective.
        """
        idle = [r for r in range(self.n) if r not in blocked]
        blocked_pids = [self.processes.pids[r] for r in blocked]
        self.call(api.teardown, blocked_pids, ranks=idle, timeout=timeout, what="process-group teardown")
        deadline = time.monotonic() + timeout
        while self.busy_ranks() and time.monotonic() < deadline:
            time.sleep(0.05)
        still = self.busy_ranks()
        if still:
            raise ClusterError(
                f"ranks {still} are still busy after their peers released them: they are not waiting in a "
                f"collective. restart() replaces the engines")


def show(outputs: list[RankOutput]) -> None:
    """Print each rank's output in rank order, every line prefixed with its rank; publish rich outputs."""
    for out in outputs:
        if out.stdout:
            sys.stdout.write(_prefix(f"[rank {out.rank}] ", out.stdout))
        if out.stderr:
            sys.stderr.write(_prefix(f"[rank {out.rank} stderr] ", out.stderr))
        if out.displays:
            try:
                from IPython.display import publish_display_data

                for item in out.displays:
                    publish_display_data(item.get("data", {}), item.get("metadata", {}))
            except ImportError:
                pass
    sys.stdout.flush()


def _strip_ansi(text) -> str:
    if isinstance(text, list):
        text = "\n".join(text)
    return _ANSI.sub("", text or "")


def _user_traceback(text: str) -> str:
    """Drop ipyparallel's own frame (the exec of an apply request) from an engine traceback."""
    blocks = re.split(r"\n(?=File |Cell In)", text)
    kept = [b for b in blocks if "ipyparallel/engine/kernel.py" not in b.split("\n", 1)[0]
            and "Could not get source, probably due dynamically evaluated source code" not in b]
    return "\n".join(kept)


def _prefix(prefix: str, text: str) -> str:
    return "".join(f"{prefix}{line}\n" for line in text.splitlines())
