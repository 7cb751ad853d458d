"""``Cluster.check``: a statement run sharded on the ranks against the same statement run unsharded in a
separate single process, outputs and gradients compared per tensor and rank.

The steps (the rank's side is ``sharddbg.engine.verify``, the single process ``sharddbg.engine.reference``):

1. every rank reads the names the statement uses; they agree that the request is sound before any data
   moves; each domain group's first rank writes what the reference needs into a private job folder: each
   input's ``full_tensor()``, the models with its weights, the other values the statement reads, its RNG
   state (``api.check_prepare``);
2. the statement runs as a cell on every rank, sharded (its output is shown as a cell's);
3. the loss (``loss``, default the sum of the mean squares of the outputs) and its backward on every rank;
   every compared tensor is placed in its global tensor (``api.check_backward``);
4. a new process runs ``sharddbg.engine.reference`` (the same Python; this process never imports torch), which
   runs the statement once per domain group on plain tensors, ``scatter`` as the identity: forked from the
   cluster's warm reference Python, which imported torch while the ranks did steps 1-3
   (``reference_process``);
5. every rank compares its local data with its slice of the reference (``api.check_compare``), and puts
   back the gradients and settings the check changed (``api.check_finish``, also after a failure).

The result is a :class:`CheckResult`.
"""

from __future__ import annotations

import json
import math
import numbers
import os
import shutil
import tempfile

from ..analysis.check import (ROW_COLUMNS, TABLE_COLUMNS, BoundaryPattern, CheckResult, check_tables,
                              whole_multiple)
from ..engine import api
from ..errors import ClusterError, RankError, ShardDbgError, hide_own_frames
from . import arguments
from .execution import RankExecution
from .reference_process import ReferenceTimeout, run_fresh

__all__ = ["CheckError", "CheckResult", "BoundaryPattern", "run_check", "whole_multiple",
           "TABLE_COLUMNS", "ROW_COLUMNS"]

class CheckError(ShardDbgError, ValueError):
    """The check could not run as asked (bad arguments, names the ranks do not have, a reference that
    raised); nothing about the sharded model is known from it."""


# ---- arguments --------------------------------------------------------------------------------------------
def _names(what: str, value, *, allow_empty: bool) -> list[str] | None:
    """``value`` (None, "x", "x, y", or a list of names) as a list of identifiers."""
    if value is None:
        return None
    if isinstance(value, str):
        value = [v.strip() for v in value.replace(",", " ").split()]
    if not isinstance(value, (list, tuple)) or not all(isinstance(v, str) for v in value):
        raise CheckError(f"{what} must be a name or a list of names of variables on the ranks, got {value!r}")
    value = [arguments.variable_name(v) for v in value]  # as Python binds them: µ is stored as μ
    bad = [v for v in value if not v.isidentifier()]
    if bad:
        raise CheckError(f"{what}: {', '.join(map(repr, bad))} {'is' if len(bad) == 1 else 'are'} not a variable name")
    if not value and not allow_empty:
        raise CheckError(f"{what} names no variable")
    return list(dict.fromkeys(value))


def _tolerance(what: str, value) -> float | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or math.isnan(value) or math.isinf(value) \
            or value < 0:
        raise CheckError(f"{what} must be a finite number of at least 0, got {value!r}")
    return float(value)


def _source(what: str, text, mode: str) -> str:
    if not isinstance(text, str) or not text.strip():
        raise CheckError(f"{what} must be Python source text, got {text!r}")
    try:
        compile(text, f"<{what}>", mode)
    except SyntaxError as exc:
        raise CheckError(f"{what} is not valid Python ({exc.msg}, line {exc.lineno}): {text!r}") from None
    return text


