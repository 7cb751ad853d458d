"""Collective recording: every collective on this rank, attributed to the op that caused it.

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
   replaced by wrappers (``PacketWrapper``) while recording: every Python caller (funcol, DTensor's
   redistribute inside its ``__torch_dispatch__``, an AsyncCollectiveTensor's ``wait_tensor``);
3. the ``torch.distributed`` collective functions are wrapped; only when 1. cannot see the call
   (``ADInplaceOrView`` excluded, or inference mode) they push ``CollectiveMode`` for that call alone;
4. ``Work.wait`` (completion of c10d work).
A per-thread depth (``ThreadState.collective_depth``) makes what a recorded collective dispatches (funcol
kernels re-enter as ``c10d`` ops) part of it, not a second record; recorded calls run with
``ADInplaceOrView`` excluded so the nested kernels are not even entered. Not seen: ``ProcessGroup``
methods called directly inside a ``__torch_dispatch__`` or on inference tensors (nothing in torch /
physicsnemo does).

``CollectiveMode`` (used by 3. only) answers ``NotImplemented`` for the tensor subclasses whose own
``__torch_dispatch__`` may communicate (ShardTensor, DTensor, AsyncCollectiveTensor; not FakeTensor,
which only its own mode may handle), like ``CommDebugMode`` does for ``DTensor``.

Attribution: ``op`` is the innermost recorded op on the recorder's thread-local stack, ``outer_op`` the
outermost. In backward (``torch._C._current_autograd_node()`` is set) the node's ``_sequence_nr()`` is
mapped at export to the forward op during which the node was created (the recorder notes the autograd
sequence counter at each op's start and end); ``param`` names the parameter whose ``AccumulateGrad`` the
node feeds.

Nothing here calls a collective or dispatches a tensor op; reading shapes/numel/element_size is metadata.
"""

from __future__ import annotations

import sys
import traceback
from typing import Any, Callable

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from .. import clock
from ..frames import HIDE_FRAMES, user_frame
from ..rank_state import STATE
from .autograd import BOX_KEY
from .comm_bytes import BYTE_COUNTS, first_tensor, no_bytes
from .cuda import CudaSpan
from .events import CollectiveEvent
from .params import deferred_gradient_owner, name_of, parameter_of

DTENSOR_PROPAGATION = "dtensor_propagation"  # schema.PATHS: a plain DTensor call of the user's (dtensor.py)
from .preflight import CollectiveMismatchError, mismatch_message
from .state import GroupInfo, RecordingState, ThreadState
from .tensors import compile_tracing, node_name
from .undo import UndoLog

_current_autograd_node = getattr(torch._C, "_current_autograd_node", lambda: None)
try:
    from torch._subclasses.fake_tensor import FakeTensor
except Exception:  # pragma: no cover - another torch layout
    class FakeTensor:  # type: ignore[no-redef]
        pass


class CollectiveSpec:
    """What the recorder knows about one collective op (one per OpOverload, made once)."""

    __slots__ = ("kind", "api", "aten_op", "arg_names", "count_bytes", "sizes_only", "synchronous",
                 "point_to_point")

    def __init__(self, kind: str, api: str, aten_op: str, arg_names: list[str], byte_count: str) -> None:
        self.kind = kind  # shown to users (schema.COLLECTIVE_KINDS)
        self.api = api  # "functional" (completed by wait_tensor) | "c10d" (completed by Work.wait)
        self.aten_op = aten_op  # "_c10d_functional.all_reduce", "c10d.send", ...
        self.arg_names = arg_names  # the op schema's argument names, in order
        self.count_bytes: Callable = BYTE_COUNTS[byte_count]
        # funcol's common ops, schema (input, ..., group_name): the bytes depend only on the input's sizes
        # and the plain arguments, so the hot path keeps those and the bytes are worked out at export
        self.sizes_only = byte_count in _SIZES_ONLY
        self.synchronous = byte_count == "dtensor_shard_dim_alltoall"  # waited inside the op itself
        self.point_to_point = byte_count in ("c10d_send", "c10d_recv")  # always completed by a later wait

    def __repr__(self) -> str:
        return f"CollectiveSpec({self.aten_op!r})"


_SIZES_ONLY = frozenset({"funcol_same_size", "funcol_all_to_all", "funcol_all_gather", "funcol_reduce_scatter"})

