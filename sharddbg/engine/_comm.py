"""Collective recording for the recorder: every collective on this rank, attributed to the op that caused it.

Private to ``recorder.py`` (it installs this while recording when ``comm=True``, the default).

What a ``TorchDispatchMode`` sees in torch 2.14 (measured with gloo, see tests/test_comm.py):
- functional collectives as ``_c10d_functional.{all_gather_into_tensor, all_to_all_single, all_reduce,
  reduce_scatter_tensor, ...}`` (the ``_c10d_functional_autograd`` variants arrive as these too, forward
  and backward) and their completion as ``_c10d_functional.wait_tensor``;
- every ``torch.distributed`` Python call as its ``c10d.*`` op: ``dist.all_reduce`` -> ``c10d.allreduce_``,
  ``all_gather`` -> ``allgather_``, ``broadcast(_object_list)`` -> ``broadcast_``, ``barrier`` ->
  ``barrier``, ``batch_isend_irecv`` / ``isend`` / ``irecv`` -> ``send`` / ``recv_``, ...
- NOT the Python-level ``Work.wait()`` that completes a c10d call (sync calls wait in Python right after
  the op returns). ``Work.wait`` is therefore wrapped while recording (restored on exit) and matched to
  the issuing op through the Python ``Work`` object (``Work.unbox`` of the op's ScriptObject result
  returns the same pybind object that ``dist.*`` hands back to its caller).

How they are caught (no per-aten-op cost: a global dispatch mode cost ~5 us on EVERY aten op):
1. Python kernels at the ``ADInplaceOrView`` dispatch key of every ``c10d`` / ``_c10d_functional`` op
   (``torch.library``, removed on exit): calls from C++ (the autograd all_to_all's forward and backward
   and its ``wait_tensor``, ``dist.*`` -> ``ProcessGroup`` methods, p2p) and from Python outside a tensor
   subclass's ``__torch_dispatch__``. That key is excluded inside a subclass's ``__torch_dispatch__``
   (below autograd) and absent on inference tensors, so also:
2. the ``torch.ops._c10d_functional`` / ``_c10d_functional_autograd`` / ``_dtensor`` packets are
   replaced by wrappers (``_Packet``) while recording: every Python caller (funcol, DTensor's
   redistribute inside its ``__torch_dispatch__``, an AsyncCollectiveTensor's ``wait_tensor``);
3. the ``torch.distributed`` collective functions are wrapped; only when 1. cannot see the call
   (``ADInplaceOrView`` excluded, or inference mode) they push ``_CommMode`` for that call alone;
4. ``Work.wait`` (completion of c10d work).
A per-thread depth (``cdepth``) makes what a recorded collective dispatches (funcol kernels re-enter as
``c10d`` ops) part of it, not a second record; recorded calls run with ``ADInplaceOrView`` excluded so
the nested kernels are not even entered. Not seen: ``ProcessGroup`` methods called directly inside a
``__torch_dispatch__`` or on inference tensors (nothing in torch / physicsnemo does).

``_CommMode`` (used by 3. only) answers ``NotImplemented`` for the tensor subclasses whose own
``__torch_dispatch__`` may communicate (ShardTensor, DTensor, AsyncCollectiveTensor; not FakeTensor,
which only its own mode may handle), like ``CommDebugMode`` does for ``DTensor``.

Attribution: ``op`` is the innermost recorded op on the recorder's thread-local stack, ``outer_op`` the
outermost. In backward (``torch._C._current_autograd_node()`` is set) the node's ``_sequence_nr()`` is
mapped to the forward op during which the node was created (the recorder notes the autograd sequence
counter at each op's start and end); ``param`` names the parameter whose ``AccumulateGrad`` the node feeds.

Nothing here calls a collective or dispatches a tensor op; reading shapes/numel/element_size is metadata.
"""

from __future__ import annotations

import bisect
import math
import threading
import traceback
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from . import clock
from ._rec_util import new_cuda_event, node_name

_current_node = getattr(torch._C, "_current_autograd_node", lambda: None)
try:
    from torch._subclasses.fake_tensor import FakeTensor as _FakeTensor
except Exception:  # pragma: no cover - another torch layout
    class _FakeTensor:  # type: ignore[no-redef]
        pass

