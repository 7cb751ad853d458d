"""The one clock every sharddbg event is stamped with, on every rank.

``now_ns()`` is ``time.monotonic_ns()`` plus an offset that is zero in normal use. Tests inject a known
offset into one rank (``set_offset_ns``) to check that the client, which measures each rank's offset by
round trips at gather time and subtracts it, lines the ranks up again.
"""

from __future__ import annotations

import time

_offset_ns = 0


def now_ns() -> int:
    """Monotonic time in ns, plus the injected offset (0 unless a test set one)."""
    return time.monotonic_ns() + _offset_ns


def set_offset_ns(ns: int) -> None:
    """Shift this process's sharddbg clock by ``ns`` (tests only: simulates a rank whose clock differs)."""
    global _offset_ns
    _offset_ns = int(ns)


def offset_ns() -> int:
    """The offset currently injected (0 by default)."""
    return _offset_ns


def describe() -> dict:
    """Plain-data description of this clock, stored in every payload."""
    return {"source": "time.monotonic_ns", "injected_offset_ns": _offset_ns}
