"""The state of one recording, in one object: ``RecordingState`` (the ``Recorder`` is one). The recorder's
parts (ops, autograd, collectives, export) read and write the attributes documented here, and nothing else
of each other.
"""

from __future__ import annotations

import itertools
import threading
from typing import Any

from ...options import RecordingOptions
from .events import CollectiveEvent, OpEvent


class NoShardTensor:
    """Stands for ShardTensor while physicsnemo's is not hooked (not imported yet): no tensor is one of these."""


class ModuleFrame:
    """A running nn.Module call: its ``Module._call_impl`` frame and the user frame that called it, so that an
    op inside walks up only to there (held while that forward runs)."""

    __slots__ = ("call_frame", "user_frame")

    def __init__(self, call_frame: Any, user_frame: Any) -> None:
        self.call_frame = call_frame
        self.user_frame = user_frame


class ThreadState:
    """What the recorder knows about one thread."""

    __slots__ = ("tid", "op_stack", "module_stack", "module_frames", "busy", "collective_depth", "collective_mode")

    def __init__(self, tid: int) -> None:
        self.tid = tid  # 0: the thread that started the recorder, then 1, 2, ... in order of first event
        self.op_stack: list[OpEvent] = []  # open op events, innermost last
        self.module_stack: list[str] = []  # module paths, innermost last
        self.module_frames: list[ModuleFrame] = []  # one per module_stack entry
        self.busy = False  # inside the recorder's own bookkeeping: any re-entry passes unrecorded
        self.collective_depth = 0  # inside a collective being recorded: what it dispatches is part of it
        self.collective_mode = False  # the collective dispatch mode is pushed for a torch.distributed call


class GroupInfo:
    """A process group as the collective records name it."""

    __slots__ = ("name", "ranks", "mesh_dim")

    def __init__(self, name: str, ranks: list[int] | None, mesh_dim: str | None) -> None:
        self.name = name
        self.ranks = ranks  # global ranks in group-rank order; None when they could not be resolved
        self.mesh_dim = mesh_dim  # the global mesh dim whose group this is ("ddp", "domain"), else None


class CollectiveState:
    """Collective recording's part of the state."""

    __slots__ = ("group_seq", "groups", "pending_tensors", "pending_works", "count", "param_node_seq_nr",
                 "param_name", "installed")

    def __init__(self) -> None:
        self.group_seq: dict[str, int] = {}  # group name -> collectives issued on it so far
        self.groups: dict[str, GroupInfo] = {}  # group name -> its ranks and mesh dim, resolved once
        self.pending_tensors: dict[int, CollectiveEvent] = {}  # id(output tensor) -> functional collective
        self.pending_works: dict[int, CollectiveEvent] = {}  # id(python Work) -> c10d collective
        self.count = 0  # collectives recorded
        # the parameter named for the last gradient reduction's node (weight and bias of one node share it)
        self.param_node_seq_nr = -1
        self.param_name: str | None = None
        self.installed = False  # its hooks are in place


class SeenError:
    """An exception already recorded by an inner op: outer ops it propagates through point at that record."""

    __slots__ = ("exception", "record")

    def __init__(self, exception: BaseException, record: dict) -> None:
        self.exception = exception
        self.record = record


