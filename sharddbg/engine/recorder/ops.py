"""Op recording: ShardTensor's ``__torch_function__`` / ``__torch_dispatch__`` and its communicating Python
methods are replaced while recording by wrappers that label each call with its dispatch path (``paths.py``,
on the registries as they are at call time) and then call the original; the DTensor fallbacks and
``_promote_plain_tensor_to_dtensor`` are rebound wherever physicsnemo modules hold them, to mark fallbacks
taken from inside handlers and to record promotions; global nn.Module forward pre/post hooks give the
module path. Everything installed is logged in the recording's ``UndoLog``.

Every wrapper first checks that its recording runs, and lets any call made by the recorder's own bookkeeping
(``ThreadState.busy``) pass unrecorded. The recorder's own errors go to ``internal_errors`` and never change
the user's result; the user's exceptions always propagate.
"""

from __future__ import annotations

import sys
import traceback
from typing import Any, Callable

import torch

from ... import errors
from .. import clock
from ..frames import HIDE_FRAMES
from ..frames import user_frame, user_frame_until
from .autograd import hook_backward
from .cells import frame_position, traceback_with_callers
from .cuda import CudaSpan
from .events import OpEvent, Promotion
from .params import name_of, name_tree
from .paths import dispatch_path, function_path
from .state import ModuleFrame, RecordingState, SeenError, ThreadState
from .tensors import (
    collect_tensors,
    compile_tracing,
    node_name,
    op_name,
    qualname,
    result_tensors,
    tensor_info,
    would_swallow_type_error,
)
from .undo import UndoLog

# ShardTensor methods recorded with path "python_method" (they communicate without __torch_function__)
PYTHON_METHODS = ("full_tensor", "redistribute", "backward", "from_local")
# ...recorded only when called by user code (no recorded op on the stack): every handler builds its
# result with from_local (explicit shapes, no communication), and an event for each would double the
# event count; inside an op its collectives (the "infer" all_gather) belong to that op anyway.
PYTHON_METHODS_TOP_ONLY = frozenset({"from_local"})

_current_autograd_node = getattr(torch._C, "_current_autograd_node", lambda: None)
_autograd_seq_nr = torch._C._autograd._get_sequence_nr  # next autograd node sequence number on this thread


# code objects of frames that stand between the user's call and a ShardTensor hook without being the caller:
# a torch function mode's handler that calls the function on (the DTensor call mode, dtensor.py)
_transparent_codes: set = set()


def see_through(code) -> None:
    """Frames running ``code`` are not the caller of a ShardTensor op: the caller is looked for above them."""
    _transparent_codes.add(code)


def calling_frame(depth: int = 2):
    """The frame that made the call the function ``depth`` frames up handles, looking through the frames of
    ``see_through`` code."""
    frame = sys._getframe(depth)
    while frame is not None and frame.f_code in _transparent_codes:
        frame = frame.f_back
    return frame


# ---- one op event: begin, end, error ---------------------------------------------------------------

def begin(rec: RecordingState, st: ThreadState, name: str, path: str, handler: str | None, infos: list) -> OpEvent:
    """Open the event of an op call. Must be called by the wrapper itself: its frame is this op's
    ``wrapper_frame``, and the user frame is looked for from the wrapper's caller up.
    Hot path: raw references only; every derived or default field is made at export."""
    stack = st.op_stack
    if stack:
        parent = stack[-1]
        root = stack[0]
        # a nested op: walk up only to the enclosing op's wrapper frame, whose user frame is known
        frame = user_frame_until(3, parent.wrapper_frame, parent.frame)
    else:
        parent = root = None
        mf = st.module_frames
        if mf:
            m = mf[-1]
            frame = user_frame_until(3, m.call_frame, m.user_frame)
        else:
            frame = user_frame(3)
    modules = st.module_stack
    ev = OpEvent(next(rec.seq), parent, root, len(stack), name, path, handler, modules[-1] if modules else None,
                 frame, sys._getframe(1), st.tid, infos, _autograd_seq_nr())
    for i in infos:
        if i.on_cuda:
            ev.cuda = CudaSpan(track_memory=rec.memory)
            break
    ev.t_start_ns = clock.now_ns()
    node = _current_autograd_node()
    if node is not None:  # called by the autograd engine (e.g. detach for AccumulateGrad)
        ev.phase = "backward"
        ev.autograd_node = node_name(node)
    elif rec.backward_frame is not None:
        rec.backward_frame = None  # a forward op after a backward pass: release that pass's frame
    stack.append(ev)
    return ev


