"""Helpers of the recorder that read state without side effects: names, frames, tensor metadata.

Nothing here may call a collective or re-enter ShardTensor dispatch. On a ShardTensor we read only the
slots ``_local_tensor`` / ``_spec`` (``t.shape`` or ``t.dtype`` would go through ``__torch_function__``)
and never call ``_spec.sharding_shapes()`` (an all_gather when ``_sharding_shapes`` is None).
"""

from __future__ import annotations

import dis
from typing import Any

import torch

try:  # only to detect torch.compile tracing cheaply
    from torch._subclasses.fake_tensor import FakeTensor
except Exception:  # pragma: no cover
    FakeTensor = ()  # type: ignore[assignment]

from torch.distributed.tensor import DTensor

# --- names -------------------------------------------------------------------------------------

_name_cache: dict[Any, str] = {}


def op_name(func: Any) -> str:
    """'torch.conv2d', 'Tensor.add', 'torch.nn.functional.linear', 'aten.add.Tensor'."""
    try:
        return _name_cache[func]
    except (KeyError, TypeError):
        pass
    if isinstance(func, (torch._ops.OpOverload, torch._ops.OpOverloadPacket)):
        name = str(func)
    elif type(func).__name__ == "method-wrapper" and hasattr(getattr(func, "__self__", None), "__objclass__"):
        # an attribute read such as `t.ndim` reaches __torch_function__ as Tensor.ndim.__get__
        d = func.__self__
        name = f"Tensor.{d.__name__}.{func.__name__}"
    else:
        qn = getattr(func, "__qualname__", None) or getattr(func, "__name__", None) or repr(func)
        mod = getattr(func, "__module__", None)
        if qn.startswith("_VariableFunctionsClass."):
            name = "torch." + qn.split(".", 1)[1]
        elif qn.startswith(("TensorBase.", "Tensor.")):
            name = "Tensor." + qn.split(".", 1)[1]
        elif mod and mod not in ("builtins",):
            name = f"{mod}.{qn}"
        else:
            name = qn
    try:
        _name_cache[func] = name
    except TypeError:
        pass
    return name


def qualname(fn: Any) -> str | None:
    if fn is None:
        return None
    try:
        return _name_cache[("h", fn)]
    except (KeyError, TypeError):
        pass
    mod = getattr(fn, "__module__", None) or ""
    qn = getattr(fn, "__qualname__", None) or getattr(fn, "__name__", None) or repr(fn)
    name = f"{mod}.{qn}" if mod else qn
    try:
        _name_cache[("h", fn)] = name
    except TypeError:
        pass
    return name


def new_cuda_event():
    """A timing event recorded on the current stream. ``torch.Event`` (C++) finds the current stream
    itself; ``torch.cuda.Event.record()`` builds a Python Stream object first (~15-35 us per event)."""
    return torch.Event("cuda", enable_timing=True)


if not hasattr(torch, "Event"):  # older torch
    def new_cuda_event():  # noqa: F811
        return torch.cuda.Event(enable_timing=True)


_node_names: dict[type, str] = {}


def node_name(node: Any) -> str:
    """``node.name()`` (fixed per node class: C++ nodes and Python Function backward classes alike),
    cached per class because building the string costs more than looking it up."""
    try:
        return _node_names[type(node)]
    except KeyError:
        name = _node_names[type(node)] = node.name()
        return name


# --- the TypeError trap --------------------------------------------------------------------------

# Python dunders in torch/_tensor.py that turn a TypeError into NotImplemented (found by the decorator,
# so a new torch version's list is picked up without editing this file).
_WRAP_QUALNAME = "_handle_torch_function_and_wrap_type_error_to_not_implemented.<locals>.wrapped"
PY_SWALLOWING_DUNDERS = frozenset(
    v
    for v in vars(torch.Tensor).values()
    if getattr(getattr(v, "__code__", None), "co_qualname", "") == _WRAP_QUALNAME
)
# C++ binary dunders (TypeError_to_NotImplemented_ in python_variable_methods.cpp) hand the torch
# function the plain method (Tensor.add for `+`); only the calling frame's instruction tells `x + y`
# from `x.add(y)`.
_SWALLOWING_OPCODES = frozenset(dis.opmap[n] for n in ("BINARY_OP", "COMPARE_OP") if n in dis.opmap)
for _n in ("BINARY_SUBTRACT", "BINARY_ADD", "BINARY_MULTIPLY", "BINARY_TRUE_DIVIDE", "INPLACE_ADD"):  # py < 3.11
    if _n in dis.opmap:
        _SWALLOWING_OPCODES = _SWALLOWING_OPCODES | {dis.opmap[_n]}

