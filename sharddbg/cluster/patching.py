"""``Cluster.patch`` / ``unpatch`` / ``check_patch``: a ShardTensor handler written in the notebook, registered on
every rank, verified, and taken back.

The handler travels by value (cloudpickle, with the globals it reads; names it reads that the notebook does not
define, such as ``torch`` or ``ShardTensor``, are taken from the ranks' namespace there) together with its
source, so a traceback through it on a rank shows its own lines. Registration is all or nothing: every rank
first resolves the op, loads the handler and checks its signature without changing anything
(``api.patch_prepare``); only when every rank accepted does each register it (``api.patch_commit``), keeping
what the registries held so that ``unpatch`` puts them back exactly (``sharddbg.engine.user_patches``).

``check_patch`` runs the statement without the handler and with it, each side traced (the op's path, its time,
the collectives inside it) and checked against one device (``Cluster.check``), and answers a ``PatchCheck``.
"""

from __future__ import annotations

import inspect
import itertools
import linecache
import pickle
import re
import sys
import textwrap
from dataclasses import dataclass
from typing import Any, Callable

from ..analysis.patch_check import PatchCheck, patch_side
from ..engine import api
from ..errors import RankError, ShardDbgError, hide_own_frames, short_message
from . import arguments

__all__ = ["PatchError", "PatchRecord", "op_text", "handler_from_source", "patch", "unpatch", "check_patch"]

KINDS = ("function", "dispatch")
_REFUSED = "PatchRefused"
_cells = itertools.count(1)


class PatchError(ShardDbgError, ValueError):
    """A handler could not be registered, taken back or checked as asked; the ranks are as they were."""


@dataclass(frozen=True)
class PatchRecord:
    """A handler registered on every rank: the op as sharddbg names it, the kind, the handler's name, and the
    handler that the registries held for the op before (None: the op fell back)."""

    op: str
    kind: str
    handler: str
    replaces: str | None


def op_text(op: Any) -> str:
    """The op's name as the ranks resolve it: a string as given; a torch function or op overload (when this
    process has torch) by the name sharddbg prints for it (``torch.diff``, ``Tensor.add``, ``aten.add.Tensor``)."""
    if isinstance(op, str):
        if not op.strip():
            raise PatchError("op must name a torch function or op overload, got an empty string")
        return op.strip()
    kind = type(op).__name__
    if kind in ("OpOverload", "OpOverloadPacket"):
        return str(op)
    overload = getattr(op, "_opoverload", None)  # a torch.library.custom_op object
    if overload is not None:
        return str(overload)
    qualname = getattr(op, "__qualname__", None) or getattr(op, "__name__", None)
    module = getattr(op, "__module__", None)
    if not callable(op) or not qualname:
        raise PatchError(f"op must be a torch function, an op overload or its name, got {kind} {op!r}")
    if qualname.startswith("_VariableFunctionsClass."):
        return "torch." + qualname.split(".", 1)[1]
    if qualname.startswith(("TensorBase.", "Tensor.")):
        return "Tensor." + qualname.split(".", 1)[1]
    return f"{module}.{qualname}" if module and module != "builtins" else qualname


def handler_from_source(source: str, name: str | None = None, namespace: dict | None = None) -> Callable:
    """Define the handler of ``source`` (the text of a cell) and return it.

    The source is compiled under a file name of its own and kept in ``linecache``, so its lines show in
    tracebacks (on the ranks too: the source travels with the handler). ``namespace``: where the cell's names
    go (a notebook's ``user_ns``); None: a namespace of its own. ``name``: the function to take; None: the one
    function the cell defines (the last one defined at its top level when there are several).
    """
    if not isinstance(source, str) or not source.strip():
        raise PatchError("the cell defines no handler: it is empty")
    filename = f"<shard_patch cell {next(_cells)}>"
    try:
        code = compile(source, filename, "exec")
    except SyntaxError as exc:
        raise PatchError(f"the handler's cell is not valid Python ({exc.msg}, line {exc.lineno})") from None
    linecache.cache[filename] = (len(source), None, source.splitlines(True), filename)
    ns = namespace if namespace is not None else {"__name__": "__sharddbg_patch__"}
    exec(code, ns)  # noqa: S102 - the user's own cell
    if name is not None:
        fn = ns.get(name)
        if not callable(fn):
            raise PatchError(f"the cell defines no function {name!r}")
        return fn
    defined = [v for v in ns.values() if inspect.isfunction(v) and v.__code__.co_filename == filename]
    if not defined:
        raise PatchError("the cell defines no function: it must define the handler, "
                         "def handler(func, types, args, kwargs): ...")
    return max(defined, key=lambda f: f.__code__.co_firstlineno)


