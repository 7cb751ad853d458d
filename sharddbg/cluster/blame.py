"""``blame=True``: is it sharddbg or is it you? The statement of a failing ``check`` or ``diff`` run again in
plain processes with no sharddbg code loaded, and whether it fails there too.

The processes are spawned as torchrun spawns its workers (one per rank, ``RANK`` / ``WORLD_SIZE`` /
``MASTER_ADDR`` / ``MASTER_PORT``, plain ``torch.distributed`` over gloo), each running the script
``sharddbg/engine/plain_rerun.py`` by its path (so that the ``sharddbg`` package is never imported). They
read the check's reference bundle (inputs, models, values, RNG state), shard the inputs as the ranks had them
(``engine.diff.input_layouts``), run the statement, the loss and the backward, and the first rank compares
every output and gradient with the unsharded reference the check wrote.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import tempfile
import time

from ..analysis.blame import Blame, BlameTensor
from ..engine.verify import DEFAULT_RTOL
from .execution import RankExecution

__all__ = ["blame_run", "PLAIN_RERUN_SCRIPT"]

START_ALLOWANCE_S = 300.0  # the least time the plain processes get: fresh interpreters importing torch
PLAIN_RERUN_SCRIPT = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "engine",
                                  "plain_rerun.py")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _mesh_shape(prepared: list[dict]) -> list[int]:
    """(ddp, domain) from the domain group each rank reported."""
    domain = sum(1 for p in prepared if p["group"] == prepared[0]["group"])
    return [len(prepared) // domain, domain]


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
    job_file = os.path.join(out_dir, "job.json")
    with open(job_file, "w") as f:
        json.dump(plain_job, f)
    port = _free_port()
    command = [sys.executable, PLAIN_RERUN_SCRIPT, job_file]
    procs = []
    for rank in range(execution.n):
        env = dict(os.environ, RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(execution.n),
                   MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        procs.append(subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    # each process starts a Python and imports torch and physicsnemo first (the ranks had them preloaded)
    deadline = time.monotonic() + max(timeout, START_ALLOWANCE_S)
    codes, errors = [], []
    for proc in procs:
        try:
            _, err = proc.communicate(timeout=max(deadline - time.monotonic(), 1.0))
        except subprocess.TimeoutExpired:
            for other in procs:
                other.kill()
            for other in procs:
                other.wait()
            return Blame(fails_without=None, command=" ".join(command), tensors=[], raised=None, versions={},
                         sharddbg_loaded=[], problem=f"the plain processes did not finish within {max(timeout, START_ALLOWANCE_S):g} s")
        codes.append(proc.returncode)
        errors.append(err or "")
    answers = {}
    for name in os.listdir(out_dir):
        if name.startswith("rank") and name.endswith(".json"):
            with open(os.path.join(out_dir, name)) as f:
                answer = json.load(f)
            answers[answer["rank"]] = answer
    first = answers.get(0)
    if first is None:
        failed = next((e for c, e in zip(codes, errors) if c != 0), "") or "no answer"
        return Blame(fails_without=None, command=" ".join(command), tensors=[], raised=None, versions={},
                     sharddbg_loaded=[], problem=f"the plain processes failed: {failed.strip()[-1500:]}")
    raised = next((a["raised"] for _, a in sorted(answers.items()) if a["raised"]), None)
    raised_ranks = [r for r, a in sorted(answers.items()) if a["raised"]]
    tensors = [BlameTensor(t["name"], t["section"], t["max_abs"], t["ok"], t["note"]) for t in first["tensors"]]
    fails = raised is not None or any(not t.ok for t in tensors)
    return Blame(fails_without=fails, command=" ".join(command), tensors=tensors,
                 raised=(f"{raised} on rank{'s' if len(raised_ranks) > 1 else ''} "
                         f"{', '.join(map(str, raised_ranks))}" if raised else None),
                 versions=first["versions"], sharddbg_loaded=first["sharddbg_loaded"], problem=None)