_OPERAND_TYPES = (torch.Tensor, int, float, complex, bool)


def would_swallow_type_error(func: Any, args: tuple, caller) -> bool:
    """Would PyTorch turn a TypeError raised for this call into a generic 'unsupported operand'?

    Only for binary dunders whose operands are all tensors or numbers: with any other operand
    (``x == None``, ``x + "a"``) NotImplemented is the legitimate answer and must stay untouched.
    """
    if len(args) != 2 or not all(isinstance(a, _OPERAND_TYPES) for a in args):
        return False
    if func in PY_SWALLOWING_DUNDERS:
        return True
    if caller is None or caller.f_lasti < 0:
        return False
    try:
        return caller.f_code.co_code[caller.f_lasti] in _SWALLOWING_OPCODES
    except IndexError:
        return False


# --- tensor metadata -----------------------------------------------------------------------------

_placements_str: dict[Any, str] = {}


def placements_str(pl: Any) -> str | None:
    if pl is None:
        return None
    try:
        return _placements_str[pl]
    except KeyError:
        s = "(" + ", ".join(str(p) for p in pl) + ("," if len(pl) == 1 else "") + ")"
        _placements_str[pl] = s
        return s
    except TypeError:
        return str(tuple(pl))


def _flag(t: torch.Tensor) -> int:
    if isinstance(t, FakeTensor):
        return 1
    return 2 if t.is_cuda else 0


def tensor_info(t: Any, ShardTensor: type) -> tuple | None:
    """(local_shape, global_shape, placements, local_bytes, dtype, sharding_shapes, flag).

    flag: 0 ordinary, 1 FakeTensor (torch.compile tracing), 2 on CUDA. Holds no tensor reference.
    Returns None for non-tensors. Reads slots only (no dispatch, no communication).
    """
    if isinstance(t, ShardTensor):
        lt = t._local_tensor
        spec = t._spec
        meta = spec.tensor_meta
        gshape = meta.shape if meta is not None else None
        return (lt.shape, gshape, spec.placements, lt.numel() * lt.element_size(), lt.dtype,
                getattr(spec, "_sharding_shapes", None), _flag(lt))
    if isinstance(t, DTensor):
        lt = t._local_tensor
        spec = t._spec
        meta = spec.tensor_meta
        return (lt.shape, meta.shape if meta is not None else None, spec.placements,
                lt.numel() * lt.element_size(), lt.dtype, None, _flag(lt))
    if isinstance(t, torch.Tensor):
        # A plain tensor (or another subclass without ShardTensor's hooks): metadata reads are local.
        return (t.shape, t.shape, None, t.numel() * t.element_size(), t.dtype, None, _flag(t))
    return None


def collect_tensors(args: Any, kwargs: Any, ShardTensor: type, limit: int = 64) -> list[tuple]:
    """tensor_info of the tensors in args/kwargs: top level plus one level of lists/tuples (torch.cat)."""
    out: list[tuple] = []
    for seq in (args, kwargs.values() if kwargs else ()):
        for a in seq:
            if isinstance(a, (list, tuple)):
                for b in a:
                    info = tensor_info(b, ShardTensor)
                    if info is not None:
                        out.append(info)
            else:
                info = tensor_info(a, ShardTensor)
                if info is not None:
                    out.append(info)
            if len(out) >= limit:
                return out
    return out


def shape_list(s: Any) -> list[int] | None:
    if s is None:
        return None
    return [int(d) for d in s]


def sharding_shapes_plain(ss: Any) -> dict | None:
    if not ss:
        return None
    try:
        return {str(int(k)): [shape_list(s) for s in v] for k, v in ss.items()}
    except Exception:  # noqa: BLE001 - symbolic or odd entries: keep a readable form
        return {str(k): [str(s) for s in v] for k, v in ss.items()}
