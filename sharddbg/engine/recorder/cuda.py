"""Device time of op and collective events on CUDA: a pair of timing events per event, read without blocking."""

from __future__ import annotations

import torch


def new_cuda_event():
    """A timing event for the current stream. ``torch.Event`` (C++) finds the current stream itself;
    ``torch.cuda.Event.record()`` builds a Python Stream object first (~15-35 us per event)."""
    return torch.Event("cuda", enable_timing=True)


if not hasattr(torch, "Event"):  # older torch
    def new_cuda_event():  # noqa: F811
        return torch.cuda.Event(enable_timing=True)


_memory_stats = getattr(torch._C, "_cuda_memoryStats", None)


def allocated_bytes() -> int:
    """``torch.cuda.memory_allocated()`` without its cost: that function flattens the allocator's whole
    statistics into a new dict on every call; this reads the one value from the nested dict."""
    try:
        return _memory_stats(torch.cuda.current_device())["allocated_bytes"]["all"]["current"]
    except Exception:  # noqa: BLE001 - another torch layout: the public (slower) call
        return torch.cuda.memory_allocated()


class CudaSpan:
    """Start and end events of one op or collective on the current stream, and (ops only) the allocator's
    change over it. ``closed`` is set last, so a reader on another thread sees either an open span or a
    complete one."""

    __slots__ = ("start", "end", "allocated_at_start", "mem_delta", "closed")

    def __init__(self, track_memory: bool) -> None:
        self.start = e = new_cuda_event()
        e.record()
        self.end = None
        self.allocated_at_start = allocated_bytes() if track_memory else None
        self.mem_delta: int | None = None
        self.closed = False

    def close(self) -> None:
        e = new_cuda_event()
        e.record()
        self.end = e
        if self.allocated_at_start is not None:
            self.mem_delta = allocated_bytes() - self.allocated_at_start
        self.closed = True

    def device_done(self) -> bool:
        """The device has passed the end event (never blocks). On NCCL a collective's host-side wait returns
        at once: only this says whether its kernel finished."""
        if not self.closed:
            return False
        try:
            return bool(self.end.query())
        except Exception:  # noqa: BLE001
            return False

    def device_ms(self) -> float | None:
        """Milliseconds between the two events once the device has passed the end event; None before
        (never blocks: a snapshot may be taken while the rank hangs)."""
        if not self.closed:
            return None
        try:
            if self.end.query():
                return float(self.start.elapsed_time(self.end))
        except Exception:  # noqa: BLE001
            pass
        return None
