"""Handlers the notebook registers with ShardTensor on this rank (``Cluster.patch``), and taking them back.

A handler arrives pickled by value (cloudpickle) with the source of the cell that defined it. It is registered
in two steps so that the ranks change together or not at all: ``prepare`` (resolve the op, unpickle the handler,
check its signature; nothing changes) and ``commit`` (put it into ShardTensor's registries, remembering what
each entry held before), or ``discard`` when any rank refused. ``remove`` puts every entry back exactly as it
was: the previous handler object where there was one, no key where there was none. ``suspend`` / ``resume``
take a registered handler out for a while and put it back (``Cluster.check_patch`` runs the op unpatched).

The handler's source goes into ``linecache`` under the file name its code carries, so a traceback through it on
this rank shows the handler's own lines.
"""

from __future__ import annotations

import builtins
import inspect
import linecache
import types
from dataclasses import dataclass, field
from typing import Any, Callable

from .recorder.tensors import op_name

__all__ = ["PatchRefused", "prepare", "commit", "discard", "remove", "suspend", "resume", "installed",
           "registry_state", "resolve_op"]

KINDS = ("function", "dispatch")


class PatchRefused(ValueError):
    """This rank refused a handler (an op that is not a torch function, a handler that does not load or has
    the wrong signature); nothing was changed."""


@dataclass
class _Entry:
    """One registry key the patch set, and what it held before (``had``: the key was there)."""

    registry: str
    key: Any
    had: bool
    previous: Any


@dataclass
class _UserPatch:
    op: str
    kind: str
    func: Any
    handler: Callable
    handler_name: str
    entries: list[_Entry] = field(default_factory=list)
    suspended: bool = False


_INSTALLED: dict[str, _UserPatch] = {}
_PENDING: dict[str, _UserPatch] = {}


def _st():
    from physicsnemo.domain_parallel.shard_tensor import ShardTensor

    return ShardTensor


def _user_namespace() -> dict:
    try:
        from IPython import get_ipython

        shell = get_ipython()
        return shell.user_ns if shell is not None else {}
    except ImportError:  # pragma: no cover - engines always have IPython
        return {}


def _walk(root: Any, dotted: str) -> Any:
    obj = root
    for part in dotted.split("."):
        obj = getattr(obj, part, None)
        if obj is None:
            return None
    return obj


def _overridable() -> set:
    import torch

    found = set()
    for funcs in torch.overrides.get_overridable_functions().values():
        for f in funcs:
            try:
                found.add(f)
            except TypeError:
                pass
    return found


def resolve_op(name: str) -> Any:
    """The torch function or op overload ``name`` stands for on this rank: a name as sharddbg prints ops
    (``"torch.diff"``, ``"torch.nn.functional.silu"``, ``"Tensor.add"``, ``"aten.add.Tensor"``,
    ``"mylib.op.default"``), ``"torch.ops.<ns>.<op>.<overload>"``, or a dotted name in the ranks' namespace
    (``"F.silu"``, a ``torch.library.custom_op``). Raises PatchRefused when it is none of those."""
    import torch

    obj = None
    if name.startswith("Tensor."):
        obj = _walk(torch.Tensor, name[len("Tensor."):])
    elif name.startswith("torch."):
        obj = _walk(torch, name[len("torch."):])
    if obj is None and name.count(".") == 2 and not name.startswith(("torch.", "Tensor.")):
        namespace, _, rest = name.partition(".")
        try:
            obj = _walk(getattr(torch.ops, namespace), rest)
        except (AttributeError, RuntimeError):
            obj = None
    if obj is None:
        head, _, rest = name.partition(".")
        ns = _user_namespace()
        obj = ns.get(head) if not rest else (_walk(ns[head], rest) if head in ns else None)
    if obj is None:
        raise PatchRefused(f"{name!r} names nothing on the ranks: give a torch function (\"torch.diff\", "
                           f"\"torch.nn.functional.silu\", \"Tensor.add\") or an op overload (\"aten.diff.default\", "
                           f"\"mylib.op.default\")")
    overload = getattr(obj, "_opoverload", None)  # a torch.library.custom_op object
    if isinstance(overload, torch._ops.OpOverload):
        obj = overload
    if isinstance(obj, torch._ops.OpOverloadPacket):
        raise PatchRefused(f"{name!r} is an op with several overloads ({', '.join(obj.overloads())}): name one, "
                           f"e.g. \"{obj}.{obj.overloads()[0]}\"")
    if isinstance(obj, torch._ops.OpOverload):
        return obj
    if callable(obj) and (obj in _overridable() or torch.overrides.is_tensor_method_or_property(obj)):
        return obj
    raise PatchRefused(f"{name!r} is a {type(obj).__name__}, not a torch function or op overload: ShardTensor "
                       f"only routes functions that take part in torch's __torch_function__ protocol and aten ops")


