"""The keeper of a detached cluster: ``python -m sharddbg.cluster.keeper --detached-name=NAME CONFIG``.

Started by ``sharddbg cluster start`` (``detached.start``) in a session of its own, its output to its log. It
starts the ``Cluster`` (so it owns the fork server and is the owner in the registry record), tells the starting
command the outcome on an inherited pipe, then answers requests on its Unix socket (``detached`` says which)
until it is asked to stop, gets SIGTERM, or the engines have had no work for ``idle_timeout`` seconds. A start
that fails leaves nothing running, not even a record.
"""

from __future__ import annotations

import json
import os
import select
import signal
import socket
import sys
import time
import traceback

from . import detached, registry
from .cluster import Cluster
from .processes import pid_alive

# how often the keeper looks at the engines' queues (for the idle timeout) while nobody asks it anything
POLL_S = 1.0


class StopRequested(BaseException):
    """SIGTERM (or SIGHUP) reached the keeper: stop the cluster and exit."""


def _raise_stop(signum, frame) -> None:
    raise StopRequested(signal.Signals(signum).name)


class Keeper:
    """One detached cluster's keeper: the ``Cluster``, its record, its socket, the notes of connected processes."""

    def __init__(self, config: dict):
        self.config = config
        self.name = config["name"]
        self.idle_timeout = config.get("idle_timeout")
        me = registry.ProcessRef.of(os.getpid(), "keeper")
        self.record = detached.DetachedRecord(name=self.name, keeper_pid=me.pid, keeper_create_time=me.create_time,
                                              uid=os.getuid(), state="starting", n=int(config["n"] or 0),
                                              idle_timeout_s=self.idle_timeout)
        self.cluster: Cluster | None = None
        self.notes: dict = {"broken": None, "last_trace": None, "mesh": None}
        self.last_work = time.monotonic()
        self._completed: dict = {}
        self.server: socket.socket | None = None

    # ---------------------------------------------------------------- start
    def start(self) -> dict:
        """Start the cluster and open the socket; what the starting command prints."""
        self.record.save()
        t0 = time.perf_counter()
        c = self.config
        self.cluster = Cluster(n=c["n"], mesh=c.get("mesh"), backend=c.get("backend"),
                               timeout=c.get("timeout") or 60.0, collective_timeout=c.get("collective_timeout") or 60.0,
                               start_timeout=c.get("start_timeout") or 180.0, force=bool(c.get("force")),
                               launcher=c.get("launcher"), ip=c.get("ip"), hosts=c.get("hosts"))
        self.cluster.start()
        path = detached.socket_path(self.name)
        path.unlink(missing_ok=True)
        self.server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        old = os.umask(0o177)  # the socket is 0600 from its first moment
        try:
            self.server.bind(str(path))
        finally:
            os.umask(old)
        self.server.listen(8)
        cl = self.cluster
        self.record.cluster_id, self.record.n = cl.cluster_id, cl.n
        self.record.mesh, self.record.backend = str(cl.mesh), cl.backend
        self.record.start_s = time.perf_counter() - t0
        self.record.state = "running"
        self.record.save()
        self.last_work = time.monotonic()
        return {"ok": True, **self.info()}

    # ---------------------------------------------------------------- answers
    def info(self) -> dict:
        cl = self.cluster
        return {"name": self.name, "cluster_id": cl.cluster_id, "n": cl.n,
                "mesh": self.notes["mesh"] or str(cl.mesh), "backend": cl.backend, "patch_mode": cl.patch_mode,
                "collective_timeout": cl.collective_timeout, "timeout": cl.timeout,
                "client_file": str(detached.client_file(cl.cluster_id)), "log_dir": cl.log_dir,
                "pids": {str(r): p for r, p in cl.pids.items()}, "facts": _plain(cl.facts),
                "fork_server_pid": cl.fork_server_pid, "controller_pid": cl.controller_pid,
                "broken": self.notes["broken"], "last_trace": self.notes["last_trace"],
                "keeper_pid": os.getpid(), "started": self.record.started, "idle_timeout": self.idle_timeout,
                "idle_s": time.monotonic() - self.last_work,
                "dead": {str(r): how for r, how in cl.dead_ranks().items()}}

    def answer(self, request: dict) -> tuple[dict, bool]:
        """The answer to one request, and whether the keeper ends after sending it."""
        command = request.get("cmd")
        if command not in ("info", "exits"):  # a look at the cluster (`sharddbg cluster list`) is not work on it
            self.last_work = time.monotonic()
        if command == "info":
            return self.info(), False
        if command == "exits":
            return {"ranks": {str(r): how for r, how in self.cluster.dead_ranks().items()},
                    "controller": self.cluster.controller_failure()}, False
        if command == "note":
            self.notes.update({k: request[k] for k in ("broken", "last_trace", "mesh") if k in request})
            return {"ok": True}, False
        if command == "restart":
            mesh = self.notes["mesh"]
            self.cluster.restart()
            if mesh and mesh != str(self.cluster.mesh):
                self.cluster.remesh(mesh)  # a connected process remeshed the old engines: the new ones follow
            self.notes.update(broken=None, mesh=None)
            self.record.mesh = str(self.cluster.mesh)
            self.record.save()
            return self.info(), False
        if command == "stop":
            return self.stop(request.get("reason") or "stopped by a connected process"), True
        return {"error": f"the keeper does not know the request {command!r}"}, False

    def stop(self, reason: str) -> dict:
        t0 = time.perf_counter()
        survivors: list[int] = []
        if self.cluster is not None and self.cluster.running:
            try:
                self.cluster.stop()
            except Exception as exc:  # survivors: say which
                print(f"sharddbg keeper: stop: {exc}", flush=True)
                survivors = [p.pid for p in self.cluster.processes()]
        self.close_socket()
        self.record.state, self.record.stopped_at, self.record.stop_reason = "stopped", time.time(), reason
        self.record.save()
        print(f"sharddbg keeper: cluster {self.name!r} {reason}", flush=True)
        return {"ok": True, "stop_s": time.perf_counter() - t0, "survivors": survivors}

    def close_socket(self) -> None:
        if self.server is not None:
            self.server.close()
            self.server = None
            detached.socket_path(self.name).unlink(missing_ok=True)

    # ---------------------------------------------------------------- loop
    def serve(self) -> None:
        while True:
            readable, _, _ = select.select([self.server], [], [], POLL_S)
            if readable:
                if self.handle_one():
                    return
            elif not pid_alive(self.cluster.fork_server_pid):
                # stopped from outside (the cluster panel's stop, a kill): nothing is left to keep
                self.stop("stopped from outside: its fork server ended")
                return
            elif self.idle_for_too_long():
                self.stop(f"stopped after {self.idle_timeout:g} s without work on any engine (--idle-timeout)")
                return

    def handle_one(self) -> bool:
        """Answer one connection; True when the keeper is to end."""
        conn, _ = self.server.accept()
        with conn:
            conn.settimeout(detached.KEEPER_ANSWER_S)
            try:
                data = b""
                while not data.endswith(b"\n"):
                    chunk = conn.recv(65536)
                    if not chunk:
                        break
                    data += chunk
                request = json.loads(data or b"{}")
            except (OSError, ValueError):
                return False
            try:
                answer, end = self.answer(request)
            except Exception as exc:
                traceback.print_exc()
                answer, end = {"error": f"the keeper of cluster {self.name!r} failed on {request.get('cmd')!r}: "
                                        f"{type(exc).__name__}: {exc}"}, False
            try:
                conn.sendall(json.dumps(answer, default=str).encode() + b"\n")
            except OSError:
                pass
            return end

    def idle_for_too_long(self) -> bool:
        """Whether the engines have had no work for ``idle_timeout`` seconds (the controller's queue counts: a
        task queued or run by any client is work)."""
        if not self.idle_timeout:
            return False
        try:
            queues = self.cluster.client.queue_status()
        except Exception:  # the controller does not answer: not a sign of idleness
            return False
        busy = any(isinstance(q, dict) and (q.get("queue") or q.get("tasks")) for q in queues.values())
        completed = {k: q.get("completed") for k, q in queues.items() if isinstance(q, dict)}
        if busy or completed != self._completed:
            self._completed = completed
            self.last_work = time.monotonic()
            return False
        return time.monotonic() - self.last_work >= self.idle_timeout


