"""Client side of the fork server (:mod:`sharddbg.cluster._zygote`): start it, ask it to fork engines."""

from __future__ import annotations

import json
import os
import queue
import subprocess
import sys
import threading
import time

from ..errors import ClusterError


class ForkServer:
    """One ``_zygote`` process. Its stdin is our lifeline: if this process dies, it kills the engines."""

    def __init__(self, config: dict, log_dir: str, python: str | None = None, env: dict | None = None):
        self.log_dir = log_dir
        self._replies: queue.Queue = queue.Queue()
        self._early: list[dict] = []  # replies that arrived while we waited for another one
        self.exited: list[dict] = []  # engines that died on their own (seen from the fork server)
        full_env = dict(os.environ)
        full_env.update(env or {})
        self._stderr = open(os.path.join(log_dir, "forkserver.log"), "ab")  # noqa: SIM115 - closed in close()
        self.proc = subprocess.Popen(
            [python or sys.executable, "-m", "sharddbg.cluster._zygote", json.dumps(config)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self._stderr,
            env=full_env,
            start_new_session=True,  # Ctrl-C in the notebook must not reach it
        )
        self._reader = threading.Thread(target=self._read, name="sharddbg-forkserver-reader", daemon=True)
        self._reader.start()

    @property
    def pid(self) -> int:
        return self.proc.pid

    def _read(self) -> None:
        for line in self.proc.stdout:
            try:
                msg = json.loads(line)
            except ValueError:
                continue
            if msg.get("event") == "exited":
                self.exited.append(msg)
            else:
                self._replies.put(msg)
        self._replies.put({"event": "eof"})

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
                detail = msg.get("traceback") or msg.get("message") or "it exited"
                raise ClusterError(
                    f"the fork server failed while waiting for {event!r}: {detail}\n"
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
        self._send(cmd="fork", ranks=list(ranks), engine_argv=list(engine_argv), env=env, log_dir=self.log_dir)
        return {int(r): int(p) for r, p in self._expect("forked", timeout)["pids"].items()}

    def adopt(self, pids) -> None:
        """Ask the fork server to end ``pids`` when we die. Not awaited: it may still be preloading."""
        self._send(cmd="adopt", pids=list(pids))

    def kill_engines(self, timeout: float = 10.0) -> list[int]:
        self._send(cmd="kill_engines")
        return self._expect("killed", timeout)["pids"]

    def close(self, timeout: float = 5.0) -> None:
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
        self._stderr.close()