# aten-level op name -> (kind shown to users, api, byte count in comm_bytes.BYTE_COUNTS)
SPECS: dict[str, tuple[str, str, str]] = {
    # functional collectives (funcol; the autograd variants dispatch as these)
    "_c10d_functional.all_gather_into_tensor": ("all_gather_into_tensor", "functional", "funcol_all_gather"),
    "_c10d_functional.all_to_all_single": ("all_to_all_single", "functional", "funcol_all_to_all"),
    "_c10d_functional.all_reduce": ("all_reduce", "functional", "funcol_same_size"),
    "_c10d_functional.all_reduce_": ("all_reduce", "functional", "funcol_same_size"),
    "_c10d_functional.reduce_scatter_tensor": ("reduce_scatter_tensor", "functional", "funcol_reduce_scatter"),
    "_c10d_functional.broadcast": ("broadcast", "functional", "funcol_same_size"),
    "_c10d_functional.broadcast_": ("broadcast", "functional", "funcol_same_size"),
    "_c10d_functional.all_gather_into_tensor_coalesced": ("all_gather_into_tensor_coalesced", "functional",
                                                          "funcol_coalesced_all_gather"),
    "_c10d_functional.reduce_scatter_tensor_coalesced": ("reduce_scatter_tensor_coalesced", "functional",
                                                         "funcol_coalesced_reduce_scatter"),
    "_c10d_functional.all_reduce_coalesced": ("all_reduce_coalesced", "functional", "funcol_coalesced_same_size"),
    "_c10d_functional.all_reduce_coalesced_": ("all_reduce_coalesced", "functional", "funcol_coalesced_same_size"),
    "_c10d_functional.isend": ("send", "functional", "funcol_send"),
    "_c10d_functional.irecv": ("recv", "functional", "funcol_recv"),
    "_c10d_functional_autograd.all_gather_into_tensor": ("all_gather_into_tensor", "functional", "funcol_all_gather"),
    "_c10d_functional_autograd.all_to_all_single": ("all_to_all_single", "functional", "funcol_all_to_all"),
    "_c10d_functional_autograd.reduce_scatter_tensor": ("reduce_scatter_tensor", "functional",
                                                        "funcol_reduce_scatter"),
    # c10d ops (torch.distributed Python API)
    "c10d.allreduce_": ("all_reduce", "c10d", "c10d_same_size"),
    "c10d.allreduce_coalesced_": ("all_reduce_coalesced", "c10d", "c10d_same_size"),
    "c10d.broadcast_": ("broadcast", "c10d", "c10d_broadcast"),
    "c10d.allgather_": ("all_gather", "c10d", "c10d_allgather"),
    "c10d._allgather_base_": ("all_gather_into_tensor", "c10d", "c10d_allgather_base"),
    "c10d.allgather_coalesced_": ("all_gather_coalesced", "c10d", "c10d_allgather_coalesced"),
    "c10d.allgather_into_tensor_coalesced_": ("all_gather_into_tensor_coalesced", "c10d",
                                              "c10d_allgather_into_tensor_coalesced"),
    "c10d.alltoall_base_": ("all_to_all_single", "c10d", "c10d_alltoall_base"),
    "c10d.alltoall_": ("all_to_all", "c10d", "c10d_alltoall"),
    "c10d.reduce_scatter_": ("reduce_scatter", "c10d", "c10d_reduce_scatter"),
    "c10d._reduce_scatter_base_": ("reduce_scatter_tensor", "c10d", "c10d_reduce_scatter_base"),
    "c10d.reduce_scatter_tensor_coalesced_": ("reduce_scatter_tensor_coalesced", "c10d",
                                              "c10d_reduce_scatter_tensor_coalesced"),
    "c10d.reduce_": ("reduce", "c10d", "c10d_reduce"),
    "c10d.gather_": ("gather", "c10d", "c10d_gather"),
    "c10d.scatter_": ("scatter", "c10d", "c10d_scatter"),
    "c10d.send": ("send", "c10d", "c10d_send"),
    "c10d.recv_": ("recv", "c10d", "c10d_recv"),
    "c10d.recv_any_source_": ("recv", "c10d", "c10d_recv"),
    "c10d.barrier": ("barrier", "c10d", "no_bytes"),
    "c10d.monitored_barrier_": ("barrier", "c10d", "no_bytes"),
    # DTensor's Shard(i) -> Shard(j) on CUDA: one C++ op (all_to_all + wait inside), synchronous
    "_dtensor.shard_dim_alltoall": ("all_to_all_single", "functional", "dtensor_shard_dim_alltoall"),
}
_NOT_COLLECTIVE = frozenset({"check_for_nan"})
# kinds whose backward call reduces a gradient: `param` names the parameter it accumulates into
_GRAD_REDUCTIONS = frozenset({"all_reduce", "all_reduce_coalesced", "reduce", "reduce_scatter",
                              "reduce_scatter_tensor", "reduce_scatter_tensor_coalesced"})
_NAMESPACES = ("c10d", "_c10d_functional", "_c10d_functional_autograd", "_dtensor")
# the two funcol ops that are not collectives themselves: the wait that completes one, and the wrap of a
# pending output into an AsyncCollectiveTensor (its wait then completes the collective)
WAIT = "wait"
WRAP = "wrap"