@dataclass(frozen=True)
class _Payload:
    data: bytes
    source: str | None
    filename: str | None
    name: str


def _payload(handler: Callable, op: str) -> _Payload:
    """The handler pickled by value with its globals, and its source text."""
    import cloudpickle

    if not callable(handler):
        raise PatchError(f"the handler for {op} must be a function, got {type(handler).__name__} {handler!r}")
    name = getattr(handler, "__qualname__", None) or getattr(handler, "__name__", None) or repr(handler)
    module_name = getattr(handler, "__module__", None)
    module = sys.modules.get(module_name) if module_name else None
    by_value = module is not None and module_name != "__main__" and \
        module_name.split(".")[0] not in ("torch", "physicsnemo", "sharddbg")
    if by_value:
        cloudpickle.register_pickle_by_value(module)
    try:
        data = cloudpickle.dumps(handler)
    except (pickle.PicklingError, TypeError, AttributeError, ValueError) as exc:
        raise PatchError(f"the handler {name} for {op} cannot be sent to the ranks: cloudpickle could not pickle it "
                         f"({type(exc).__name__}: {short_message(str(exc))}). It, and every value it reads from the "
                         f"notebook, must be picklable: create locks, files and the like inside the handler") from None
    finally:
        if by_value:
            cloudpickle.unregister_pickle_by_value(module)
    code = getattr(handler, "__code__", None)
    filename = code.co_filename if code is not None else None
    lines = linecache.getlines(filename) if filename else []
    return _Payload(data, "".join(lines) or None, filename, name)


def _check_function_signature(handler: Callable, op: str, kind: str) -> None:
    if kind != "function":
        return  # a dispatch handler's arguments are the op's: the ranks check them against its schema
    try:
        sig = inspect.signature(handler)
    except (TypeError, ValueError):
        return
    try:
        sig.bind(None, (), (), {})
    except TypeError:
        name = getattr(handler, "__name__", repr(handler))
        raise PatchError(f"the handler {name}{sig} for {op} has the wrong signature: ShardTensor calls a function "
                         f"handler as handler(func, types, args, kwargs)") from None


def _refusal(exc: RankError) -> str | None:
    """The ranks' refusal as one sentence, when every failing rank refused (PatchRefused)."""
    causes = [exc.errors[r] for r in exc.causes if r in exc.errors]
    if causes and all(c.type_name == _REFUSED for c in causes):
        ranks = sorted(r for r in exc.causes if r in exc.errors)
        first = short_message(causes[0].message)
        return first if len(ranks) == len(exc.errors) else f"rank {ranks[0]} refused it: {first}"
    return None


def _on_ranks(execution, fn, *args, timeout: float) -> list:
    __tracebackhide__ = hide_own_frames()
    try:
        return execution.apply(fn, args, {}, execution.ranks(None), timeout)
    except RankError as exc:
        sentence = _refusal(exc)
        if sentence is not None:
            raise PatchError(sentence + "; the ranks are as they were") from None
        raise


def _kind(kind: Any) -> str:
    if kind not in KINDS:
        raise PatchError(f"kind must be \"function\" (ShardTensor.register_function_handler) or \"dispatch\" "
                         f"(register_dispatch_handler), got {kind!r}")
    return kind


def patch(execution, op: Any, handler: Callable, *, kind: str = "function", timeout: float | None = None) -> PatchRecord:
    """``Cluster.patch``: see the module docstring."""
    __tracebackhide__ = hide_own_frames()
    name = op_text(op)
    kind = _kind(kind)
    timeout = arguments.seconds("timeout", timeout, allow_none=True) or execution.default_timeout
    if not callable(handler):
        raise PatchError(f"the handler for {name} must be a function, got {type(handler).__name__} {handler!r}")
    _check_function_signature(handler, name, kind)
    payload = _payload(handler, name)
    try:
        prepared = _on_ranks(execution, api.patch_prepare, name, kind, payload.data, payload.source,
                             payload.filename, timeout=timeout)
    except BaseException:
        _discard(execution, timeout)
        raise
    op_name = prepared[0]["op"]
    try:
        _on_ranks(execution, api.patch_commit, op_name, timeout=timeout)
    except BaseException:  # a rank that committed takes it back: all or nothing
        _remove_where_installed(execution, op_name, timeout)
        raise
    return PatchRecord(op_name, kind, prepared[0]["handler"], prepared[0]["replaces"])


