"""Extra overhead of collective recording on top of the recorder, 4 gloo CPU ranks, one run.

    OMP_NUM_THREADS=1 .venv/bin/python bench/bench_comm.py [--ranks 4] [--rounds 7] [--iters 5]

Same workload as bench_recorder.py (3-conv net, input (1, 8, 128, 64) sharded on H, forward + backward,
patches registered), modes interleaved round by round (rotated), in ONE run:
  none            plain eager
  recorder_ops    Recorder(comm=False): ShardTensor ops only (issue 3)
  recorder        Recorder(): ops + every collective (issue 4: the TorchDispatchMode + Work.wait wrapper)
Reports wall ms/step (slowest rank), CPU ms/step (sum over ranks), and the ratios recorder/recorder_ops
(the cost of collective recording alone) and each mode/none.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import sys
import time

os.environ.setdefault("OMP_NUM_THREADS", "1")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from bench_recorder import _setup, paired_summary, run_pooled, time_modes  # noqa: E402

MODES = ("none", "recorder_ops", "recorder")


def _mode_ctx(mode: str):
    if mode == "none":
        return contextlib.nullcontext()
    from sharddbg.engine.recorder import Recorder

    return Recorder(comm=(mode == "recorder"))


def _worker(rank, world, port, rounds, iters, out):
    import torch
    import torch.distributed as dist
    import torch.nn as nn
    from physicsnemo.domain_parallel import ShardTensor
    from torch.distributed.tensor import Shard

    mesh = _setup(rank, world, port)
    torch.manual_seed(0)
    full = torch.randn(1, 8, 128, 64)
    parts = torch.tensor_split(full, world, dim=2)
    x = ShardTensor.from_local(parts[rank].clone().requires_grad_(True), mesh, (Shard(2),),
                               sharding_shapes={0: [tuple(p.shape) for p in parts]})
    net = nn.Sequential(nn.Conv2d(8, 16, 3, padding=1), nn.ReLU(), nn.Conv2d(16, 16, 3, padding=1), nn.ReLU(),
                        nn.Conv2d(16, 8, 3, padding=1))

    def step():
        net.zero_grad(set_to_none=True)
        net(x).square().mean().backward()

    for _ in range(3):
        step()
    counts = {}

    def count(mode, ctx):
        ev = ctx.events
        counts[mode] = (sum(e["kind"] == "op" for e in ev) // iters,
                        sum(e["kind"] == "collective" for e in ev) // iters)

    times, cpu = time_modes(step, MODES, _mode_ctx, rounds, iters, count)
    if rank == 0:
        out.put((times, cpu, counts))
    dist.barrier()
    dist.destroy_process_group()


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ranks", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=11)
    ap.add_argument("--iters", type=int, default=5)
    ap.add_argument("--runs", type=int, default=3, help="fresh rank processes per run (memory layouts differ)")
    a = ap.parse_args(argv)
    times, cpu, _per_run, _enter_exit, counts = run_pooled(_worker, MODES, a)
    wall, cpus = paired_summary(times), paired_summary(cpu)
    print(f"\nsharded 3-conv net fwd+bwd, input (1,8,128,64) over {a.ranks} gloo ranks; {a.runs} runs x {a.rounds} "
          f"rounds x {a.iters} steps; per step on rank 0: (ops, collectives) = {counts}")
    print(f"cores: {os.cpu_count()}; wall = slowest rank, cpu = sum over ranks (process_time); ratio = median of "
          "per-round ratios to none [quartiles]")
    print(f"{'mode':<13} {'wall ms/step':>13} {'wall ratio':>11} {'[q1, q3]':>15} {'cpu ms/step':>12} {'cpu ratio':>10} "
          f"{'[q1, q3]':>15}")
    for m in MODES:
        w, c = wall[m], cpus[m]
        wq = f"[{w['q1']:.3f}, {w['q3']:.3f}]"
        cq = f"[{c['q1']:.3f}, {c['q3']:.3f}]"
        print(f"{m:<13} {w['median'] * 1e3:>13.2f} {w['ratio']:>11.3f} {wq:>15} {c['median'] * 1e3:>12.2f} "
              f"{c['ratio']:>10.3f} {cq:>15}")
    # paired per round: the comm recording's own cost, round by round
    pair = statistics.median(x / y for x, y in zip(times["recorder"], times["recorder_ops"]))
    cpair = statistics.median(x / y for x, y in zip(cpu["recorder"], cpu["recorder_ops"]))
    print(f"collective recording on top of the recorder (paired per round): wall x{pair:.3f}, cpu x{cpair:.3f}")
    return {"wall": wall, "cpu": cpus, "comm_ratio_wall": pair, "comm_ratio_cpu": cpair}


if __name__ == "__main__":
    main()