# torch.distributed functions wrapped for the calls the ADInplaceOrView kernels cannot see
DIST_FUNCTIONS = (
    "all_reduce", "all_reduce_coalesced", "all_gather", "all_gather_into_tensor", "_all_gather_base",
    "all_gather_coalesced", "all_gather_object", "broadcast", "broadcast_object_list", "reduce",
    "reduce_scatter", "reduce_scatter_tensor", "_reduce_scatter_base", "all_to_all", "all_to_all_single",
    "gather", "gather_object", "scatter", "scatter_object_list", "send", "recv", "isend", "irecv",
    "batch_isend_irecv", "barrier", "monitored_barrier", "send_object_list", "recv_object_list",
)
_ADIOV = torch._C.DispatchKey.ADInplaceOrView
_ADIOV_SET = torch._C.DispatchKeySet(_ADIOV)
_excluded = torch._C._dispatch_tls_is_dispatch_key_excluded

_specs: dict[Any, Any] = {}  # OpOverload -> CollectiveSpec | WAIT | WRAP | None (not a collective)
_NOT_SEEN = object()


def spec_of(func) -> Any:
    """The CollectiveSpec of an op (WAIT / WRAP for funcol's wait_tensor / _wrap_tensor_autograd; None for an
    op that is not a collective). An unknown c10d / funcol op is still a collective, bytes unknown."""
    try:
        return _specs[func]
    except KeyError:
        pass
    s = None
    ns = getattr(func, "namespace", "")
    if ns in _NAMESPACES:
        opname = func._schema.name.split("::", 1)[1]
        base = f"{ns}.{opname}"
        names = [a.name for a in func._schema.arguments]
        if ns == "_dtensor" and base not in SPECS:
            s = None
        elif base == "_c10d_functional.wait_tensor":
            s = WAIT
        elif base == "_c10d_functional._wrap_tensor_autograd":
            s = WRAP
        elif base in SPECS:
            kind, api, byte_count = SPECS[base]
            # the autograd variants are reported as the functional op their kernels run (as a dispatch
            # mode saw them)
            s = CollectiveSpec(kind, api, base.replace("_c10d_functional_autograd.", "_c10d_functional."), names,
                               byte_count)
        else:
            s = CollectiveSpec(opname.rstrip("_"), "c10d" if ns == "c10d" else "functional", base, names,
                               no_bytes.__name__)
    _specs[func] = s
    return s


def _collective_op_names(names, ns: str):
    """Op names of namespace ``ns`` among ``names`` ("ns::op"), less the ones that move no data."""
    for full in names:
        if full.startswith(ns + "::"):
            opname = full.split("::", 1)[1]
            if opname not in _NOT_COLLECTIVE:
                yield opname


_op_names: list[str] = []


def _all_collective_op_names() -> list[str]:
    """The c10d / funcol / _dtensor op names (read once: listing every registered op takes ~2 ms; they are
    all registered by the time the recorder is imported, which imports DTensor and funcol)."""
    if not _op_names:
        _op_names.extend(n for n in torch._C._dispatch_get_all_op_names()
                         if n.startswith(tuple(ns + "::" for ns in _NAMESPACES)))
    return _op_names


# ---- the dispatch mode (torch.distributed calls the kernels cannot see) ----------------------------------

_delegated: tuple = ()  # the subclasses whose own __torch_dispatch__ may communicate, found on first use
_plain_type: dict[type, bool] = {}
_types_plain: dict[tuple, bool] = {}  # the `types` tuple a mode receives -> all plain


def _is_plain(t: type) -> bool:
    """False for the subclasses whose own __torch_dispatch__ may issue or complete collectives
    (ShardTensor, DTensor, AsyncCollectiveTensor): the mode lets them run first and stays active inside.
    Every other type (plain tensors, FakeTensor during DTensor sharding propagation, ...) is run directly,
    as CommDebugMode does: a FakeTensor answers NotImplemented to everyone but its own mode."""
    global _delegated
    try:
        return _plain_type[t]
    except KeyError:
        if not _delegated:
            from torch.distributed._functional_collectives import AsyncCollectiveTensor
            from torch.distributed.tensor import DTensor

            d = [DTensor, AsyncCollectiveTensor]
            try:
                from physicsnemo.domain_parallel.shard_tensor import ShardTensor

                d.append(ShardTensor)
            except Exception:  # noqa: BLE001
                pass
            _delegated = tuple(d)
        p = not issubclass(t, _delegated)
        _plain_type[t] = p
        return p


class CollectiveMode(TorchDispatchMode):
    """Sees every aten op on plain tensors; records the c10d / funcol ones, passes the rest through."""

    def __init__(self, hooks: "CollectiveHooks") -> None:
        super().__init__()
        self.hooks = hooks
        self.dead = False  # stopped from another thread: left on this thread's mode stack, inert

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        __tracebackhide__ = HIDE_FRAMES  # the user's traceback shows their code, not the recorder
        if self.dead:
            return func(*args, **kwargs) if kwargs else func(*args)
        # the hot path (every aten op while recording): two dict lookups, then the op itself
        p = _types_plain.get(types)
        if p is None:
            p = _types_plain[types] = all(_is_plain(t) for t in types)
        if not p:
            return NotImplemented  # let the subclass run with this mode still active (see module doc)
        s = _specs.get(func, _NOT_SEEN)
        if s is None:
            return func(*args, **kwargs) if kwargs else func(*args)
        if s is _NOT_SEEN:
            s = spec_of(func)
            if s is None:
                return func(*args, **kwargs) if kwargs else func(*args)
        return self.hooks.handle(func, s, args, kwargs or {})


