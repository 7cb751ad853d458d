"""``Cluster.doctor``: the known ShardTensor pitfalls, checked against what the ranks hold.

Every rank answers ``api.doctor_facts`` (what it reads without communicating); ``analysis.doctor.examine``
compares the ranks' answers with the last numerical check and the last trace and turns them into one row per
check (``sharddbg.analysis.doctor`` lists them).
"""

from __future__ import annotations

from ..analysis.check import CheckResult
from ..analysis.doctor import (ASYNC_WAITED, SAMPLES_APART, CHECKS, DDP_GROUP, FIXES, NO_FSDP1, OPTIMIZER_GROUPS,
                               PLAN_CACHE, REDUCED_ONCE, REQUIRES_GRAD, STATUSES, TABLE_COLUMNS, WEIGHTS_SYNCED,
                               DoctorReport, Finding, examine, ranks_text)
from ..engine import api
from ..errors import ShardDbgError, hide_own_frames
from ..trace import Trace
from . import arguments
from .execution import RankExecution

__all__ = ["DoctorError", "DoctorReport", "Finding", "run_doctor", "TABLE_COLUMNS", "CHECKS", "STATUSES", "FIXES",
           "WEIGHTS_SYNCED", "SAMPLES_APART", "REQUIRES_GRAD", "ASYNC_WAITED", "OPTIMIZER_GROUPS", "NO_FSDP1", "DDP_GROUP",
           "REDUCED_ONCE", "PLAN_CACHE"]


class DoctorError(ShardDbgError, ValueError):
    """The doctor could not run as asked (a name the ranks do not have)."""


# ---- the doctor ------------------------------------------------------------------------------------------
def run_doctor(execution: RankExecution, names: list[str], *, check=None, trace=None,
               timeout: float | None = None) -> DoctorReport:
    """``Cluster.doctor`` on the ranks of ``execution``, reading ``check`` (the last CheckResult, or None) and
    ``trace`` (the last Trace, or None): see the module docstring."""
    __tracebackhide__ = hide_own_frames()
    bad = [n for n in names if not isinstance(n, str) or not arguments.variable_name(n).isidentifier()]
    if bad:
        raise DoctorError(f"doctor() takes names of variables on the ranks, got {', '.join(map(repr, bad))}")
    names = [arguments.variable_name(n) for n in names]  # as Python binds them: µ is stored as μ
    if check is not None and not isinstance(check, CheckResult):
        raise DoctorError(f"check= takes the CheckResult of cl.check(...), got {type(check).__name__}")
    if trace is not None and not isinstance(trace, Trace):
        raise DoctorError(f"trace= takes a Trace (cl.trace(...), sharddbg.last_trace()), got {type(trace).__name__}")
    facts = execution.apply(api.doctor_facts, (list(names) or None,), {}, execution.ranks(None), timeout)
    missing = sorted({n for f in facts for n in f["missing"]})
    if missing:
        where = {n: [f["rank"] for f in facts if n in f["missing"]] for n in missing}
        raise DoctorError("no variable " + "; ".join(f"{n!r} on {ranks_text(r)}" for n, r in where.items())
                          + " (doctor() takes names of variables on the ranks)")
    return examine(facts, check, trace, list(names))