# aten-level op name -> (kind shown to users, api, handler name)
_SPECS: dict[str, tuple[str, str, str]] = {
    # functional collectives (funcol; the autograd variants dispatch as these)
    "_c10d_functional.all_gather_into_tensor": ("all_gather_into_tensor", "functional", "f_all_gather"),
    "_c10d_functional.all_to_all_single": ("all_to_all_single", "functional", "f_all_to_all"),
    "_c10d_functional.all_reduce": ("all_reduce", "functional", "f_same"),
    "_c10d_functional.all_reduce_": ("all_reduce", "functional", "f_same"),
    "_c10d_functional.reduce_scatter_tensor": ("reduce_scatter_tensor", "functional", "f_reduce_scatter"),
    "_c10d_functional.broadcast": ("broadcast", "functional", "f_same"),
    "_c10d_functional.broadcast_": ("broadcast", "functional", "f_same"),
    "_c10d_functional.all_gather_into_tensor_coalesced": ("all_gather_into_tensor_coalesced", "functional", "f_coalesced_gather"),
    "_c10d_functional.reduce_scatter_tensor_coalesced": ("reduce_scatter_tensor_coalesced", "functional", "f_coalesced_rs"),
    "_c10d_functional.all_reduce_coalesced": ("all_reduce_coalesced", "functional", "f_coalesced_same"),
    "_c10d_functional.all_reduce_coalesced_": ("all_reduce_coalesced", "functional", "f_coalesced_same"),
    "_c10d_functional.isend": ("send", "functional", "f_send"),
    "_c10d_functional.irecv": ("recv", "functional", "f_recv"),
    "_c10d_functional_autograd.all_gather_into_tensor": ("all_gather_into_tensor", "functional", "f_all_gather"),
    "_c10d_functional_autograd.all_to_all_single": ("all_to_all_single", "functional", "f_all_to_all"),
    "_c10d_functional_autograd.reduce_scatter_tensor": ("reduce_scatter_tensor", "functional", "f_reduce_scatter"),
    # c10d ops (torch.distributed Python API)
    "c10d.allreduce_": ("all_reduce", "c10d", "c_same"),
    "c10d.allreduce_coalesced_": ("all_reduce_coalesced", "c10d", "c_same"),
    "c10d.broadcast_": ("broadcast", "c10d", "c_broadcast"),
    "c10d.allgather_": ("all_gather", "c10d", "c_allgather"),
    "c10d._allgather_base_": ("all_gather_into_tensor", "c10d", "c_allgather_base"),
    "c10d.allgather_coalesced_": ("all_gather_coalesced", "c10d", "c_allgather_coalesced"),
    "c10d.allgather_into_tensor_coalesced_": ("all_gather_into_tensor_coalesced", "c10d", "c_ag_into_coalesced"),
    "c10d.alltoall_base_": ("all_to_all_single", "c10d", "c_alltoall_base"),
    "c10d.alltoall_": ("all_to_all", "c10d", "c_alltoall"),
    "c10d.reduce_scatter_": ("reduce_scatter", "c10d", "c_reduce_scatter"),
    "c10d._reduce_scatter_base_": ("reduce_scatter_tensor", "c10d", "c_reduce_scatter_base"),
    "c10d.reduce_scatter_tensor_coalesced_": ("reduce_scatter_tensor_coalesced", "c10d", "c_rs_coalesced"),
    "c10d.reduce_": ("reduce", "c10d", "c_reduce"),
    "c10d.gather_": ("gather", "c10d", "c_gather"),
    "c10d.scatter_": ("scatter", "c10d", "c_scatter"),
    "c10d.send": ("send", "c10d", "c_send"),
    "c10d.recv_": ("recv", "c10d", "c_recv"),
    "c10d.recv_any_source_": ("recv", "c10d", "c_recv"),
    "c10d.barrier": ("barrier", "c10d", "c_barrier"),
    "c10d.monitored_barrier_": ("barrier", "c10d", "c_barrier"),
    # DTensor's Shard(i) -> Shard(j) on CUDA: one C++ op (all_to_all + wait inside), synchronous
    "_dtensor.shard_dim_alltoall": ("all_to_all_single", "functional", "d_shard_a2a"),
}
_NOT_COLLECTIVE = frozenset({"check_for_nan"})
# kinds whose backward call reduces a gradient: `param` names the parameter it accumulates into
_GRAD_REDUCTIONS = frozenset({"all_reduce", "all_reduce_coalesced", "reduce", "reduce_scatter",
                              "reduce_scatter_tensor", "reduce_scatter_tensor_coalesced"})


def _collective_op_names(names, ns: str):
    """Op names of namespace ``ns`` among ``names`` ("ns::op"), less the ones that move no data."""
    for full in names:
        if full.startswith(ns + "::"):
            opname = full.split("::", 1)[1]
            if opname not in _NOT_COLLECTIVE:
                yield opname


# torch.distributed functions wrapped for the calls the ADInplaceOrView kernels cannot see
_DIST_FUNCS = (
    "all_reduce", "all_reduce_coalesced", "all_gather", "all_gather_into_tensor", "_all_gather_base",
    "all_gather_coalesced", "all_gather_object", "broadcast", "broadcast_object_list", "reduce",
    "reduce_scatter", "reduce_scatter_tensor", "_reduce_scatter_base", "all_to_all", "all_to_all_single",
    "gather", "gather_object", "scatter", "scatter_object_list", "send", "recv", "isend", "irecv",
    "batch_isend_irecv", "barrier", "monitored_barrier", "send_object_list", "recv_object_list",
)
_ADIOV = torch._C.DispatchKey.ADInplaceOrView
_ADIOV_SET = torch._C.DispatchKeySet(_ADIOV)
_excluded = torch._C._dispatch_tls_is_dispatch_key_excluded
_WAIT = "_c10d_functional.wait_tensor"
_WRAP = "_c10d_functional._wrap_tensor_autograd"

_op_spec: dict[Any, Any] = {}  # OpOverload -> spec tuple | "wait" | "wrap" | None (not a collective)
_plain_type: dict[type, bool] = {}
_types_plain: dict[tuple, bool] = {}  # the `types` tuple a mode receives -> all plain


