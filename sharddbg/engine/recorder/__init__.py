"""Per-rank recorder: every ShardTensor op call (its dispatch path, module, shapes, time, errors) and every
collective, attributed to the op that caused it.

On one rank::

    with Recorder(max_events=200_000) as rec:
        y = model(x); y.square().mean().backward()
    rec.events        # schema.py records, sorted by seq

From a cluster (one round trip each, through ``engine.api``): ``start(options)`` on
every rank, run the cell, ``stop()`` -> payload dict; ``peek()`` may be called from another thread while the
main thread is blocked (e.g. in a collective) and returns what was recorded so far plus the ops still in
flight.

Verification while recording: ``spec_check`` (on by default: a ShardTensor result whose spec disagrees with
its local tensor, ``spec_check.py``), ``replicas`` (digests of what claims Replicate, ``replicas.py``) and
``preflight`` (each collective compared across its group before it is issued, ``preflight.py``).

The parts, each importing only the ones below it:
``recording`` (the Recorder's lifecycle) -> ``ops`` (ShardTensor hooks, module hooks), ``collectives``
(collective hooks), ``export`` (schema records) -> ``autograd`` (backward events), ``paths`` (the
dispatch-path decision), ``comm_bytes`` (bytes per collective kind), ``state`` (the recording's state),
``events``, ``tensors``, ``cuda``, ``undo``. Nothing is installed while no recorder runs; everything
installed is put back on exit, also after an exception; nothing is recorded while torch.compile traces.
"""

from __future__ import annotations

from ...errors import RecorderError, UnmaskedOpError
from ...options import RecordingOptions
from .ops import PYTHON_METHODS
from .preflight import CollectiveMismatchError
from .recording import Recorder

__all__ = ["Recorder", "RecorderError", "UnmaskedOpError", "CollectiveMismatchError", "PYTHON_METHODS", "start",
           "stop", "peek", "abandon", "is_recording"]

_session: Recorder | None = None  # the recorder started by start(), if any
_last_payload: dict | None = None  # payload of the last stop(), for a later peek()


def start(options: RecordingOptions | dict | None = None, *, preflight_token: str | None = None) -> dict:
    """Start recording on this rank with ``options`` (a ``RecordingOptions``, or its ``as_dict()`` as the
    client sends it); returns {"rank", "t_start_ns"}. Refused if one is running."""
    global _session, _last_payload
    if isinstance(options, dict):
        options = RecordingOptions.from_dict(options)
    rec = Recorder(options, preflight_token=preflight_token)
    rec.__enter__()
    _session = rec
    _last_payload = None
    return {"rank": rec.rank, "t_start_ns": rec.t_start_ns}


def stop() -> dict:
    """Stop the recording started by start(); returns the payload (schema.py)."""
    global _session, _last_payload
    rec = _session
    if rec is None:
        raise RecorderError("stop(): no recording was started on this rank with start()")
    _session = None
    rec.close()
    _last_payload = rec.payload(complete=True)
    return _last_payload


def peek() -> dict:
    """The events so far, without stopping (complete=False while running; in-flight ops included); after
    stop(), the payload stop() returned.

    Safe from another thread while the main thread is blocked: copies lists, takes no locks, never
    synchronizes a device or calls a collective.
    """
    rec = _session
    if rec is not None:
        return rec.payload()
    if _last_payload is not None:
        return _last_payload
    raise RecorderError("peek(): no recording was started on this rank with start()")


def is_recording() -> bool:
    """A recording started by start() is running on this rank."""
    return _session is not None


def abandon() -> None:
    """Stop a recording cut short (a hang, a broken process group), keeping nothing: every hook is
    removed. Does nothing when no recording runs."""
    if _session is not None:
        try:
            stop()
        except Exception:  # noqa: BLE001 - the hooks are restored first; an export failure loses nothing needed
            pass