def pop_dead_modes() -> None:
    """Pop inert collective modes left on top of this thread's dispatch mode stack."""
    from torch.utils._python_dispatch import _get_current_dispatch_mode

    m = _get_current_dispatch_mode()
    while isinstance(m, CollectiveMode) and m.dead:
        m.__exit__(None, None, None)
        m = _get_current_dispatch_mode()


class PacketWrapper:
    """Stands in for a ``torch.ops.<ns>.<op>`` packet while recording: records Python callers' calls
    (DTensor's redistribute inside ``__torch_dispatch__``, ``wait_tensor`` of an AsyncCollectiveTensor)
    and otherwise behaves as the packet (attributes, overloads, hash and equality)."""

    __slots__ = ("_packet", "_spec", "_hooks")

    def __init__(self, packet, spec, hooks: "CollectiveHooks") -> None:
        self._packet = packet
        self._spec = spec
        self._hooks = hooks

    def __call__(self, *args, **kwargs):
        __tracebackhide__ = HIDE_FRAMES  # the user's traceback shows their code, not the recorder
        hooks = self._hooks
        rec = hooks.rec
        if rec.running:
            s = self._spec
            if s is WAIT:  # what handle() does for a wait, without its layers: a wait is half of every call
                try:
                    with torch._C._ExcludeDispatchKeyGuard(_ADIOV_SET):
                        res = self._packet(*args, **kwargs)
                except Exception as e:
                    hooks.wait_failed(args, kwargs, e)
                    raise
                hooks.wait_returned(args, kwargs)
                return res
            if s is WRAP:  # makes an AsyncCollectiveTensor: nothing below to hide from the kernels
                res = self._packet(*args, **kwargs)
                hooks.wrapped(args, res)
                return res
            if not rec.thread().collective_depth:
                return hooks.handle(self._call, s, args, kwargs)
        return self._packet(*args, **kwargs)

    def _call(self, *args, **kwargs):
        __tracebackhide__ = HIDE_FRAMES  # the user's traceback shows their code, not the recorder
        # recorded here: the ADInplaceOrView kernels (C++ callers) need not see it again
        with torch._C._ExcludeDispatchKeyGuard(_ADIOV_SET):
            return self._packet(*args, **kwargs)

    def __getattr__(self, name):
        return getattr(self._packet, name)

    def __hash__(self) -> int:
        return hash(self._packet)

    def __eq__(self, other) -> bool:
        return other is self or other is self._packet or (
            isinstance(other, PacketWrapper) and other._packet is self._packet)

    def __repr__(self) -> str:
        return repr(self._packet)


# ---- recording -----------------------------------------------------------------------------------------