def _spec_of(func) -> Any:
    try:
        return _op_spec[func]
    except KeyError:
        pass
    s = None
    ns = getattr(func, "namespace", "")
    if ns in ("c10d", "_c10d_functional", "_c10d_functional_autograd", "_dtensor"):
        base = f"{ns}.{func._schema.name.split('::', 1)[1]}"
        if ns == "_dtensor" and base not in _SPECS:
            s = None
        elif base == _WAIT:
            s = "wait"
        elif base == _WRAP:
            s = "wrap"
        elif base in _SPECS:
            kind, api, handler = _SPECS[base]
            # the autograd variants are reported as the functional op their kernels run (as a dispatch
            # mode saw them)
            shown = base.replace("_c10d_functional_autograd.", "_c10d_functional.")
            s = (kind, api, handler, [a.name for a in func._schema.arguments], shown)
        else:  # an unknown c10d op: still a collective, bytes unknown
            s = (func._schema.name.split("::", 1)[1].rstrip("_"), "c10d" if ns == "c10d" else "functional",
                 "unknown", [a.name for a in func._schema.arguments], base)
    _op_spec[func] = s
    return s


_DELEGATE: tuple = ()


def _is_plain(t: type) -> bool:
    """False for the subclasses whose own __torch_dispatch__ may issue or complete collectives
    (ShardTensor, DTensor, AsyncCollectiveTensor): this mode lets them run first and stays active inside.
    Every other type (plain tensors, FakeTensor during DTensor sharding propagation, ...) is run directly,
    as CommDebugMode does: a FakeTensor answers NotImplemented to everyone but its own mode."""
    global _DELEGATE
    try:
        return _plain_type[t]
    except KeyError:
        if not _DELEGATE:
            from torch.distributed._functional_collectives import AsyncCollectiveTensor
            from torch.distributed.tensor import DTensor

            d = [DTensor, AsyncCollectiveTensor]
            try:
                from physicsnemo.domain_parallel.shard_tensor import ShardTensor

                d.append(ShardTensor)
            except Exception:  # noqa: BLE001
                pass
            _DELEGATE = tuple(d)
        p = not issubclass(t, _DELEGATE)
        _plain_type[t] = p
        return p


class _TensorMeta:
    """What the byte counts need of a collective's input tensor, kept instead of the tensor itself."""

    __slots__ = ("shape", "dtype", "_esize")

    def __init__(self, shape, dtype, esize: int) -> None:
        self.shape, self.dtype, self._esize = shape, dtype, esize

    def numel(self) -> int:
        return math.prod(self.shape)

    def element_size(self) -> int:
        return self._esize

    def dim(self) -> int:
        return len(self.shape)


# funcol ops whose schema is (input, ..., group_name) and whose bytes depend only on sizes and plain args
_FAST_HANDLERS = frozenset({"f_same", "f_all_to_all", "f_all_gather", "f_reduce_scatter"})


def _nb(t: Any) -> int:
    if isinstance(t, (torch.Tensor, _TensorMeta)):
        return t.numel() * t.element_size()
    if isinstance(t, (list, tuple)):
        return sum(_nb(x) for x in t)
    return 0


def _first_tensor(x: Any):
    if isinstance(x, torch.Tensor):
        return x
    if isinstance(x, (list, tuple)):
        for y in x:
            t = _first_tensor(y)
            if t is not None:
                return t
    return None


class _CommMode(TorchDispatchMode):
    """Sees every aten op on plain tensors; handles the c10d / funcol ones, passes the rest through."""

    def __init__(self, comm: "CommRecorder") -> None:
        super().__init__()
        self.comm = comm
        self.dead = False  # stopped from another thread: left on this thread's mode stack, inert

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if self.dead:
            return func(*args, **kwargs) if kwargs else func(*args)
        # the hot path (every aten op while recording): two dict lookups, then the op itself
        p = _types_plain.get(types)
        if p is None:
            p = _types_plain[types] = all(_is_plain(t) for t in types)
        if not p:
            return NotImplemented  # let the subclass run with this mode still active (see module doc)
        s = _op_spec.get(func, 0)
        if s is None:
            return func(*args, **kwargs) if kwargs else func(*args)
        if s == 0:
            s = _spec_of(func)
            if s is None:
                return func(*args, **kwargs) if kwargs else func(*args)
        return self.comm.handle(func, s, args, kwargs or {})