def close(st: ThreadState, ev: OpEvent) -> None:
    """Stamp the end and take the event off the thread's stack."""
    ev.t_end_ns = clock.now_ns()
    c = ev.cuda
    if c is not None:
        c.close()
    ev.wrapper_frame = None  # never keep a frame (and its locals) past the op
    stack = st.op_stack
    while stack:  # robust to a child that never closed
        if stack.pop() is ev:
            break


def end(rec: RecordingState, st: ThreadState, ev: OpEvent, res: Any, args: tuple | None = None,
        kwargs: dict | None = None) -> None:
    """The op returned ``res``: close and keep its event, hook the autograd node behind its output.
    ``args`` / ``kwargs``: those of a call through __torch_function__ (replica digests read them)."""
    close(st, ev)
    if st.tid == 0 and ev.phase == "forward":
        rec.forward_op_ends.append(_autograd_seq_nr())
        rec.forward_ops.append(ev)
    if res is NotImplemented:
        ev.not_implemented = True
    elif isinstance(res, torch.Tensor):
        info = tensor_info(res, rec.shard_tensor_cls)
        ev.output = info
        ev.out_bytes = info.local_bytes
        hook_backward(rec, ev, (res,))
    else:
        outs = result_tensors(res)
        if outs:
            infos = [i for i in (tensor_info(t, rec.shard_tensor_cls) for t in outs) if i is not None]
            ev.output = infos[0] if infos else None
            if len(infos) > 1:
                ev.outputs = infos
            ev.out_bytes = sum(i.local_bytes for i in infos)
            hook_backward(rec, ev, outs)
    rec.keep(ev)
    if rec.outputs is not None and not ev.not_implemented:  # a diff keeps the outputs (outputs.py)
        rec.outputs.after_op(ev, res, args, kwargs)
    if rec.replicas is not None and ev.phase == "forward" and not ev.not_implemented:
        if args is not None and ev.parent is None:  # a call from the user's code: the parameters it read too
            rec.replicas.after_op(ev, res, rec.shard_tensor_cls, (args, kwargs), lambda t: name_of(rec, t))
        else:
            rec.replicas.after_op(ev, res, rec.shard_tensor_cls)


def record_error(rec: RecordingState, st: ThreadState, ev: OpEvent, e: BaseException, unmasked: bool) -> dict:
    """The op raised ``e``: close and keep its event with the error record (schema.ERROR_FIELDS), which
    points at the innermost op where this exception object was first seen. Its traceback starts at the
    user's code that made the call (the exception has not reached it yet), cells named as IPython does."""
    caller = ev.wrapper_frame.f_back if ev.wrapper_frame is not None else None
    close(st, ev)
    seen = rec.errors_seen.get(id(e))
    if seen is not None and seen.exception is e:
        err = dict(seen.record, unmasked=seen.record["unmasked"] or unmasked)  # propagated: point at origin
    else:
        err = {
            "exc_type": f"{type(e).__module__}.{type(e).__qualname__}".removeprefix("builtins."),
            "message": str(e),
            "traceback": traceback_with_callers(e, caller),
            "origin_seq": ev.seq,
            "unmasked": unmasked,
        }
        rec.errors_seen[id(e)] = SeenError(e, err)
    ev.error = err
    rec.keep(ev)
    return err


def run_recorded(rec: RecordingState, st: ThreadState, ev: OpEvent, fn: Callable, *args, **kwargs):
    """Run ``fn`` for the begun event ``ev``, then record its error or its end."""
    __tracebackhide__ = HIDE_FRAMES  # the user's traceback shows their code, not the recorder
    try:
        res = fn(*args, **kwargs)
    except BaseException as e:
        st.busy = True
        try:
            record_error(rec, st, ev, e, False)
        finally:
            st.busy = False
        raise
    st.busy = True
    try:
        end(rec, st, ev, res)
    except Exception:  # noqa: BLE001
        rec.internal_errors.append(traceback.format_exc())
    finally:
        st.busy = False
    return res


