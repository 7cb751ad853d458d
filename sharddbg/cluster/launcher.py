"""Client side of the fork server (:mod:`sharddbg.cluster._zygote`): start it (it starts the controller
first thing), ask it to fork engines, to restart or stop the controller; hear which of its children ended."""

from __future__ import annotations

import json
import os
import queue
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass

from ..errors import ClusterError
from . import registry


def returncode_description(returncode: int) -> str:
    """How a process ended, from a ``Popen``-style return code (negative: the signal that killed it):
    "killed by signal 9 (SIGKILL)", "exited with status 1"."""
    if returncode < 0:
        sig = -returncode
        try:
            name = signal.Signals(sig).name
        except ValueError:
            name = "unknown signal"
        return f"killed by signal {sig} ({name})"
    return f"exited with status {returncode}"


@dataclass(frozen=True)
class ProcessExit:
    """A child of the fork server that ended: an engine (with its rank) or the controller."""

    role: str  # engine | controller
    pid: int
    rank: int | None
    returncode: int  # negative: killed by that signal

    @property
    def description(self) -> str:
        return returncode_description(self.returncode)


@dataclass(frozen=True)
class ControllerProcess:
    """The controller the fork server started: its pid, and the process group (and session) it leads."""

    pid: int
    group: int


class ForkServer:
    """One ``_zygote`` process. Its stdin is our lifeline: if this process dies, it kills the engines and
    the controller's process group.

    ``config`` may name the controller to start (``{"controller": {"argv": [...], "log": path, "env": {}}}``):
    it is started before the fork server imports anything (``wait_controller`` gives its pid); and
    ``cluster_id``, which goes onto the fork server's command line (``registry.cluster_id_arg``).
    """

    def __init__(self, config: dict, log_dir: str, python: str | None = None, env: dict | None = None):
        self.log_dir = log_dir
        self._replies: queue.Queue = queue.Queue()
        self._early: list[dict] = []  # replies that arrived while we waited for another one
        self.exited: list[ProcessExit] = []  # children that ended on their own, in order
        self._exit_heard = threading.Condition()
        self.cuda_initialized_at_fork: bool | None = None  # as the fork server reported at the last fork
        full_env = dict(os.environ)
        full_env.update(env or {})
        marker = [registry.cluster_id_arg(config["cluster_id"])] if config.get("cluster_id") else []
        stderr = registry.open_private(os.path.join(log_dir, "forkserver.log"))
        try:
            self.proc = subprocess.Popen(
                [python or sys.executable, "-m", "sharddbg.cluster._zygote", *marker, json.dumps(config)],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=stderr,
                env=full_env,
                start_new_session=True,  # Ctrl-C in the notebook must not reach it
            )
        finally:
            os.close(stderr)
        self._reader = threading.Thread(target=self._read, name="sharddbg-forkserver-reader", daemon=True)
        self._reader.start()

    @property
    def pid(self) -> int:
        return self.proc.pid

    def alive(self) -> bool:
        return self.proc.poll() is None

    def _read(self) -> None:
        for line in self.proc.stdout:
            try:
                msg = json.loads(line)
            except ValueError:
                continue
            if msg.get("event") == "exited":
                with self._exit_heard:
                    self.exited.append(ProcessExit(msg["role"], int(msg["pid"]), msg.get("rank"), int(msg["returncode"])))
                    self._exit_heard.notify_all()
            else:
                self._replies.put(msg)
        self._replies.put({"event": "eof"})
        with self._exit_heard:
            self._exit_heard.notify_all()

    def exit_of(self, pid: int, wait_s: float = 0.0) -> ProcessExit | None:
        """How child ``pid`` ended, as the fork server saw it; waits up to ``wait_s`` for the report (the
        fork server reports an exit a moment after the process is gone). None if not (yet) reported."""
        deadline = time.monotonic() + wait_s
        with self._exit_heard:
            while True:
                for event in reversed(self.exited):
                    if event.pid == pid:
                        return event
                left = deadline - time.monotonic()
                if left <= 0 or not self.alive():
                    return None
                self._exit_heard.wait(left)

    def _expect(self, event: str, timeout: float) -> dict:
        for msg in self._early:
            if msg.get("event") == event:
                self._early.remove(msg)
                return msg
        deadline = time.monotonic() + timeout
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise ClusterError(
                    f"the fork server (pid {self.pid}) did not answer {event!r} within {timeout:.0f} s; "
                    f"see {os.path.join(self.log_dir, 'forkserver.log')}"
                )
            try:
                msg = self._replies.get(timeout=left)
            except queue.Empty:
                continue
            if msg.get("event") == event:
                return msg
            if msg.get("event") in ("error", "eof"):
                if msg.get("event") == "eof":
                    self._replies.put(msg)  # every later wait hears it too
                detail = msg.get("traceback") or msg.get("message") or "it exited"
                raise ClusterError(
                    f"the fork server (pid {self.pid}) failed while waiting for {event!r}: {detail}\n"
                    f"(log: {os.path.join(self.log_dir, 'forkserver.log')})"
                )
            self._early.append(msg)

    def wait_ready(self, timeout: float) -> dict:
        """The facts the fork server reports once its imports are done (GPU count, versions, timings)."""
        return self._expect("ready", timeout)

    def _send(self, **cmd) -> None:
        try:
            self.proc.stdin.write((json.dumps(cmd) + "\n").encode())
            self.proc.stdin.flush()
        except (BrokenPipeError, ValueError) as exc:
            raise ClusterError(f"the fork server (pid {self.pid}) is gone: {exc}") from exc

    def fork(self, ranks, engine_argv, env, timeout: float = 30.0) -> dict[int, int]:
        """Fork one engine per rank; rank -> pid. ``cuda_initialized_at_fork`` tells whether CUDA was
        initialised in the fork server then (it never should be)."""
        self._send(cmd="fork", ranks=list(ranks), engine_argv=list(engine_argv), env=env, log_dir=self.log_dir)
        reply = self._expect("forked", timeout)
        self.cuda_initialized_at_fork = bool(reply.get("cuda_initialized"))
        return {int(r): int(p) for r, p in reply["pids"].items()}

    def wait_controller(self, timeout: float = 30.0) -> ControllerProcess:
        """The controller the fork server started (from its config, or on ``start_controller``)."""
        reply = self._expect("controller_started", timeout)
        return ControllerProcess(int(reply["pid"]), int(reply["group"]))

    def start_controller(self, timeout: float = 30.0) -> ControllerProcess:
        """Start the controller again (the one of the config); the previous one must have been stopped."""
        self._send(cmd="start_controller")
        return self.wait_controller(timeout)

    def stop_controller(self, timeout: float = 15.0) -> ProcessExit | None:
        """SIGTERM to the controller's process group, SIGKILL to what is left a moment later. Returns how
        the controller ended (None if there was none); also when it had died already."""
        self._send(cmd="stop_controller")
        reply = self._expect("controller_stopped", timeout)
        if reply.get("pid") is None:
            return None
        return ProcessExit("controller", int(reply["pid"]), None, int(reply["returncode"]))

    def kill_engines(self, timeout: float = 10.0) -> list[int]:
        self._send(cmd="kill_engines")
        return self._expect("killed", timeout)["pids"]

    def close(self, timeout: float = 5.0) -> None:
        """Ask it to end everything and exit; kill it if it does not."""
        if self.proc.poll() is None:
            try:
                self._send(cmd="exit")
            except ClusterError:
                pass
            try:
                self.proc.stdin.close()
            except OSError:
                pass
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)