class CollectiveHooks:
    """The collective hooks of one recording; what they record lives in ``rec.collectives``."""

    def __init__(self, rec: RecordingState) -> None:
        self.rec = rec
        self.mode = CollectiveMode(self)

    # ---- install / remove ---------------------------------------------------------------------
    def install(self, undo: UndoLog) -> None:
        """Hooks that cost nothing on non-collective aten ops (see the module docstring), in ``undo``."""
        self._wrap_work_wait(undo)
        pop_dead_modes()
        names = _all_collective_op_names()
        self._register_kernels(undo, names)
        self._wrap_packets(undo, names)
        self._wrap_dist_functions(undo)
        self.rec.collectives.installed = True
        undo.add(self.remove)

    def _wrap_work_wait(self, undo: UndoLog) -> None:
        """4. ``Work.wait``: completes c10d work."""
        import torch.distributed as dist

        state = self.rec.collectives
        done = self.done
        failed = self.failed
        original = dist.Work.__dict__["wait"]

        def wait(self, *a, **k):
            __tracebackhide__ = HIDE_FRAMES  # the user's traceback shows their code, not the recorder
            try:
                res = original(self, *a, **k)
            except Exception as e:  # gloo's own timeout, a peer gone: the collective failed
                ev = state.pending_works.get(id(self)) if state.pending_works else None
                if ev is not None and ev.waiting_on is self:
                    failed(ev, e)
                raise
            if state.pending_works:
                ev = state.pending_works.pop(id(self), None)
                if ev is not None:
                    if ev.waiting_on is self:
                        done(ev)
                    else:  # an id reused by another object: not ours
                        state.pending_works[id(self)] = ev
            return res

        wait.__doc__ = getattr(original, "__doc__", None)
        undo.setattr(dist.Work, "wait", wait)

    def _register_kernels(self, undo: UndoLog, names: list[str]) -> None:
        """1. Python kernels at the ADInplaceOrView key of every c10d / funcol op."""
        libs = []
        undo.add(lambda: [lib._destroy() for lib in libs])
        for ns in ("_c10d_functional", "c10d"):
            lib = torch.library.Library(ns, "IMPL")
            libs.append(lib)
            nsobj = getattr(torch.ops, ns)
            for opname in _collective_op_names(names, ns):
                packet = getattr(nsobj, opname)
                for ov in packet.overloads():
                    func = getattr(packet, ov)
                    s = spec_of(func)
                    if s is None or s is WRAP:
                        continue
                    lib.impl(opname if ov == "default" else f"{opname}.{ov}", self._kernel(func, s),
                             "ADInplaceOrView", with_keyset=True)

    def _wrap_packets(self, undo: UndoLog, names: list[str]) -> None:
        """2. The op packets, for Python callers (also inside a subclass's __torch_dispatch__)."""
        for ns in ("_c10d_functional", "_c10d_functional_autograd", "_dtensor"):
            nsobj = getattr(torch.ops, ns, None)
            if nsobj is None:
                continue
            for opname in _collective_op_names(names, ns):
                packet = getattr(nsobj, opname)
                if not isinstance(packet, torch._ops.OpOverloadPacket) or "default" not in packet.overloads():
                    continue
                s = spec_of(packet.default)
                if s is not None:
                    undo.setattr(nsobj, opname, PacketWrapper(packet, s, self))

    def _wrap_dist_functions(self, undo: UndoLog) -> None:
        """3. The torch.distributed functions, for the calls the kernels cannot see."""
        import torch.distributed as dist
        import torch.distributed.distributed_c10d as c10d_mod

        for fname in DIST_FUNCTIONS:
            fn = getattr(c10d_mod, fname, None)
            if fn is None or not callable(fn):
                continue
            w = self._dist_wrapper(fn)
            for mod in (c10d_mod, dist):
                if getattr(mod, fname, None) is fn:
                    undo.setattr(mod, fname, w)

    def _kernel(self, func, s):
        after = torch._C._after_ADInplaceOrView_keyset
        rec = self.rec
        handle = self.handle

        def kernel(keyset, *args, **kwargs):
            __tracebackhide__ = HIDE_FRAMES  # the user's traceback shows their code, not the recorder
            ks = keyset & after
            if rec.running and not rec.thread().collective_depth:
                def call(*a, **k):
                    __tracebackhide__ = HIDE_FRAMES  # the user's traceback shows their code, not the recorder
                    # what the op dispatches (a funcol kernel's c10d op) is this collective, not another
                    with torch._C._ExcludeDispatchKeyGuard(_ADIOV_SET):
                        return func.redispatch(ks, *a, **k)

                return handle(call, s, args, kwargs)
            return func.redispatch(ks, *args, **kwargs)

        return kernel

    def _dist_wrapper(self, fn):
        rec = self.rec
        mode = self.mode

        def wrapper(*args, **kwargs):
            __tracebackhide__ = HIDE_FRAMES  # the user's traceback shows their code, not the recorder
            if rec.running and (_excluded(_ADIOV) or torch.is_inference_mode_enabled()):
                st = rec.thread()
                if not (st.collective_depth or st.collective_mode or st.busy):
                    st.collective_mode = True
                    try:
                        with mode:
                            return fn(*args, **kwargs)
                    finally:
                        st.collective_mode = False
            return fn(*args, **kwargs)

        for a in ("__name__", "__qualname__", "__module__", "__doc__"):
            try:
                setattr(wrapper, a, getattr(fn, a))
            except Exception:  # noqa: BLE001
                pass
        wrapper.__wrapped__ = fn  # type: ignore[attr-defined]
        return wrapper

    def remove(self) -> None:
        """Forget what is still pending: records never waited while recording keep t_done_ns None; their
        tensor / Work references are dropped."""
        state = self.rec.collectives
        if not state.installed:
            return
        state.installed = False
        for d in (state.pending_tensors, state.pending_works):
            for ev in d.values():
                ev.waiting_on = None
                ev.pending_keys = None
            d.clear()

    # ---- groups -------------------------------------------------------------------------------
    def group(self, name: str, pg: Any = None) -> GroupInfo:
        """The group named ``name`` (its ProcessGroup ``pg`` when the caller has it), resolved once."""
        groups = self.rec.collectives.groups
        g = groups.get(name)
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
        g = groups[name] = GroupInfo(name, ranks, mesh_dim_of(name, ranks, sys._getframe(1)))
        return g

    # ---- the handler --------------------------------------------------------------------------
    def handle(self, func, s, args: tuple, kwargs: dict):
        """Record one collective (or a wait / wrap). ``func`` runs the op itself (an OpOverload, a
        packet, or a redispatch below the ADInplaceOrView kernel)."""
        __tracebackhide__ = HIDE_FRAMES  # the user's traceback shows their code, not the recorder
        rec = self.rec
        if not rec.running:
            return func(*args, **kwargs)
        if s is WAIT:  # dispatches nothing else: no depth to keep
            try:
                res = func(*args, **kwargs)
            except Exception as e:
                self.wait_failed(args, kwargs, e)
                raise
            self.wait_returned(args, kwargs)
            return res
        if s is WRAP:
            res = func(*args, **kwargs)
            self.wrapped(args, res)
            return res
        st = rec.thread()
        if st.busy or compile_tracing() or (args and isinstance(args[0], FakeTensor)):
            # busy: our own bookkeeping; tracing: torch.compile runs the op on fake tensors, nothing
            # is communicated (the compiled graph's collectives run later, below these hooks)
            return func(*args, **kwargs)
        try:
            ev = self._begin(func, s, args, kwargs, st)
        except Exception:  # noqa: BLE001 - a recorder bug must not change the user's result
            rec.internal_errors.append(traceback.format_exc())
            return func(*args, **kwargs)
        if rec.preflight is not None and (st.op_stack or ev.node_seq_nr is not None) and ev.trigger is None:
            self._preflight(ev, args, kwargs, st)  # raises CollectiveMismatchError instead of a hang
        ev.t_issue_ns = clock.now_ns()
        st.collective_depth += 1  # what this op dispatches (a funcol kernel's c10d op) is not another collective
        try:
            res = func(*args, **kwargs)
        except Exception as e:  # refused at once (gloo: split sizes that do not add up): failed, not in flight
            ev.error = error_text(e)
            raise
        finally:
            st.collective_depth -= 1
        ev.t_return_ns = clock.now_ns()
        try:
            self._after(ev, s, res)
        except Exception:  # noqa: BLE001
            rec.internal_errors.append(traceback.format_exc())
        return res

    def _preflight(self, ev: CollectiveEvent, args: tuple, kwargs: dict, st: ThreadState) -> None:
        """Compare ``ev`` across its group before it is issued (inside a recorded op, or in backward, not in
        DDP's hooks); on a mismatch raise CollectiveMismatchError on this rank, as every rank of the group
        does."""
        rec = self.rec
        st.busy = True
        try:
            ev.preflight = rec.preflight.check(ev, args, kwargs)
        except Exception:  # noqa: BLE001 - a recorder bug must not change the user's result
            rec.internal_errors.append(traceback.format_exc())
        finally:
            st.busy = False
        if ev.preflight is not None and ev.preflight.status == "mismatch":
            ev.t_issue_ns = clock.now_ns()  # when it would have been issued; it never completes
            mismatch = CollectiveMismatchError(mismatch_message(ev, ev.preflight.detail))
            ev.error = error_text(mismatch)
            raise mismatch

    def wrapped(self, args: tuple, res) -> None:
        """``_wrap_tensor_autograd`` put a pending output into an AsyncCollectiveTensor: its wait closes it."""
        pending = self.rec.collectives.pending_tensors
        ev = pending.get(id(args[0])) if args and pending else None
        if ev is not None and ev.waiting_on[0] is args[0]:
            ev.waiting_on.append(res)
            ev.pending_keys.append(id(res))
            pending[id(res)] = ev

    def _begin(self, func, s: CollectiveSpec, args, kwargs, st: ThreadState) -> CollectiveEvent:
        # Hot path: only what cannot be known later (times, sizes, attribution). Names, plain dtypes and
        # the op fields are filled in at export.
        rec = self.rec
        state = rec.collectives
        names = s.arg_names
        if not kwargs and s.sizes_only and len(args) == len(names) and isinstance(args[0], torch.Tensor):
            # funcol's common ops, called positionally: input first, group_name last. Keep the sizes and
            # the other (plain) arguments; bytes and splits are worked out at export.
            t0 = args[0]
            gname = args[-1]
            if type(gname) is not str:
                gname = str(gname)
            g = state.groups.get(gname) or self.group(gname)
            counted = None
        else:
            v = dict(zip(names, args))
            if kwargs:
                v.update(kwargs)
            if s.api == "functional":
                gname = v.get("group_name")
                if type(gname) is not str:
                    gname = str(gname)
                g = state.groups.get(gname) or self.group(gname)
            else:
                import torch.distributed as dist

                pg = dist.ProcessGroup.unbox(v["process_group"])
                gname = pg.group_name
                g = state.groups.get(gname) or self.group(gname, pg)
            counted = s.count_bytes(v, g.ranks, rec.rank)
            t0 = counted.first_tensor
        gs = state.group_seq.get(gname, 0)
        state.group_seq[gname] = gs + 1
        ev = CollectiveEvent(next(rec.seq), gs, s, g, st.tid)
        if counted is None:
            ev.input_element_size = t0.element_size()
            ev.deferred_args = args[1:]
        else:
            ev.bytes_sent = counted.sent
            ev.bytes_recv = counted.recv
            ev.splits_sent = counted.splits_sent
            ev.splits_recv = counted.splits_recv
            ev.peer = counted.peer
            ev.root = counted.root
            if not g.ranks:
                ev.group_size = int(v.get("group_size") or 0) or None
        node = _current_autograd_node()
        if node is not None:
            ev.phase = "backward"
            ev.autograd_node = node_name(node)
            n = ev.node_seq_nr = node._sequence_nr()
            # the forward op that made this node: looked up at export among the forward ops that had
            # ended by now, or the op whose output node this is (the output-node box is only needed for
            # ops of other threads: sequence numbers are per thread)
            ev.forward_ops_ended = len(rec.forward_ops)
            if len(rec.threads) > 1:
                ev.node_box = node.metadata.get(BOX_KEY)
            if s.kind in _GRAD_REDUCTIONS:
                accumulator = getattr(node, "variable", None)
                if accumulator is not None:
                    # an AccumulateGrad node (every one has the same sequence number): DDP's reducer
                    # issues its bucket's all_reduce from the hook of the parameter that completed it
                    ev.param = name_of(rec, accumulator)
                    ev.trigger = accumulator
                else:
                    if n != state.param_node_seq_nr:  # weight and bias of one node: walk its inputs once
                        state.param_name = parameter_of(rec, node)
                        state.param_node_seq_nr = n
                    ev.param = state.param_name
        else:
            stack = st.op_stack
            # a reduction of a parameter's distributed gradient, reduced at its first use (the optimizer's step),
            # outside every recorded op or inside a plain DTensor call of the user's (the optimizer's update of a
            # DTensor parameter): it belongs to the backward of the op that used the parameter
            owner = None
            if (s.kind in _GRAD_REDUCTIONS and t0 is not None and rec.roots
                    and (not stack or stack[0].path == DTENSOR_PROPAGATION)):
                owner = deferred_gradient_owner(rec, t0)
            if owner is not None:
                ev.frame = user_frame(3)
                ev.param = owner
                ev.deferred_gradient = True
                ev.forward_ops_ended = len(rec.forward_ops)
            elif stack:
                ev.op = stack[-1]
                ev.outer = stack[0]
            else:
                ev.frame = user_frame(3)  # outside every recorded op: the user's line that issued it
        # is_async is True unless set here: functional collectives and point-to-point calls always complete at a
        # later wait
        if s.synchronous:
            ev.is_async = False
        elif not (s.point_to_point or s.api == "functional"):
            ev.is_async = bool(v.get("async_op", True))  # c10d: what the caller asked for
        if t0 is not None:
            ev.dtype = t0.dtype  # made plain at export
            ev.shape = t0.shape
            if t0.is_cuda:
                ev.cuda = CudaSpan(track_memory=False)
        state.count += 1
        rec.keep(ev)
        return ev

    def _after(self, ev: CollectiveEvent, s: CollectiveSpec, res) -> None:
        if s.synchronous:  # waited inside the op
            self.done(ev)
            return
        if s.api == "functional":
            out = res if isinstance(res, torch.Tensor) else first_tensor(res)
            if out is None:
                self.done(ev)
                return
            pending = self.rec.collectives.pending_tensors
            ev.waiting_on = [out]
            ev.pending_keys = [id(out)]
            pending[id(out)] = ev
            if isinstance(res, (list, tuple)):  # coalesced: any of the outputs closes it
                for o in res[1:]:
                    if isinstance(o, torch.Tensor):
                        ev.waiting_on.append(o)
                        ev.pending_keys.append(id(o))
                        pending[id(o)] = ev
            return
        work = res[-1] if isinstance(res, (tuple, list)) else res
        if isinstance(work, torch.ScriptObject):
            import torch.distributed as dist

            try:
                w = dist.Work.unbox(work)
            except Exception:  # noqa: BLE001
                w = None
            if w is not None:
                ev.waiting_on = w
                self.rec.collectives.pending_works[id(w)] = ev
                # work that C++ waits for (DDP's reducer and its broadcasts) never reaches Work.wait: its
                # completion is taken from its future
                self._on_completion(ev, w)
                return
        self.done(ev)  # returned nothing to wait on (monitored_barrier): complete on return

    def wait_failed(self, args: tuple, kwargs: dict, exc: BaseException) -> None:
        """A ``wait_tensor`` raised: the collective it waited for failed."""
        pending = self.rec.collectives.pending_tensors
        if not pending:
            return
        t = args[0] if args else kwargs.get("tensor")
        ev = pending.get(id(t))
        if ev is None:
            el = getattr(t, "elem", None)  # an AsyncCollectiveTensor handed to wait_tensor directly
            ev = pending.get(id(el)) if el is not None else None
        if ev is not None:
            self.failed(ev, exc)

    def wait_returned(self, args: tuple, kwargs: dict) -> None:
        """A ``wait_tensor`` returned: the collective it waited for is done."""
        if self.rec.collectives.pending_tensors:
            self._close_tensor(args[0] if args else kwargs.get("tensor"))

    def _close_tensor(self, t: Any) -> None:
        pending = self.rec.collectives.pending_tensors
        ev = pending.get(id(t))
        if ev is None:
            el = getattr(t, "elem", None)  # an AsyncCollectiveTensor handed to wait_tensor directly
            ev = pending.get(id(el)) if el is not None else None
            if ev is None:
                return
            t = el
        if not any(o is t for o in ev.waiting_on):
            return
        self.done(ev)

    def _on_completion(self, ev: CollectiveEvent, work: Any) -> None:
        """Stamp ``t_done_ns`` when ``work`` completes without error, on whichever thread completes it (a
        Python wait that returns later stamps its own time). A failed collective (a peer gone, released, gloo's
        own timeout) is not done: its error is kept."""
        rec = self.rec

        def completed(future):
            if not rec.running or ev.t_done_ns is not None:
                return
            try:
                future.value()  # raises the collective's error
            except Exception as e:  # noqa: BLE001
                if ev.error is None:
                    ev.error = error_text(e)
                return
            ev.t_done_ns = clock.now_ns()

        try:
            work.get_future().then(completed)
        except Exception:  # noqa: BLE001 - a backend without futures: it stays unfinished unless waited
            pass

    def failed(self, ev: CollectiveEvent, exc: BaseException) -> None:
        """Its wait raised: keep the error (the first one seen), forget what it waited on."""
        if ev.error is None:
            ev.error = error_text(exc)
        pending = self.rec.collectives.pending_tensors
        for k in ev.pending_keys or ():
            pending.pop(k, None)
        self.rec.collectives.pending_works.pop(id(ev.waiting_on), None)
        ev.pending_keys = None
        ev.waiting_on = None

    def done(self, ev: CollectiveEvent) -> None:
        """Its wait returned (or the op completed inside): stamp it, forget what it waited on."""
        ev.t_done_ns = clock.now_ns()
        ev.waited = True
        stack = self.rec.thread().op_stack
        ev.wait_op_seq = stack[-1].seq if stack else None
        if ev.cuda is not None:
            ev.cuda.close()
        pending = self.rec.collectives.pending_tensors
        for k in ev.pending_keys or ():
            pending.pop(k, None)
        ev.pending_keys = None
        ev.waiting_on = None