class CommRecorder:
    """State of collective recording for one Recorder (one per rank)."""

    def __init__(self, rec: Any) -> None:
        self.rec = rec
        self.mode = _CommMode(self)
        self.group_seq: dict[str, int] = {}
        self.groups: dict[str, tuple] = {}  # group_name -> (ranks, mesh_dim)
        self.pending_t: dict[int, dict] = {}  # id(output tensor) -> record (functional collectives)
        self.pending_w: dict[int, dict] = {}  # id(python Work) -> record (c10d ops)
        self.n = 0
        self._param_node = -1  # autograd sequence number of the last node whose parameter was looked up
        self._param_name: str | None = None
        self.entered = False
        self.thread: int | None = None
        from . import recorder as R  # noqa: PLC0415 - its _ACTIVE is read at call time

        self._R = R

    # ---- install / remove ---------------------------------------------------------------------
    def install(self, patches) -> None:
        """Hooks that cost nothing on non-collective aten ops (see the module docstring):
        1. Python kernels at the ADInplaceOrView key of every ``c10d`` / ``_c10d_functional`` op;
        2. wrappers of the ``torch.ops._c10d_functional`` / ``_c10d_functional_autograd`` / ``_dtensor``
           packets (Python callers, also inside a subclass's ``__torch_dispatch__`` where 1. is excluded);
        3. wrappers of the ``torch.distributed`` collective functions that push ``_CommMode`` for the call
           only when 1. cannot see it (inside a ``__torch_dispatch__``, or in inference mode);
        4. ``Work.wait``, which completes c10d work.
        A per-thread depth (``_ThreadState.cdepth``) keeps a collective from being recorded twice when
        it passes through several of these (a funcol kernel re-enters as a ``c10d`` op)."""
        import torch.distributed as dist
        import torch.distributed.distributed_c10d as c10d_mod

        comm = self
        Work = dist.Work
        orig_wait = Work.__dict__["wait"]

        def wait(self, *a, **k):
            res = orig_wait(self, *a, **k)
            if comm.pending_w:
                rec = comm.pending_w.pop(id(self), None)
                if rec is not None:
                    if rec["_obj"] is self:
                        comm._done(rec)
                    else:  # an id reused by another object: not ours
                        comm.pending_w[id(self)] = rec
            return res

        wait.__doc__ = getattr(orig_wait, "__doc__", None)
        patches.setattr(Work, "wait", wait)
        _pop_dead_modes()

        # 1. ADInplaceOrView kernels
        libs = []
        patches.add_undo(lambda: [lib._destroy() for lib in libs])
        names = _op_names()
        for ns in ("_c10d_functional", "c10d"):
            lib = torch.library.Library(ns, "IMPL")
            libs.append(lib)
            nsobj = getattr(torch.ops, ns)
            for opname in _collective_op_names(names, ns):
                packet = getattr(nsobj, opname)
                for ov in packet.overloads():
                    func = getattr(packet, ov)
                    s = _spec_of(func)
                    if s is None or s == "wrap":
                        continue
                    lib.impl(opname if ov == "default" else f"{opname}.{ov}", self._kernel(func, s),
                             "ADInplaceOrView", with_keyset=True)

        # 2. packets called from Python
        for ns in ("_c10d_functional", "_c10d_functional_autograd", "_dtensor"):
            nsobj = getattr(torch.ops, ns, None)
            if nsobj is None:
                continue
            for opname in _collective_op_names(names, ns):
                packet = getattr(nsobj, opname)
                if not isinstance(packet, torch._ops.OpOverloadPacket) or "default" not in packet.overloads():
                    continue
                s = _spec_of(packet.default)
                if s is not None:
                    patches.setattr(nsobj, opname, _Packet(packet, s, self))

        # 3. torch.distributed functions, for the calls 1. cannot see
        for fname in _DIST_FUNCS:
            fn = getattr(c10d_mod, fname, None)
            if fn is None or not callable(fn):
                continue
            w = self._dist_wrapper(fn)
            for mod in (c10d_mod, dist):
                if getattr(mod, fname, None) is fn:
                    patches.setattr(mod, fname, w)

        self.entered = True
        self.thread = threading.get_ident()
        patches.add_undo(self.remove)

    def _kernel(self, func, s):
        after = torch._C._after_ADInplaceOrView_keyset
        comm = self
        rec = self.rec
        from . import recorder as R

        def kernel(keyset, *args, **kwargs):
            ks = keyset & after
            if R._ACTIVE is rec and not rec._state().cdepth:
                def call(*a, **k):
                    # what the op dispatches (a funcol kernel's c10d op) is this collective, not another
                    with torch._C._ExcludeDispatchKeyGuard(_ADIOV_SET):
                        return func.redispatch(ks, *a, **k)

                return comm.handle(call, s, args, kwargs)
            return func.redispatch(ks, *args, **kwargs)

        return kernel

    def _dist_wrapper(self, fn):
        comm = self
        rec = self.rec
        mode = self.mode
        from . import recorder as R

        def wrapper(*args, **kwargs):
            if R._ACTIVE is rec and (_excluded(_ADIOV) or torch.is_inference_mode_enabled()):
                st = rec._state()
                if not (st.cdepth or st.cmode or st.busy):
                    st.cmode = True
                    try:
                        with mode:
                            return fn(*args, **kwargs)
                    finally:
                        st.cmode = False
            return fn(*args, **kwargs)

        for a in ("__name__", "__qualname__", "__module__", "__doc__"):
            try:
                setattr(wrapper, a, getattr(fn, a))
            except Exception:  # noqa: BLE001
                pass
        wrapper.__wrapped__ = fn  # type: ignore[attr-defined]
        del comm
        return wrapper

    def remove(self) -> None:
        if not self.entered:
            return
        self.entered = False
        # records never waited during the recording keep t_done_ns None; drop the tensor / Work refs
        for d in (self.pending_t, self.pending_w):
            for rec in d.values():
                rec.pop("_obj", None)
                rec.pop("_keys", None)
            d.clear()

    # ---- groups -------------------------------------------------------------------------------
    def _group(self, name: str, pg: Any = None) -> tuple:
        g = self.groups.get(name)
        if g is not None:
            return g
        import torch.distributed as dist

        try:
            if pg is None:
                from torch.distributed.distributed_c10d import _resolve_process_group

                pg = _resolve_process_group(name)
            ranks = [int(r) for r in dist.get_process_group_ranks(pg)]
        except Exception:  # noqa: BLE001
            ranks = None
        g = (ranks, _mesh_dim_of(name))
        self.groups[name] = g
        return g

    # ---- the handler --------------------------------------------------------------------------
    def handle(self, func, s, args: tuple, kwargs: dict):
        """Record one collective (or a wait / wrap). ``func`` runs the op itself (an OpOverload, a
        packet, or a redispatch below the ADInplaceOrView kernel)."""
        rec = self.rec
        if self._R._ACTIVE is not rec:
            return func(*args, **kwargs)
        if s == "wait":  # dispatches nothing else: no depth to keep
            res = func(*args, **kwargs)
            if self.pending_t:
                self._close_tensor(args[0] if args else kwargs.get("tensor"))
            return res
        if s == "wrap":
            res = func(*args, **kwargs)
            self._wrapped(args, res)
            return res
        st = rec._state()
        if st.busy or self._R._tracing() or (args and isinstance(args[0], _FakeTensor)):
            # busy: our own bookkeeping; tracing: torch.compile runs the op on fake tensors, nothing
            # is communicated (the compiled graph's collectives run later, below these hooks)
            return func(*args, **kwargs)
        try:
            ev = self._begin(func, s, args, kwargs, st)
        except Exception:  # noqa: BLE001 - a recorder bug must not change the user's result
            rec.internal_errors.append(traceback.format_exc())
            return func(*args, **kwargs)
        ev["t_issue_ns"] = clock.now_ns()
        st.cdepth += 1  # what this op dispatches (a funcol kernel's c10d op) is not another collective
        try:
            res = func(*args, **kwargs)
        finally:
            st.cdepth -= 1
        ev["t_return_ns"] = clock.now_ns()
        try:
            self._after(ev, s, res)
        except Exception:  # noqa: BLE001
            rec.internal_errors.append(traceback.format_exc())
        return res

    def _wrapped(self, args: tuple, res) -> None:
        """``_wrap_tensor_autograd`` put a pending output into an AsyncCollectiveTensor: its wait closes it."""
        r = self.pending_t.get(id(args[0])) if args and self.pending_t else None
        if r is not None and r["_obj"][0] is args[0]:
            r["_obj"].append(res)
            r["_keys"].append(id(res))
            self.pending_t[id(res)] = r

    def _begin(self, func, s, args, kwargs, st) -> dict:
        # Hot path: only what cannot be known later (times, sizes, attribution). Names, plain dtypes and
        # the op fields are filled in by export().
        rec = self.rec
        kind, api, handler, names, base = s
        if (not kwargs and handler in _FAST_HANDLERS and len(args) == len(names)
                and isinstance(args[0], torch.Tensor)):
            # funcol's common ops, called positionally: input first, group_name last. Keep the sizes and
            # the other (plain) arguments; bytes and splits are worked out at export.
            t0 = args[0]
            gname = args[-1]
            if type(gname) is not str:
                gname = str(gname)
            g = self.groups.get(gname) or self._group(gname)
            bm = (t0.shape, t0.dtype, t0.element_size(), args[1:])
            sent = recv = ss = sr = peer = root = None
        else:
            bm = None
            v = dict(zip(names, args))
            if kwargs:
                v.update(kwargs)
            if api == "functional":
                gname = v.get("group_name")
                if type(gname) is not str:
                    gname = str(gname)
                g = self.groups.get(gname) or self._group(gname)
            else:
                import torch.distributed as dist

                pg = dist.ProcessGroup.unbox(v["process_group"])
                gname = pg.group_name
                g = self.groups.get(gname) or self._group(gname, pg)
            sent, recv, ss, sr, peer, root, t0 = _bytes(handler, v, g[0], rec.rank)
            if not g[0]:
                ev_gsize = int(v.get("group_size") or 0) or None
        gs = self.group_seq.get(gname, 0)
        self.group_seq[gname] = gs + 1
        node = _current_node()
        bw = None
        if node is not None:
            phase = "backward"
            anode = node_name(node)
            n = node._sequence_nr()
            # the forward op that made this node: looked up at export among the forward ops that had
            # ended by now (their count is the limit), or the op whose output node this is
            # (the output-node box is only needed for ops of other threads: sequence numbers are per thread)
            bw = (n, len(rec._fwd_ranges), node.metadata.get("sharddbg") if len(rec._states) > 1 else None)
            op = outer = None
            param = None
            if kind in _GRAD_REDUCTIONS:
                if n == self._param_node:  # weight and bias of one node: walk its inputs once
                    param = self._param_name
                else:
                    param = self._param_name = _param_of(node, rec._params)
                    self._param_node = n
        else:
            phase, anode, param = "forward", None, None
            stack = st.stack
            op = stack[-1] if stack else None
            outer = stack[0] if stack else None
        if handler == "d_shard_a2a":
            is_async = False
        elif handler in ("c_send", "c_recv"):
            is_async = True  # point-to-point work is always completed by a later wait
        else:
            # functional collectives always complete at a later wait_tensor; c10d: what the caller asked for
            is_async = True if api == "functional" else bool(v.get("async_op", True))
        ev = {
            "kind": "collective",
            "seq": next(rec._seq),
            "group_seq": gs,
            "_s": s,
            "group_name": gname,
            "_g": g,
            "_bm": None,
            "peer": peer,
            "root": root,
            "bytes_sent": sent,
            "bytes_recv": recv,
            "splits_sent": ss,
            "splits_recv": sr,
            "dtype": t0.dtype if t0 is not None else None,  # made plain at export
            "shape": t0.shape if t0 is not None else None,
            "async": is_async,
            "t_issue_ns": 0,
            "t_return_ns": None,
            "t_done_ns": None,
            "wait_op_seq": None,
            "waited": False,
            "_op": op,
            "_outer": outer,
            "_bw": bw,
            "phase": phase,
            "autograd_node": anode,
            "param": param,
            "thread": st.tid,
            "_cuda": _cuda_begin() if t0 is not None and t0.is_cuda else None,
        }
        if bm is not None:
            ev["_bm"] = bm
        elif not g[0]:
            ev["group_size"] = ev_gsize
        self.n += 1
        rec._keep(ev)
        return ev

    def _after(self, ev: dict, s, res) -> None:
        if s[2] == "d_shard_a2a":  # waited inside the op
            self._done(ev)
            return
        if s[1] == "functional":
            out = res if isinstance(res, torch.Tensor) else _first_tensor(res)
            if out is None:
                self._done(ev)
                return
            ev["_obj"] = [out]
            ev["_keys"] = [id(out)]
            self.pending_t[id(out)] = ev
            if isinstance(res, (list, tuple)):  # coalesced: any of the outputs closes it
                for o in res[1:]:
                    if isinstance(o, torch.Tensor):
                        ev["_obj"].append(o)
                        ev["_keys"].append(id(o))
                        self.pending_t[id(o)] = ev
            return
        work = res[-1] if isinstance(res, (tuple, list)) else res
        if isinstance(work, torch.ScriptObject):
            import torch.distributed as dist

            try:
                w = dist.Work.unbox(work)
            except Exception:  # noqa: BLE001
                w = None
            if w is not None:
                ev["_obj"] = w
                self.pending_w[id(w)] = ev
                return
        self._done(ev)  # returned nothing to wait on (monitored_barrier): complete on return

    def _close_tensor(self, t: Any) -> None:
        ev = self.pending_t.get(id(t))
        if ev is None:
            el = getattr(t, "elem", None)  # an AsyncCollectiveTensor handed to wait_tensor directly
            ev = self.pending_t.get(id(el)) if el is not None else None
            if ev is None:
                return
            t = el
        if not any(o is t for o in ev["_obj"]):
            return
        self._done(ev)

    def _done(self, ev: dict) -> None:
        ev["t_done_ns"] = clock.now_ns()
        ev["waited"] = True
        st = self.rec._state()
        stack = st.stack
        ev["wait_op_seq"] = stack[-1]["seq"] if stack else None
        if ev["_cuda"] is not None:
            _cuda_end(ev["_cuda"])
        for k in ev.pop("_keys", ()):
            self.pending_t.pop(k, None)
        ev.pop("_obj", None)