def compiling_now(rec: RecordingState, infos: list) -> bool:
    """torch.compile is tracing this call (FakeTensor operands, or a fake mode / dynamo active): counted,
    not recorded."""
    for i in infos:
        if i.fake:
            break
    else:
        if not compile_tracing():
            return False
    rec.calls_while_compiling += 1
    return True


# ---- the wrappers ------------------------------------------------------------------------------------

def torch_function_wrapper(rec: RecordingState, original: Callable, fallback: Callable,
                           conversion_active: Callable[[], bool]) -> Callable:
    """ShardTensor.__torch_function__ (the function under the classmethod) that records each call."""
    shard_tensor_cls = rec.shard_tensor_cls

    def __torch_function__(cls, func, types, args=(), kwargs=None):
        __tracebackhide__ = HIDE_FRAMES  # the user's traceback shows their code, not the recorder
        if not rec.running:
            return original(cls, func, types, args, kwargs)
        st = rec.thread()
        if st.busy:
            rec.reentries += 1
            return original(cls, func, types, args, kwargs)
        st.busy = True
        ev = None
        try:
            infos = collect_tensors(args, kwargs, shard_tensor_cls)
            if not compiling_now(rec, infos):
                choice = function_path(func, converting=conversion_active(),
                                       passthrough=cls._autograd_passthrough_functions,
                                       function_registry=cls._function_registry,
                                       named_registry=cls._named_function_registry,
                                       patches_enabled=cls._enable_shard_patches, fallback=fallback)
                ev = begin(rec, st, op_name(func), choice.path, qualname(choice.handler), infos)
        except Exception:  # noqa: BLE001 - a recorder bug must not change the user's result
            rec.internal_errors.append(traceback.format_exc())
            ev = None
        finally:
            st.busy = False
        if ev is None:
            return original(cls, func, types, args, kwargs)
        try:
            res = original(cls, func, types, args, kwargs)
        except BaseException as e:
            unmask = rec.unmask and isinstance(e, TypeError) and would_swallow_type_error(func, args, calling_frame())
            st.busy = True
            try:
                err = record_error(rec, st, ev, e, unmask)
            finally:
                st.busy = False
            if unmask:
                where = frame_position(ev.frame)
                new = errors.UnmaskedOpError(
                    f"{ev.op} raised {err['exc_type']} on rank {rec.rank}"
                    + (f" at {where}" if where else "") + f": {err['message']}\n"
                    "(sharddbg unmasked it: without the recorder PyTorch reports only "
                    "\"unsupported operand type(s)\". The original exception is chained above; "
                    "pass unmask=False / --no-unmask for PyTorch's behaviour.)",
                    op=ev.op,
                    rank=rec.rank,
                )
                rec.errors_seen[id(new)] = SeenError(new, err)  # outer ops point at the original, not at this
                raise new from e
            raise
        st.busy = True
        try:
            end(rec, st, ev, res, args, kwargs)
        except Exception:  # noqa: BLE001
            rec.internal_errors.append(traceback.format_exc())
        finally:
            st.busy = False
        return res

    return __torch_function__


def torch_dispatch_wrapper(rec: RecordingState, original: Callable, fallback: Callable) -> Callable:
    """ShardTensor.__torch_dispatch__ (the function under the classmethod) that records each call."""
    shard_tensor_cls = rec.shard_tensor_cls

    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        __tracebackhide__ = HIDE_FRAMES  # the user's traceback shows their code, not the recorder
        if not rec.running:
            return original(cls, func, types, args, kwargs)
        st = rec.thread()
        if st.busy:
            rec.reentries += 1
            return original(cls, func, types, args, kwargs)
        st.busy = True
        ev = None
        try:
            infos = collect_tensors(args, kwargs, shard_tensor_cls)
            if not compiling_now(rec, infos):
                choice = dispatch_path(func, cls._dispatch_registry, cls._dispatch_registry_by_name, fallback)
                ev = begin(rec, st, op_name(func), choice.path, qualname(choice.handler), infos)
        except Exception:  # noqa: BLE001
            rec.internal_errors.append(traceback.format_exc())
            ev = None
        finally:
            st.busy = False
        if ev is None:
            return original(cls, func, types, args, kwargs)
        return run_recorded(rec, st, ev, original, cls, func, types, args, kwargs)

    return __torch_dispatch__