class RecordingState:
    """Everything one recording holds. Attributes are public to the recorder's parts; documented here."""

    def __init__(self, options: RecordingOptions, rank: int, world_size: int, *, replicas: Any = None,
                 preflight: Any = None) -> None:
        # ---- configuration: the options, and each one the hot path reads as an attribute of its own
        self.options = options
        self.max_events = options.max_events  # events kept at most; further ones are counted in ``dropped``
        self.unmask = options.unmask  # re-raise a TypeError that PyTorch would hide as UnmaskedOpError
        self.comm = options.comm  # record collectives too
        self.memory = options.memory  # CUDA: the allocator's delta over each device-timed op
        self.rank = rank
        self.world_size = world_size
        # ---- verification
        self.spec_check = options.spec_check  # compare each ShardTensor result's spec with its local tensor (at export)
        self.replicas = replicas  # replicas.ReplicaTracker (options.replicas): digest what claims Replicate
        self.preflight = preflight  # preflight.Preflight (options.preflight): compare each collective first
        # ---- lifecycle
        self.running = False  # hooks installed and recording: every hook checks this first
        self.t_start_ns: int | None = None
        self.t_stop_ns: int | None = None
        self.installed_at: list[str] = []  # module globals rebound while recording ("module.name")
        # physicsnemo's ShardTensor, bound when its hooks are installed; until then a class no tensor is one of
        self.shard_tensor_cls: type = NoShardTensor
        # ---- the events
        self.buffer: list[OpEvent | CollectiveEvent] = []  # kept events, in the order they were completed
        self.dropped = 0  # events not kept: the buffer was full
        self.seq = itertools.count()  # next(seq): the shared op/collective sequence number
        # ---- health
        self.reentries = 0  # hook calls made by the recorder's own bookkeeping (must stay 0)
        self.internal_errors: list[str] = []  # bugs in the recorder itself; never raised into user code
        self.calls_while_compiling = 0  # op calls seen while torch.compile traced (not recorded)
        # ---- threads
        self.threads: dict[int, ThreadState] = {}  # threading ident -> its state
        self._local = threading.local()
        self._tids = itertools.count()
        # ---- modules and parameters (names from the outermost module seen; params.py)
        self.module_names: dict[int, str] = {}  # id(module) -> its path
        self.params: dict[int, str] = {}  # id(parameter or buffer) -> its name
        self.param_objects: dict[int, Any] = {}  # id -> the parameter named (an id names only this object)
        self.param_modules: dict[str, str] = {}  # parameter name -> the path of the module that holds it
        self.roots: list[Any] = []  # modules named so far, kept alive so that their ids are not reused
        self.params_named_at = 0  # backward_events when the parameter names were last refreshed
        # gradient reductions outside every op: id(local data of a parameter's distributed gradient) ->
        # (parameter name, that tensor), rebuilt when backward events were recorded since gradients_seen_at
        self.gradient_owners: dict[int, tuple[str, Any]] = {}
        self.gradients_seen_at = -1
        self.ddp_modules: list[Any] = []  # DistributedDataParallel modules among the roots (kept to export)
        self.ddp_bucket_cache: dict[int, list] = {}  # id(DDP module) -> its buckets, read at export
        # ---- errors: id(exception) -> where it was first recorded
        self.errors_seen: dict[int, SeenError] = {}
        # origin seqs of the op errors whose exception (or one it was chained into) ended a cell or left the
        # recording's ``with`` block; every other op error was handled by the user's code once recording stops
        self.escaped_origins: set[int] = set()
        # ---- backward
        self.backward_handles: list[Any] = []  # hooks left on autograd nodes, removed at stop
        # every hook of one backward pass is called from the same Python frame: that frame and its user
        # frame, looked up once per pass (released at the next forward op or at stop)
        self.backward_frame: Any = None
        self.backward_user_frame: Any = None
        self.backward_events = 0  # backward events recorded (new gradients may exist after each)
        # thread 0's forward ops in end order, and the autograd sequence number at each one's end: a
        # backward collective's node is mapped to the forward op that created it (export.forward_op_of)
        self.forward_ops: list[OpEvent] = []
        self.forward_op_ends: list[int] = []
        # ---- collectives
        self.collectives = CollectiveState()
        # ---- DTensor's redistribution plan cache: its misses (plan_cache.PlanCacheWatch, set by the Recorder)
        self.plan_cache: Any = None
        # ---- Cluster.diff: outputs.OutputKeeper keeping each user-called op's output, else None
        self.outputs: Any = None
        # ---- after recording: seq of a forward op -> local_ms (local_timing.py)
        self.local_ms: dict[int, float] = {}

    def thread(self) -> ThreadState:
        """The calling thread's state (the first thread to ask gets tid 0)."""
        try:
            return self._local.s
        except AttributeError:
            s = ThreadState(next(self._tids))
            self._local.s = s
            self.threads[threading.get_ident()] = s
            return s

    def keep(self, ev: OpEvent | CollectiveEvent) -> None:
        """Keep a completed (or, for collectives, issued) event, unless the buffer is full."""
        if len(self.buffer) < self.max_events:
            self.buffer.append(ev)
        else:
            self.dropped += 1