_OP_NAMES: list[str] = []


def _op_names() -> list[str]:
    """The c10d / funcol / _dtensor op names (read once: listing every registered op takes ~2 ms; they are
    all registered by the time sharddbg's recorder is imported, which imports DTensor and funcol)."""
    if not _OP_NAMES:
        _OP_NAMES.extend(n for n in torch._C._dispatch_get_all_op_names()
                         if n.startswith(("c10d::", "_c10d_functional::", "_c10d_functional_autograd::",
                                          "_dtensor::")))
    return _OP_NAMES


class _Packet:
    """Stands in for a ``torch.ops.<ns>.<op>`` packet while recording: records Python callers' calls
    (DTensor's redistribute inside ``__torch_dispatch__``, ``wait_tensor`` of an AsyncCollectiveTensor)
    and otherwise behaves as the packet (attributes, overloads, hash and equality)."""

    __slots__ = ("_p", "_s", "_comm")

    def __init__(self, p, s, comm: "CommRecorder") -> None:
        self._p = p
        self._s = s
        self._comm = comm

    def __call__(self, *args, **kwargs):
        comm = self._comm
        rec = comm.rec
        if comm._R._ACTIVE is rec:
            s = self._s
            if s == "wrap":  # makes an AsyncCollectiveTensor: nothing below to hide from the kernels
                res = self._p(*args, **kwargs)
                comm._wrapped(args, res)
                return res
            if s == "wait" or not rec._state().cdepth:
                return comm.handle(self._call, s, args, kwargs)
        return self._p(*args, **kwargs)

    def _call(self, *args, **kwargs):
        # recorded here: the ADInplaceOrView kernels (C++ callers) need not see it again
        with torch._C._ExcludeDispatchKeyGuard(_ADIOV_SET):
            return self._p(*args, **kwargs)

    def __getattr__(self, name):
        return getattr(self._p, name)

    def __hash__(self) -> int:
        return hash(self._p)

    def __eq__(self, other) -> bool:
        return other is self or other is self._p or (isinstance(other, _Packet) and other._p is self._p)

    def __repr__(self) -> str:
        return repr(self._p)


