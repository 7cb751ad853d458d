"""Per-rank recorder: every ShardTensor op call, its dispatch path, module, shapes, time and errors.

Usage on one rank::

    with Recorder(max_events=200_000) as rec:
        y = model(x); y.square().mean().backward()
    rec.events        # schema.py "op" records, sorted by seq
    rec.dropped       # records lost to a full buffer

From a cluster (one round trip each): ``start(max_events, unmask)`` on every rank, run the cell,
``stop()`` -> payload dict; ``snapshot()`` may be called from another thread while the main thread is
blocked (e.g. in a collective) and returns what was recorded so far plus the ops still in flight.

How it works (see shared/docs/shardtensor-notes.md):
- ``ShardTensor.__torch_function__`` / ``__torch_dispatch__`` are replaced by classmethods that label
  the call by mirroring ShardTensor's decision order on the registries at call time, then call the
  original. The originals are put back on exit, also after an exception.
- The DTensor fallbacks and ``_promote_plain_tensor_to_dtensor`` are rebound wherever physicsnemo
  modules hold them (``linear_patches`` imported the fallback by name) to mark fallbacks taken from
  inside handlers and to record promotions.
- Global nn.Module forward pre/post hooks give the module path; backward events come from pre/post
  hooks on the autograd node behind each recorded op's output (no ShardTensor hook runs during
  backward), and inherit the forward op's module.
- Nothing is recorded while torch.compile traces; nothing is installed when no recorder is active.
"""

from __future__ import annotations

import itertools
import sys
import threading
import traceback
from typing import Any

import torch

from .. import schema
from ..errors import RecorderError, UnmaskedOpError
from . import _comm, clock
from ._hooks import Patches
from .frames import format_frame, user_frame, user_frame_until
from .rank_state import STATE, rank_and_world
from ._rec_util import (
    collect_tensors,
    new_cuda_event,
    node_name,
    op_name,
    placements_str,
    qualname,
    shape_list,
    sharding_shapes_plain,
    tensor_info,
    would_swallow_type_error,
)

__all__ = ["Recorder", "RecorderError", "UnmaskedOpError", "start", "stop", "peek", "abandon", "is_recording"]


_ACTIVE: "Recorder | None" = None  # the one recorder of this process (nested ones are refused)
_SESSION: "Recorder | None" = None  # the recorder started by start(), if any
_LAST_PAYLOAD: dict | None = None  # payload of the last stop(), for a late snapshot()
_FAKE_KEY = getattr(torch._C, "_TorchDispatchModeKey", None)
_FAKE_KEY = getattr(_FAKE_KEY, "FAKE", None)


_current_node = getattr(torch._C, "_current_autograd_node", lambda: None)
_seq_nr = torch._C._autograd._get_sequence_nr  # next autograd node sequence number on this thread


def active() -> "Recorder | None":
    return _ACTIVE


def _tracing() -> bool:
    """torch.compile is tracing (FakeTensor mode active / dynamo compiling)."""
    if _FAKE_KEY is not None and torch._C._get_dispatch_mode(_FAKE_KEY) is not None:
        return True
    return torch.compiler.is_compiling()


class _ThreadState:
    __slots__ = ("stack", "modstack", "modframes", "busy", "tid", "cdepth", "cmode")

    def __init__(self, tid: int) -> None:
        self.stack: list[dict] = []  # open op events, innermost last
        self.modstack: list[str] = []  # module paths, innermost last
        # per running module: (its Module._call_impl frame, the user frame that called it), so that an op
        # inside walks up only to there (held while that forward runs; popped with modstack)
        self.modframes: list[tuple] = []
        self.busy = False  # inside our own bookkeeping: let any re-entry pass unrecorded
        self.tid = tid
        self.cdepth = 0  # inside a collective being recorded (engine/_comm.py): nested ones are its own
        self.cmode = False  # engine/_comm.py pushed its dispatch mode for a torch.distributed call


