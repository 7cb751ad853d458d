"""What the launcher tells every process of a recorded job, through one environment variable."""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass

ENV_SETTINGS = "SHARDDBG_RECORD_JOB"  # the job's settings (JSON), set by `sharddbg record`
ENV_CLAIMED = "SHARDDBG_RECORD_CLAIMED"  # set by a process that records: the processes it starts do not


@dataclass(frozen=True)
class JobSettings:
    """A recorded job's settings, the same in every process of it."""

    out: str  # the job's folder (absolute)
    run_id: str  # names this run in every file it writes
    options: dict  # RecordingOptions.as_dict()
    steps: tuple[int, int] | None = None  # record optimizer steps first..last only (1-based, inclusive)
    hang_after_s: float = 60.0  # a collective not done after this long: every rank writes where it is
    flush_every_s: float = 1.0  # at most this long between two flushes of a rank's stream

    def to_env(self) -> str:
        """The settings as the environment variable's value."""
        return json.dumps(asdict(self))

    @classmethod
    def from_env(cls, environ=os.environ) -> "JobSettings | None":
        """The settings of the job this process belongs to; None outside a recorded job."""
        raw = environ.get(ENV_SETTINGS)
        if not raw:
            return None
        values = json.loads(raw)
        if values.get("steps") is not None:
            values["steps"] = tuple(values["steps"])
        return cls(**values)