def _plain(facts: dict) -> dict:
    """``facts`` with only what JSON holds as is."""
    return json.loads(json.dumps(facts, default=str))


def _report(fd: int, answer: dict) -> None:
    """Tell the starting command how the start went (it may have gone: nothing to tell then)."""
    try:
        os.write(fd, json.dumps(answer, default=str).encode() + b"\n")
    except OSError:
        pass
    finally:
        try:
            os.close(fd)
        except OSError:
            pass


def main(argv: list[str]) -> int:
    """Run the keeper named on the command line until its cluster stops.

    Parameters
    ----------
    argv : list of str
        ``--detached-name=NAME`` and the JSON config.

    Returns
    -------
    int
        0 once the cluster stopped; 1 when its start failed.

    Examples
    --------
    >>> main(["--detached-name=dev", '{"name": "dev", "n": 2, "ready_fd": 3}'])
    0
    """
    config = json.loads(argv[-1])
    ready_fd = int(config.pop("ready_fd"))
    signal.signal(signal.SIGTERM, _raise_stop)
    signal.signal(signal.SIGHUP, _raise_stop)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # its own session: a Ctrl-C meant for a terminal is not for it
    keeper = Keeper(config)
    print(f"sharddbg keeper of {keeper.name!r}: pid {os.getpid()}, starting {config['n']} ranks", flush=True)
    try:
        answer = keeper.start()
    except BaseException as exc:
        traceback.print_exc()
        if keeper.cluster is not None and keeper.cluster.running:
            keeper.cluster.stop()
        keeper.close_socket()
        keeper.record.path.unlink(missing_ok=True)  # a failed start leaves nothing behind
        _report(ready_fd, {"ok": False, "error": f"{type(exc).__name__}: {exc}"})
        return 1
    _report(ready_fd, answer)
    print(f"sharddbg keeper of {keeper.name!r}: cluster {answer['cluster_id']} up", flush=True)
    try:
        keeper.serve()
    except StopRequested as signal_name:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        keeper.stop(f"stopped by {signal_name} to its keeper")
    except BaseException:
        traceback.print_exc()
        keeper.stop("stopped because its keeper failed (see its log)")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