def _pop_dead_modes() -> None:
    """Pop inert sharddbg modes left on top of this thread's dispatch mode stack."""
    from torch.utils._python_dispatch import _get_current_dispatch_mode

    m = _get_current_dispatch_mode()
    while isinstance(m, _CommMode) and m.dead:
        m.__exit__(None, None, None)
        m = _get_current_dispatch_mode()


# ---- bytes ------------------------------------------------------------------------------------

def _bytes(h: str, v: dict, ranks: list | None, my_rank: int):
    """(bytes_sent, bytes_recv, splits_sent, splits_recv, peer, root, first tensor) from the arguments.

    bytes_sent / bytes_recv are the sizes of the send and receive buffers of this rank (the part that
    stays local included, as NCCL-tests' "size"); splits_* are per group rank (all_to_all only).
    """
    n = len(ranks) if ranks else None
    ss = sr = peer = root = None

    def glob(gr):
        return ranks[gr] if ranks and gr is not None and 0 <= gr < len(ranks) else gr

    if h == "f_all_gather":
        t = v["input"]
        s = _nb(t)
        return s, s * int(v["group_size"]), None, None, None, None, t
    if h == "f_same":
        t = v.get("input", v.get("tensor"))
        s = _nb(t)
        return s, s, None, None, None, None, t
    if h == "f_reduce_scatter":
        t = v["input"]
        s = _nb(t)
        return s, s // max(int(v["group_size"]), 1), None, None, None, None, t
    if h == "f_all_to_all":
        t = v["input"]
        return _a2a(t, v.get("input_split_sizes"), v.get("output_split_sizes"), n) + (None, None, t)
    if h in ("f_coalesced_gather", "f_coalesced_rs", "f_coalesced_same"):
        ts = v["inputs"]
        s = _nb(ts)
        r = s * int(v["group_size"]) if h == "f_coalesced_gather" else (
            s // max(int(v["group_size"]), 1) if h == "f_coalesced_rs" else s)
        return s, r, None, None, None, None, _first_tensor(ts)
    if h == "f_send":
        t = v["tensor"]
        return _nb(t), 0, None, None, glob(v.get("dst")), None, t
    if h == "f_recv":
        t = v["tensor"]
        return 0, _nb(t), None, None, glob(v.get("src")), None, t
    if h == "c_same":
        ts = v["tensors"]
        s = _nb(ts)
        return s, s, None, None, None, None, _first_tensor(ts)
    if h == "c_broadcast":
        ts = v["tensors"]
        s = _nb(ts)
        root = glob(v.get("root_rank"))
        return (s if root == my_rank else 0), (0 if root == my_rank else s), None, None, None, root, _first_tensor(ts)
    if h == "c_allgather":
        return _nb(v["input_tensors"]), _nb(v["output_tensors"]), None, None, None, None, _first_tensor(v["input_tensors"])
    if h == "c_allgather_base":
        return _nb(v["input_tensor"]), _nb(v["output_tensor"]), None, None, None, None, v["input_tensor"]
    if h == "c_allgather_coalesced":
        return _nb(v["input_list"]), _nb(v["output_lists"]), None, None, None, None, _first_tensor(v["input_list"])
    if h == "c_ag_into_coalesced":
        return _nb(v["inputs"]), _nb(v["outputs"]), None, None, None, None, _first_tensor(v["inputs"])
    if h == "c_alltoall_base":
        t = v["input"]
        return _a2a(t, v.get("input_split_sizes"), v.get("output_split_sizes"), n) + (None, None, t)
    if h == "c_alltoall":
        ins, outs = v["input_tensors"], v["output_tensors"]
        return _nb(ins), _nb(outs), [_nb(x) for x in ins], [_nb(x) for x in outs], None, None, _first_tensor(ins)
    if h == "c_reduce_scatter":
        return _nb(v["input_tensors"]), _nb(v["output_tensors"]), None, None, None, None, _first_tensor(v["input_tensors"])
    if h == "c_reduce_scatter_base":
        return _nb(v["input_tensor"]), _nb(v["output_tensor"]), None, None, None, None, v["input_tensor"]
    if h == "c_rs_coalesced":
        return _nb(v["inputs"]), _nb(v["outputs"]), None, None, None, None, _first_tensor(v["inputs"])
    if h == "c_reduce":
        ts = v["tensors"]
        s = _nb(ts)
        root = glob(v.get("root_rank"))
        return s, (s if root == my_rank else 0), None, None, None, root, _first_tensor(ts)
    if h == "c_gather":
        root = glob(v.get("root_rank"))
        return _nb(v["input_tensors"]), (_nb(v["output_tensors"]) if root == my_rank else 0), None, None, None, root, \
            _first_tensor(v["input_tensors"])
    if h == "c_scatter":
        root = glob(v.get("root_rank"))
        return (_nb(v["input_tensors"]) if root == my_rank else 0), _nb(v["output_tensors"]), None, None, None, root, \
            _first_tensor(v["output_tensors"])
    if h == "c_send":
        ts = v["tensors"]
        return _nb(ts), 0, None, None, glob(v.get("dst")), None, _first_tensor(ts)
    if h == "c_recv":
        ts = v["tensors"]
        return 0, _nb(ts), None, None, glob(v.get("src")), None, _first_tensor(ts)
    if h == "d_shard_a2a":
        t = v["input"]
        s = _nb(t)
        return s, s, None, None, None, None, t
    if h == "c_barrier":
        return 0, 0, None, None, None, None, None
    return 0, 0, None, None, None, None, None  # unknown: bytes not computed


def _a2a(t: torch.Tensor, in_splits, out_splits, n: int | None):
    """all_to_all_single: splits are rows of dim 0; empty/None splits mean equal chunks."""
    row = (t.numel() // t.shape[0] if t.dim() and t.shape[0] else t.numel()) * t.element_size()
    if in_splits:
        ss = [int(x) * row for x in in_splits]
    else:
        ss = [_nb(t) // n] * n if n else None
    if out_splits:
        sr = [int(x) * row for x in out_splits]
    else:
        sr = list(ss) if ss is not None else None
    sent = sum(ss) if ss is not None else _nb(t)
    recv = sum(sr) if sr is not None else _nb(t)
    return sent, recv, ss, sr


def _param_of(node: Any, params: dict[int, str]) -> str | None:
    """The parameter a backward node's output accumulates into: an AccumulateGrad among its next
    functions (or one single-input node further), named from the modules the recorder saw."""
    try:
        nexts = node.next_functions
    except Exception:  # noqa: BLE001
        return None
    for fn, _ in nexts:
        # follow a chain of single-input nodes (a promoted weight: to_local / from_local backward ...)
        for _depth in range(6):
            if fn is None:
                break
            var = getattr(fn, "variable", None)
            if var is not None:
                name = params.get(id(var))
                if name is not None:
                    return name
                break
            try:
                nn = [f for f, _ in fn.next_functions if f is not None]
            except Exception:  # noqa: BLE001
                break
            fn = nn[0] if len(nn) == 1 else None
    return None


_mesh_dims_cache: dict[str, str | None] = {}


def _mesh_dim_of(group_name: str) -> str | None:
    """Name of the mesh dim of the DistributedManager's global mesh whose group this is, if any."""
    try:
        from physicsnemo.distributed import DistributedManager

        dm = DistributedManager()
        mesh = dm.global_mesh
        names = mesh.mesh_dim_names or ()
        for nm in names:
            try:
                if mesh.get_group(nm).group_name == group_name:
                    return nm
            except Exception:  # noqa: BLE001
                continue
        if len(names) == 0 and mesh.ndim == 1 and mesh.get_group().group_name == group_name:
            return "0"
    except Exception:  # noqa: BLE001
        pass
    return None


# ---- CUDA ---------------------------------------------------------------------------------------

def _cuda_begin() -> list:
    e0 = new_cuda_event()
    e0.record()
    return [e0, None]


def _cuda_end(c: list) -> None:
    e1 = new_cuda_event()
    e1.record()
    c[1] = e1


def cuda_ms(c: list | None) -> float | None:
    if c is None or c[1] is None:
        return None
    try:
        if c[1].query():  # never blocks
            return float(c[0].elapsed_time(c[1]))
    except Exception:  # noqa: BLE001
        pass
    return None


# ---- export --------------------------------------------------------------------------------------

EXPORT_KEYS = ("kind", "seq", "group_seq", "coll", "aten_op", "api", "group_name", "group_ranks", "group_size",
               "mesh_dim", "peer", "root", "bytes_sent", "bytes_recv", "splits_sent", "splits_recv", "dtype",
               "shape", "async", "t_issue_ns", "t_return_ns", "t_done_ns", "wait_op_seq", "waited", "op", "op_seq",
               "outer_op", "outer_op_seq", "phase", "autograd_node", "param", "thread")
def export(ev: dict, in_flight: bool, rec: Any = None) -> dict:
    kind, api, _handler, _names, base = ev["_s"]
    ranks, mesh_dim = ev["_g"]
    op, outer = ev["_op"], ev["_outer"]
    bw = ev["_bw"]
    if bw is not None and rec is not None:  # backward: the forward op that made the node
        n, limit, box = bw
        op = fwd_lookup(rec._fwd_snr1, rec._fwd_ranges, n, limit)
        if op is None and box is not None and box[1] is rec:
            op = box[0]
        outer = (op.get("_root") or op) if op is not None else None
    # fields kept raw on the hot path (CommRecorder._begin), worked out here
    derived = dict(
        coll=kind, aten_op=base, api=api, group_ranks=ranks, mesh_dim=mesh_dim,
        group_size=len(ranks) if ranks else ev.get("group_size"),
        op=op["op"] if op is not None else None, op_seq=op["seq"] if op is not None else None,
        outer_op=outer["op"] if outer is not None else None,
        outer_op_seq=outer["seq"] if outer is not None else None,
    )
    bm = ev["_bm"]
    if bm is not None:  # funcol fast path: sizes and plain arguments
        shape, dtype, esize, rest = bm
        v = dict(zip(_names, (_TensorMeta(shape, dtype, esize),) + tuple(rest)))
        sent, recv, ss, sr, peer, root, _ = _bytes(_handler, v, ranks, rec.rank if rec is not None else -1)
        derived.update(bytes_sent=sent, bytes_recv=recv, splits_sent=ss, splits_recv=sr, peer=peer, root=root)
        if not ranks:
            derived["group_size"] = int(v.get("group_size") or 0) or None
    out = {k: derived[k] if k in derived else ev.get(k) for k in EXPORT_KEYS}
    out["bytes_sent"] = int(out["bytes_sent"])
    out["bytes_recv"] = int(out["bytes_recv"])
    if out["dtype"] is not None and not isinstance(out["dtype"], str):
        out["dtype"] = str(out["dtype"]).removeprefix("torch.")
    if out["shape"] is not None:
        out["shape"] = [int(d) for d in out["shape"]]
    out["device_ms"] = cuda_ms(ev.get("_cuda"))
    out["in_flight"] = bool(in_flight or ev.get("t_return_ns") is None)
    return out


def fwd_lookup(snr1: list, ranges: list, n: int, limit: int | None = None) -> dict | None:
    """The innermost forward op whose autograd sequence-number range [snr0, snr1) contains n.

    ``ranges`` are thread 0's forward ops in end order; ``limit`` is how many of them had ended when n was
    looked for. Top-level ops do not overlap, so the scan stops at the first one that starts after n
    (a node made between two ops belongs to neither)."""
    end = len(ranges) if limit is None else min(limit, len(ranges))
    i = bisect.bisect_right(snr1, n, 0, end)
    for j in range(i, end):
        s0, ev = ranges[j]
        if s0 <= n:
            return ev
        if ev["depth"] == 0:
            return None
    return None
