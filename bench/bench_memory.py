"""Memory: what an engine holds once ready, and what the recorder holds per 10,000 events.

    OMP_NUM_THREADS=1 .venv/bin/python bench/bench_memory.py [--ranks 4] [--steps 300]

One run on a real cluster (``sharddbg.Cluster``, CPU + gloo here, GPUs where there are GPUs):
- per engine, right after start and after a first traced cell: RSS and USS (pages only that process holds;
  the fork server's preloaded torch and physicsnemo are shared between engines, so USS is what one more
  rank costs);
- the recorder, on each rank, running the sharded 3-conv net forward and backward ``--steps`` times: the
  Python memory still alive that sharddbg's engine code allocated (tracemalloc, attributed to the
  allocating frame, so the ops' own tensors and torch's caches do not count), while recording (the raw
  events) and after the recording stopped (the formatted records beside them), per 10,000 events;
- the client: the trace of the same cell, its size in memory (the DataFrames of every get_*) and as a
  saved file, per 10,000 events.
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
import tempfile
import time

os.environ.setdefault("OMP_NUM_THREADS", "1")
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

SETUP = """
import gc, tracemalloc
import torch, torch.nn as nn
from sharddbg.engine.recorder import Recorder
torch.manual_seed(0)
_x = sharddbg.engine.scatter(torch.randn(1, 8, 128, 64), dim=2)
_net = nn.Sequential(nn.Conv2d(8, 16, 3, padding=1), nn.ReLU(), nn.Conv2d(16, 16, 3, padding=1), nn.ReLU(),
                     nn.Conv2d(16, 8, 3, padding=1))
def _step():
    _net.zero_grad(set_to_none=True)
    _net(_x).square().mean().backward()
for _ in range(3):
    _step()

def _recorder_bytes():
    gc.collect()
    snap = tracemalloc.take_snapshot().filter_traces([tracemalloc.Filter(True, "*sharddbg/engine/*")])
    return sum(st.size for st in snap.statistics("filename"))

def _held(steps):
    '''Python bytes still alive that sharddbg's engine code allocated (tracemalloc, by the allocating
    frame): while recording ``steps`` steps (the raw events), and after the recording stopped (the formatted
    records, with the raw events still referenced by the recorder).'''
    tracemalloc.start(1)
    before = _recorder_bytes()
    rec = Recorder()
    rec.__enter__()
    for _ in range(steps):
        _step()
    raw, raw_n = _recorder_bytes() - before, len(rec.buffer)
    rec.__exit__(None, None, None)
    records = rec.events
    after, rec_n = _recorder_bytes() - before, len(records)
    tracemalloc.stop()
    return {"raw_events": raw_n, "raw_py_bytes": raw, "records": rec_n, "after_stop_py_bytes": after}
"""


def _process_memory(pids: dict[int, int]) -> dict[int, dict]:
    import psutil

    out = {}
    for rank, pid in sorted(pids.items()):
        info = psutil.Process(pid).memory_full_info()
        out[rank] = {"rss_mib": info.rss / 2**20, "uss_mib": info.uss / 2**20}
    return out


def _frame_bytes(trace) -> int:
    total = 0
    for getter in ("get_ops", "get_collectives", "get_errors"):
        df = getattr(trace, getter)()
        total += int(df.memory_usage(deep=True).sum())
    return total


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ranks", type=int, default=4)
    ap.add_argument("--steps", type=int, default=300, help="forward + backward steps recorded on each rank")
    a = ap.parse_args(argv)
    import sharddbg
    import torch

    t0 = time.monotonic()
    with sharddbg.Cluster(n=a.ranks) as cl:
        started = _process_memory(cl.pids)
        cl.run(SETUP, timeout=300)
        cl.trace("_step()", display=False, timeout=300)
        after_first = _process_memory(cl.pids)
        held = cl.eval(f"_held({a.steps})", timeout=900)
        trace = cl.trace(f"for _ in range({a.steps}):\n    _step()", display=False, timeout=900)
        n_events = len(trace.get_ops()) + len(trace.get_collectives())
        frames = _frame_bytes(trace)
        with tempfile.TemporaryDirectory() as d:
            path = os.path.join(d, "t.sdtrace.json")
            trace.save(path)
            file_bytes = os.path.getsize(path)
    per10k = lambda b, n: b / max(n, 1) * 10_000 / 2**20  # noqa: E731 - MiB per 10,000
    print(f"\nmemory, {a.ranks} ranks ({'CUDA' if torch.cuda.is_available() else 'CPU + gloo'}), sharded 3-conv net "
          f"(1,8,128,64), {a.steps} recorded steps; {os.cpu_count()} cores, torch {torch.__version__}, "
          f"{platform.node()}, {time.strftime('%Y-%m-%d')}; run took {time.monotonic() - t0:.0f} s")
    print(f"{'rank':>4} {'RSS at start':>13} {'USS at start':>13} {'RSS after a trace':>18} {'USS after':>10}  (MiB)")
    for r in sorted(started):
        s, f = started[r], after_first[r]
        print(f"{r:>4} {s['rss_mib']:>13.1f} {s['uss_mib']:>13.1f} {f['rss_mib']:>18.1f} {f['uss_mib']:>10.1f}")
    print(f"{'rank':>4} {'events':>7} {'while recording, MiB/10k':>25} {'after stop (+ records), MiB/10k':>32}")
    for r, h in enumerate(held):
        print(f"{r:>4} {h['raw_events']:>7} {per10k(h['raw_py_bytes'], h['raw_events']):>25.2f} "
              f"{per10k(h['after_stop_py_bytes'], h['records']):>32.2f}")
    print(f"client: {n_events} events in the trace; DataFrames {per10k(frames, n_events):.2f} MiB per 10k events, "
          f"saved file {per10k(file_bytes, n_events):.2f} MiB per 10k events")
    result = {"ranks": a.ranks, "steps": a.steps, "engines_at_start": started, "engines_after_trace": after_first,
              "recorder": held, "trace_events": n_events, "frames_bytes": frames, "file_bytes": file_bytes}
    return result


if __name__ == "__main__":
    main()
