"""``JobRecording``: the recording of one process of a recorded job, from its start to its exit.

- **Window** (``--steps A:B``): steps are counted from ``optimizer.step()`` calls (step k ends when the k-th
  returns, and step k+1 begins at once), or from the user's ``with sharddbg.recording():`` blocks where the
  job has them (block k is step k: the recording runs from the start of block A to the end of block B). The
  recorder is installed when step A begins and removed when step B ends: outside the window nothing of
  sharddbg runs but one counter per optimizer step.
- **Clock**: when ``torch.distributed.init_process_group`` returns, each rank takes its clock against rank 0's
  through the group's own store (no collective) and writes it into its stream: known where the two read one
  monotonic clock (rank 0's host), else measured by a few round trips.
- **Hangs**: a background thread flushes the stream every ``flush_every_s`` and watches the collectives in
  flight; one not done after ``hang_after_s`` makes the rank write where it is (stack, Flight Recorder,
  groups) and leave a marker in the job's folder, on which every other rank writes where it is too. The job
  goes on as it would have (the collective may still complete, or time out).
- **Exit**: at interpreter exit, on an exception that ends the script (``sys.excepthook``) and on SIGTERM
  (torchrun's way to stop the other workers when one fails; only when the job has no handler of its own),
  the stream is flushed a last time and ended.
"""

from __future__ import annotations

import atexit
import json
import os
import signal
import sys
import threading
import time
import traceback

from ... import job_files
from ...options import RecordingOptions
from .. import clock
from ..rank_state import STATE
from .settings import JobSettings
from .stream import RankStreamWriter, header

_job: "JobRecording | None" = None  # this process's recording, when it records


def current() -> "JobRecording | None":
    """This process's job recording, or None (not a recorded job, or not a recording process)."""
    return _job