def python_method_wrapper(rec: RecordingState, name: str, fn: Callable) -> Callable:
    """A ShardTensor Python method that communicates without __torch_function__ (PYTHON_METHODS), recorded
    as an op with path "python_method" so that the collectives it issues have an op to belong to."""
    label = f"ShardTensor.{name}"
    handler = qualname(fn)
    top_only = name in PYTHON_METHODS_TOP_ONLY
    shard_tensor_cls = rec.shard_tensor_cls

    def method(*args, **kwargs):
        __tracebackhide__ = HIDE_FRAMES  # the user's traceback shows their code, not the recorder
        if not rec.running:
            return fn(*args, **kwargs)
        st = rec.thread()
        if st.busy or (top_only and st.op_stack):
            return fn(*args, **kwargs)
        st.busy = True
        ev = None
        try:
            infos = collect_tensors(args, kwargs, shard_tensor_cls)
            if not compiling_now(rec, infos):
                ev = begin(rec, st, label, "python_method", handler, infos)
        except Exception:  # noqa: BLE001
            rec.internal_errors.append(traceback.format_exc())
            ev = None
        finally:
            st.busy = False
        if ev is None:
            return fn(*args, **kwargs)
        return run_recorded(rec, st, ev, fn, *args, **kwargs)

    looks_like(method, fn)
    method.__doc__ = fn.__doc__
    return method


def fallback_marker(rec: RecordingState, original: Callable) -> Callable:
    """A DTensor fallback function that marks the running op as having taken it (also when a handler
    calls the fallback itself)."""

    def marked(*a, **k):
        __tracebackhide__ = HIDE_FRAMES  # the user's traceback shows their code, not the recorder
        if rec.running:
            stack = rec.thread().op_stack
            if stack:
                stack[-1].fallback = True
        return original(*a, **k)

    looks_like(marked, original)
    return marked


def promotion_recorder(rec: RecordingState, original: Callable) -> Callable:
    """``_promote_plain_tensor_to_dtensor`` that records the promotion on the running op."""

    def promote(tensor, mesh, *a, **k):
        __tracebackhide__ = HIDE_FRAMES  # the user's traceback shows their code, not the recorder
        if rec.running:
            st = rec.thread()
            if st.op_stack and not st.busy:
                ev = st.op_stack[-1]
                if ev.promotions is None:
                    ev.promotions = []
                name = rec.params.get(id(tensor))
                ev.promotions.append(Promotion(name, tensor.shape, tensor.dtype))
                if rec.replicas is not None and ev.phase == "forward":
                    st.busy = True
                    try:
                        rec.replicas.promoted(ev, tensor, mesh, name, len(ev.promotions) - 1)
                    except Exception:  # noqa: BLE001 - a recorder bug must not change the user's result
                        rec.internal_errors.append(traceback.format_exc())
                    finally:
                        st.busy = False
        return original(tensor, mesh, *a, **k)

    looks_like(promote, original)
    return promote


def looks_like(wrapper: Callable, original: Callable) -> None:
    wrapper.__wrapped__ = original  # type: ignore[attr-defined]
    wrapper.__name__ = original.__name__
    wrapper.__qualname__ = original.__qualname__
    wrapper.__module__ = original.__module__


# ---- modules -----------------------------------------------------------------------------------------

def module_name(rec: RecordingState, m: Any, st: ThreadState) -> str:
    """The module's path: from the outermost module seen (whose whole tree, parameters included, is named
    at once), or "<parent path>.<Class>" for a module created inside a forward."""
    name = rec.module_names.get(id(m))
    if name is not None:
        return name
    if not st.module_stack:  # a new outermost module: name its whole tree once
        name_tree(rec, m)
        return rec.module_names[id(m)]
    name = f"{st.module_stack[-1]}.<{type(m).__name__}>"
    rec.roots.append(m)
    rec.module_names[id(m)] = name
    return name


