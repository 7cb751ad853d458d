"""Run chosen ops through ShardTensor's DTensor fallback instead of their registered patch.

    with without_patches(torch.nn.functional.conv2d):
        y = F.conv2d(x, w)      # dtensor_fallback_function instead of function_handler

Compare a patch against the generic path (result, communication, time). The registries are restored
on exit, also after an exception.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Any, Iterator

from ..errors import NoPatchError
from .recorder.tensors import op_name

__all__ = ["without_patches", "NoPatchError", "registered_patches"]


_REGISTRIES = ("_function_registry", "_named_function_registry", "_dispatch_registry", "_dispatch_registry_by_name")


def _st():
    from physicsnemo.domain_parallel.shard_tensor import ShardTensor

    return ShardTensor


def registered_patches() -> dict[str, list[str]]:
    """The ops ShardTensor routes to a registered patch on this rank, registry by registry.

    Read from ShardTensor's four registries (``_function_registry``, ``_named_function_registry``,
    ``_dispatch_registry``, ``_dispatch_registry_by_name``) as they are now: inside a ``without_patches``
    block, without the ops it removed. Imports physicsnemo.

    Returns
    -------
    dict of str to list of str
        Registry name -> the ops registered there, as strings (a registry's own string keys, else the op's
        name as sharddbg prints it: ``"torch.conv2d"``, ``"Tensor.mean"``, ``"aten.view.default"``), sorted.
        Every registry is there, empty or not.

    Examples
    --------
    In a ``%%px`` cell on the ranks (patches registered: on CPU ranks the cluster registers them):

    >>> from sharddbg.engine.patches import registered_patches
    >>> patches = registered_patches()
    >>> sorted(patches)
    ['_dispatch_registry', '_dispatch_registry_by_name', '_function_registry', '_named_function_registry']
    >>> "torch.conv2d" in patches["_function_registry"]
    True
    """
    ST = _st()
    return {r: sorted(k if isinstance(k, str) else op_name(k) for k in getattr(ST, r, {})) for r in _REGISTRIES}


def _matches(op: Any) -> list[tuple[dict, Any]]:
    """(registry, key) pairs that route ``op`` to a patch."""
    import torch

    ST = _st()
    found: list[tuple[dict, Any]] = []
    keys: list[tuple[str, Any]] = []
    if isinstance(op, str):
        # a registry key ("aten.view.default", "physicsnemo.knn_cuml.default") or an op name as
        # sharddbg prints it ("torch.conv2d", "Tensor.mean")
        for r in _REGISTRIES:
            for k in getattr(ST, r, {}):
                if k == op or (not isinstance(k, str) and op_name(k) == op):
                    keys.append((r, k))
    else:
        if isinstance(op, torch._ops.OpOverloadPacket):
            overloads = [getattr(op, o) for o in op.overloads()]
        else:
            overloads = [op]
        for o in overloads:
            for r in _REGISTRIES:
                reg = getattr(ST, r)
                if r.endswith("by_name") or r == "_named_function_registry":
                    k = str(o)
                    if k in reg:
                        keys.append((r, k))
                else:
                    try:
                        if o in reg:
                            keys.append((r, o))
                    except TypeError:  # unhashable
                        pass
    seen = set()
    for r, k in keys:
        if (r, k) not in seen:
            seen.add((r, k))
            found.append((getattr(ST, r), k))
    return found


@contextmanager
def without_patches(*ops: Any) -> Iterator[None]:
    """Remove ``ops`` from ShardTensor's registries for the duration of the block.

    Inside it those ops run through ShardTensor's DTensor fallback (``dtensor_fallback_function``) instead
    of their registered patch (``function_handler``), which lets a patch be compared with the generic path
    (result, communication, time). Every registry entry that routes an op to a patch is removed (a name can
    match several registries), and each is put back on exit, also after an exception. The registries are
    ShardTensor's class attributes: the removal holds for the whole process (every thread) while the block
    runs. An op already removed by an enclosing block has no patch left to remove.

    Parameters
    ----------
    *ops : callable, torch op or str
        The callables the patches are registered for (``torch.nn.functional.conv2d``,
        ``torch.Tensor.mean``), aten ops (``torch.ops.aten.view.default`` or the packet
        ``torch.ops.aten.view``, for each of its overloads), or their names: a registry key
        (``"aten.view.default"``, ``"physicsnemo.knn_cuml.default"``) or the name sharddbg prints
        (``"torch.conv2d"``, ``"Tensor.mean"``). At least one.

    Yields
    ------
    None
        The block runs with the patches removed.

    Raises
    ------
    ValueError
        No op was given (raised when the block is entered).
    NoPatchError
        An op has no patch to remove (it already runs through the DTensor fallback, or the patches are not
        registered on this rank); raised when the block is entered, before anything is changed.

    Examples
    --------
    In a ``%%px`` cell on the ranks, ``x`` a ShardTensor split along dim 2:

    >>> from sharddbg.engine.patches import without_patches
    >>> w = torch.randn(4, 3, 3, 3)
    >>> y = F.conv2d(x, w, padding=1)  # the patch: halo exchange
    >>> with without_patches(F.conv2d):
    ...     y_fallback = F.conv2d(x, w, padding=1)  # the DTensor fallback
    >>> with without_patches(torch.add):  # doctest: +ELLIPSIS
    ...     pass
    Traceback (most recent call last):
    ...
    sharddbg.errors.NoPatchError: torch.add has no ShardTensor patch to remove (it already runs through ...
    """
    if not ops:
        raise ValueError("without_patches() needs at least one op")
    plan: list[tuple[dict, Any]] = []
    for op in ops:
        m = _matches(op)
        if not m:
            name = op if isinstance(op, str) else op_name(op)
            raise NoPatchError(
                f"{name} has no ShardTensor patch to remove (it already runs through the DTensor fallback, "
                "or patches are not registered on this rank: on CPU call "
                "physicsnemo.domain_parallel.register_custom_ops()). "
                "sharddbg.engine.patches.registered_patches() lists what is registered."
            )
        plan.extend(m)
    removed: list[tuple[dict, Any, Any]] = []
    try:
        for reg, key in plan:
            if key in reg:
                removed.append((reg, key, reg.pop(key)))
        yield
    finally:
        for reg, key, val in reversed(removed):
            reg[key] = val
