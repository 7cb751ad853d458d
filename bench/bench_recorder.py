"""Overhead of the sharddbg recorder on a small sharded conv net, forward + backward, 4 gloo CPU ranks.

    OMP_NUM_THREADS=1 .venv/bin/python bench/bench_recorder.py [--ranks 4] [--rounds 7] [--iters 5]

Compares, in ONE run, interleaved round by round so that machine noise hits every mode alike:
  none        plain eager
  recorder    sharddbg.engine.recorder.Recorder (everything issue 3 records switched on)
  commdebug   torch.distributed.tensor.debug.CommDebugMode
  profiler    torch.profiler (CPU activity, record_shapes=True)
Each mode runs `iters` fwd+bwd steps inside ONE context per round (as a traced cell would);
the time per step is the slowest rank's, and the table reports medians over rounds and the ratio
to `none`. Input (1, 8, 128, 64) sharded on H over the domain ranks, patches registered.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import socket
import statistics
import sys
import time

os.environ.setdefault("OMP_NUM_THREADS", "1")
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

MODES = ("none", "recorder", "commdebug", "profiler")


def _free_port() -> int:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    p = s.getsockname()[1]
    s.close()
    return p


def _setup(rank: int, world: int, port: int):
    import torch
    import torch.distributed as dist
    from physicsnemo.distributed import DistributedManager
    from torch.distributed.device_mesh import init_device_mesh

    import physicsnemo.domain_parallel as dp

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    gm = init_device_mesh("cpu", (1, world), mesh_dim_names=("ddp", "domain"))
    DistributedManager._shared_state.update(
        _is_initialized=True, _distributed=True, _rank=rank, _world_size=world, _local_rank=rank,
        _device=torch.device("cpu"), _cuda=False, _global_mesh=gm, _mesh_dims={"ddp": 1, "domain": world})
    dp.register_custom_ops()  # CPU host: physicsnemo does not register its patches by itself
    return gm["domain"]


def _mode_ctx(mode: str):
    import torch

    if mode == "none":
        return contextlib.nullcontext()
    if mode == "recorder":
        from sharddbg.engine.recorder import Recorder

        return Recorder()
    if mode == "commdebug":
        from torch.distributed.tensor.debug import CommDebugMode

        return CommDebugMode()
    if mode == "profiler":
        return torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], record_shapes=True)
    raise ValueError(mode)


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
    local = parts[rank].clone().requires_grad_(True)
    x = ShardTensor.from_local(local, mesh, (Shard(2),), sharding_shapes={0: [tuple(p.shape) for p in parts]})
    net = nn.Sequential(nn.Conv2d(8, 16, 3, padding=1), nn.ReLU(), nn.Conv2d(16, 16, 3, padding=1), nn.ReLU(),
                        nn.Conv2d(16, 8, 3, padding=1))

    def step():
        net.zero_grad(set_to_none=True)
        net(x).square().mean().backward()

    for _ in range(3):  # warm-up: first calls build caches in DTensor / physicsnemo
        step()
    n_events = 0

    def count(mode, ctx):
        nonlocal n_events
        if mode == "recorder":
            n_events = len(ctx.events)

    times, cpu = time_modes(step, MODES, _mode_ctx, rounds, iters, count)
    if rank == 0:
        out.put((times, cpu, n_events))
    dist.barrier()
    dist.destroy_process_group()


def time_modes(step, modes, mode_ctx, rounds: int, iters: int, on_ctx=None):
    """Interleaved timing of ``step`` under each mode (rotated so no mode always goes first).

    Returns ({mode: [wall s/step of the slowest rank]}, {mode: [CPU s/step summed over ranks]}); CPU
    summed over ranks is the honest cost when ranks share fewer cores than there are ranks.
    ``on_ctx(mode, ctx)`` sees each mode's context after its timed block (e.g. to count events).
    """
    import torch
    import torch.distributed as dist

    times = {m: [] for m in modes}
    cpu = {m: [] for m in modes}
    for r in range(rounds):
        for mode in modes[r % len(modes):] + modes[: r % len(modes)]:
            dist.barrier()
            c0 = time.process_time()
            t0 = time.perf_counter()
            with mode_ctx(mode) as ctx:
                for _ in range(iters):
                    step()
            for store, value, op in ((times, (time.perf_counter() - t0) / iters, dist.ReduceOp.MAX),
                                     (cpu, (time.process_time() - c0) / iters, dist.ReduceOp.SUM)):
                t = torch.tensor([value], dtype=torch.float64)
                dist.all_reduce(t, op=op)
                store[mode].append(float(t))
            if on_ctx is not None and ctx is not None:
                on_ctx(mode, ctx)
    return times, cpu


def spawn_ranks(worker, ranks: int, *args, timeout: float = 1800):
    """Run ``worker(rank, ranks, port, *args, queue)`` in ``ranks`` fresh processes; rank 0 puts the result."""
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=worker, args=(r, ranks, port, *args, q)) for r in range(ranks)]
    for p in procs:
        p.start()
    result = q.get(timeout=timeout)
    for p in procs:
        p.join(60)
    return result


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ranks", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--iters", type=int, default=5)
    a = ap.parse_args(argv)
    times, cpu, n_events = spawn_ranks(_worker, a.ranks, a.rounds, a.iters)
    base = statistics.median(times["none"])
    cbase = statistics.median(cpu["none"])
    print(f"\nsharded 3-conv net fwd+bwd, input (1,8,128,64) over {a.ranks} gloo ranks; "
          f"{a.rounds} rounds x {a.iters} steps; recorder kept {n_events} events per round")
    print(f"cores: {os.cpu_count()}; wall = slowest rank, cpu = sum over ranks (process_time)")
    print(f"{'mode':<10} {'wall ms/step':>13} {'min':>8} {'max':>8} {'ratio':>7} {'overhead':>9} "
          f"{'cpu ms/step':>12} {'cpu ratio':>10}")
    res = {}
    for m in MODES:
        med = statistics.median(times[m])
        cmed = statistics.median(cpu[m])
        res[m] = {"wall_ratio": med / base, "cpu_ratio": cmed / cbase}
        print(f"{m:<10} {med * 1e3:>13.2f} {min(times[m]) * 1e3:>8.2f} {max(times[m]) * 1e3:>8.2f} "
              f"{med / base:>7.3f} {100 * (med / base - 1):>+8.1f}% {cmed * 1e3:>12.2f} {cmed / cbase:>10.3f}")
    return res


if __name__ == "__main__":
    main()
