"""The recorder's events while it records: plain slotted records holding raw references (shapes, dtypes,
other events). Every derived or defaulted field of the schema record is worked out at export
(``export.py``), so that the hot path stores only what cannot be known later.
"""

from __future__ import annotations

from typing import Any


class Promotion:
    """A plain tensor that ShardTensor promoted to a Replicate DTensor during an op."""

    __slots__ = ("param", "shape", "dtype")

    def __init__(self, param: str | None, shape: Any, dtype: Any) -> None:
        self.param = param  # its parameter/buffer name, from the modules seen; None if not a parameter
        self.shape = shape
        self.dtype = dtype


class OpEvent:
    """One recorded op call on one thread, forward or backward (schema.OP_FIELDS at export).

    A backward event (the autograd node behind a forward op's output ran) has ``forward`` set: its op,
    path, handler, module and fallback are the forward event's, read at export.
    """

    __slots__ = (
        "seq",  # shared numbering with collectives, in start order
        "parent",  # the enclosing recorded op on this thread (OpEvent) or None
        "root",  # the outermost recorded op on this thread when this one is nested, else None
        "depth",
        "phase",  # "forward" | "backward" (a forward-path op the autograd engine called is "backward" too)
        "op", "path", "handler", "module",  # None on a backward event (see ``forward``)
        "autograd_node",  # the node's name when called by the autograd engine
        "forward",  # backward event: the forward OpEvent whose node ran
        "frame",  # (file, line, function) of the user's frame, or None
        "wrapper_frame",  # the recorder wrapper's frame while the op runs (a nested op stops its walk there)
        "thread",  # recorder thread id
        "inputs",  # [TensorInfo] of the tensor arguments (backward: the incoming gradients)
        "output",  # TensorInfo of the first tensor result (backward: first outgoing gradient) or None
        "outputs",  # [TensorInfo] of every tensor result when there are several (the spec check reads them)
        "out_bytes",
        "autograd_seq_start",  # the thread's next autograd sequence number when the op began
        "cuda",  # CudaSpan when an argument is on CUDA, else None
        "t_start_ns", "t_end_ns",
        "error",  # schema.ERROR_FIELDS record when the call raised
        "fallback",  # the DTensor fallback ran (directly or from inside the handler)
        "promotions",  # [Promotion] or None
        "not_implemented",  # the call returned NotImplemented
        "replicas",  # [replicas.ReplicaDigest] of the tensors claiming Replicate, when replicas are checked
    )

    def __init__(self, seq: int, parent: "OpEvent | None", root: "OpEvent | None", depth: int, op: str, path: str,
                 handler: str | None, module: str | None, frame: Any, wrapper_frame: Any, thread: int,
                 inputs: list, autograd_seq_start: int) -> None:
        """A forward call, begun (``t_start_ns``, ``cuda`` and a backward ``phase`` are set by the caller)."""
        self.seq = seq
        self.parent = parent
        self.root = root
        self.depth = depth
        self.phase = "forward"
        self.op = op
        self.path = path
        self.handler = handler
        self.module = module
        self.autograd_node = None
        self.forward = None
        self.frame = frame
        self.wrapper_frame = wrapper_frame
        self.thread = thread
        self.inputs = inputs
        self.output = None
        self.outputs = None
        self.out_bytes = 0
        self.autograd_seq_start = autograd_seq_start
        self.cuda = None
        self.t_start_ns = 0
        self.t_end_ns = None
        self.error = None
        self.fallback = False
        self.promotions = None
        self.not_implemented = False
        self.replicas = None

    @classmethod
    def backward(cls, seq: int, parent: "OpEvent | None", depth: int, forward: "OpEvent", autograd_node: str,
                 frame: Any, thread: int, grad_outputs: list, grad_inputs: list, t_start_ns: int,
                 t_end_ns: int) -> "OpEvent":
        """The event of a backward node that ran (complete: both times known)."""
        ev = cls.__new__(cls)
        ev.seq = seq
        ev.parent = parent
        ev.root = None
        ev.depth = depth
        ev.phase = "backward"
        ev.op = ev.path = ev.handler = ev.module = None
        ev.autograd_node = autograd_node
        ev.forward = forward
        ev.frame = frame
        ev.wrapper_frame = None
        ev.thread = thread
        ev.inputs = grad_outputs
        ev.output = grad_inputs[0] if grad_inputs else None
        ev.outputs = grad_inputs if len(grad_inputs) > 1 else None
        ev.out_bytes = sum(i.local_bytes for i in grad_inputs)
        ev.autograd_seq_start = None
        ev.cuda = None
        ev.t_start_ns = t_start_ns
        ev.t_end_ns = t_end_ns
        ev.error = None
        ev.fallback = False
        ev.promotions = None
        ev.not_implemented = False
        ev.replicas = None
        return ev

    def __repr__(self) -> str:
        return f"OpEvent(seq={self.seq}, op={self.op!r}, phase={self.phase!r}, path={self.path!r})"