# ---- the check --------------------------------------------------------------------------------------------
def run_check(execution: RankExecution, stmt: str, *, inputs=None, outputs=None, model=None, loss: str | None = None,
              rtol: float | None = None, atol: float | None = None, grads: bool = True,
              timeout: float | None = None, display: bool = True, blame: bool = False) -> CheckResult:
    """``Cluster.check`` on the ranks of ``execution``: see the module docstring. ``blame``: a failing check
    is run again without sharddbg (``cluster.blame``)."""
    __tracebackhide__ = hide_own_frames()
    stmt = _source("the statement", stmt, "exec")
    inputs = _names("inputs", inputs, allow_empty=True)
    outputs = _names("outputs", outputs, allow_empty=False)
    models = _names("model", model, allow_empty=True)
    loss = None if loss is None else _source("loss", loss, "eval")
    rtol, atol = _tolerance("rtol", rtol), _tolerance("atol", atol)
    for name, value in (("grads", grads), ("blame", blame)):
        if not isinstance(value, bool):
            raise CheckError(f"{name} must be True or False, got {value!r}")
    timeout = arguments.seconds("timeout", timeout, allow_none=True) or execution.default_timeout
    overlap = sorted(set(inputs or ()) & set(models or ()))
    if overlap:
        raise CheckError(f"{', '.join(overlap)} cannot be both an input and a model")
    if execution.broken is not None:
        raise ClusterError(f"the process group is broken ({execution.broken.cause}): the check's collectives would "
                           f"fail; cl.recover() first")
    job_dir = tempfile.mkdtemp(prefix="sharddbg-check-")  # private (0700): the engines run as this user
    blamed = None
    if blame:
        from .blame import PlainServer

        PlainServer.start()  # its imports overlap the check
    execution.processes.warm_reference()  # its imports overlap the ranks' part
    try:
        prepared = _on_ranks(execution, api.check_prepare, job_dir, stmt, loss, inputs, outputs, models, grads,
                             timeout=timeout)
        execution.run(stmt, execution.ranks(None), timeout, display)
        after = _on_ranks(execution, api.check_backward, timeout=timeout)
        first = prepared[0]
        job = {"stmt": stmt, "loss": loss, "outputs": after[0]["outputs"], "backward": after[0]["backward"],
               "groups": sorted({p["group"] for p in prepared})}
        reference_losses = _run_reference(execution, job_dir, job, timeout)
        records = _on_ranks(execution, api.check_compare, rtol, atol, timeout=timeout)
        _finish(execution, timeout)
        if blame and not all(r["ok"] for rank in records for r in rank):
            from .blame import blame_run

            blamed = blame_run(execution, job_dir, job, prepared, rtol=rtol, atol=atol, timeout=timeout)
    finally:
        _finish(execution, timeout)
        shutil.rmtree(job_dir, ignore_errors=True)
    table, rows = check_tables(records)
    result = CheckResult(stmt, table, rows, inputs=first["inputs"], outputs=after[0]["outputs"],
                         models=first["models"], backward=after[0]["backward"], backward_note=after[0]["note"],
                         loss=after[0]["loss"], reference_loss=reference_losses.get(0), tf32=first["tf32"],
                         groups=job["groups"], unsynced=list(dict.fromkeys(n for p in prepared for n in p["unsynced"])))
    result.blame = blamed
    return result


def _on_ranks(execution: RankExecution, fn, *args, timeout: float):
    """``fn(*args)`` on every rank; a refusal the ranks agreed on (CheckSetupError) as a CheckError."""
    __tracebackhide__ = hide_own_frames()
    try:
        return execution.apply(fn, args, {}, execution.ranks(None), timeout)
    except RankError as exc:
        causes = [exc.errors[r] for r in exc.causes if r in exc.errors]
        if causes and all(c.type_name == "CheckSetupError" for c in causes):
            raise CheckError(causes[0].message) from None
        raise


def _finish(execution: RankExecution, timeout: float) -> None:
    """Every live rank puts back what the check changed; a rank that cannot answer (dead, stuck) is left."""
    if execution.closed:
        return
    alive = [r for r in range(execution.n) if r not in execution.processes.dead_ranks()]
    try:
        if alive:
            execution.apply(api.check_finish, (), {}, alive, min(timeout, 30.0))
    except ShardDbgError:
        pass


