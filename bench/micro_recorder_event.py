"""Per-event host cost of the recorder on CPU, 1 rank: a loop of x.unsqueeze(0) on a small ShardTensor
(2 recorded events per call: the handler and the Tensor.shape read it makes through the DTensor fallback),
with parts of the bookkeeping stubbed out to see where the time goes.

    OMP_NUM_THREADS=1 .venv/bin/python bench/micro_recorder_event.py [--pkg PATH] [--rounds 7]

``--pkg``: import sharddbg from PATH (another checkout) instead of this one. The stubbed modes replace
functions of ``sharddbg.engine.recorder.ops`` for one block each:
  min_end       ops.end only closes and keeps the event (no output metadata, no backward hook)
  no_collect    ops.collect_tensors returns no tensor metadata
  no_uframe     ops.user_frame / ops.user_frame_until find no user frame
  no_compile    ops.compile_tracing answers False without asking torch
  all_min       all four
  nogc          the full recorder with the garbage collector off
"""
import argparse
import gc
import os
import statistics
import sys
import time

os.environ["OMP_NUM_THREADS"] = "1"
HERE = os.path.dirname(os.path.abspath(__file__))
ap = argparse.ArgumentParser()
ap.add_argument("--pkg", default=os.path.dirname(HERE))
ap.add_argument("--rounds", type=int, default=7)
a = ap.parse_args()
sys.path.insert(0, HERE)
from bench_recorder import _free_port, _setup  # noqa: E402

sys.path.insert(0, os.path.abspath(a.pkg))
import torch  # noqa: E402

mesh = _setup(0, 1, _free_port())
from physicsnemo.domain_parallel import ShardTensor  # noqa: E402
from torch.distributed.tensor import Shard  # noqa: E402

import sharddbg.engine.recorder as R  # noqa: E402
from sharddbg.engine.recorder import ops  # noqa: E402

x = ShardTensor.from_local(torch.randn(1, 2, 8, 8), mesh, (Shard(2),), sharding_shapes={0: [(1, 2, 8, 8)]})
N = 2000


def loop():
    for _ in range(N):
        x.unsqueeze(0)


loop()
ORIGINAL = {name: getattr(ops, name) for name in ("end", "collect_tensors", "user_frame", "user_frame_until",
                                                    "compile_tracing")}


def min_end(rec, st, ev, res, args=None, kwargs=None):
    ops.close(st, ev)
    rec.keep(ev)


STUBS = {
    "min_end": {"end": min_end},
    "no_collect": {"collect_tensors": lambda args, kwargs, cls, limit=64: []},
    "no_uframe": {"user_frame": lambda skip=2: None, "user_frame_until": lambda skip, stop, answer: None},
    "no_compile": {"compile_tracing": lambda: False},
}
STUBS["all_min"] = {k: v for d in STUBS.values() for k, v in d.items()}


def run(mode):
    gc.collect()
    if mode == "none":
        t0 = time.process_time()
        loop()
        return (time.process_time() - t0) / N
    for name, fn in STUBS.get(mode, {}).items():
        setattr(ops, name, fn)
    if mode == "nogc":
        gc.disable()
    try:
        with R.Recorder(comm=False, max_events=10**7) as rec:
            t0 = time.process_time()
            loop()
            dt = (time.process_time() - t0) / N
    finally:
        gc.enable()
        for name, fn in ORIGINAL.items():
            setattr(ops, name, fn)
    assert not rec.internal_errors, rec.internal_errors[0]
    assert len(rec.events) == 2 * N, len(rec.events)
    return dt


res = {m: [] for m in ("none", "full", "min_end", "no_collect", "no_uframe", "no_compile", "nogc", "all_min")}
for _ in range(a.rounds):
    for m in res:
        res[m].append(run(m))
b = statistics.median(res["none"])
print(f"sharddbg from {os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(R.__file__))))}")
for m in res:
    v = statistics.median(res[m])
    print(f"{m:<12} {v*1e6:7.1f} us/call  (+{(v-b)*1e6:5.1f} us; {(v-b)*1e6/2:5.1f} us per event)")
