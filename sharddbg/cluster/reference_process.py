"""The process that runs a check's or a diff's unsharded reference (``sharddbg.engine.reference``).

Each reference is a fresh process forked from a warm Python (``python -m sharddbg.engine.reference --serve``)
that has already imported torch, so a check does not wait seconds for torch's import. One warm Python per
cluster, started by this (the client's) process when the cluster's first check or diff begins, so that its
imports overlap the ranks' part; it is stopped with the cluster. It runs in the client's environment: when the
client's environment or Python changed since it started, a new one is started, and a reference is run as
``python -m sharddbg.engine.reference JOB_DIR`` directly whenever the warm one cannot serve (it died, or did
not start).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass

from .pipe_lines import PipeLines

REFERENCE_MODULE = "sharddbg.engine.reference"
SERVE = "--serve"  # sharddbg.engine.reference.SERVE (the client never imports the engine's modules)
STDERR_FILE = "reference-stderr.txt"  # sharddbg.engine.reference.STDERR_FILE


@dataclass
class ReferenceExit:
    """How a reference process ended: its exit status (negative: killed by that signal) and its stderr."""

    returncode: int
    stderr: str


class ReferenceTimeout(Exception):
    """The reference did not end within its time (it was killed)."""


def _environment() -> tuple:
    """What a reference process started now would inherit: the Python, and the environment's variables."""
    return sys.executable, tuple(sorted(os.environ.items()))


class WarmReference:
    """A warm Python that forks one reference process per job (``sharddbg.engine.reference.serve``); its stdin
    is its lifeline (it ends when this process closes it, or ends)."""

    def __init__(self) -> None:
        self.environment = _environment()
        self.ready = False
        self.proc = subprocess.Popen([sys.executable, "-m", REFERENCE_MODULE, SERVE], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, start_new_session=True)
        self.lines = PipeLines(self.proc.stdout.fileno())

    @property
    def pid(self) -> int:
        return self.proc.pid

    def serves_now(self) -> bool:
        """Alive, and started with the environment a reference started now would have."""
        return self.proc.poll() is None and self.environment == _environment()

    def _read(self, deadline: float) -> dict | None:
        """Its next reply; None when it ended, or none came before ``deadline``."""
        line = self.lines.next_line(deadline)
        return None if line is None else json.loads(line)

    def run(self, job_dir: str, timeout: float) -> ReferenceExit | None:
        """The reference of ``job_dir`` in a process forked for it; None when this warm Python cannot serve (it
        ended, or was not ready within the time: nothing was run then). Raises ReferenceTimeout when the
        reference ran past ``timeout`` (it is killed)."""
        deadline = time.monotonic() + timeout
        if not self.ready:
            reply = self._read(deadline)
            if reply is None or "ready" not in reply:
                still_importing = self.proc.poll() is None
                self.close()
                if still_importing:  # its imports alone took the reference's whole time
                    raise ReferenceTimeout()
                return None
            self.ready = True
        try:
            self.proc.stdin.write((json.dumps({"job_dir": job_dir, "cwd": os.getcwd()}) + "\n").encode())
            self.proc.stdin.flush()
        except OSError:
            self.close()
            return None
        started = self._read(deadline)
        if started is None or "started" not in started:
            self.close()
            return None
        pid = started["started"]
        try:
            ended = self._read(deadline)
        except BaseException:  # Ctrl-C while it runs: the reference goes, as a child of this process would
            self._kill(pid)
            self.close()
            raise
        if ended is None:
            timed_out = time.monotonic() >= deadline
            self._kill(pid)
            self.close()  # the next check starts a new one
            if timed_out:
                raise ReferenceTimeout()
            return None  # it ended under the reference: that one is run again as a new Python
        try:
            with open(os.path.join(job_dir, STDERR_FILE), errors="replace") as f:
                stderr = f.read()
        except OSError:
            stderr = ""
        return ReferenceExit(ended["returncode"], stderr)

    @staticmethod
    def _kill(pid: int) -> None:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass

    def close(self) -> None:
        """End it (its lifeline closed; killed when it does not end at once) and wait for it."""
        try:
            self.proc.stdin.close()
        except OSError:
            pass
        try:
            self.proc.wait(timeout=2)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.proc.stdout.close()


def run_fresh(job_dir: str, timeout: float) -> ReferenceExit:
    """The reference as ``python -m sharddbg.engine.reference JOB_DIR``, a new Python. Raises ReferenceTimeout."""
    try:
        done = subprocess.run([sys.executable, "-m", REFERENCE_MODULE, job_dir], capture_output=True, text=True,
                              timeout=timeout)
    except subprocess.TimeoutExpired:
        raise ReferenceTimeout() from None
    return ReferenceExit(done.returncode, done.stderr or "")