class CollectiveEvent:
    """One recorded collective call on one rank (schema.COLLECTIVE_FIELDS at export)."""

    __slots__ = (
        "seq", "group_seq",
        "spec",  # collectives.CollectiveSpec: kind, api, aten op, byte count, argument names
        "group",  # state.GroupInfo
        "group_size",  # from the arguments, only when the group's ranks are unknown
        "peer", "root", "bytes_sent", "bytes_recv", "splits_sent", "splits_recv",  # None until export when
        # the sizes were kept (``deferred_args``)
        "input_element_size", "deferred_args",  # funcol's common ops: the input's element size and the
        # plain arguments after it; the byte counts are worked out from these and shape/dtype at export
        "dtype", "shape",  # of the first tensor argument (torch objects, made plain at export)
        "is_async",
        "t_issue_ns", "t_return_ns", "t_done_ns",
        "wait_op_seq",  # seq of the innermost op running when its wait returned
        "waited",
        "op", "outer",  # forward: innermost and outermost recorded OpEvent on the stack at issue
        "phase", "autograd_node", "param",
        "frame",  # outside every recorded op: the user's frame (file, line, function) that issued it
        "trigger",  # issued from an AccumulateGrad node (DDP's reducer): the parameter that node accumulates
        "deferred_gradient",  # outside every op, it reduces the distributed gradient of ``param``
        # backward: the issuing node's autograd sequence number, how many forward ops of thread 0 had ended
        # at issue, and the node's recorder box (only when ops ran on several threads): the forward op is
        # looked up from these at export
        "node_seq_nr", "forward_ops_ended", "node_box",
        "thread",
        "cuda",  # CudaSpan when the first tensor is on CUDA
        "waiting_on",  # the outputs (funcol) or the Work (c10d) whose wait completes it; None once done
        "pending_keys",  # ids under which it is pending (funcol outputs)
        "preflight",  # preflight.PreflightResult when the group compared it before it was issued
    )

    def __init__(self, seq: int, group_seq: int, spec: Any, group: Any, thread: int) -> None:
        self.seq = seq
        self.group_seq = group_seq
        self.spec = spec
        self.group = group
        self.group_size = None
        self.peer = self.root = None
        self.bytes_sent = self.bytes_recv = None
        self.splits_sent = self.splits_recv = None
        self.input_element_size = None
        self.deferred_args = None
        self.dtype = self.shape = None
        self.is_async = True
        self.t_issue_ns = 0
        self.t_return_ns = None
        self.t_done_ns = None
        self.wait_op_seq = None
        self.waited = False
        self.op = self.outer = None
        self.phase = "forward"
        self.autograd_node = None
        self.param = None
        self.frame = None
        self.trigger = None
        self.deferred_gradient = False
        self.node_seq_nr = None
        self.forward_ops_ended = 0
        self.node_box = None
        self.thread = thread
        self.cuda = None
        self.waiting_on = None
        self.pending_keys = None
        self.preflight = None

    def __repr__(self) -> str:
        return f"CollectiveEvent(seq={self.seq}, group_seq={self.group_seq}, spec={self.spec!r})"


class CellErrorEvent:
    """An exception that ended the cell on this rank (schema "error" record at export), wherever it was
    raised: inside a recorded op (``origin_seq`` names that op's record) or in the user's own code."""

    __slots__ = ("seq", "t_ns", "exception", "origin_seq", "cell", "cell_line", "cell_code", "thread")

    def __init__(self, seq: int, t_ns: int, exception: BaseException, origin_seq: int | None, cell: int | None,
                 cell_line: int | None, cell_code: str | None, thread: int) -> None:
        self.seq = seq
        self.t_ns = t_ns
        self.exception = exception
        self.origin_seq = origin_seq
        self.cell = cell  # the cell's execution count on this rank (In[n]); None when not an IPython cell
        self.cell_line = cell_line  # the line of the cell (1-based) whose statement raised
        self.cell_code = cell_code
        self.thread = thread