class Recorder:
    """Record ShardTensor ops on this rank. See the module docstring."""

    def __init__(self, max_events: int = 200_000, unmask: bool = True, comm: bool = True) -> None:
        if int(max_events) < 0:
            raise ValueError("max_events must be >= 0")
        self.max_events = int(max_events)
        self.unmask = bool(unmask)
        self.comm = bool(comm)  # record collectives too (engine/_comm.py)
        self._comm: _comm.CommRecorder | None = None
        # forward ops of thread 0 in end order: autograd sequence numbers [snr0, snr1) of the nodes they
        # created, so a backward collective can be attributed to its forward op (engine/_comm.py)
        self._fwd_snr1: list[int] = []
        self._fwd_ranges: list[tuple[int, dict]] = []
        self.dropped = 0
        self.reentries = 0  # hook calls made by our own bookkeeping (must stay 0)
        self.internal_errors: list[str] = []  # bugs in the recorder itself; never raised into user code
        self._buf: list[dict] = []
        self._seq = itertools.count()
        self._tls = threading.local()
        self._states: dict[int, _ThreadState] = {}
        self._tids = itertools.count()
        self._modnames: dict[int, str] = {}
        self._params: dict[int, str] = {}
        self._roots: list[Any] = []  # keep seen roots alive so their ids are not reused
        self._exc_seen: dict[int, tuple[BaseException, dict]] = {}
        self._bw_handles: list[Any] = []
        self._bw_frame: Any = None  # see _backward_event
        self._bw_user_frame: Any = None
        self._patches: Patches | None = None
        self._running = False
        self._used = False
        self._final_events: list[dict] | None = None
        self.rank, self.world_size = rank_and_world()
        self.t_start_ns: int | None = None
        self.t_stop_ns: int | None = None
        self.installed_at: list[str] = []

    # ---- lifecycle -------------------------------------------------------------------------------
    def __enter__(self) -> "Recorder":
        global _ACTIVE
        if _ACTIVE is not None:
            raise RecorderError(
                "a sharddbg recorder is already active on this rank; nested recorders are not supported "
                "(stop the running one first, e.g. sharddbg.engine.recorder.stop())"
            )
        if self._used:
            raise RecorderError("a Recorder can be entered once; create a new one")
        self._used = True
        self._state()  # the starting thread gets tid 0
        patches = Patches()
        try:
            _install(self, patches)
            if self.comm:
                self._comm = _comm.CommRecorder(self)
                self._comm.install(patches)
        except BaseException:
            patches.restore()
            raise
        self._patches = patches
        self.t_start_ns = clock.now_ns()
        self._running = True
        _ACTIVE = self
        return self

    def __exit__(self, *exc) -> bool:
        self.close()
        return False

    def close(self) -> None:
        global _ACTIVE
        if not self._running:
            return
        self._running = False
        if _ACTIVE is self:
            _ACTIVE = None
        self.t_stop_ns = clock.now_ns()
        errs = self._patches.restore() if self._patches else []
        for h in self._bw_handles:  # hooks left on graph nodes that outlive the recording
            try:
                h.remove()
            except Exception:  # noqa: BLE001
                pass
        self._bw_handles.clear()
        self._bw_frame = None
        for st in list(self._states.values()):
            st.modframes.clear()  # a forward the recording ended inside: its frames are not ours to keep
        if torch.cuda.is_initialized():
            torch.cuda.synchronize()  # so device_ms of every event can be read
        # Formatting into schema records happens on first access of .events / payload(), not here:
        # the recorder's exit stays cheap inside timed user code.
        self._exc_seen.clear()
        self._roots.clear()
        # _fwd_snr1 / _fwd_ranges stay until the events are formatted: backward collectives are
        # attributed to their forward op then
        if errs:
            raise RecorderError(f"restoring hooks failed: {errs!r}")

    @property
    def events(self) -> list[dict]:
        """Schema records (schema.OP_FIELDS), sorted by seq; formatted on first access after exit."""
        if self._running:
            return self._export_all(include_in_flight=False)
        if self._final_events is None:
            self._final_events = self._export_all(include_in_flight=False)
            self._fwd_snr1 = []
            self._fwd_ranges = []
        return self._final_events

    # ---- per-thread state ------------------------------------------------------------------------
    def _state(self) -> _ThreadState:
        try:
            return self._tls.s
        except AttributeError:
            s = _ThreadState(next(self._tids))
            self._tls.s = s
            self._states[threading.get_ident()] = s
            return s

    # ---- recording -------------------------------------------------------------------------------
    def _begin(self, st: _ThreadState, name: str, path: str, handler: str | None, infos: list) -> dict:
        # Hot path: raw references only; every derived or default field is made at export (_export).
        stack = st.stack
        if stack:
            parent = stack[-1]
            root = stack[0]
            # a nested op: walk up only to the enclosing op's wrapper frame, whose user frame is known
            frame = user_frame_until(3, parent["_wf"], parent["_frame"])
        else:
            parent = root = None
            mf = st.modframes
            frame = user_frame_until(3, mf[-1][0], mf[-1][1]) if mf else user_frame(3)
        ev = {
            "kind": "op",
            "seq": next(self._seq),
            "parent": parent,
            "depth": len(stack),
            "op": name,
            "path": path,
            "handler": handler,
            "phase": "forward",
            "module": st.modstack[-1] if st.modstack else None,
            "_frame": frame,
            "_wf": sys._getframe(1),  # this op's wrapper frame (held while the op runs, see _close)
            "_in": infos,
            "thread": st.tid,
            "_root": root,  # outermost op on the stack, None for itself (collective attribution)
            "_snr0": _seq_nr(),
            "_cuda": None,
        }
        for i in infos:
            if i[6] == 2:
                ev["_cuda"] = _cuda_begin()
                break
        ev["t_start_ns"] = clock.now_ns()
        node = _current_node()
        if node is not None:  # called by the autograd engine (e.g. detach for AccumulateGrad)
            ev["phase"] = "backward"
            ev["autograd_node"] = node_name(node)
        elif self._bw_frame is not None:
            self._bw_frame = None  # a forward op after a backward pass: release that pass's frame
        stack.append(ev)
        return ev

    def _keep(self, ev: dict) -> None:
        if len(self._buf) < self.max_events:
            self._buf.append(ev)
        else:
            self.dropped += 1

    def _close(self, st: _ThreadState, ev: dict) -> None:
        ev["t_end_ns"] = clock.now_ns()
        c = ev["_cuda"]
        if c is not None:
            _cuda_end(c)
        ev["_wf"] = None  # never keep a frame (and its locals) past the op
        stack = st.stack
        while stack:  # robust to a child that never closed
            if stack.pop() is ev:
                break

    def _end(self, st: _ThreadState, ev: dict, res: Any) -> None:
        self._close(st, ev)
        if st.tid == 0 and ev["phase"] == "forward":
            self._fwd_snr1.append(_seq_nr())
            self._fwd_ranges.append((ev["_snr0"], ev))
        if res is NotImplemented:
            ev["not_implemented"] = True
        elif isinstance(res, torch.Tensor):
            info = tensor_info(res, _ST)
            ev["_out"] = info
            ev["out_bytes"] = info[3]
            self._hook_backward(ev, (res,))
        else:
            outs = _result_tensors(res)
            if outs:
                infos = [i for i in (tensor_info(t, _ST) for t in outs) if i is not None]
                ev["_out"] = infos[0] if infos else None
                ev["out_bytes"] = sum(i[3] for i in infos)
                self._hook_backward(ev, outs)
        self._keep(ev)

    def _record_error(self, st: _ThreadState, ev: dict, e: BaseException, unmasked: bool) -> dict:
        self._close(st, ev)
        seen = self._exc_seen.get(id(e))
        if seen is not None and seen[0] is e:
            err = dict(seen[1], unmasked=seen[1]["unmasked"] or unmasked)  # propagated: point at origin
        else:
            err = {
                "exc_type": f"{type(e).__module__}.{type(e).__qualname__}".removeprefix("builtins."),
                "message": str(e),
                "traceback": "".join(traceback.format_exception(type(e), e, e.__traceback__)),
                "origin_seq": ev["seq"],
                "unmasked": unmasked,
            }
            self._exc_seen[id(e)] = (e, err)
        ev["error"] = err
        self._keep(ev)
        return err

    def _hook_backward(self, ev: dict, outs: list) -> None:
        node = None
        for t in outs:
            # ShardTensor.grad_fn is a shielded property (no __torch_function__); plain/DTensor reads
            # are C getters.
            node = t.grad_fn
            if node is not None:
                break
        if node is None:
            return
        md = node.metadata
        box = md.get("sharddbg")
        if box is not None and box[1] is self:
            box[0] = ev  # the same node ends an enclosing op too: attribute it to the outer (later) one
            return
        box = [ev, self, None, None, node_name(node)]
        md["sharddbg"] = box
        # The hooks capture the box, not the node: a node -> hook -> node cycle would leak the graph.
        self._bw_handles.append(node.register_prehook(_make_bw_pre(box)))
        self._bw_handles.append(node.register_hook(_make_bw_post(box)))

    def _backward_event(self, box: list, grad_inputs: Any, grad_outputs: Any) -> None:
        fwd = box[0]
        st = self._state()
        stack = st.stack
        parent = stack[-1] if stack else None
        t0 = box[2] if box[2] is not None else clock.now_ns()
        gout = [i for i in (tensor_info(g, _ST) for g in grad_outputs or ()) if i is not None]
        gin = [i for i in (tensor_info(g, _ST) for g in grad_inputs or ()) if i is not None]
        # Every hook of one backward pass is called from the same Python frame (the one that entered the
        # autograd engine), so the user frame above it is walked once per pass. The frame is held only
        # until the next forward op or the end of the recording (it is alive during the pass anyway).
        try:
            f = sys._getframe(2)
        except ValueError:  # called from a thread with no Python caller (the CUDA autograd worker)
            f = None
        if f is None:
            uf = None
        elif f is self._bw_frame:
            uf = self._bw_user_frame
        else:
            uf = user_frame(3)
            self._bw_frame, self._bw_user_frame = f, uf
        del f
        # op / path / handler / module / fallback come from the forward event at export
        ev = {
            "kind": "op",
            "seq": next(self._seq),
            "parent": parent,
            "depth": len(stack),
            "phase": "backward",
            "_fwd": fwd,
            "autograd_node": box[4],
            "_frame": uf or fwd["_frame"],
            "_in": gout,
            "_out": gin[0] if gin else None,
            "out_bytes": sum(i[3] for i in gin),
            "thread": st.tid,
            "_cuda": None,
            "t_start_ns": t0,
            "t_end_ns": clock.now_ns(),
        }
        box[2] = None
        self._keep(ev)

    def _module_name(self, m: Any, st: _ThreadState) -> str:
        name = self._modnames.get(id(m))
        if name is not None:
            return name
        if not st.modstack:  # a new outermost module: name its whole tree once
            self._roots.append(m)
            root = type(m).__name__
            for n, sub in m.named_modules():
                self._modnames.setdefault(id(sub), n or root)
            for n, p in itertools.chain(m.named_parameters(), m.named_buffers()):
                self._params.setdefault(id(p), n)
            return self._modnames[id(m)]
        name = f"{st.modstack[-1]}.<{type(m).__name__}>"  # created on the fly inside a forward
        self._roots.append(m)
        self._modnames[id(m)] = name
        return name

    # ---- export ----------------------------------------------------------------------------------
    def _export_all(self, include_in_flight: bool) -> list[dict]:
        done = list(self._buf)  # list() of a list is atomic under the GIL: safe from another thread
        out = [_export(ev, False) if ev["kind"] == "op" else _comm.export(ev, False, self) for ev in done]
        if include_in_flight:
            for st in list(self._states.values()):
                for ev in list(st.stack):
                    out.append(_export(dict(ev), True))
        out.sort(key=lambda e: e["seq"])
        return out

    def payload(self, complete: bool | None = None) -> dict:
        running = self._running
        events = self._export_all(include_in_flight=True) if running else self.events
        return {
            "format": schema.PAYLOAD_FORMAT,
            "schema_version": schema.SCHEMA_VERSION,
            "rank": self.rank,
            "world_size": self.world_size,
            "complete": (not running) if complete is None else complete,
            "events": events,
            "dropped": self.dropped,
            "clock": dict(clock.describe(), t_start_ns=self.t_start_ns, t_stop_ns=self.t_stop_ns, t_payload_ns=clock.now_ns()),
            "meta": _meta(self),
        }


