"""Recorder wall overhead on one GPU (run through the device tool), one process, world size 1, NCCL.

    python bench/bench_gpu_recorder.py [--rounds 7] [--iters 10] [--pkg DIR]

Same workload as gpu_check.py's recorder row: 3-conv net on a (1, 16, 1024, 1024) ShardTensor, forward +
backward, modes interleaved round by round: none / recorder ops only / recorder ops + collectives.
Wall time per step with a device synchronize at the end of each block. --pkg DIR puts DIR first on
sys.path (to time another copy of sharddbg in the same run). Also times the per-event CUDA pieces.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import sys
import time


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--pkg", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
    a = ap.parse_args()
    sys.path.insert(0, a.pkg)
    import torch
    import torch.distributed as dist
    import torch.nn as nn
    from physicsnemo.distributed import DistributedManager
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard

    import physicsnemo.domain_parallel as dp
    from physicsnemo.domain_parallel import ShardTensor
    import sharddbg.engine.recorder as R

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29533")
    torch.cuda.set_device(0)
    dist.init_process_group("nccl", rank=0, world_size=1)
    gm = init_device_mesh("cuda", (1, 1), mesh_dim_names=("ddp", "domain"))
    DistributedManager._shared_state.update(
        _is_initialized=True, _distributed=True, _rank=0, _world_size=1, _local_rank=0,
        _device=torch.device("cuda:0"), _cuda=True, _global_mesh=gm, _mesh_dims={"ddp": 1, "domain": 1})
    if not ShardTensor._function_registry:
        dp.register_custom_ops()
    mesh = gm["domain"]
    torch.manual_seed(0)
    full = torch.randn(1, 16, 1024, 1024, device="cuda")
    x = ShardTensor.from_local(full.clone().requires_grad_(True), mesh, (Shard(2),),
                               sharding_shapes={0: [tuple(full.shape)]})
    net = nn.Sequential(nn.Conv2d(16, 32, 3, padding=1), nn.GELU(), nn.Conv2d(32, 32, 3, padding=1), nn.ReLU(),
                        nn.Conv2d(32, 4, 3, padding=1)).cuda()

    def step():
        net.zero_grad(set_to_none=True)
        net(x).square().mean().backward()

    for _ in range(5):
        step()
    torch.cuda.synchronize()
    modes = ("none", "ops", "rec")
    wall = {m: [] for m in modes}
    counts = {}
    for r in range(a.rounds):
        order = modes[r % 3:] + modes[: r % 3]
        for m in order:
            ctx = contextlib.nullcontext() if m == "none" else R.Recorder(comm=(m == "rec"))
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            with ctx:
                for _ in range(a.iters):
                    step()
                torch.cuda.synchronize()
            wall[m].append((time.perf_counter() - t0) / a.iters * 1e3)
            if m != "none":
                ev = ctx.events
                counts[m] = (sum(e["kind"] == "op" for e in ev) // a.iters,
                             sum(e["kind"] == "collective" for e in ev) // a.iters,
                             sum(e.get("device_ms") is not None for e in ev if e["kind"] == "op") // a.iters)
    med = {m: statistics.median(v) for m, v in wall.items()}
    # the per-event CUDA pieces
    def us(f, n=2000):
        f()
        t0 = time.perf_counter()
        for _ in range(n):
            f()
        return (time.perf_counter() - t0) / n * 1e6

    def ev_rec():
        torch.cuda.Event(enable_timing=True).record()

    pieces = {"torch.cuda.memory_allocated()": us(torch.cuda.memory_allocated),
              "Event(enable_timing)+record": us(ev_rec)}
    if hasattr(R, "new_cuda_event"):
        pieces["recorder.new_cuda_event()+record"] = us(lambda: R.new_cuda_event().record())
    fast = getattr(R, "_allocated_bytes", None)
    if fast is not None:
        pieces["recorder._allocated_bytes()"] = us(fast)
        assert fast() == torch.cuda.memory_allocated()
    out = {"pkg": a.pkg, "torch": torch.__version__, "gpu": torch.cuda.get_device_name(0),
           "ms_per_step": med, "ratio": {m: med[m] / med["none"] for m in modes},
           "min": {m: min(v) for m, v in wall.items()}, "max": {m: max(v) for m, v in wall.items()},
           "per_step_events_colls_devms": counts, "piece_us": pieces}
    print(json.dumps(out, indent=1))
    if os.environ.get("OUT"):
        with open(os.path.join(os.environ["OUT"], f"gpu_{abs(hash(a.pkg)) % 1000}.json"), "w") as f:
            json.dump(out, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
