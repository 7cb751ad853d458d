"""Per-event host cost of the recorder on CPU, 1 rank: a loop of x.unsqueeze(0) on a small ShardTensor
(2 recorded events per call: the handler and the Tensor.shape read it makes through the DTensor fallback),
with parts of the bookkeeping stubbed out to see where the time goes.

    OMP_NUM_THREADS=1 .venv/bin/python bench/micro_recorder_event.py
"""
import os, sys, time, statistics, cProfile, pstats
os.environ["OMP_NUM_THREADS"] = "1"
sys.path.insert(0, "/work/main"); sys.path.insert(0, "/work/main/bench")
from bench_recorder import _setup, _free_port
import torch
mesh = _setup(0, 1, _free_port())
from physicsnemo.domain_parallel import ShardTensor
from torch.distributed.tensor import Shard
import sharddbg.engine.recorder as R
x = ShardTensor.from_local(torch.randn(1, 2, 8, 8), mesh, (Shard(2),), sharding_shapes={0: [(1, 2, 8, 8)]})
N = 2000
def loop():
    for _ in range(N):
        x.unsqueeze(0)
loop()
import sharddbg.engine._rec_util as U
orig = {"_end": R.Recorder._end, "_begin": R.Recorder._begin, "ct": R.collect_tensors, "uf": R.user_frame, "tr": R._tracing}
def min_end(self, st, ev, res):
    ev["t_end_ns"] = R.clock.now_ns(); self._pop(st, ev); self._keep(ev)
def setv(v):
    R.Recorder._end = orig["_end"]; R.Recorder._begin = orig["_begin"]; R.collect_tensors = orig["ct"]; R.user_frame = orig["uf"]; R._tracing = orig["tr"]
    if v == "min_end": R.Recorder._end = min_end
    if v == "no_collect": R.collect_tensors = lambda a, k, S, limit=64: []
    if v == "no_uframe": R.user_frame = lambda skip=2: None
    if v == "no_tracing": R._tracing = lambda: False
    if v == "all_min":
        R.Recorder._end = min_end; R.collect_tensors = lambda a, k, S, limit=64: []; R.user_frame = lambda skip=2: None; R._tracing = lambda: False
def run(mode):
    if mode == "none":
        t0 = time.process_time(); loop(); return (time.process_time() - t0) / N
    import gc
    setv(mode)
    if mode == "nogc": gc.disable()
    if mode == "nogc_none":
        t0 = time.process_time(); loop(); dt = (time.process_time() - t0) / N; gc.enable(); return dt
    with R.Recorder(comm=False, max_events=10**7) as r:
        t0 = time.process_time(); loop(); dt = (time.process_time() - t0) / N
    gc.enable()
    setv("full")
    return dt
res = {m: [] for m in ("none", "full", "min_end", "no_collect", "no_uframe", "nogc", "all_min")}
for i in range(7):
    for m in res: res[m].append(run(m))
b = statistics.median(res["none"])
for m in res:
    v = statistics.median(res[m]); print(f"{m:<12} {v*1e6:7.1f} us/call  (+{(v-b)*1e6:5.1f} us)")