# ---- export helpers (run at stop/snapshot time, never on the hot path) ---------------------------

def _export(ev: dict, in_flight: bool) -> dict:
    get = ev.get
    ins = ev["_in"] or []
    out = get("_out")
    first = out if out is not None else (ins[0] if ins else None)
    dist_out = out if out is not None and out[2] is not None else next((i for i in ins if i[2] is not None), None)
    t0, t1 = ev["t_start_ns"], get("t_end_ns")
    dev_ms, mem = _cuda_read(ev["_cuda"])
    parent = ev["parent"]
    fwd = get("_fwd")  # a backward event: what it runs the backward of
    src = fwd if fwd is not None else ev
    err = get("error")
    return {
        "kind": "op",
        "seq": ev["seq"],
        "parent_seq": parent["seq"] if parent is not None else None,
        "depth": ev["depth"],
        "op": src["op"],
        "path": src["path"],
        "handler": src["handler"],
        "phase": ev["phase"],
        "autograd_node": get("autograd_node"),
        "module": src["module"],
        "user_frame": format_frame(ev["_frame"]),
        "in_local_shapes": [shape_list(i[0]) for i in ins],
        "in_global_shapes": [shape_list(i[1]) for i in ins],
        "out_local_shape": shape_list(out[0]) if out is not None else None,
        "out_global_shape": shape_list(out[1]) if out is not None else None,
        "placements": placements_str(dist_out[2]) if dist_out is not None else None,
        "dtype": str(first[4]).removeprefix("torch.") if first is not None else None,
        "sharding_shapes": sharding_shapes_plain(out[5]) if out is not None else None,
        "in_bytes": int(sum(i[3] for i in ins)),
        "out_bytes": int(get("out_bytes", 0)),
        "t_start_ns": int(t0),
        "t_end_ns": int(t1) if t1 is not None else None,
        "host_ms": (t1 - t0) / 1e6 if t1 is not None else None,
        "device_ms": dev_ms,
        "mem_delta_bytes": mem,
        "error": dict(err) if err is not None else None,
        "fwd_seq": fwd["seq"] if fwd is not None else None,
        "in_placements": [placements_str(i[2]) for i in ins],
        "fallback": bool(src.get("fallback", False)),
        "promotions": [
            {"param": p[0], "shape": shape_list(p[1]), "dtype": str(p[2]).removeprefix("torch.")}
            for p in list(get("promotions") or ())
        ],
        "not_implemented": bool(get("not_implemented", False)),
        "in_flight": in_flight,
        "thread": ev["thread"],
    }