def _run_reference(execution: RankExecution, job_dir: str, job: dict, timeout: float) -> dict[int, float | None]:
    """The reference process over ``job``; each group's reference loss."""
    from ..engine import reference

    with open(os.path.join(job_dir, reference.JOB_FILE), "w") as f:
        json.dump(job, f)
    warm = execution.processes.reference
    try:
        done = warm.run(job_dir, timeout) if warm is not None and warm.serves_now() else None
        if done is None:
            done = run_fresh(job_dir, timeout)
    except ReferenceTimeout:
        raise CheckError(f"the unsharded reference (python -m sharddbg.engine.reference) did not finish within "
                         f"{timeout:g} s; pass a larger timeout= (the ranks' part finished)") from None
    error_file = os.path.join(job_dir, reference.ERROR_FILE)
    if done.returncode != 0:
        if os.path.exists(error_file):
            with open(error_file) as f:
                failure = json.load(f)
            if failure["what"] == reference.REBUILDING:
                raise CheckError(_rebuild_message(failure))
            where = f" (line {failure['line']} of the statement: `{failure['code']}`)" if failure.get("line") else ""
            if failure["what"] == "the loss":
                where = f" (the loss: `{job['loss']}`)" if job.get("loss") else ""
            raise CheckError(
                f"the unsharded reference raised {failure['message']} in {failure['what']}{where}. It runs the "
                f"statement in one process, on plain tensors: code that needs the ranks (torch.distributed, the "
                f"mesh, ShardTensor methods) cannot run there.\n{_user_lines(failure['traceback'])}")
        raise CheckError(f"the unsharded reference process failed (exit status {done.returncode}): "
                         f"{(done.stderr or '').strip()[-2000:]}")
    with open(os.path.join(job_dir, reference.LOSSES_FILE)) as f:
        return {int(group): loss for group, loss in json.load(f).items()}


def _rebuild_message(failure: dict) -> str:
    """Why the reference could not rebuild what the ranks hold: the module and where the ranks found it, what
    raised, then what it means and how to fix it."""
    names = failure.get("names") or []
    what = ", ".join(names) if names else "the values the statement reads"
    module = failure.get("module")
    found = f" (the ranks imported it from {failure['module_file']})" if failure.get("module_file") else ""
    if module and failure["type"] == "ModuleNotFoundError" and failure["message"].endswith(f"'{module}'"):
        cause = (f"the unsharded reference could not rebuild {what}: there is no module named {module!r} in its "
                 f"process{found}, although it ran with the ranks' sys.path and working directory "
                 f"({failure.get('cwd')})")
    elif module:
        cause = f"the unsharded reference could not rebuild {what}: importing module {module!r}{found} raised " \
                f"{failure['message']}"
    else:
        cause = f"the unsharded reference could not rebuild {what}: loading them raised {failure['message']}"
    target = module or "the module"
    fix = (f"Nothing was compared. The reference is one process started by the notebook's Python, without "
           f"torch.distributed or the mesh: make {target} importable there without the ranks (code at its top "
           f"level that needs them belongs in a function), or have it travel by value instead: on the ranks, "
           f"`import cloudpickle, {target}; cloudpickle.register_pickle_by_value({target})`"
           if module else
           "Nothing was compared. Define the class in a cell (it travels by value) or make its module importable "
           "in one process started by the notebook's Python")
    lines = failure.get("traceback", "").rstrip().splitlines()
    file = failure.get("module_file")
    start = next((i for i, line in enumerate(lines) if file and line.strip().startswith(f'File "{file}"')),
                 max(len(lines) - 8, 0))  # from the module's own code on, where it is known
    return f"{cause.rstrip('.')}. {fix}.\nTraceback (the reference):\n" + "\n".join(lines[start:])


def _user_lines(traceback_text: str) -> str:
    """The traceback's part that shows the user's statement (from its first frame in it on)."""
    from ..engine.reference import LOSS_FILENAME, STATEMENT_FILENAME

    lines = traceback_text.splitlines()
    for i, line in enumerate(lines):
        if STATEMENT_FILENAME in line or LOSS_FILENAME in line:
            return "\n".join(["Traceback (the reference):"] + lines[i:])
    return traceback_text


# ---- the op-by-op diff --------------------------------------------------------------------------------------
DEFAULT_DIFF_MEMORY = 2 * 1024 ** 3  # bytes the diff may keep on a rank, and in the reference, unless raised


class DiffError(CheckError):
    """The diff could not run as asked (bad arguments, an ``ops=`` that names no op the statement called,
    more memory than ``max_memory`` allows); nothing was compared."""


