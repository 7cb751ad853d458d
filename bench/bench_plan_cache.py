"""How a training step slows down as DTensor's redistribution plan cache fills with stale entries (one CPU rank,
gloo, no sharddbg recording), and the same loop with the cache cleared every ``--clear-every`` steps.

    OMP_NUM_THREADS=1 .venv/bin/python bench/bench_plan_cache.py [--blocks 6] [--steps 400] [--clear-every 100]

The net is bench_gpu_recorder.py's 3-conv net on a (1, 16, 32, 32) ShardTensor, forward + backward of a
Partial loss: each step's ``backward()`` redistributes the loss through ``ShardTensor.redistribute``, which
changes the target spec after DTensor cached the plan under it. Prints ms per step and the cache's size per
block of ``--steps`` steps, first with the cache left alone, then (a fresh net, the cache emptied) clearing it
every ``--clear-every`` steps; the ratio last block / first block says how much slower the step became.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

os.environ.setdefault("OMP_NUM_THREADS", "1")
HERE = os.path.dirname(os.path.abspath(__file__))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--blocks", type=int, default=6)
    ap.add_argument("--steps", type=int, default=400)
    ap.add_argument("--clear-every", type=int, default=100)
    a = ap.parse_args()
    sys.path.insert(0, HERE)
    import torch
    import torch.nn as nn
    from bench_recorder import _free_port, _setup

    mesh = _setup(0, 1, _free_port())
    from physicsnemo.domain_parallel import ShardTensor
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor._redistribute import _gen_transform_infos

    torch.manual_seed(0)
    full = torch.randn(1, 16, 32, 32)
    x = ShardTensor.from_local(full.clone().requires_grad_(True), mesh, (Shard(2),),
                               sharding_shapes={0: [tuple(full.shape)]})
    net = nn.Sequential(nn.Conv2d(16, 32, 3, padding=1), nn.GELU(), nn.Conv2d(32, 32, 3, padding=1), nn.ReLU(),
                        nn.Conv2d(32, 4, 3, padding=1))

    def step():
        net.zero_grad(set_to_none=True)
        net(x).square().mean().backward()

    print(f"torch {torch.__version__}, {os.cpu_count()} cores; {a.blocks} blocks of {a.steps} steps")
    for clear_every in (None, a.clear_every):
        _gen_transform_infos.cache_clear()
        step()
        label = "cache left alone" if clear_every is None else f"cache_clear() every {clear_every} steps"
        per_block = []
        for b in range(a.blocks):
            t0 = time.perf_counter()
            for i in range(a.steps):
                step()
                if clear_every and (b * a.steps + i + 1) % clear_every == 0:
                    _gen_transform_infos.cache_clear()
            ms = (time.perf_counter() - t0) / a.steps * 1e3
            per_block.append(ms)
            print(f"{label:34s} steps {b * a.steps:5d}-{(b + 1) * a.steps:5d}: {ms:6.2f} ms/step, "
                  f"{_gen_transform_infos.cache_info().currsize:5d} entries", flush=True)
        print(f"{label:34s} last block / first block: {per_block[-1] / per_block[0]:.2f}")
    import torch.distributed as dist

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