def module_hooks(rec: RecordingState) -> tuple[Callable, Callable]:
    """The global forward pre-hook and hook that keep each thread's module stack."""

    def pre(m, inputs):
        if rec.running:
            st = rec.thread()
            st.module_stack.append(module_name(rec, m, st))
            mf = st.module_frames
            try:
                f = sys._getframe(1)  # Module._call_impl, which calls the global hooks itself
            except ValueError:
                f = None
            # the module's user frame: above _call_impl, up to the enclosing module's _call_impl
            if mf:
                top = mf[-1]
                uf = user_frame_until(2, top.call_frame, top.user_frame)
            else:
                uf = user_frame(2)
            mf.append(ModuleFrame(f, uf))

    def post(m, inputs, output):
        if rec.running:
            st = rec.thread()
            if st.module_stack:
                st.module_stack.pop()
            if st.module_frames:
                st.module_frames.pop()

    return pre, post


# ---- install -------------------------------------------------------------------------------------------

def install(rec: RecordingState, undo: UndoLog) -> None:
    """Install every op hook for ``rec`` (ShardTensor's, importing physicsnemo, and the module hooks), each
    change logged in ``undo``."""
    install_shard_tensor(rec, undo)
    install_modules(rec, undo)


def install_shard_tensor(rec: RecordingState, undo: UndoLog) -> None:
    """ShardTensor's hooks (imports physicsnemo's shard_tensor), each change logged in ``undo``."""
    import physicsnemo.domain_parallel.shard_tensor as stm

    st_cls = stm.ShardTensor
    rec.shard_tensor_cls = st_cls
    fallback_fn = stm._torch_function_fallback_via_dtensor
    fallback_dispatch = stm._dispatch_fallback_via_dtensor
    _install_library_wrappers(rec, undo, fallback_fn, fallback_dispatch, stm._promote_plain_tensor_to_dtensor)
    undo.setattr(st_cls, "__torch_function__", classmethod(torch_function_wrapper(
        rec, st_cls.__dict__["__torch_function__"].__func__, fallback_fn, stm._conversion_active)))
    undo.setattr(st_cls, "__torch_dispatch__", classmethod(torch_dispatch_wrapper(
        rec, st_cls.__dict__["__torch_dispatch__"].__func__, fallback_dispatch)))
    _install_python_methods(rec, undo, st_cls)


def install_modules(rec: RecordingState, undo: UndoLog) -> None:
    """The global nn.Module hooks that give each op its module path, logged in ``undo``."""
    _install_module_hooks(rec, undo)


def _install_library_wrappers(rec: RecordingState, undo: UndoLog, fallback_fn: Callable, fallback_dispatch: Callable,
                              promote: Callable) -> None:
    replacements = [(fallback_fn, fallback_marker(rec, fallback_fn)),
                    (fallback_dispatch, fallback_marker(rec, fallback_dispatch)),
                    (promote, promotion_recorder(rec, promote))]
    # physicsnemo.domain_parallel is where these private helpers are imported from
    rec.installed_at += undo.replace_globals(replacements, package="physicsnemo.domain_parallel")


def _install_python_methods(rec: RecordingState, undo: UndoLog, st_cls: type) -> None:
    for name in PYTHON_METHODS:
        raw = st_cls.__dict__.get(name)
        if isinstance(raw, staticmethod):
            undo.setattr(st_cls, name, staticmethod(python_method_wrapper(rec, name, raw.__func__)))
        elif callable(raw):
            undo.setattr(st_cls, name, python_method_wrapper(rec, name, raw))


def _install_module_hooks(rec: RecordingState, undo: UndoLog) -> None:
    from torch.nn.modules import module as nn_module

    pre, post = module_hooks(rec)
    undo.add(nn_module.register_module_forward_pre_hook(pre).remove)
    # always_call: the pop also happens when the forward raises.
    undo.add(nn_module.register_module_forward_hook(post, always_call=True).remove)