def _meta(rec: Recorder) -> dict:
    import platform

    try:
        import physicsnemo

        pn = getattr(physicsnemo, "__version__", "?")
    except Exception:  # noqa: BLE001
        pn = None
    ST = _shard_tensor_cls()
    # how the cluster set this rank up, when it did (registered-by-physicsnemo / -by-sharddbg / none)
    boot_mode = STATE.patches.patch_mode if STATE.patches is not None else None
    return {
        "torch": torch.__version__,
        "physicsnemo": pn,
        "python": platform.python_version(),
        "host": platform.node(),
        "patch_mode": "registered" if ST is not None and ST._function_registry else "fallback_only",
        "patch_mode_bootstrap": boot_mode,
        "n_function_handlers": len(ST._function_registry) if ST is not None else 0,
        "n_named_handlers": len(ST._named_function_registry) if ST is not None else 0,
        "n_dispatch_handlers": len(ST._dispatch_registry) if ST is not None else 0,
        "cuda": bool(torch.cuda.is_available()),
        "unmask": rec.unmask,
        "max_events": rec.max_events,
        "recording": rec._running,
        "reentries": rec.reentries,
        "comm": rec.comm,
        "n_collectives": rec._comm.n if rec._comm is not None else 0,
        "internal_errors": list(rec.internal_errors[-5:]),
        "installed_at": list(rec.installed_at),
    }