def _ops_argument(ops):
    """``ops`` as the ranks take it: None, a callable, or a list of op names."""
    if ops is None or callable(ops):
        return ops
    if isinstance(ops, str):
        ops = [o.strip() for o in ops.replace(",", " ").split()]
    if not isinstance(ops, (list, tuple, set)) or not all(isinstance(o, str) and o for o in ops):
        raise DiffError(f"ops must be op names (\"conv2d\", \"torch.conv2d\"), a list of them, or a function of the "
                        f"op's name, got {ops!r}")
    if not ops:
        raise DiffError("ops= names no op: leave it out to compare every op")
    return sorted(set(ops))


def _size_text(nbytes: float) -> str:
    for unit in ("bytes", "KiB", "MiB", "GiB"):
        if nbytes < 1024 or unit == "GiB":
            return f"{nbytes:.0f} {unit}" if unit == "bytes" else f"{nbytes:.1f} {unit}"
        nbytes /= 1024
    return f"{nbytes:.1f} GiB"


def run_diff(execution: RankExecution, stmt: str, *, inputs=None, outputs=None, model=None, loss: str | None = None,
             rtol: float | None = None, atol: float | None = None, grads: bool = True, ops=None,
             max_memory: int = DEFAULT_DIFF_MEMORY, blame: bool = False, timeout: float | None = None,
             display: bool = True):
    """``Cluster.diff`` on the ranks of ``execution``: the check's steps (module docstring) with every op's
    output kept on both sides (``engine.diff``), compared op by op."""
    __tracebackhide__ = hide_own_frames()
    from ..analysis.diff import DiffResult, diff_tables
    from ..engine import diff

    stmt = _source("the statement", stmt, "exec")
    inputs = _names("inputs", inputs, allow_empty=True)
    outputs = _names("outputs", outputs, allow_empty=False)
    models = _names("model", model, allow_empty=True)
    loss = None if loss is None else _source("loss", loss, "eval")
    rtol, atol = _tolerance("rtol", rtol), _tolerance("atol", atol)
    ops = _ops_argument(ops)
    if isinstance(max_memory, bool) or not isinstance(max_memory, numbers.Real) or not max_memory > 0 \
            or math.isinf(max_memory):
        raise DiffError(f"max_memory must be a number of bytes above 0, got {max_memory!r}")
    for name, value in (("grads", grads), ("blame", blame)):
        if not isinstance(value, bool):
            raise DiffError(f"{name} must be True or False, got {value!r}")
    timeout = arguments.seconds("timeout", timeout, allow_none=True) or execution.default_timeout
    overlap = sorted(set(inputs or ()) & set(models or ()))
    if overlap:
        raise DiffError(f"{', '.join(overlap)} cannot be both an input and a model")
    if execution.broken is not None:
        raise ClusterError(f"the process group is broken ({execution.broken.cause}): the diff's collectives would "
                           f"fail; cl.recover() first")
    job_dir = tempfile.mkdtemp(prefix="sharddbg-diff-")
    if blame:
        from .blame import PlainServer

        PlainServer.start()  # its imports overlap the diff
    execution.processes.warm_reference()  # its imports overlap the ranks' part
    try:
        prepared = _on_ranks(execution, diff.diff_prepare, job_dir, stmt, loss, inputs, outputs, models, grads, ops,
                             int(max_memory), timeout=timeout)
        _refuse_estimate(prepared[0].get("estimated_bytes"), max_memory, grads)
        execution.run(stmt, execution.ranks(None), timeout, display)
        after = _on_ranks(execution, diff.diff_backward, timeout=timeout)
        _refuse_memory(after, max_memory, grads)
        selected = sorted({name for a in after for name in a["selected"]})
        if ops is not None and not selected:
            called = sorted({name for a in after for name in a["seen"]})
            raise DiffError(f"ops={ops if not callable(ops) else getattr(ops, '__name__', 'the function')!r} names no "
                            f"op the statement called; it called {', '.join(called) or 'no op on a ShardTensor'}. "
                            f"Nothing was compared")
        first = prepared[0]
        check_after = after[0]["check"]
        job = {"stmt": stmt, "loss": loss, "outputs": check_after["outputs"], "backward": check_after["backward"],
               "groups": sorted({p["group"] for p in prepared}), "diff": {"selected": selected}}
        reference_losses = _run_reference(execution, job_dir, job, timeout)
        records = _on_ranks(execution, diff.diff_compare, rtol, atol, timeout=timeout)
    finally:
        _finish_diff(execution, timeout)
    try:
        table, rows = check_tables([r["check"] for r in records])
        check = CheckResult(stmt, table, rows, inputs=first["inputs"], outputs=check_after["outputs"],
                            models=first["models"], backward=check_after["backward"],
                            backward_note=check_after["note"], loss=check_after["loss"],
                            reference_loss=reference_losses.get(0), tf32=first["tf32"], groups=job["groups"],
                            unsynced=list(dict.fromkeys(n for p in prepared for n in p["unsynced"])))
        described = after[0]["ops"]
        ops_table, ranks_table = diff_tables(described, [r for rank in records for r in rank["ops"]], check, stmt)
        memory = {"rank_bytes": max(a["kept_bytes"] for a in after), "reference_bytes": after[0]["global_bytes"],
                  "limit": int(max_memory), "estimated_bytes": first.get("estimated_bytes")}
        payloads = [r["payload"] for r in records]  # each names its rank
        trace = None
        if all(p is not None for p in payloads):
            from ..trace import Trace

            def trace():
                return Trace.from_payloads(payloads, meta={"code": stmt, "diff": True})
        result = DiffResult(stmt, ops_table, ranks_table, check=check, skipped=after[0]["nested"],
                            inputs_of={op["key"]: op["sources"] for op in described}, memory=memory, trace=trace)
        if blame and not (result.ok and check.ok):
            from .blame import blame_run

            result.blame = blame_run(execution, job_dir, job, prepared, rtol=rtol, atol=atol, timeout=timeout)
    finally:
        shutil.rmtree(job_dir, ignore_errors=True)
    return result


