"""The one clock every sharddbg event is stamped with, on every rank.

``now_ns()`` is ``time.monotonic_ns()`` plus an offset that is zero in normal use. Tests inject a known
offset into one rank (``set_offset_ns``) to check that the client, which measures each rank's offset by
round trips at gather time and subtracts it, lines the ranks up again.
"""

from __future__ import annotations

import time

_offset_ns = 0

# Monotonic time in ns, plus the injected offset (0 unless a test set one). With no offset this IS the
# C function (the recorder stamps several times per event; a Python wrapper cost ~0.1 us each time).
# Callers look it up as ``clock.now_ns`` at call time, so set_offset_ns() takes effect everywhere.
now_ns = time.monotonic_ns


def _now_with_offset_ns() -> int:
    return time.monotonic_ns() + _offset_ns


def set_offset_ns(ns: int) -> None:
    """Shift this process's sharddbg clock by ``ns`` (tests only: simulates a rank whose clock differs)."""
    global _offset_ns, now_ns
    _offset_ns = int(ns)
    now_ns = _now_with_offset_ns if _offset_ns else time.monotonic_ns


def describe() -> dict:
    """Plain-data description of this clock, stored in every payload."""
    return {"source": "time.monotonic_ns", "injected_offset_ns": _offset_ns}