def _result_tensors(res: Any) -> list:
    if isinstance(res, torch.Tensor):
        return [res]
    if isinstance(res, (tuple, list)):
        return [r for r in res[:64] if isinstance(r, torch.Tensor)]
    return []


def _allocated_bytes() -> int:
    """``torch.cuda.memory_allocated()`` without its cost: that function flattens the allocator's whole
    statistics into a new dict on every call; this reads the one value from the nested dict."""
    try:
        return _cuda_stats(_cuda_dev())["allocated_bytes"]["all"]["current"]
    except Exception:  # noqa: BLE001 - another torch layout: the public (slower) call
        return torch.cuda.memory_allocated()


_cuda_stats = getattr(torch._C, "_cuda_memoryStats", None)
_cuda_dev = torch.cuda.current_device


def _cuda_begin() -> list:
    e0 = new_cuda_event()
    e0.record()
    return [e0, None, _allocated_bytes()]


def _cuda_end(c: list) -> None:
    e1 = new_cuda_event()
    e1.record()
    c[1] = e1
    c[2] = _allocated_bytes() - c[2]
    c.append(True)  # closed: c[2] is now a delta


def _cuda_read(c: list | None) -> tuple[float | None, int | None]:
    if c is None or len(c) < 4:
        return None, None
    try:
        if c[1].query():  # never blocks: snapshot() may run while the rank is hung
            return float(c[0].elapsed_time(c[1])), int(c[2])
    except Exception:  # noqa: BLE001
        pass
    return None, int(c[2])


