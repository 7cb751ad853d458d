"""Plain DTensor recording (``RecordingOptions.dtensor``): the user's calls on DTensors that are not
ShardTensors, as op records with their own paths.

Since torch 2.10 a DTensor op is dispatched by a C++ fast path that calls no Python per op, so there is no
class hook to wrap as for ShardTensor. A torch function mode, pushed on the recording thread while it records,
sees every torch function call there: a call with a plain DTensor argument made by the user's code (no
recorded op open on the thread) is recorded with path "dtensor_propagation" (DTensor's sharding propagation
decides its output placements and the redistributions its inputs need; the collectives those issue belong to
it). ``DTensor.redistribute`` and ``DTensor.full_tensor`` called by the user's code are recorded with path
"dtensor_redistribute". Calls with a ShardTensor argument pass through untouched (ShardTensor's own hooks
record them), as does everything while torch.compile traces.
"""

from __future__ import annotations

import traceback
from typing import Any, Callable

import torch
from torch.overrides import TorchFunctionMode

from ..frames import HIDE_FRAMES
from .ops import begin, compiling_now, looks_like, run_recorded, see_through
from .state import RecordingState
from .tensors import collect_tensors, op_name, qualname
from .undo import UndoLog

PROPAGATION = "dtensor_propagation"
REDISTRIBUTE = "dtensor_redistribute"
# DTensor methods that communicate without a torch function call of their own
REDISTRIBUTE_METHODS = ("redistribute", "full_tensor")


class DTensorCalls(TorchFunctionMode):
    """The torch function mode that records the user's calls with plain DTensor arguments."""

    def __init__(self, rec: RecordingState, dtensor_cls: type) -> None:
        super().__init__()
        self.rec = rec
        self.dtensor_cls = dtensor_cls

    def __torch_function__(self, func, types, args=(), kwargs=None):
        __tracebackhide__ = HIDE_FRAMES  # the user's traceback shows their code, not the recorder
        kwargs = kwargs or {}
        rec = self.rec
        if not torch._C._is_torch_function_enabled():
            # subclass dispatch is off (DisableTorchFunctionSubclass: ShardTensor's handlers, the recorder's
            # own bookkeeping): a mode is still called, and must not route to a subclass behind their back
            return func(*args, **kwargs)
        for t in types:
            own = getattr(getattr(t, "__torch_function__", None), "__func__", None)
            if own is not None and own is not _TENSOR_DEFAULT:
                # a ShardTensor (or another subclass with a __torch_function__ of its own): called once, here, as
                # torch would call it with no mode on (this mode is off while its handler runs)
                res = t.__torch_function__(func, types, args, kwargs)
                if res is not NotImplemented:
                    return res
        # ``types`` cannot tell: DTensor's own __torch_function__ is disabled, so it is listed for some calls only
        if not rec.running or not _has_plain_dtensor(args, kwargs, self.dtensor_cls):
            return func(*args, **kwargs)
        st = rec.thread()
        if st.busy or st.op_stack:
            return func(*args, **kwargs)
        st.busy = True
        ev = None
        try:
            infos = collect_tensors(args, kwargs, rec.shard_tensor_cls)
            if not any(i.shard_tensor for i in infos) and not compiling_now(rec, infos):
                ev = begin(rec, st, op_name(func), PROPAGATION, "torch.distributed.tensor.DTensor (sharding propagation)",
                           infos)
        except Exception:  # noqa: BLE001 - a recorder bug must not change the user's result
            rec.internal_errors.append(traceback.format_exc())
            ev = None
        finally:
            st.busy = False
        if ev is None:
            return func(*args, **kwargs)
        return run_recorded(rec, st, ev, func, *args, **kwargs)


_TENSOR_DEFAULT = torch.Tensor.__torch_function__.__func__


def _has_plain_dtensor(args: tuple, kwargs: dict, dtensor_cls: type) -> bool:
    """A plain DTensor among the arguments (top level, or one level down in a list or tuple: torch.cat)."""
    for seq in (args, kwargs.values() if kwargs else ()):
        for a in seq:
            if type(a) is dtensor_cls:
                return True
            if type(a) in (list, tuple):
                for b in a:
                    if type(b) is dtensor_cls:
                        return True
    return False


def redistribute_wrapper(rec: RecordingState, name: str, fn: Callable, dtensor_cls: type) -> Callable:
    """``DTensor.<name>`` recorded with path "dtensor_redistribute" when the user's code calls it on a plain
    DTensor (a ShardTensor has its own, recorded as "python_method")."""
    label = f"DTensor.{name}"
    handler = qualname(fn)

    def method(self, *args, **kwargs):
        __tracebackhide__ = HIDE_FRAMES  # the user's traceback shows their code, not the recorder
        if not rec.running or type(self) is not dtensor_cls:
            return fn(self, *args, **kwargs)
        st = rec.thread()
        if st.busy or st.op_stack:
            return fn(self, *args, **kwargs)
        st.busy = True
        ev = None
        try:
            infos = collect_tensors((self,) + args, kwargs, rec.shard_tensor_cls)
            if not compiling_now(rec, infos):
                ev = begin(rec, st, label, REDISTRIBUTE, handler, infos)
        except Exception:  # noqa: BLE001
            rec.internal_errors.append(traceback.format_exc())
            ev = None
        finally:
            st.busy = False
        if ev is None:
            return fn(self, *args, **kwargs)
        return run_recorded(rec, st, ev, fn, self, *args, **kwargs)

    looks_like(method, fn)
    method.__doc__ = fn.__doc__
    return method


# ShardTensor's recorder reads the frame that made a call (a binary dunder's TypeError is unmasked from it):
# it looks through this mode's frame to the user's
see_through(DTensorCalls.__torch_function__.__code__)


def install(rec: RecordingState, undo: UndoLog) -> None:
    """Push the DTensor call mode on this thread and wrap DTensor's communicating methods, in ``undo``."""
    from torch.distributed.tensor import DTensor

    for name in REDISTRIBUTE_METHODS:
        raw = DTensor.__dict__.get(name)
        if callable(raw):
            undo.setattr(DTensor, name, redistribute_wrapper(rec, name, raw, DTensor))
    mode = DTensorCalls(rec, DTensor)
    mode.__enter__()
    undo.add(lambda: _leave(mode))


def _leave(mode: Any) -> None:
    """Pop ``mode`` if it is still the innermost torch function mode of this thread (a recording stopped from
    another thread cannot pop it: it stays, and passes every call through, its recording stopped)."""
    stack = torch.overrides._get_current_function_mode_stack()
    if stack and stack[-1] is mode:
        mode.__exit__(None, None, None)