def error_text(exc: BaseException) -> str:
    """'exc_type: message' of a collective's failure (schema COLLECTIVE_FIELDS ``error``): the message whole."""
    name = f"{type(exc).__module__}.{type(exc).__qualname__}".removeprefix("builtins.")
    return f"{name}: {exc}"


# ---- attribution ----------------------------------------------------------------------------------------

def _meshes_in_frames(frame: Any, limit: int = 30) -> list:
    """DeviceMeshes the calling code holds (a ``mesh`` argument, a ShardTensor's or DTensor's spec), innermost
    frame first: the mesh a collective's group was taken from is among them."""
    from torch.distributed.device_mesh import DeviceMesh

    found: list = []
    seen: set[int] = set()
    f = frame
    while f is not None and limit > 0:
        limit -= 1
        try:
            values = list(f.f_locals.values())
        except Exception:  # noqa: BLE001
            values = []
        for v in values:
            m = v if isinstance(v, DeviceMesh) else None
            if m is None and isinstance(v, torch.Tensor):
                spec = getattr(v, "_spec", None)  # a slot of ShardTensor / DTensor: no dispatch
                m = getattr(spec, "mesh", None) if spec is not None else None
                if not isinstance(m, DeviceMesh):
                    m = None
            if m is not None and id(m) not in seen:
                seen.add(id(m))
                found.append(m)
        f = f.f_back
    return found