# ---- the hooks ---------------------------------------------------------------------------------

_ST = None  # ShardTensor class, bound at install time
# ShardTensor methods recorded with path "python_method" (they communicate without __torch_function__)
PYTHON_METHODS = ("full_tensor", "redistribute", "backward", "from_local")
# ...recorded only when called by user code (no recorded op on the stack): every handler builds its
# result with from_local (explicit shapes, no communication), and an event for each would double the
# event count; inside an op its collectives (the "infer" all_gather) belong to that op anyway.
PYTHON_METHODS_TOP_ONLY = frozenset({"from_local"})


def _shard_tensor_cls():
    try:
        from physicsnemo.domain_parallel.shard_tensor import ShardTensor

        return ShardTensor
    except Exception:  # noqa: BLE001
        return None


def _make_bw_pre(box: list):
    def _sharddbg_bw_pre(grad_outputs):
        if _ACTIVE is box[1]:
            box[2] = clock.now_ns()
        return None

    return _sharddbg_bw_pre


def _make_bw_post(box: list):
    def _sharddbg_bw_post(grad_inputs, grad_outputs):
        rec = box[1]
        if _ACTIVE is rec:
            try:
                rec._backward_event(box, grad_inputs, grad_outputs)
            except Exception:  # noqa: BLE001 - never break the user's backward
                rec.internal_errors.append(traceback.format_exc())
        return None

    return _sharddbg_bw_post


def _run_recorded(r: "Recorder", st: "_ThreadState", ev: dict, fn, *args, **kwargs):
    """Run ``fn`` for the begun event ``ev``, then record its error or its end. The recorder's own
    bookkeeping never raises into the user's call; the user's exception always propagates."""
    try:
        res = fn(*args, **kwargs)
    except BaseException as e:
        st.busy = True
        try:
            r._record_error(st, ev, e, False)
        finally:
            st.busy = False
        raise
    st.busy = True
    try:
        r._end(st, ev, res)
    except Exception:  # noqa: BLE001
        r.internal_errors.append(traceback.format_exc())
    finally:
        st.busy = False
    return res


