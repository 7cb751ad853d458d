"""What the recorder reads of tensors and callables, without side effects: tensor metadata, names, the
TypeError trap, whether torch.compile is tracing.

Nothing here may call a collective or re-enter ShardTensor dispatch. On a ShardTensor we read only the
slots ``_local_tensor`` / ``_spec`` (``t.shape`` or ``t.dtype`` would go through ``__torch_function__``)
and never call ``_spec.sharding_shapes()`` (an all_gather when ``_sharding_shapes`` is None).
"""

from __future__ import annotations

import dis
from typing import Any

import torch
from torch.distributed.tensor import DTensor

try:
    from torch._subclasses.fake_tensor import FakeTensor
except Exception:  # pragma: no cover - another torch layout
    FakeTensor = ()  # type: ignore[assignment,misc]

# --- tensor metadata -----------------------------------------------------------------------------


class TensorInfo:
    """One tensor argument or result of an op, as plain metadata (holds no tensor).

    ``local_shape`` / ``global_shape`` are torch.Size objects (made plain lists at export); ``placements``
    is None for a plain tensor; ``sharding_shapes`` is a ShardTensor's ``_spec._sharding_shapes`` (None
    for DTensor and plain tensors); ``mesh``: the DeviceMesh of a ShardTensor or DTensor (None for a plain
    tensor); ``shard_tensor``: a ShardTensor (its spec is checked against its local tensor at export);
    ``fake``: a FakeTensor (torch.compile is tracing); ``on_cuda``: a real tensor on a CUDA device (its op
    is timed with CUDA events).
    """

    __slots__ = ("local_shape", "global_shape", "placements", "local_bytes", "dtype", "sharding_shapes", "mesh",
                 "shard_tensor", "fake", "on_cuda")

    def __repr__(self) -> str:
        return "TensorInfo(" + ", ".join(f"{k}={getattr(self, k)!r}" for k in self.__slots__) + ")"


_new_info = TensorInfo.__new__  # tensor_info builds one per tensor of every op: no __init__ call


def tensor_info(t: Any, shard_tensor_cls: type) -> TensorInfo | None:
    """The TensorInfo of ``t``; None for a non-tensor. Reads slots only (no dispatch, no communication)."""
    if isinstance(t, shard_tensor_cls):
        i = _new_info(TensorInfo)
        lt = t._local_tensor
        spec = t._spec
        meta = spec.tensor_meta
        i.global_shape = meta.shape if meta is not None else None
        i.placements = spec.placements
        i.sharding_shapes = getattr(spec, "_sharding_shapes", None)
        i.mesh = spec.mesh
        i.shard_tensor = True
    elif isinstance(t, DTensor):
        i = _new_info(TensorInfo)
        lt = t._local_tensor
        spec = t._spec
        meta = spec.tensor_meta
        i.global_shape = meta.shape if meta is not None else None
        i.placements = spec.placements
        i.sharding_shapes = None
        i.mesh = spec.mesh
        i.shard_tensor = False
    elif isinstance(t, torch.Tensor):
        # A plain tensor (or another subclass without ShardTensor's hooks): metadata reads are local.
        i = _new_info(TensorInfo)
        lt = t
        i.global_shape = t.shape
        i.placements = None
        i.sharding_shapes = None
        i.mesh = None
        i.shard_tensor = False
    else:
        return None
    i.local_shape = lt.shape
    i.local_bytes = lt.numel() * lt.element_size()
    i.dtype = lt.dtype
    if isinstance(lt, FakeTensor):
        i.fake = True
        i.on_cuda = False
    else:
        i.fake = False
        i.on_cuda = lt.is_cuda
    return i


def collect_tensors(args: Any, kwargs: Any, shard_tensor_cls: type, limit: int = 64) -> list[TensorInfo]:
    """tensor_info of the tensors in args/kwargs: top level plus one level of lists/tuples (torch.cat)."""
    out: list[TensorInfo] = []
    for seq in (args, kwargs.values() if kwargs else ()):
        for a in seq:
            if isinstance(a, (list, tuple)):
                for b in a:
                    info = tensor_info(b, shard_tensor_cls)
                    if info is not None:
                        out.append(info)
            else:
                info = tensor_info(a, shard_tensor_cls)
                if info is not None:
                    out.append(info)
            if len(out) >= limit:
                return out
    return out


