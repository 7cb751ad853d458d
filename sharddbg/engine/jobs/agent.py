"""In torchrun's agent process: note how each worker ended, for the report (``job.json``'s ``rank_exits``).

A worker killed by a signal cannot write that itself; torchrun's agent sees its exit code. The agent's
``launch_agent`` is wrapped: when it raises ``ChildFailedError``, each failure (rank, pid, exit code or signal)
is written to ``agent-exits.json`` in the job's folder, then the error goes on as before.
"""

from __future__ import annotations

import json
import os
import signal

from .settings import JobSettings

EXITS_FILE = "agent-exits.json"


def _words(exitcode: int, pid) -> str:
    if exitcode < 0:
        try:
            name = signal.Signals(-exitcode).name
        except ValueError:
            name = f"signal {-exitcode}"
        return f"its process (pid {pid}) was killed by {name}"
    return f"its process (pid {pid}) exited with status {exitcode}"


def install(settings: JobSettings) -> None:
    """Wrap torchrun's ``launch_agent`` in this (agent) process; nothing when torch has none."""
    try:
        from torch.distributed.launcher import api
    except ImportError:
        return
    original = getattr(api, "launch_agent", None)
    if original is None:
        return

    def launch_agent(*args, **kwargs):
        try:
            return original(*args, **kwargs)
        except Exception as e:
            failures = getattr(e, "failures", None)
            if isinstance(failures, dict):
                exits = {}
                for rank, failure in failures.items():
                    code = getattr(failure, "exitcode", None)
                    if isinstance(code, int):
                        exits[str(rank)] = _words(code, getattr(failure, "pid", "?"))
                try:
                    path = os.path.join(settings.out, EXITS_FILE)
                    with open(path + ".tmp", "w") as f:
                        json.dump(exits, f)
                    os.replace(path + ".tmp", path)
                except OSError:
                    pass
            raise

    launch_agent.__wrapped__ = original  # type: ignore[attr-defined]
    api.launch_agent = launch_agent