def _keys(kind: str, func: Any) -> list[tuple[str, Any]]:
    if kind == "function":
        return [("_function_registry", func)]
    return [("_dispatch_registry", func), ("_dispatch_registry_by_name", str(func))]


def _names_used(code: types.CodeType) -> set[str]:
    names = set(code.co_names)
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            names |= _names_used(const)
    return names


def _with_filename(code: types.CodeType, filename: str) -> types.CodeType:
    """``code`` and the code objects nested in it under ``filename``, so that tracebacks find the source."""
    consts = tuple(_with_filename(c, filename) if isinstance(c, types.CodeType) else c for c in code.co_consts)
    return code.replace(co_filename=filename, co_consts=consts)


def _check_signature(kind: str, func: Any, handler: Callable, op: str) -> None:
    try:
        sig = inspect.signature(handler)
    except (TypeError, ValueError):
        return  # a builtin without a signature: nothing to check
    if kind == "function":
        try:
            sig.bind(func, (), (), {})
        except TypeError:
            raise PatchRefused(f"the handler {getattr(handler, '__name__', handler)!r} for {op} takes {sig}, but "
                               f"ShardTensor calls a function handler as handler(func, types, args, kwargs)") from None
        return
    required = [a for a in func._schema.arguments if not a.kwarg_only and not a.has_default_value()]
    try:
        sig.bind(*[None] * len(required))
    except TypeError:
        raise PatchRefused(f"the handler {getattr(handler, '__name__', handler)!r} for {op} takes {sig}, but "
                           f"ShardTensor calls a dispatch handler with the op's own arguments "
                           f"({', '.join(a.name for a in required)}): handler(*args, **kwargs)") from None


def prepare(op: str, kind: str, payload: bytes, source: str | None, filename: str | None) -> dict:
    """Resolve ``op``, load the handler from ``payload`` (cloudpickle), give it the names it reads from the
    ranks' namespace that it did not bring, check its signature, and keep it pending; ShardTensor's registries
    are not touched. The handler's ``source`` goes into linecache under ``filename``."""
    import cloudpickle

    if kind not in KINDS:
        raise PatchRefused(f"kind must be one of {KINDS}, got {kind!r}")
    func = resolve_op(op)
    if kind == "dispatch" and not type(func).__name__ == "OpOverload":
        raise PatchRefused(f"{op!r} is not an op overload: a dispatch handler is registered for an aten-level op "
                           f"(\"aten.diff.default\"); use kind=\"function\" for a torch function")
    name = op_name(func)
    try:
        handler = cloudpickle.loads(payload)
    except Exception as exc:  # noqa: BLE001 - whatever loading raised is the answer
        raise PatchRefused(f"the handler for {name} could not be loaded on this rank ({type(exc).__name__}: "
                           f"{exc}): what it refers to must exist on the ranks or travel with it") from None
    if not callable(handler):
        raise PatchRefused(f"the handler for {name} is a {type(handler).__name__}, not a function")
    code = getattr(handler, "__code__", None)
    glob = getattr(handler, "__globals__", None)
    if code is not None and glob is not None:
        ns = _user_namespace()
        for used in _names_used(code):
            if used not in glob and used in ns and not hasattr(builtins, used):
                glob[used] = ns[used]
    if source and filename:
        linecache.cache[filename] = (len(source), None, source.splitlines(True), filename)
        if code is not None and code.co_filename != filename:  # cloudpickle names dynamic code "<dynamic-code>"
            handler.__code__ = _with_filename(code, filename)
    _check_signature(kind, func, handler, name)
    _PENDING[name] = _UserPatch(op=name, kind=kind, func=func, handler=handler,
                                handler_name=f"{getattr(handler, '__module__', None) or ''}."
                                             f"{getattr(handler, '__qualname__', repr(handler))}".lstrip("."))
    previous = [_registry(r).get(k) for r, k in _keys(kind, func)]
    replaced = next((p for p in previous if p is not None), None)
    return {"op": name, "kind": kind, "handler": _PENDING[name].handler_name,
            "replaces": _qualname(replaced) if replaced is not None else None,
            "already_patched": name in _INSTALLED}


