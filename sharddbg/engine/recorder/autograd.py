"""Backward events: hooks on the autograd node behind each recorded forward op's output.

No ShardTensor hook runs during backward, so the recorder puts a pre-hook and a post-hook on the node that
a recorded op's output came from (``hook_backward``, at the op's end). When the node runs, its event is
recorded with the forward op's path and module (``OpEvent.forward``). The node's metadata holds the
``BackwardBox`` under ``BOX_KEY``; collective recording reads it too.
"""

from __future__ import annotations

import sys
import traceback
from typing import Any

from .. import clock
from ..frames import user_frame
from .events import OpEvent
from .state import RecordingState
from .tensors import node_name, tensor_info

BOX_KEY = "sharddbg"  # key of the BackwardBox in ``node.metadata``


class BackwardBox:
    """What a node's hooks know: the forward event it belongs to, the recording, when the node started, its
    name. The hooks are this box's bound methods: they hold the box, never the node (a node -> hook -> node
    cycle would keep the graph alive)."""

    __slots__ = ("forward", "recording", "t_start_ns", "node_name")

    def __init__(self, forward: OpEvent, recording: RecordingState, node_name: str) -> None:
        self.forward = forward
        self.recording = recording
        self.t_start_ns: int | None = None
        self.node_name = node_name

    def pre_hook(self, grad_outputs) -> None:
        """The node is about to run."""
        if self.recording.running:
            self.t_start_ns = clock.now_ns()

    def post_hook(self, grad_inputs, grad_outputs) -> None:
        """The node ran: record its event. Never raises into the user's backward."""
        rec = self.recording
        if rec.running:
            try:
                backward_event(rec, self, grad_inputs, grad_outputs)
            except Exception:  # noqa: BLE001
                rec.internal_errors.append(traceback.format_exc())


def hook_backward(rec: RecordingState, ev: OpEvent, outs: list) -> None:
    """Hook the autograd node behind the first of ``outs`` that has one, for the forward event ``ev``."""
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
    box = md.get(BOX_KEY)
    if box is not None and box.recording is rec:
        box.forward = ev  # the same node ends an enclosing op too: attribute it to the outer (later) one
        return
    box = BackwardBox(ev, rec, node_name(node))
    md[BOX_KEY] = box
    rec.backward_handles.append(node.register_prehook(box.pre_hook))
    rec.backward_handles.append(node.register_hook(box.post_hook))


def backward_event(rec: RecordingState, box: BackwardBox, grad_inputs: Any, grad_outputs: Any) -> None:
    """Record the event of the node of ``box``, which has just run (called by ``BackwardBox.post_hook``)."""
    st = rec.thread()
    stack = st.op_stack
    t0 = box.t_start_ns if box.t_start_ns is not None else clock.now_ns()
    st_cls = rec.shard_tensor_cls
    gout = [i for i in (tensor_info(g, st_cls) for g in grad_outputs or ()) if i is not None]
    gin = [i for i in (tensor_info(g, st_cls) for g in grad_inputs or ()) if i is not None]
    # Every hook of one backward pass is called from the same Python frame (the one that entered the
    # autograd engine), so the user frame above it is walked once per pass. The frame is held only
    # until the next forward op or the end of the recording (it is alive during the pass anyway).
    try:
        f = sys._getframe(2)  # above post_hook: the frame that entered the autograd engine
    except ValueError:  # called from a thread with no Python caller (the CUDA autograd worker)
        f = None
    if f is None:
        uf = None
    elif f is rec.backward_frame:
        uf = rec.backward_user_frame
    else:
        uf = user_frame(3)
        rec.backward_frame, rec.backward_user_frame = f, uf
    del f
    fwd = box.forward
    ev = OpEvent.backward(next(rec.seq), stack[-1] if stack else None, len(stack), fwd, box.node_name,
                          uf or fwd.frame, st.tid, gout, gin, t0, clock.now_ns())
    box.t_start_ns = None
    rec.backward_events += 1
    rec.keep(ev)