def _install(rec: Recorder, patches: Patches) -> None:
    global _ST
    import physicsnemo.domain_parallel.shard_tensor as stm
    from torch.nn.modules import module as nnmod

    ST = stm.ShardTensor
    _ST = ST
    orig_tf = ST.__dict__["__torch_function__"].__func__
    orig_td = ST.__dict__["__torch_dispatch__"].__func__
    orig_fb_fn = stm._torch_function_fallback_via_dtensor
    orig_fb_td = stm._dispatch_fallback_via_dtensor
    orig_promote = stm._promote_plain_tensor_to_dtensor
    conversion_active = stm._conversion_active
    fb_fn_name = qualname(orig_fb_fn)
    fb_td_name = qualname(orig_fb_td)

    def __torch_function__(cls, func, types, args=(), kwargs=None):
        r = _ACTIVE
        if r is None:
            return orig_tf(cls, func, types, args, kwargs)
        st = r._state()
        if st.busy:
            r.reentries += 1
            return orig_tf(cls, func, types, args, kwargs)
        st.busy = True
        ev = None
        try:
            infos = collect_tensors(args, kwargs, ST)
            if not (any(i[6] == 1 for i in infos) or _tracing()):
                # ShardTensor's own order (shard_tensor.py, __torch_function__), read at call time.
                if conversion_active():
                    path, h = "conversion", None
                elif func in cls._autograd_passthrough_functions:
                    path, h = "autograd_passthrough", None
                elif func in cls._function_registry and cls._enable_shard_patches:
                    path, h = "function_handler", qualname(cls._function_registry[func])
                elif cls._enable_shard_patches and str(func) in cls._named_function_registry:
                    path, h = "named_handler", qualname(cls._named_function_registry[str(func)])
                else:
                    path, h = "dtensor_fallback_function", fb_fn_name
                ev = r._begin(st, op_name(func), path, h, infos)
        except Exception:  # noqa: BLE001 - a recorder bug must not change the user's result
            r.internal_errors.append(traceback.format_exc())
            ev = None
        finally:
            st.busy = False
        if ev is None:
            return orig_tf(cls, func, types, args, kwargs)
        try:
            res = orig_tf(cls, func, types, args, kwargs)
        except BaseException as e:
            unmask = r.unmask and isinstance(e, TypeError) and would_swallow_type_error(func, args, sys._getframe(1))
            st.busy = True
            try:
                err = r._record_error(st, ev, e, unmask)
            finally:
                st.busy = False
            if unmask:
                new = UnmaskedOpError(
                    f"{ev['op']} raised {err['exc_type']} on rank {r.rank}: {err['message']}\n"
                    "(sharddbg unmasked it: without the recorder PyTorch reports only "
                    "\"unsupported operand type(s)\". The original exception is chained above; "
                    "pass unmask=False / --no-unmask for PyTorch's behaviour.)",
                    op=ev["op"],
                    rank=r.rank,
                )
                r._exc_seen[id(new)] = (new, err)  # outer ops point at the original, not at this
                raise new from e
            raise
        st.busy = True
        try:
            r._end(st, ev, res)
        except Exception:  # noqa: BLE001
            r.internal_errors.append(traceback.format_exc())
        finally:
            st.busy = False
        return res

    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        r = _ACTIVE
        if r is None:
            return orig_td(cls, func, types, args, kwargs)
        st = r._state()
        if st.busy:
            r.reentries += 1
            return orig_td(cls, func, types, args, kwargs)
        st.busy = True
        ev = None
        try:
            infos = collect_tensors(args, kwargs, ST)
            if not (any(i[6] == 1 for i in infos) or _tracing()):
                handler = cls._dispatch_registry.get(func)
                if handler is None:
                    handler = cls._dispatch_registry_by_name.get(str(func))
                if handler is not None:
                    path, h = "dispatch_handler", qualname(handler)
                else:
                    path, h = "dtensor_fallback_dispatch", fb_td_name
                ev = r._begin(st, op_name(func), path, h, infos)
        except Exception:  # noqa: BLE001
            r.internal_errors.append(traceback.format_exc())
            ev = None
        finally:
            st.busy = False
        if ev is None:
            return orig_td(cls, func, types, args, kwargs)
        return _run_recorded(r, st, ev, orig_td, cls, func, types, args, kwargs)

    def _mark_fallback():
        r = _ACTIVE
        if r is not None:
            st = r._state()
            if st.stack:
                st.stack[-1]["fallback"] = True

    def _torch_function_fallback_via_dtensor(*a, **k):
        _mark_fallback()
        return orig_fb_fn(*a, **k)

    def _dispatch_fallback_via_dtensor(*a, **k):
        _mark_fallback()
        return orig_fb_td(*a, **k)

    def _promote_plain_tensor_to_dtensor(tensor, mesh, *a, **k):
        r = _ACTIVE
        if r is not None:
            st = r._state()
            if st.stack and not st.busy:
                ev = st.stack[-1]
                proms = ev.get("promotions")
                if proms is None:
                    proms = ev["promotions"] = []
                proms.append((r._params.get(id(tensor)), tensor.shape, tensor.dtype))
        return orig_promote(tensor, mesh, *a, **k)

    repl = {}
    for w, o in ((_torch_function_fallback_via_dtensor, orig_fb_fn),
                 (_dispatch_fallback_via_dtensor, orig_fb_td),
                 (_promote_plain_tensor_to_dtensor, orig_promote)):
        w.__wrapped__ = o  # type: ignore[attr-defined]
        w.__qualname__ = o.__qualname__
        w.__module__ = o.__module__
        repl[id(o)] = (o, w)
    # physicsnemo.domain_parallel is where these private helpers are imported from
    rec.installed_at += patches.replace_globals(repl, package="physicsnemo.domain_parallel")

    patches.setattr(ST, "__torch_function__", classmethod(__torch_function__))
    patches.setattr(ST, "__torch_dispatch__", classmethod(__torch_dispatch__))

    # ShardTensor's Python methods that communicate bypass __torch_function__ (full_tensor, redistribute,
    # backward's Partial->Replicate, from_local(..., "infer")): recorded as ops with path "python_method"
    # so the collectives they issue have an op to belong to.
    def _wrap_method(name: str, fn):
        label = f"ShardTensor.{name}"
        hname = qualname(fn)

        top_only = name in PYTHON_METHODS_TOP_ONLY

        def method(*args, **kwargs):
            r = _ACTIVE
            if r is None:
                return fn(*args, **kwargs)
            st = r._state()
            if st.busy or (top_only and st.stack):
                return fn(*args, **kwargs)
            st.busy = True
            ev = None
            try:
                infos = collect_tensors(args, kwargs, ST)
                if not (any(i[6] == 1 for i in infos) or _tracing()):
                    ev = r._begin(st, label, "python_method", hname, infos)
            except Exception:  # noqa: BLE001
                r.internal_errors.append(traceback.format_exc())
                ev = None
            finally:
                st.busy = False
            if ev is None:
                return fn(*args, **kwargs)
            return _run_recorded(r, st, ev, fn, *args, **kwargs)

        method.__wrapped__ = fn  # type: ignore[attr-defined]
        method.__name__ = fn.__name__
        method.__qualname__ = fn.__qualname__
        method.__module__ = fn.__module__
        method.__doc__ = fn.__doc__
        return method

    for mname in PYTHON_METHODS:
        raw = ST.__dict__.get(mname)
        if isinstance(raw, staticmethod):
            patches.setattr(ST, mname, staticmethod(_wrap_method(mname, raw.__func__)))
        elif callable(raw):
            patches.setattr(ST, mname, _wrap_method(mname, raw))

    def _mod_pre(m, inputs):
        r = _ACTIVE
        if r is not None:
            st = r._state()
            st.modstack.append(r._module_name(m, st))
            mf = st.modframes
            try:
                f = sys._getframe(1)  # Module._call_impl, which calls the global hooks itself
            except ValueError:
                f = None
            # the module's user frame: above _call_impl, up to the enclosing module's _call_impl
            uf = user_frame_until(2, mf[-1][0], mf[-1][1]) if mf else user_frame(2)
            mf.append((f, uf))

    def _mod_post(m, inputs, output):
        r = _ACTIVE
        if r is not None:
            st = r._state()
            if st.modstack:
                st.modstack.pop()
            if st.modframes:
                st.modframes.pop()

    h1 = nnmod.register_module_forward_pre_hook(_mod_pre)
    patches.add_undo(h1.remove)
    # always_call: the pop also happens when the forward raises.
    h2 = nnmod.register_module_forward_hook(_mod_post, always_call=True)
    patches.add_undo(h2.remove)


