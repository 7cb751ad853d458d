"""``blame=True``: is it sharddbg or is it you? The statement of a failing ``check`` or ``diff``, or a wrong
configuration of the smoke matrix, run again in plain processes with no sharddbg code loaded, and whether it
fails there too.

The ranks are plain processes as torchrun's workers (``RANK`` / ``WORLD_SIZE`` / ``MASTER_ADDR`` /
``MASTER_PORT``, plain ``torch.distributed`` over gloo) running ``sharddbg/engine/plain_rerun.py``, a script
loaded by its path (so that the ``sharddbg`` package is never imported). ``PlainServer`` keeps one such Python
(``plain_rerun.py --serve``) that imported torch and physicsnemo once and forks the ranks of each re-run: a
re-run costs no fresh imports after the first (four ranks importing them at once take four times the CPU).

For ``check`` and ``diff`` (``blame_run``) the ranks read the check's reference bundle (inputs, models, values,
RNG state), shard the inputs as the ranks had them (``engine.diff.input_layouts``), run the statement, the loss
and the backward, and the first rank compares every output and gradient with the unsharded reference the check
wrote. For the smoke matrix (``blame_smoke``) they run the configuration's steps from ``setup`` and ``step``, and
the losses and first-step gradients are held to the single-device run the matrix compared with.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass

from ..analysis.blame import Blame, BlameTensor
from ..engine.verify import DEFAULT_RTOL
from .execution import RankExecution
from .pipe_lines import PipeLines

__all__ = ["blame_run", "blame_smoke", "PlainServer", "PLAIN_RERUN_SCRIPT"]

START_ALLOWANCE_S = 300.0  # the least time the plain processes get: a fresh interpreter importing torch
PLAIN_RERUN_SCRIPT = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "engine",
                                  "plain_rerun.py")
# what the re-run is, in words (``Blame.command``)
PLAIN_COMMAND = (f"{sys.executable} {PLAIN_RERUN_SCRIPT}: plain processes, one per rank, forked after importing "
                 f"torch and physicsnemo once")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class PlainRun:
    """What one job of plain processes left: each rank's answer (``rank<r>.json``), its output (``rank<r>.log``),
    and why there is no answer where there is none (``problem``)."""

    answers: dict
    logs: dict
    problem: str | None = None


class PlainServer:
    """``plain_rerun.py --serve``: one plain Python (no sharddbg module) that imported torch and physicsnemo once
    and forks the ranks of each job from there, so that a re-run costs no fresh imports after the first. Its
    stdin is the lifeline: it ends when this process ends or ``close()`` lets it go."""

    _lock = threading.Lock()
    _current: PlainServer | None = None

    def __init__(self):
        self.proc = subprocess.Popen([sys.executable, PLAIN_RERUN_SCRIPT, "--serve"], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
        self.lines = PipeLines(self.proc.stdout.fileno())

    @classmethod
    def run(cls, job: dict, world_size: int, timeout: float) -> PlainRun:
        """``job`` (written to its ``out_dir``) on ``world_size`` forked ranks; their answers."""
        with cls._lock:
            server = cls._current
            if server is None or server.proc.poll() is not None:
                server = cls._current = PlainServer()
            return server._run(job, world_size, timeout)

    @classmethod
    def start(cls) -> None:
        """Start the server now without waiting for it: its imports overlap the run whose failure it may re-run."""
        with cls._lock:
            if cls._current is None or cls._current.proc.poll() is not None:
                cls._current = PlainServer()

    @classmethod
    def close(cls) -> None:
        """End the server (a later re-run starts another)."""
        with cls._lock:
            if cls._current is not None:
                cls._current._end()
                cls._current = None

    def _end(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()

    def _run(self, job: dict, world_size: int, timeout: float) -> PlainRun:
        out_dir = job["out_dir"]
        job_file = os.path.join(out_dir, "job.json")
        with open(job_file, "w") as f:
            json.dump(job, f)
        deadline = time.monotonic() + max(timeout, START_ALLOWANCE_S)
        problem = None
        try:
            self.proc.stdin.write(f"{job_file} {world_size} {_free_port()}\n".encode())
            self.proc.stdin.flush()
        except (BrokenPipeError, OSError):
            problem = "the plain Python that runs them ended before the job started"
        line = None if problem else self.lines.next_line(deadline)
        while line == "ready":  # the first job waits for the imports
            line = self.lines.next_line(deadline)
        if problem is None and line is None and self.proc.poll() is not None:
            problem = (f"the plain Python that runs them ended (exit status {self.proc.returncode}) before answering: "
                       f"run `{sys.executable} {PLAIN_RERUN_SCRIPT} --serve` to see why")
        elif problem is None and line is None:
            problem = f"the plain processes did not finish within {max(timeout, START_ALLOWANCE_S):g} s"
            self._kill_ranks(out_dir)
            if self.lines.next_line(time.monotonic() + 10.0) is None:  # the server itself is stuck: start another next time
                self._end()
        return _collect(out_dir, problem)

    @staticmethod
    def _kill_ranks(out_dir: str) -> None:
        for name in os.listdir(out_dir):
            if name.startswith("rank") and name.endswith(".pid"):
                try:
                    with open(os.path.join(out_dir, name)) as f:
                        os.kill(int(f.read().strip()), signal.SIGKILL)
                except (OSError, ValueError):
                    pass


def _collect(out_dir: str, problem: str | None) -> PlainRun:
    answers, logs = {}, {}
    for name in os.listdir(out_dir):
        path = os.path.join(out_dir, name)
        if name.startswith("rank") and name.endswith(".json"):
            with open(path) as f:
                answer = json.load(f)
            answers[answer["rank"]] = answer
        elif name.startswith("rank") and name.endswith(".log"):
            with open(path, errors="replace") as f:
                logs[int(name[4:-4])] = f.read()
    return PlainRun(answers, logs, problem)


def _mesh_shape(prepared: list[dict]) -> list[int]:
    """(ddp, domain) from the domain group each rank reported."""
    domain = sum(1 for p in prepared if p["group"] == prepared[0]["group"])
    return [len(prepared) // domain, domain]


def _failed(done: PlainRun) -> str:
    """Why a job of plain processes left no answer: its problem, else the first rank's output that says something."""
    told = done.problem or next((log for _, log in sorted(done.logs.items()) if log.strip()), "") or "no answer"
    return f"the plain processes failed: {told.strip()[-1500:]}"


