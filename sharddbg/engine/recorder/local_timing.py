"""What a ShardTensor op's own local computation costs on CPU, measured after the recording: the function of
each top-level forward call, run on plain tensors of that call's local shapes and dtypes (its other arguments
left at their defaults), the least host time of a few runs. ``host_ms - local_ms`` is then what ShardTensor's
dispatch (path decision, conversions, sharding propagation, re-wrapping) and the call's communication added.

On CUDA the device time of the call answers that question (``device_ms``), so CUDA calls are not replayed.
Runs once per distinct (function, local shapes, dtypes), within a time budget, when the recording's events are
formatted (never while recording, never inside the user's timed code); a call whose function cannot be found or
does not run on plain tensors with default arguments keeps ``local_ms`` None.
"""

from __future__ import annotations

import time
from typing import Any

import torch

from .events import OpEvent
from .state import RecordingState
from .tensors import function_named

# dispatch paths whose call computes something locally (python methods communicate or re-wrap)
_COMPUTING_PATHS = frozenset({"function_handler", "named_handler", "dispatch_handler", "dtensor_fallback_function",
                              "dtensor_fallback_dispatch"})
BUDGET_S = 2.0  # at most this long per recording, all replays together
REPEATS = 3


def _plain(shape: Any, dtype: torch.dtype, generator: torch.Generator) -> torch.Tensor:
    if dtype.is_floating_point or dtype.is_complex:
        return torch.rand(tuple(shape), dtype=dtype, generator=generator)
    return torch.zeros(tuple(shape), dtype=dtype)


def _replay_ms(func: Any, inputs: list, generator: torch.Generator) -> float | None:
    """Least host time (ms) of ``func`` on fresh plain tensors like ``inputs`` (TensorInfo), or None."""
    try:
        args = [_plain(i.local_shape, i.dtype, generator) for i in inputs]
        best = None
        with torch.no_grad():
            func(*args)  # warm-up (first-call costs are not the op's own)
            for _ in range(REPEATS):
                t0 = time.perf_counter_ns()
                func(*args)
                dt = (time.perf_counter_ns() - t0) / 1e6
                best = dt if best is None else min(best, dt)
        return best
    except Exception:  # noqa: BLE001 - needs arguments we do not have: not measured
        return None


def _key(ev: OpEvent) -> tuple | None:
    if (ev.phase != "forward" or ev.depth != 0 or ev.path not in _COMPUTING_PATHS or ev.error is not None
            or ev.not_implemented or ev.cuda is not None or ev.t_end_ns is None or not ev.inputs
            or ev.op.endswith(".__get__")):
        return None
    return (ev.op,) + tuple((tuple(i.local_shape), i.dtype) for i in ev.inputs if i is not None)


def measure(rec: RecordingState, budget_s: float = BUDGET_S) -> None:
    """Fill ``rec.local_ms`` (seq of a forward op -> ms) for the recording's CPU top-level calls."""
    groups: dict[tuple, list[OpEvent]] = {}
    for ev in list(rec.buffer):
        if type(ev) is OpEvent:
            k = _key(ev)
            if k is not None:
                groups.setdefault(k, []).append(ev)
    if not groups:
        return
    deadline = time.monotonic() + budget_s
    generator = torch.Generator().manual_seed(0)  # the inputs' values: never from the user's random stream
    # a replayed op that draws random numbers (dropout) must not move the user's stream either: the next
    # cell draws what it would have drawn without the recorder
    with torch.random.fork_rng(devices=[]):
        # the most frequent calls first: where the budget runs out, the rare ones go unmeasured
        for key, evs in sorted(groups.items(), key=lambda kv: -len(kv[1])):
            if time.monotonic() > deadline:
                break
            func = function_named(key[0])
            if func is None or any(i.fake for i in evs[0].inputs):
                continue
            ms = _replay_ms(func, evs[0].inputs, generator)
            if ms is not None:
                for ev in evs:
                    rec.local_ms[ev.seq] = ms
