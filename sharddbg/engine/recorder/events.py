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

    No ``__slots__``, like ``CollectiveEvent``: a constructor sets what its call knows, and every other field
    reads its default from the class. ``FIELDS`` names them all.
    """

    FIELDS = (
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

    # the defaults (immutable values only: they are shared by every instance until it sets its own)
    root = None
    phase = "forward"
    op = path = handler = module = None
    autograd_node = None
    forward = None
    frame = None
    wrapper_frame = None
    output = None
    outputs = None
    out_bytes = 0
    autograd_seq_start = None
    cuda = None
    t_start_ns = 0
    t_end_ns = None
    error = None
    fallback = False
    promotions = None
    not_implemented = False
    replicas = None

    def __init__(self, seq: int, parent: "OpEvent | None", root: "OpEvent | None", depth: int, op: str, path: str,
                 handler: str | None, module: str | None, frame: Any, wrapper_frame: Any, thread: int,
                 inputs: list, autograd_seq_start: int) -> None:
        """A forward call, begun (``t_start_ns``, ``cuda`` and a backward ``phase`` are set by the caller)."""
        self.seq = seq
        self.parent = parent
        self.root = root
        self.depth = depth
        self.op = op
        self.path = path
        self.handler = handler
        self.module = module
        self.frame = frame
        self.wrapper_frame = wrapper_frame
        self.thread = thread
        self.inputs = inputs
        self.autograd_seq_start = autograd_seq_start

    @classmethod
    def backward(cls, seq: int, parent: "OpEvent | None", depth: int, forward: "OpEvent", autograd_node: str,
                 frame: Any, thread: int, grad_outputs: list, grad_inputs: list, t_start_ns: int,
                 t_end_ns: int) -> "OpEvent":
        """The event of a backward node that ran (complete: both times known)."""
        ev = cls.__new__(cls)
        ev.seq = seq
        ev.parent = parent
        ev.depth = depth
        ev.phase = "backward"
        ev.autograd_node = autograd_node
        ev.forward = forward
        ev.frame = frame
        ev.thread = thread
        ev.inputs = grad_outputs
        if grad_inputs:
            ev.output = grad_inputs[0]
            if len(grad_inputs) > 1:
                ev.outputs = grad_inputs
            ev.out_bytes = sum(i.local_bytes for i in grad_inputs)
        ev.t_start_ns = t_start_ns
        ev.t_end_ns = t_end_ns
        return ev

    def __repr__(self) -> str:
        return f"OpEvent(seq={self.seq}, op={self.op!r}, phase={self.phase!r}, path={self.path!r})"


class CollectiveEvent:
    """One recorded collective call on one rank (schema.COLLECTIVE_FIELDS at export).

    No ``__slots__``: a collective sets a handful of its fields while it is recorded, and every other field
    reads its default from the class (a collective is recorded in the user's hot path; writing some thirty
    defaults per call was an eighth of the instructions it cost). ``FIELDS`` names them all.
    """

    FIELDS = (
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
        "error",  # "exc_type: message" of what its issuing call or its wait raised (it failed), else None
    )

    # the defaults (immutable values only: they are shared by every instance until it sets its own)
    group_size = None
    peer = root = None
    bytes_sent = bytes_recv = None
    splits_sent = splits_recv = None
    input_element_size = None
    deferred_args = None
    dtype = shape = None
    is_async = True
    t_issue_ns = 0
    t_return_ns = None
    t_done_ns = None
    wait_op_seq = None
    waited = False
    op = outer = None
    phase = "forward"
    autograd_node = None
    param = None
    frame = None
    trigger = None
    deferred_gradient = False
    node_seq_nr = None
    forward_ops_ended = 0
    node_box = None
    cuda = None
    waiting_on = None
    pending_keys = None
    preflight = None
    error = None

    def __init__(self, seq: int, group_seq: int, spec: Any, group: Any, thread: int) -> None:
        self.seq = seq
        self.group_seq = group_seq
        self.spec = spec
        self.group = group
        self.thread = thread

    def __repr__(self) -> str:
        return f"CollectiveEvent(seq={self.seq}, group_seq={self.group_seq}, spec={self.spec!r})"


class CellErrorEvent:
    """An exception that ended the cell on this rank (schema "error" record at export), wherever it was
    raised: inside a recorded op (``origin_seq`` names that op's record) or in the user's own code."""

    __slots__ = ("seq", "t_ns", "exception", "origin_seq", "cell", "cell_line", "cell_code", "thread", "user_frame")

    def __init__(self, seq: int, t_ns: int, exception: BaseException, origin_seq: int | None, cell: int | None,
                 cell_line: int | None, cell_code: str | None, thread: int, user_frame: Any = None) -> None:
        self.seq = seq
        self.t_ns = t_ns
        self.exception = exception
        self.origin_seq = origin_seq
        self.cell = cell  # the cell's execution count on this rank (In[n]); None when not an IPython cell
        self.cell_line = cell_line  # the line of the cell (1-based) whose statement raised
        self.cell_code = cell_code
        self.thread = thread
        self.user_frame = user_frame  # (file, line, function) of the innermost frame of the user's code, or None
