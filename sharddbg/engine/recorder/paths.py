"""Which path ShardTensor takes for a call: the dispatch-path decision, as pure functions of the registries.

It mirrors ShardTensor's own order (physicsnemo/domain_parallel/shard_tensor.py), read at call time by the
recorder's wrappers, which pass the registries as they are at that moment (``without_patches`` edits them):

``__torch_function__``: a ShardTensor<->DTensor conversion in progress runs the call plain ("conversion");
an autograd-identity function (register_hook, retain_grad, torch.autograd.grad, ...) runs on the real tensor
("autograd_passthrough"); then, only while shard patches are enabled, ``_function_registry[func]``
("function_handler") or ``_named_function_registry[str(func)]`` ("named_handler"); otherwise the DTensor
fallback ("dtensor_fallback_function"). Calls on FakeTensors (torch.compile tracing, ShardTensor's
"compile_tracing" branch) are not recorded at all, so that branch is not decided here.

``__torch_dispatch__``: ``_dispatch_registry[func]``, else ``_dispatch_registry_by_name[str(func)]``
("dispatch_handler"), else the DTensor fallback ("dtensor_fallback_dispatch").
"""

from __future__ import annotations

from typing import Any, Callable, Mapping

# the dispatch paths decided here (schema.PATHS lists every path a record may carry)
CONVERSION = "conversion"
AUTOGRAD_PASSTHROUGH = "autograd_passthrough"
FUNCTION_HANDLER = "function_handler"
NAMED_HANDLER = "named_handler"
DTENSOR_FALLBACK_FUNCTION = "dtensor_fallback_function"
DISPATCH_HANDLER = "dispatch_handler"
DTENSOR_FALLBACK_DISPATCH = "dtensor_fallback_dispatch"


class PathChoice:
    """The path a call takes and the function that handles it (the registered handler, or the fallback
    function for the fallback paths; None where the call runs as it is)."""

    __slots__ = ("path", "handler")

    def __init__(self, path: str, handler: Callable | None) -> None:
        self.path = path
        self.handler = handler

    def __eq__(self, other: object) -> bool:
        return isinstance(other, PathChoice) and other.path == self.path and other.handler is self.handler

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        return f"PathChoice({self.path!r}, {self.handler!r})"


def function_path(func: Any, *, converting: bool, passthrough: Any, function_registry: Mapping,
                  named_registry: Mapping, patches_enabled: bool, fallback: Callable | None = None) -> PathChoice:
    """The path of ``ShardTensor.__torch_function__(func, ...)``.

    ``converting``: a ShardTensor<->DTensor conversion is in progress; ``passthrough``: the autograd-identity
    functions; ``function_registry`` / ``named_registry``: handlers by function and by ``str(func)``;
    ``patches_enabled``: ShardTensor's ``_enable_shard_patches``; ``fallback``: the DTensor fallback function.
    """
    if converting:
        return PathChoice(CONVERSION, None)
    if func in passthrough:
        return PathChoice(AUTOGRAD_PASSTHROUGH, None)
    if patches_enabled:
        handler = function_registry.get(func)
        if handler is not None:
            return PathChoice(FUNCTION_HANDLER, handler)
        handler = named_registry.get(str(func))
        if handler is not None:
            return PathChoice(NAMED_HANDLER, handler)
    return PathChoice(DTENSOR_FALLBACK_FUNCTION, fallback)


def dispatch_path(func: Any, dispatch_registry: Mapping, dispatch_registry_by_name: Mapping,
                  fallback: Callable | None = None) -> PathChoice:
    """The path of ``ShardTensor.__torch_dispatch__(func, ...)``: a handler by op, else by the op's name,
    else the DTensor fallback ``fallback``."""
    handler = dispatch_registry.get(func)
    if handler is None:
        handler = dispatch_registry_by_name.get(str(func))
    if handler is not None:
        return PathChoice(DISPATCH_HANDLER, handler)
    return PathChoice(DTENSOR_FALLBACK_DISPATCH, fallback)