def _dim_groups(mesh: Any) -> list[tuple[str, Any]]:
    """(dim name, process group) of each dim of a mesh; an unnamed 1-d mesh's dim is "0"."""
    out = []
    names = mesh.mesh_dim_names or ()
    for nm in names:
        try:
            out.append((nm, mesh.get_group(nm)))
        except Exception:  # noqa: BLE001
            continue
    if not names and mesh.ndim == 1:
        try:
            out.append(("0", mesh.get_group()))
        except Exception:  # noqa: BLE001
            pass
    return out


def mesh_dim_of(group_name: str, group_ranks: list[int] | None = None, frame: Any = None) -> str | None:
    """The name of the mesh dim whose group this is, from the group's own mesh: the meshes the calling code
    holds (``frame`` and up), then DistributedManager's current global mesh, then the mesh the cluster built.
    A dim whose group is this group wins; else a dim whose group has the same ranks (a group made for a
    sub-mesh, e.g. DistributedManager.get_mesh_group after the user re-initialised the mesh). None if no
    mesh dim matches."""
    import torch.distributed as dist

    meshes = []
    try:
        if frame is not None:
            meshes += _meshes_in_frames(frame)
    except Exception:  # noqa: BLE001
        pass
    try:
        from physicsnemo.distributed import DistributedManager

        meshes.append(DistributedManager().global_mesh)
    except Exception:  # noqa: BLE001
        pass
    if STATE.mesh is not None:
        meshes.append(STATE.mesh)
    same_ranks = None
    for mesh in meshes:
        if mesh is None:
            continue
        for nm, pg in _dim_groups(mesh):
            if pg.group_name == group_name:
                return nm
            if same_ranks is None and group_ranks:
                try:
                    if [int(r) for r in dist.get_process_group_ranks(pg)] == list(group_ranks):
                        same_ranks = nm
                except Exception:  # noqa: BLE001
                    pass
    return same_ranks
