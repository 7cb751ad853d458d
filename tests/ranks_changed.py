"""A change made on every rank for one test, undone afterwards whatever the test body did."""

from __future__ import annotations

from contextlib import contextmanager


@contextmanager
def changed_on_ranks(cl, change: str, restore: str, timeout: float = 30):
    """Run ``change`` on the ranks, then the body, then ``restore`` (also when the body raised; a process group
    the body left broken is recovered first, or ``restore`` could not run)."""
    cl.run(change, timeout=timeout)
    try:
        yield
    finally:
        if cl.broken:
            cl.recover()
        cl.run(restore, timeout=timeout)