def result_tensors(res: Any) -> list:
    """The tensors of an op's result: itself, or the tensors of a tuple/list result (at most 64)."""
    if isinstance(res, torch.Tensor):
        return [res]
    if isinstance(res, (tuple, list)):
        return [r for r in res[:64] if isinstance(r, torch.Tensor)]
    return []


_FAKE_MODE_KEY = getattr(getattr(torch._C, "_TorchDispatchModeKey", None), "FAKE", None)


def compile_tracing() -> bool:
    """torch.compile is tracing (a FakeTensor mode is active / dynamo is compiling)."""
    if _FAKE_MODE_KEY is not None and torch._C._get_dispatch_mode(_FAKE_MODE_KEY) is not None:
        return True
    return torch.compiler.is_compiling()


# --- plain forms for export ------------------------------------------------------------------------

_placements_str: dict[Any, str] = {}


def placements_str(pl: Any) -> str | None:
    """'(S(2),)' for a placements tuple, None for None."""
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


def shape_list(s: Any) -> list[int] | None:
    if s is None:
        return None
    return [int(d) for d in s]


def sharding_shapes_plain(ss: Any) -> dict | None:
    """``{mesh_dim: [shape per rank]}`` with str keys and list shapes (JSON-able)."""
    if not ss:
        return None
    try:
        return {str(int(k)): [shape_list(s) for s in v] for k, v in ss.items()}
    except Exception:  # noqa: BLE001 - symbolic or odd entries: keep a readable form
        return {str(k): [str(s) for s in v] for k, v in ss.items()}


# --- names -----------------------------------------------------------------------------------------

_op_names: dict[Any, str] = {}
_qualnames: dict[Any, str] = {}


def op_name(func: Any) -> str:
    """'torch.conv2d', 'Tensor.add', 'torch.nn.functional.linear', 'aten.add.Tensor'."""
    try:
        return _op_names[func]
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
        _op_names[func] = name
    except TypeError:
        pass
    return name


def function_named(name: str) -> Any:
    """The function ``op_name`` gave ``name`` to (among those it named in this process), else None."""
    for func, known in list(_op_names.items()):
        if known == name:
            return func
    return None


def qualname(fn: Any) -> str | None:
    """'module.qualname' of a handler function; None for None."""
    if fn is None:
        return None
    try:
        return _qualnames[fn]
    except (KeyError, TypeError):
        pass
    mod = getattr(fn, "__module__", None) or ""
    qn = getattr(fn, "__qualname__", None) or getattr(fn, "__name__", None) or repr(fn)
    name = f"{mod}.{qn}" if mod else qn
    try:
        _qualnames[fn] = name
    except TypeError:
        pass
    return name


_node_names: dict[type, str] = {}


def node_name(node: Any) -> str:
    """``node.name()`` (fixed per node class: C++ nodes and Python Function backward classes alike),
    cached per class because building the string costs more than looking it up."""
    try:
        return _node_names[type(node)]
    except KeyError:
        name = _node_names[type(node)] = node.name()
        return name


# --- the TypeError trap ----------------------------------------------------------------------------

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
_SWALLOWING_OPCODES = frozenset(dis.opmap[n] for n in ("BINARY_OP", "COMPARE_OP", "BINARY_SUBTRACT", "BINARY_ADD",
                                                        "BINARY_MULTIPLY", "BINARY_TRUE_DIVIDE", "INPLACE_ADD")
                                if n in dis.opmap)  # the last five: Python < 3.11

_OPERAND_TYPES = (torch.Tensor, int, float, complex, bool)


def would_swallow_type_error(func: Any, args: tuple, caller) -> bool:
    """Would PyTorch turn a TypeError raised for this call into a generic 'unsupported operand'?

    Only for binary dunders whose operands are all tensors or numbers: with any other operand
    (``x == None``, ``x + "a"``) NotImplemented is the legitimate answer and must stay untouched.
    ``caller``: the frame that made the call (its current instruction tells ``x + y`` from ``x.add(y)``).
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