def _discard(execution, timeout: float) -> None:
    try:
        execution.apply(api.patch_discard, (), {}, execution.ranks(None), min(timeout, 30.0))
    except ShardDbgError:
        pass


def _remove_where_installed(execution, op: str, timeout: float) -> None:
    try:
        states = execution.apply(api.patch_installed, (), {}, execution.ranks(None), min(timeout, 30.0))
        ranks = [r for r, s in enumerate(states) if any(p["op"] == op for p in s)]
        if ranks:
            execution.apply(api.patch_remove, (op,), {}, ranks, min(timeout, 30.0))
    except ShardDbgError:
        pass


def unpatch(execution, op: Any, *, timeout: float | None = None) -> PatchRecord:
    """``Cluster.unpatch``: see the module docstring."""
    __tracebackhide__ = hide_own_frames()
    name = op_text(op)
    timeout = arguments.seconds("timeout", timeout, allow_none=True) or execution.default_timeout
    states = execution.apply(api.patch_installed, (), {}, execution.ranks(None), timeout)
    resolved = _installed_name(name, states)
    if resolved is None:
        ops = sorted({p["op"] for s in states for p in s})
        raise PatchError(f"{name} has no handler registered by cl.patch (registered now: {', '.join(ops) or 'none'}); "
                         f"the ranks are as they were")
    removed = _on_ranks(execution, api.patch_remove, resolved, timeout=timeout)
    return PatchRecord(resolved, removed[0]["kind"], removed[0]["handler"], None)


def _installed_name(name: str, states: list[list[dict]]) -> str | None:
    """The registered op ``name`` stands for (the name sharddbg prints, or a short form like ``F.silu``)."""
    ops = {p["op"] for s in states for p in s}
    if name in ops:
        return name
    tail = name.rsplit(".", 1)[-1]
    matches = [o for o in ops if o.rsplit(".", 1)[-1] == tail]
    return matches[0] if len(matches) == 1 else None


def _repeated(stmt: str, repeat: int) -> str:
    if repeat == 1:
        return stmt
    return f"for _sharddbg_repeat in range({repeat}):\n" + textwrap.indent(stmt, "    ")


def _handler_failure(exc: RankError, op: str, filename: str | None, n: int) -> str:
    """'the handler for torch.diff raised TypeError: boom on rank 1 (ran on rank 0), at line 4 of the handler:
    `raise TypeError(...)`'."""
    ranks = [r for r in exc.causes if r in exc.errors] or sorted(exc.errors)
    first = exc.errors[ranks[0]]
    where = ""
    if filename and filename in first.traceback:
        hits = re.findall(re.escape(filename) + r"\D+(\d+)", first.traceback)
        if hits:
            line = int(hits[-1])
            code = linecache.getline(filename, line).strip()
            where = f", at line {line} of the handler" + (f": `{code}`" if code else "")
    others = sorted(set(range(n)) - set(exc.errors))
    ran = f" (it ran on {'rank' if len(others) == 1 else 'ranks'} {', '.join(map(str, others))})" if others else ""
    type_name, message, hidden = first.type_name, short_message(first.message), ""
    if first.type_name == "UnmaskedOpError":
        # "Tensor.add raised TypeError on rank 0 at cell ..., line 1: `y = x + x`: <the real message>"
        m = re.search(r" raised ([\w.]+) on rank \d+", message)
        type_name = m.group(1) if m else "TypeError"
        message = message.rsplit("`: ", 1)[-1] if "`: " in message else message.split(": ", 1)[-1]
        hidden = (" (inside a Python operator, where PyTorch alone would have hidden it behind a generic "
                  "operand-type message; sharddbg's recorder unmasked it)")
    who = f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {', '.join(map(str, ranks))}"
    if filename and not where:
        return (f"with the handler for {op} registered, the statement raised on {who}{ran}, not inside the handler: "
                f"{type_name}: {message}{hidden} (is the function it calls the one the handler is registered for? "
                f"an op called as torch.ops.<ns>.<op>(...) reaches ShardTensor as the packet, not the overload)")
    return f"the handler for {op} raised on {who}{ran}: {type_name}: {message}{hidden}{where}"