def blame_run(execution: RankExecution, job_dir: str, job: dict, prepared: list[dict], *, rtol: float | None,
              atol: float | None, timeout: float) -> Blame:
    """The statement of ``job`` (its reference already written under ``job_dir``) run again without sharddbg
    on as many plain processes as the cluster has ranks; the answer as a ``Blame``."""
    from ..engine import diff

    layouts = execution.apply(diff.input_layouts, (prepared[0]["inputs"],), {}, [0], timeout)[0]
    out_dir = tempfile.mkdtemp(prefix="plain-", dir=job_dir)
    plain_job = {"stmt": job["stmt"], "loss": job["loss"], "outputs": job["outputs"], "backward": job["backward"],
                 "job_dir": job_dir, "out_dir": out_dir, "mesh_shape": _mesh_shape(prepared),
                 "layouts": layouts, "rtol": rtol, "atol": atol, "default_rtol": DEFAULT_RTOL}
    done = PlainServer.run(plain_job, execution.n, timeout)
    first = done.answers.get(0)
    if first is None:
        return Blame(fails_without=None, command=PLAIN_COMMAND, tensors=[], raised=None, versions={},
                     sharddbg_loaded=[], problem=_failed(done))
    answers = done.answers
    raised = next((a["raised"] for _, a in sorted(answers.items()) if a["raised"]), None)
    raised_ranks = [r for r, a in sorted(answers.items()) if a["raised"]]
    tensors = [BlameTensor(t["name"], t["section"], t["max_abs"], t["ok"], t["note"]) for t in first["tensors"]]
    fails = raised is not None or any(not t.ok for t in tensors)
    return Blame(fails_without=fails, command=PLAIN_COMMAND, tensors=tensors,
                 raised=(f"{raised} on rank{'s' if len(raised_ranks) > 1 else ''} "
                         f"{', '.join(map(str, raised_ranks))}" if raised else None),
                 versions=first["versions"], sharddbg_loaded=first["sharddbg_loaded"], problem=None)


def blame_smoke(plan: dict, setup, step, reference_losses: list, reference_grads: dict | None, *, rtol: float,
                world_size: int, mesh_shape: list[int], timeout: float) -> Blame:
    """One failing configuration of the smoke matrix (``plan``, as the ranks ran it) run again without
    sharddbg on ``world_size`` plain processes (one for the single device); its losses and first-step gradients
    against the same single-device run the matrix compared with; the answer as a ``Blame``."""
    import pickle

    out_dir = tempfile.mkdtemp(prefix="sharddbg-plain-smoke-")
    try:
        functions = os.path.join(out_dir, "functions.pkl")
        with open(functions, "wb") as f:  # setup and step as cloudpickle's bytes; the gradients as numpy arrays
            pickle.dump({"setup_step": [setup, step], "reference_grads": reference_grads}, f)
        done = PlainServer.run({"kind": "smoke", "plan": plan, "mesh_shape": mesh_shape, "functions": functions,
                                "out_dir": out_dir}, world_size, timeout)
    finally:
        import shutil

        shutil.rmtree(out_dir, ignore_errors=True)
    first = done.answers.get(0)
    if first is None or len(done.answers) < world_size and not any(a["raised"] for a in done.answers.values()):
        return Blame(fails_without=None, command=PLAIN_COMMAND, tensors=[], raised=None, versions={},
                     sharddbg_loaded=[], problem=_failed(done))
    answers = [a for _, a in sorted(done.answers.items())]
    raised_ranks = [a["rank"] for a in answers if a["raised"]]
    if raised_ranks:
        raised = next(a["raised"] for a in answers if a["raised"])
        return Blame(fails_without=True, command=PLAIN_COMMAND, tensors=[], versions=first["versions"],
                     raised=f"{raised} on rank{'s' if len(raised_ranks) > 1 else ''} {', '.join(map(str, raised_ranks))}",
                     sharddbg_loaded=first["sharddbg_loaded"])
    steps = len(first["losses"])
    losses = [sum(a["losses"][k] for a in answers) / len(answers) for k in range(steps)]
    errors = [abs(a - b) / max(abs(b), 1e-30) for a, b in zip(losses, reference_losses)]
    worst = max(range(steps), key=lambda k: errors[k] if errors[k] == errors[k] else float("inf"))
    tensors = [BlameTensor(f"loss (step {worst})", "losses", errors[worst], errors[worst] <= rtol,
                           "relative to the single-device run's")]
    grad = max((a for a in answers if a["grad_error"] is not None), key=lambda a: a["grad_error"], default=None)
    if grad is not None:
        tensors.append(BlameTensor(f"gradient of {grad['grad_error_param']}", "param_grads", grad["grad_error"],
                                   grad["grad_error"] <= rtol, "relative to its largest value, first step"))
    return Blame(fails_without=any(not t.ok for t in tensors), command=PLAIN_COMMAND, tensors=tensors, raised=None,
                 versions=first["versions"], sharddbg_loaded=first["sharddbg_loaded"])
