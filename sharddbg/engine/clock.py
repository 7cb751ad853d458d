"""The one clock every sharddbg event is stamped with, on every rank.

``now_ns()`` is ``time.monotonic_ns()`` plus an offset that is zero in normal use. Tests inject a known
offset into one rank (``set_offset_ns``) to check that the client, which measures each rank's offset by
round trips at gather time and subtracts it, lines the ranks up again.

Processes of one boot of one kernel, in one time namespace, read one ``CLOCK_MONOTONIC``: ``domain()`` names
that clock, so that the client can take a rank's offset as known (its injected offset) instead of measuring it,
when the rank and the client share it.
"""

from __future__ import annotations

import os
import time

_offset_ns = 0
_domain: str | None | bool = False  # worked out on first use; False: not yet

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


def domain() -> str | None:
    """The clock ``time.monotonic_ns`` reads in this process, named: the kernel's boot id and this process's time
    namespace (``"<boot id> time:[<inode>]"``); None where either cannot be read (not Linux), which leaves the offset
    to be measured. Two processes with the same name read the same clock; a kernel without time namespaces (before
    Linux 5.6) gives every process its one clock, named ``"<boot id> time:none"``."""
    global _domain
    if _domain is False:
        try:
            with open("/proc/sys/kernel/random/boot_id") as f:
                boot = f.read().strip()
        except OSError:
            _domain = None
        else:
            try:
                namespace = os.readlink("/proc/self/ns/time")
            except FileNotFoundError:  # a kernel without time namespaces
                namespace = "time:none"
            except OSError:
                namespace = None
            _domain = f"{boot} {namespace}" if boot and namespace else None
    return _domain


def reading() -> dict:
    """This process's clock now, for the client's offset: ``now_ns`` (sharddbg's clock), ``domain`` (``domain()``:
    which monotonic clock it is made from) and ``injected_offset_ns`` (what it adds to that clock)."""
    return {"now_ns": now_ns(), "domain": domain(), "injected_offset_ns": _offset_ns}


def added_on_this_clock(other: dict, earliest_ns: int | None, latest_ns: int) -> int | None:
    """What another process's clock adds to this process's ``time.monotonic_ns``, where the two read one monotonic
    clock: ``other`` is its ``reading()``, taken between ``earliest_ns`` and ``latest_ns`` of this process's
    ``time.monotonic_ns`` (``earliest_ns`` None: at any time before ``latest_ns``). None where it reads another
    clock (another host or time namespace, a name not readable here), or where its reading falls outside that window:
    a clock that says it is this one but is not (shifted some other way) is measured instead."""
    here = domain()
    added = other.get("injected_offset_ns")
    if here is None or other.get("domain") != here or type(added) is not int:
        return None
    monotonic = int(other["now_ns"]) - added
    if monotonic > latest_ns or (earliest_ns is not None and monotonic < earliest_ns):
        return None
    return added