def _registry(name: str) -> dict:
    return getattr(_st(), name)


def _qualname(fn: Any) -> str:
    return f"{getattr(fn, '__module__', '')}.{getattr(fn, '__qualname__', repr(fn))}"


def commit(op: str) -> dict:
    """Register the pending handler of ``op`` (``prepare``), remembering what each registry entry held; a
    handler this workflow registered before for the op is taken back first."""
    pending = _PENDING.pop(op)
    if op in _INSTALLED:
        remove(op)
    for registry, key in _keys(pending.kind, pending.func):
        reg = _registry(registry)
        pending.entries.append(_Entry(registry, key, key in reg, reg.get(key)))
        reg[key] = pending.handler
    _INSTALLED[op] = pending
    return {"op": op, "kind": pending.kind, "handler": pending.handler_name}


def discard() -> None:
    """Forget every pending handler (another rank refused)."""
    _PENDING.clear()


def _restore(patch: _UserPatch) -> None:
    for e in reversed(patch.entries):
        reg = _registry(e.registry)
        if e.had:
            reg[e.key] = e.previous
        else:
            reg.pop(e.key, None)


def remove(op: str) -> dict:
    """Take the handler of ``op`` back: every registry entry as it was before ``commit``."""
    patch = _INSTALLED.pop(op, None)
    if patch is None:
        raise PatchRefused(f"{op} has no handler registered by cl.patch on this rank (registered now: "
                           f"{', '.join(sorted(_INSTALLED)) or 'none'})")
    if not patch.suspended:
        _restore(patch)
    return {"op": op, "kind": patch.kind, "handler": patch.handler_name}


def suspend(op: str) -> None:
    """Take the handler of ``op`` out of the registries (as ``remove``) but keep it for ``resume``."""
    patch = _INSTALLED[op]
    if not patch.suspended:
        _restore(patch)
        patch.suspended = True


def resume(op: str) -> None:
    """Put a suspended handler back."""
    patch = _INSTALLED.get(op)
    if patch is not None and patch.suspended:
        for e in patch.entries:
            _registry(e.registry)[e.key] = patch.handler
        patch.suspended = False


def installed() -> list[dict]:
    """The handlers registered by ``cl.patch`` on this rank: op, kind, handler, suspended."""
    return [{"op": p.op, "kind": p.kind, "handler": p.handler_name, "suspended": p.suspended}
            for p in _INSTALLED.values()]


def registry_state() -> dict[str, dict[str, int]]:
    """Every entry of ShardTensor's four registries: registry -> {key as text: id of the handler object}, to
    tell that they are exactly as they were."""
    out = {}
    for registry in ("_function_registry", "_named_function_registry", "_dispatch_registry",
                     "_dispatch_registry_by_name"):
        out[registry] = {k if isinstance(k, str) else f"{op_name(k)}@{id(k)}": id(v)
                         for k, v in _registry(registry).items()}
    return out