class JobRecording:
    """One recording process of a job: its recorder, its stream, its background thread."""

    def __init__(self, settings: JobSettings, rank: int, world_size: int, local_rank: int | None) -> None:
        self.settings = settings
        self.rank = rank
        self.world_size = world_size
        self.local_rank = local_rank
        self.options = RecordingOptions.from_dict(settings.options)
        self.recorder = None
        self.step = 1  # the optimizer step running now (1-based)
        self.blocks_seen = False  # the job marks its steps with sharddbg.recording() blocks
        self.window_done = False
        self.ended = False
        self.stream = RankStreamWriter(os.path.join(settings.out, job_files.rank_file_name(rank)), rank)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._hang_written: set[int] = set()  # seqs of the collectives a hang diagnosis was written for
        self._marker_seen: set[str] = set()
        self._last_flush = 0.0
        self._undo: list = []
        # the hang watch: a collective is hung when it is not done after hang_after_s and the rank recorded
        # nothing since (an async collective left unwaited while the rank works on is not a hang)
        self._buffer_size = -1
        self._progress_ns = 0
        self._sigterm_fd: int | None = None  # wakes the background thread when SIGTERM arrives
        self._end_lock = threading.Lock()
        self._ended_fully = threading.Event()  # set when the last flush is written, by whichever thread wrote it
        self._ending_thread: int | None = None
        self._die_after_end = False  # SIGTERM came while this thread wrote the last flush: die once it is written
        # sharddbg's own CPU time in this process, written at the end (the bench reads what being ready costs
        # outside a window): the background thread's, and the main thread's in the step hook
        self.watch_cpu_ns = 0
        self.step_hook_cpu_ns = 0

    # ---- start -----------------------------------------------------------------------------------------
    def start(self) -> None:
        """Write the stream's header, hook the process's life, start recording unless a window waits."""
        from ..recorder.recording import Recorder

        STATE.rank, STATE.world_size = self.rank, self.world_size
        probe = Recorder(self.options, shard_tensor_when_imported=True)
        from ..recorder import export

        meta = export.payload(probe, [], False)["meta"]
        if not self.stream.write_lines([header(self.settings, self.rank, self.world_size, self.local_rank, meta,
                                                clock.now_ns())]):
            self._writing_failed()
            return
        self._hook_init_process_group()
        self._hook_optimizer_steps()
        atexit.register(self.end, "normal")
        self._hook_excepthook()
        self._hook_sigterm()
        if self._in_window(self.step):
            self._start_recorder()
        self._thread = threading.Thread(target=self._watch, name="sharddbg-job-stream", daemon=True)
        self._thread.start()

    def _start_recorder(self) -> None:
        from ..recorder.recording import Recorder

        if self.recorder is not None or self.window_done:
            return
        rec = Recorder(self.options, shard_tensor_when_imported=True)
        rec.__enter__()
        self.recorder = rec
        self._step_marker()

    def _stop_recorder(self) -> None:
        rec = self.recorder
        if rec is None or not rec.running:
            return
        try:
            rec.close()
        except Exception:  # noqa: BLE001 - restoring a hook failed: the events are kept all the same
            rec.internal_errors.append(traceback.format_exc())

    # ---- steps -----------------------------------------------------------------------------------------
    def _in_window(self, step: int) -> bool:
        steps = self.settings.steps
        return steps is None or steps[0] <= step <= steps[1]

    def _step_marker(self) -> None:
        rec = self.recorder
        if rec is None or not rec.running:
            return
        self.stream.queue({"event": {"kind": "meta", "seq": next(rec.seq), "name": "step", "t_ns": clock.now_ns(),
                                     "data": {"step": self.step}}})

    def step_ended(self, from_block: bool = False) -> None:
        """Step ``self.step`` ended (an optimizer step returned, or a recording() block was left)."""
        if self.blocks_seen and not from_block:
            return  # the job's blocks count the steps
        steps = self.settings.steps
        if steps is not None and self.step >= steps[1] and self.recorder is not None:
            self._stop_recorder()
            self.window_done = True
            self.flush()
        self.step += 1
        if from_block:
            return  # the next step begins with the next block
        if self._in_window(self.step) and not self.window_done:
            if self.recorder is None:
                self._start_recorder()
            else:
                self._step_marker()

    def block_entered(self) -> None:
        """A ``sharddbg.recording()`` block begins step ``self.step`` (the first block is step 1: from then on
        the blocks count the steps, not the optimizer)."""
        if not self.blocks_seen:
            self.blocks_seen = True
            self.step = 1
        if not self._in_window(self.step) or self.window_done:
            return
        if self.recorder is None:
            self._start_recorder()
        else:
            self._step_marker()

    def _hook_optimizer_steps(self) -> None:
        try:
            from torch.optim.optimizer import register_optimizer_step_post_hook
        except ImportError:
            return
        def optimizer_stepped(optimizer, args, kwargs) -> None:
            t0 = time.thread_time_ns()
            self.step_ended()
            self.step_hook_cpu_ns += time.thread_time_ns() - t0

        handle = register_optimizer_step_post_hook(optimizer_stepped)
        self._undo.append(handle.remove)

    # ---- the process group: clock -------------------------------------------------------------------
    def _hook_init_process_group(self) -> None:
        import torch.distributed as dist

        from ..recorder.undo import UndoLog

        original = dist.init_process_group
        original_destroy = dist.destroy_process_group
        job = self

        def destroy_process_group(*args, **kwargs):
            # format what was recorded while the meshes it names still resolve (physicsnemo destroys the
            # group in its own exit handler, before this process's last flush)
            if job.recorder is not None and (not args or args[0] is None) and not kwargs.get("group"):
                job.flush()
            return original_destroy(*args, **kwargs)

        def init_process_group(*args, **kwargs):
            result = original(*args, **kwargs)
            try:
                job.measure_clock()
            except Exception as e:  # noqa: BLE001 - the clock stays unaligned; the job goes on
                job.stream.write_lines([{"clock": {"offset_ns": 0, "uncertainty_ns": None,
                                                   "error": f"{type(e).__name__}: {e}"}}])
            return result

        init_process_group.__wrapped__ = original  # type: ignore[attr-defined]
        init_process_group.__doc__ = original.__doc__
        undo = UndoLog()
        destroy_process_group.__wrapped__ = original_destroy  # type: ignore[attr-defined]
        destroy_process_group.__doc__ = original_destroy.__doc__
        undo.replace_globals([(original, init_process_group), (original_destroy, destroy_process_group)],
                             package="torch.distributed")
        self._undo.append(undo.restore)

    def measure_clock(self, rounds: int = 5, timeout_s: float = 10.0) -> None:
        """This rank's clock against rank 0's through the default group's store, written as a ``clock`` line.

        Rank 0 says which monotonic clock it reads (``clock.reading()``). A rank that reads the same one (rank 0's
        host: one boot, one time namespace) knows its offset exactly, what the two sharddbg clocks add to it
        (uncertainty 0); any other is measured: rank 0 answers each such rank's pings in rank order, and the best
        round trip of ``rounds`` is kept."""
        from datetime import timedelta

        import torch.distributed as dist

        if not dist.is_initialized():
            return
        rank, world = dist.get_rank(), dist.get_world_size()
        STATE.rank, STATE.world_size = rank, world
        STATE.group_created_ns = time.time_ns()
        store = dist.distributed_c10d._get_default_store()
        prefix = f"sharddbg/clock/{self.settings.run_id}"
        wait = timedelta(seconds=timeout_s)
        if rank == 0:
            store.set(f"{prefix}/reference", json.dumps(clock.reading()))
            for other in range(1, world):
                store.wait([f"{prefix}/{other}/how"], wait)
                if store.get(f"{prefix}/{other}/how") == b"known":
                    continue
                for i in range(rounds):
                    store.wait([f"{prefix}/{other}/ping/{i}"], wait)
                    store.set(f"{prefix}/{other}/pong/{i}", str(clock.now_ns()))
            self.stream.write_lines([{"clock": {"offset_ns": 0, "uncertainty_ns": 0, "reference_rank": 0}}])
            return
        store.wait([f"{prefix}/reference"], wait)
        # rank 0's reading was made before this rank read it
        reference_added = clock.added_on_this_clock(json.loads(store.get(f"{prefix}/reference")), None,
                                                    time.monotonic_ns())
        if reference_added is not None:
            store.set(f"{prefix}/{rank}/how", "known")
            self.stream.write_lines([{"clock": {"offset_ns": clock.reading()["injected_offset_ns"] - reference_added,
                                                "uncertainty_ns": 0, "reference_rank": 0}}])
            return
        store.set(f"{prefix}/{rank}/how", "measured")
        best = None
        for i in range(rounds):
            t0 = clock.now_ns()
            store.set(f"{prefix}/{rank}/ping/{i}", "1")
            store.wait([f"{prefix}/{rank}/pong/{i}"], wait)
            t1 = clock.now_ns()
            t_ref = int(store.get(f"{prefix}/{rank}/pong/{i}"))
            half = (t1 - t0) // 2
            if best is None or half < best[1]:
                best = ((t0 + t1) // 2 - t_ref, half)
        self.stream.write_lines([{"clock": {"offset_ns": int(best[0]), "uncertainty_ns": int(best[1]),
                                           "reference_rank": 0}}])

    # ---- the background thread: flushes and hangs --------------------------------------------------
    def flush(self) -> None:
        rec = self.recorder
        if rec is None or self.stream.failed is not None:
            return
        if not self.stream.flush(rec, self.step):
            self._writing_failed()
        self._last_flush = time.monotonic()

    def _writing_failed(self) -> None:
        rec = self.recorder
        if rec is not None:
            rec.running = False  # every hook passes through from now on; they are put back at exit
        print(f"sharddbg: recording stopped on rank {self.rank}: writing {self.stream.path} failed "
              f"({self.stream.failed}); the job goes on unrecorded", file=sys.stderr, flush=True)

    def _watch(self) -> None:
        import select

        period = min(0.2, self.settings.flush_every_s / 2)
        while not self._stop.is_set():
            self.watch_cpu_ns = time.thread_time_ns()  # this thread's CPU time so far (it started at 0)
            woken = []
            try:
                if self._sigterm_fd is not None:
                    woken = select.select([self._sigterm_fd], [], [], period)[0]
                else:
                    self._stop.wait(period)
            except (OSError, ValueError):
                self._stop.wait(period)
            if woken:
                try:
                    numbers = os.read(self._sigterm_fd, 64)
                except OSError:
                    numbers = b""
                if signal.SIGTERM in numbers:  # other signals with a Python handler (Ctrl-C) write here too
                    self._sigterm_from_watch()
                    return
                continue
            try:
                # never more than flush_every_s between two flushes, though the wait may wake a little late
                if time.monotonic() - self._last_flush >= self.settings.flush_every_s - period:
                    self.flush()
                self._check_hang()
            except Exception:  # noqa: BLE001 - the watch must not die; the job never sees it
                rec = self.recorder
                if rec is not None:
                    rec.internal_errors.append(traceback.format_exc())

    def _check_hang(self) -> None:
        rec = self.recorder
        if rec is None or self.stream.failed is not None:
            return
        now = clock.now_ns()
        limit = int(self.settings.hang_after_s * 1e9)
        if any(ev.error is not None for ev in self.stream.pending_collectives()):
            self.flush()  # a collective failed (its timeout, a peer gone): on disk now, before what follows it
        size = len(rec.buffer) + rec.dropped
        if size != self._buffer_size:  # the rank made progress: nothing it waits in is a hang yet
            self._buffer_size, self._progress_ns = size, now
        if now - self._progress_ns < limit or not _main_thread_in_torch_distributed():
            return self._answer_markers()
        for ev in self.stream.pending_collectives():
            if ev.seq in self._hang_written or ev.t_done_ns is not None or ev.error is not None:
                continue
            if now - ev.t_issue_ns < limit:
                continue
            self._hang_written.add(ev.seq)
            self.flush()  # the events before it first: the report names what ran last
            self._write_diagnosis("hang", ev)
            self._leave_marker(ev)
            return
        self._answer_markers()

    def _leave_marker(self, ev) -> None:
        name = f".hang-rank{self.rank}-seq{ev.seq}"
        self._marker_seen.add(name)
        try:
            with open(os.path.join(self.settings.out, name), "w") as f:
                f.write(f"rank {self.rank} waits in collective seq {ev.seq} since {ev.t_issue_ns}\n")
        except OSError:
            pass

    def _answer_markers(self) -> None:
        try:
            names = [n for n in os.listdir(self.settings.out) if n.startswith(".hang-")]
        except OSError:
            return
        new = [n for n in names if n not in self._marker_seen]
        if new:
            self._marker_seen.update(new)
            self.flush()
            self._write_diagnosis("hang_elsewhere", None)

    def _write_diagnosis(self, why: str, ev) -> None:
        from .. import control

        report = {"why": why, "t_ns": clock.now_ns(), "rank": self.rank, "pid": os.getpid(),
                  "stack": control.main_thread_stack(), "flight_recorder": control.flight_recorder(),
                  "groups": control.process_groups(), "mesh_dims": control.mesh_dim_names(), "step": self.step}
        rec = self.recorder
        if rec is not None:  # the recorder knows which mesh dim each group serves (no sharddbg mesh in a job)
            for name, info in list(rec.collectives.groups.items()):
                if info.mesh_dim:
                    report["mesh_dims"].setdefault(str(name), info.mesh_dim)
        if ev is not None:
            report["collective_seq"] = ev.seq
            report["hang_after_s"] = self.settings.hang_after_s
        if rec is not None:
            from ..recorder import export

            collectives = [export.record_of(c, rec, None) for c in list(rec.buffer)[-200:]
                           if type(c).__name__ == "CollectiveEvent"]
            report["recording"] = {"events": collectives}
        self.stream.write_lines([{"diagnosis": report}])

    # ---- the end ---------------------------------------------------------------------------------------
    def _hook_excepthook(self) -> None:
        original = sys.excepthook
        job = self

        def excepthook(exc_type, exc, tb):
            try:
                rec = job.recorder
                if rec is not None and rec.running:
                    from ..recorder import cell_errors

                    cell_errors.record(rec, exc)
                job.end("exception")
            except Exception:  # noqa: BLE001 - the user's traceback is printed whatever happens here
                pass
            return original(exc_type, exc, tb)

        sys.excepthook = excepthook

    def _hook_sigterm(self) -> None:
        """On SIGTERM: the last flush, then the default action (the process ends by SIGTERM, as without
        sharddbg). Python runs a handler only between bytecodes of the main thread, and torchrun's SIGTERM often
        finds it inside a collective that will not return: the signal also wakes the background thread (through
        a wakeup fd), which ends the stream itself."""
        if threading.current_thread() is not threading.main_thread():
            return
        if signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL:
            return  # the job handles SIGTERM itself: left alone

        def on_sigterm(signum, frame):
            self._sigterm_from_watch()

        signal.signal(signal.SIGTERM, on_sigterm)
        try:
            read_fd, write_fd = os.pipe()
            os.set_blocking(write_fd, False)
            previous = signal.set_wakeup_fd(write_fd, warn_on_full_buffer=False)
            if previous != -1:  # someone else's wakeup fd (an event loop): theirs stays
                signal.set_wakeup_fd(previous)
                os.close(read_fd)
                os.close(write_fd)
            else:
                self._sigterm_fd = read_fd
        except (OSError, ValueError):
            pass

    def _sigterm_from_watch(self) -> None:
        """SIGTERM arrived: end the stream, then die of it as the job would have. The signal reaches both
        threads (the main thread's handler and the background thread's wakeup fd): whichever comes second waits
        for the first one's last flush, so neither kills the process while the other still writes."""
        if self._ending_thread == threading.get_ident():
            # the handler interrupted this very thread's last flush: it dies once that flush is written
            self._die_after_end = True
            return
        try:
            self.end("SIGTERM")
        finally:
            self._ended_fully.wait(timeout=10.0)
            _die_of_sigterm()

    def end(self, how: str) -> None:
        """The last flush: stop recording, write every event kept, the end line; once (from whichever thread
        comes first: the main thread at exit, the background thread on SIGTERM)."""
        with self._end_lock:
            if self.ended:
                return
            self.ended = True
            self._ending_thread = threading.get_ident()
        self._stop.set()
        rec = self.recorder
        try:
            if rec is not None:
                self._stop_recorder()
                if self.stream.failed is None:
                    self.stream.flush(rec, self.step, final=True)
            if self.stream.failed is None:
                self._write_diagnosis("end", None)
                from ..recorder import export

                meta = export.payload(rec, [], True)["meta"] if rec is not None else {}
                self.stream.write_lines([{"end": {
                    "exit": how, "t_ns": clock.now_ns(), "step": self.step,
                    "dropped": rec.dropped if rec is not None else 0, "meta": meta,
                    "clock": {"t_stop_ns": rec.t_stop_ns if rec is not None else None},
                    "recorded": rec is not None, "largest_flush_ms": round(self.stream.largest_flush_ms, 3),
                    "largest_piece_ms": round(self.stream.largest_piece_ms, 3),
                    "sharddbg_cpu_ms": {"background": round(self.watch_cpu_ns / 1e6, 3),
                                        "step_hook": round(self.step_hook_cpu_ns / 1e6, 3)},
                }}])
        finally:
            for undo in reversed(self._undo):
                try:
                    undo()
                except Exception:  # noqa: BLE001
                    pass
            self.stream.close()
            self._ended_fully.set()
            if self._die_after_end:
                _die_of_sigterm()


def _die_of_sigterm() -> None:
    """End the process by SIGTERM's default action, as it would have ended without sharddbg. Python lets only
    the main thread set a handler, and the background thread ends the stream while the main thread may wait
    in a collective forever: that thread sets the default action through the C library."""
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
    else:
        import ctypes

        try:
            ctypes.CDLL(None).signal(int(signal.SIGTERM), ctypes.c_void_p(0))  # 0 is SIG_DFL
        except (OSError, AttributeError):
            os._exit(128 + int(signal.SIGTERM))
    os.kill(os.getpid(), signal.SIGTERM)


_DISTRIBUTED = f"{os.sep}torch{os.sep}distributed{os.sep}"


def _main_thread_in_torch_distributed() -> bool:
    """The main thread runs torch.distributed's code now (a collective's call or its wait): a rank that sleeps or
    computes with an unwaited collective pending is not stuck in it."""
    frame = sys._current_frames().get(threading.main_thread().ident)
    for _ in range(4):  # its innermost frames: the C call of the collective returns to one of these
        if frame is None:
            return False
        if _DISTRIBUTED in frame.f_code.co_filename:
            return True
        frame = frame.f_back
    return False


def start(settings: JobSettings, rank: int, world_size: int, local_rank: int | None) -> JobRecording:
    """Start this process's job recording (once)."""
    global _job
    if _job is None:
        _job = JobRecording(settings, rank, world_size, local_rank)
        _job.start()
    return _job