def _refuse_estimate(estimated: int | None, max_memory: float, grads: bool) -> None:
    """Refuse, before the ranks run anything, a diff whose reference would keep more than ``max_memory``: every
    compared op's whole output (and its gradient), as a run of the statement on the meta device sized them."""
    if estimated is None:
        return  # not runnable on the meta device: told after the sharded run (``_refuse_memory``)
    need = estimated * (2 if grads else 1)
    if need <= max_memory:
        return
    raise DiffError(
        f"cl.diff would keep about {_size_text(need)} in the single-device reference (every compared op's whole "
        f"output{' and its gradient' if grads else ''}, sized by a run of the statement on the meta device), above "
        f"max_memory={_size_text(max_memory)}. Nothing ran: narrow ops= to the ops you suspect, or raise max_memory=")


def _refuse_memory(after: list[dict], max_memory: float, grads: bool) -> None:
    """Refuse, before the reference runs, a diff that keeps more than ``max_memory`` on a rank or in the
    reference (whole outputs, and their gradients when compared)."""
    rank_need = max(a["needed_bytes"] for a in after) * (2 if grads else 1)
    reference_need = after[0]["global_bytes"] * (2 if grads else 1)
    if not any(a["over_limit"] for a in after) and reference_need <= max_memory:
        return
    raise DiffError(
        f"cl.diff would keep {_size_text(rank_need)} on a rank and {_size_text(reference_need)} in the single-device "
        f"reference (every compared op's output{' and its gradient' if grads else ''}), above max_memory="
        f"{_size_text(max_memory)}. Nothing was compared: the statement ran on the ranks (its outputs are there), "
        f"the reference did not. Narrow ops= to the ops you suspect, or raise max_memory=")


def _finish_diff(execution: RankExecution, timeout: float) -> None:
    """Every live rank removes the diff's keeper and puts back what the check changed."""
    from ..engine import diff

    if execution.closed:
        return
    alive = [r for r in range(execution.n) if r not in execution.processes.dead_ranks()]
    try:
        if alive:
            execution.apply(diff.diff_finish, (), {}, alive, min(timeout, 30.0))
    except ShardDbgError:
        pass