# ---- module-level API for clusters (one round trip each) -----------------------------------------

def start(max_events: int = 200_000, unmask: bool = True, comm: bool = True) -> dict:
    """Start recording on this rank; returns {"rank", "t_start_ns"}. Refused if one is running."""
    global _SESSION, _LAST_PAYLOAD
    rec = Recorder(max_events=max_events, unmask=unmask, comm=comm)
    rec.__enter__()
    _SESSION = rec
    _LAST_PAYLOAD = None
    return {"rank": rec.rank, "t_start_ns": rec.t_start_ns}


def stop() -> dict:
    """Stop the recording started by start(); returns the payload (schema.py)."""
    global _SESSION, _LAST_PAYLOAD
    rec = _SESSION
    if rec is None:
        raise RecorderError("stop(): no recording was started on this rank with start()")
    _SESSION = None
    rec.close()
    _LAST_PAYLOAD = rec.payload(complete=True)
    return _LAST_PAYLOAD


def peek() -> dict:
    """The events so far, without stopping (complete=False while running; in-flight ops included); after
    stop(), the payload stop() returned.

    Safe from another thread while the main thread is blocked: copies lists, takes no locks, never
    synchronizes a device or calls a collective.
    """
    rec = _SESSION
    if rec is not None:
        return rec.payload()
    if _LAST_PAYLOAD is not None:
        return _LAST_PAYLOAD
    raise RecorderError("peek(): no recording was started on this rank with start()")


def is_recording() -> bool:
    """A recording started by start() is running on this rank."""
    return _SESSION is not None


def abandon() -> None:
    """Stop a recording cut short (a hang, a broken process group), keeping nothing: every hook is
    removed. Does nothing when no recording runs."""
    if _SESSION is not None:
        try:
            stop()
        except Exception:  # noqa: BLE001 - the hooks are restored first; an export failure loses nothing needed
            pass
