"""The ``Recorder``: one recording on this rank, from install to the schema payload."""

from __future__ import annotations

import sys
import traceback

import torch

from ...errors import RecorderError
from ...options import RecordingOptions
from .. import clock
from ..rank_state import rank_and_world
from . import cell_errors, dtensor, export, late_import, local_timing, ops, plan_cache
from .collectives import CollectiveHooks
from .preflight import Preflight
from .replicas import ReplicaTracker, remember
from .state import RecordingState
from .undo import UndoLog

SHARD_TENSOR_MODULE = "physicsnemo.domain_parallel.shard_tensor"
_active: "Recorder | None" = None  # the one recorder of this process (nested ones are refused)
_preflights = 0  # recordings with preflight in this process (names their store keys when no token is given)


def active_recorder() -> "Recorder | None":
    """The recorder running in this process, if any."""
    return _active


class Recorder(RecordingState):
    """Record ShardTensor ops (and, with ``comm``, every collective) on this rank::

        with Recorder(max_events=200_000) as rec:
            y = model(x); y.square().mean().backward()
        rec.events        # schema.py records, sorted by seq
        rec.dropped       # records lost to a full buffer

    ``options`` (a ``RecordingOptions``) and ``settings`` (its field names, overriding it) say what is kept
    and checked: ``max_events``, ``unmask`` (re-raise a TypeError that PyTorch would report only as
    "unsupported operand type(s)" as ``UnmaskedOpError`` chained to the original), ``comm``, ``spec_check``
    (flag a ShardTensor result whose spec disagrees with its local tensor; checked at export, nothing on the
    hot path but a reference per result), ``replicas`` (digest every tensor that claims Replicate after each
    forward op and keep copies for a later max difference, ``replicas.py``), ``preflight`` (before each
    collective inside a recorded op, compare it across its group through the rendezvous store,
    ``preflight.py``) and ``memory`` (on CUDA, the allocator's counter before and after each device-timed op;
    about 20 us per read on an H200 host). ``preflight_token`` names this recording's store keys, the same on
    every rank (default: counted per process). One recorder per process at a time; a Recorder is entered
    once. Its attributes are the recording's state (``RecordingState``).
    """

    def __init__(self, options: RecordingOptions | None = None, *, preflight_token: str | None = None,
                 shard_tensor_when_imported: bool = False, **settings) -> None:
        global _preflights
        options = RecordingOptions.build(options, **settings)
        rank, world_size = rank_and_world()
        tracker = pf = None
        if options.replicas:
            tracker = ReplicaTracker()
        if options.preflight:
            _preflights += 1
            pf = Preflight(preflight_token or f"local-{_preflights}", rank)
        super().__init__(options, rank, world_size, replicas=tracker, preflight=pf)
        self.plan_cache = plan_cache.PlanCacheWatch()
        self._undo: UndoLog | None = None
        self._used = False
        self._final_events: list[dict] | None = None
        # a recorded job's process: physicsnemo's ShardTensor is hooked when the user's code imports it (the
        # recorder never imports it there itself: a plain DTensor job need not load it)
        self._shard_tensor_when_imported = shard_tensor_when_imported

    # ---- lifecycle -------------------------------------------------------------------------------
    def __enter__(self) -> "Recorder":
        global _active
        if _active is not None:
            raise RecorderError(
                "a sharddbg recorder is already active on this rank; nested recorders are not supported "
                "(stop the running one first, e.g. sharddbg.engine.recorder.stop())"
            )
        if self._used:
            raise RecorderError("a Recorder can be entered once; create a new one")
        self._used = True
        self.thread()  # the starting thread gets tid 0
        undo = UndoLog()
        try:
            if not self._shard_tensor_when_imported or SHARD_TENSOR_MODULE in sys.modules:
                ops.install(self, undo)
            else:
                ops.install_modules(self, undo)
                late_import.when_imported(SHARD_TENSOR_MODULE, lambda: self._install_shard_tensor(undo), undo)
            if self.options.dtensor:
                dtensor.install(self, undo)
            if self.comm:
                CollectiveHooks(self).install(undo)
            cell_errors.install(self, undo)
            plan_cache.install(self, undo)
        except BaseException:
            undo.restore()
            raise
        self._undo = undo
        remember(self.replicas)  # the previous recording's kept copies go
        self.t_start_ns = clock.now_ns()
        self.running = True
        _active = self
        return self

    def _install_shard_tensor(self, undo: UndoLog) -> None:
        """The ShardTensor hooks, once the user's code imported physicsnemo's shard_tensor (recording or not)."""
        if not self.running or self._undo is not undo:
            return
        try:
            ops.install_shard_tensor(self, undo)
        except Exception:  # noqa: BLE001 - a recorder bug must not break the user's import
            self.internal_errors.append(traceback.format_exc())

    def __exit__(self, exc_type, exc, tb) -> bool:
        if exc is not None and self.running:
            try:
                cell_errors.mark_escaped(self, exc)  # it leaves the recorded block: its op errors were not handled
            except Exception:  # noqa: BLE001 - recording must never hide the user's exception
                self.internal_errors.append(traceback.format_exc())
        self.close()
        return False

    def close(self) -> None:
        """Stop recording and put every hook back (idempotent). Formatting waits for ``events``/``payload``,
        so that the exit stays cheap inside timed user code."""
        global _active
        if not self.running:
            return
        self.running = False
        if _active is self:
            _active = None
        self.t_stop_ns = clock.now_ns()
        self.plan_cache.stop()
        errs = self._undo.restore() if self._undo else []
        for h in self.backward_handles:  # hooks left on graph nodes that outlive the recording
            try:
                h.remove()
            except Exception:  # noqa: BLE001
                pass
        self.backward_handles.clear()
        self.backward_frame = None
        for st in list(self.threads.values()):
            st.module_frames.clear()  # a forward the recording ended inside: its frames are not ours to keep
        if torch.cuda.is_initialized():
            torch.cuda.synchronize()  # so device_ms of every event can be read
        self.errors_seen.clear()
        self.roots.clear()
        if self.preflight is not None:
            try:
                self.preflight.release()
            except Exception:  # noqa: BLE001 - a store already gone (the group torn down) holds no keys
                self.internal_errors.append(traceback.format_exc())
        # forward_ops / forward_op_ends stay until the events are formatted: backward collectives are
        # attributed to their forward op then
        if errs:
            raise RecorderError(f"restoring hooks failed: {errs!r}")

    @property
    def events(self) -> list[dict]:
        """Schema records (schema.OP_FIELDS, schema.COLLECTIVE_FIELDS), sorted by seq; formatted on first
        access after the recording stopped."""
        if self.running:
            return export.records(self, include_in_flight=False)
        if self._final_events is None:
            local_timing.measure(self)
            self._final_events = export.records(self, include_in_flight=False)
            self.plan_cache.release()  # its record is made: the specs it held go
            self.forward_ops = []
            self.forward_op_ends = []
            self.ddp_modules = []
            self.ddp_bucket_cache.clear()
            self.gradient_owners.clear()
            self.param_objects.clear()
        return self._final_events

    def payload(self, complete: bool | None = None) -> dict:
        """The rank's payload (schema.py); while running, a snapshot with the ops still in flight
        (``complete`` False unless given)."""
        running = self.running
        events = export.records(self, include_in_flight=True) if running else self.events
        return export.payload(self, events, (not running) if complete is None else complete)