def check_patch(cluster, execution, op: Any, stmt: str, handler: Callable | None = None, *, kind: str = "function",
                inputs=None, outputs=None, model=None, loss: str | None = None, rtol: float | None = None,
                atol: float | None = None, grads: bool = True, repeat: int = 3, keep: bool = False,
                before: bool = True, timeout: float | None = None) -> PatchCheck:
    """``Cluster.check_patch``: see the module docstring and the method."""
    __tracebackhide__ = hide_own_frames()
    name = op_text(op)
    kind = _kind(kind)
    if not isinstance(stmt, str) or not stmt.strip():
        raise PatchError(f"the statement must be Python source text, got {stmt!r}")
    try:
        compile(stmt, "<statement>", "exec")
    except SyntaxError as exc:
        raise PatchError(f"the statement is not valid Python ({exc.msg}, line {exc.lineno}): {stmt!r}") from None
    if isinstance(repeat, bool) or not isinstance(repeat, int) or repeat < 1:
        raise PatchError(f"repeat must be a whole number of at least 1, got {repeat!r}")
    if not isinstance(keep, bool):
        raise PatchError(f"keep must be True or False, got {keep!r}")
    if not isinstance(before, bool):
        raise PatchError(f"before must be True or False, got {before!r}")
    timeout = arguments.seconds("timeout", timeout, allow_none=True) or execution.default_timeout
    states = execution.apply(api.patch_installed, (), {}, execution.ranks(None), timeout)
    registered = _installed_name(name, states)
    if handler is None and registered is None:
        raise PatchError(f"{name} has no handler registered by cl.patch: pass handler=, or cl.patch() it first")
    if handler is not None and registered is not None:
        raise PatchError(f"{registered} already has a handler registered by cl.patch: leave out handler= to check "
                         f"that one, or cl.unpatch({registered!r}) first")
    if handler is not None:  # refused before anything runs: not a function, wrong signature, not picklable
        if not callable(handler):
            raise PatchError(f"the handler for {name} must be a function, got {type(handler).__name__} {handler!r}")
        _check_function_signature(handler, name, kind)
        _payload(handler, name)
    filename = getattr(getattr(handler, "__code__", None), "co_filename", None)
    check_args = dict(inputs=inputs, outputs=outputs, model=model, loss=loss, rtol=rtol, atol=atol, grads=grads,
                      timeout=timeout, display=False)
    traced = _repeated(stmt, repeat)
    installed_here = suspended = False
    traces, checks = {}, {}
    try:
        if registered is not None:
            _on_ranks(execution, api.patch_suspend, registered, timeout=timeout)
            suspended = True
        before_error = None
        if before:
            try:
                traces["before"] = cluster.trace(traced, timeout=timeout, display=False)
            except RankError as exc:  # the op cannot run without a handler (no DTensor sharding strategy, ...)
                if cluster.broken is not None:
                    raise
                ranks = [r for r in exc.causes if r in exc.errors] or sorted(exc.errors)
                failure = exc.errors[ranks[0]]
                who = "every rank" if len(ranks) == execution.n else f"rank{'s' if len(ranks) > 1 else ''} " \
                                                                    f"{', '.join(map(str, ranks))}"
                line = failure.cell_code or stmt.strip().splitlines()[0]
                before_error = f"without the handler {line!r} raised on {who}: " \
                               f"{failure.type_name}: {short_message(failure.message)}"
            else:
                checks["before"] = cluster.check(stmt, **check_args)
        if handler is not None:
            record = patch(execution, name, handler, kind=kind, timeout=timeout)
            installed_here = True
        else:
            _on_ranks(execution, api.patch_resume, registered, timeout=timeout)
            suspended = False
            found = next(p for s in states for p in s if p["op"] == registered)
            record = PatchRecord(registered, found["kind"], found["handler"], None)
            filename = None
        try:
            traces["after"] = cluster.trace(traced, timeout=timeout, display=False)
            checks["after"] = cluster.check(stmt, **check_args)
        except RankError as exc:
            ranks = [r for r in exc.causes if r in exc.errors] or sorted(exc.errors)
            undone = ("the handler was taken back and the ranks are as they were" if installed_here and not keep
                      else "the handler stays registered")
            shown = exc.errors[ranks[0]].traceback if ranks else ""
            raise PatchError(f"{_handler_failure(exc, record.op, filename, execution.n)}; {undone}\n{shown}") from None
    finally:
        if suspended:
            _on_ranks(execution, api.patch_resume, registered, timeout=timeout)
        if installed_here and not keep:
            _remove_where_installed(execution, record.op, timeout)
    op_name = record.op
    sides = {label: patch_side(label, op_name, traces[label].get_ops(), traces[label].get_collectives(), check)
             for label, check in checks.items()}
    return PatchCheck(op_name, kind, stmt, record.handler, sides.get("before"), sides["after"], traces,
                      before_error=before_error)
