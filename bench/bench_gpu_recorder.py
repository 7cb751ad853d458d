"""Recorder wall overhead on one GPU (run through the device tool), one process, world size 1, NCCL.

    python bench/bench_gpu_recorder.py [--rounds 7] [--iters 10] [--shapes 1x16x1024x1024 1x32x4096x4096]
                                       [--pkg DIR] [--profile] [--device cpu] [--parts]

3-conv net (16/32 -> 32 -> 32 -> 4 channels) on a ShardTensor of each shape, forward + backward, modes
interleaved round by round: none / recorder ops only / recorder ops + collectives (the default) / the same
with the CUDA allocator's memory deltas (memory=True) / torch.profiler (CPU activities, record_shapes: the
anchor). Per step: wall time
(a device synchronize ends each block) and host time (until the Python loop returns, before that
synchronize); ratios are medians of the per-round ratios to `none` of the same round. The first shape is
host-bound (every host microsecond is wall time), the second GPU-sized (the device is the bottleneck).
--pkg DIR puts DIR first on sys.path (to time another copy of sharddbg in the same run); --profile [MODE ...]
prints where the host time goes in one block of each mode named (the default recorder when none is named). Also times the per-event CUDA pieces.
--device cpu runs the same net on the CPU with gloo (no memory mode, no CUDA pieces): with a small shape
(1x16x32x32) the development box's stand-in for the host-bound GPU row, where the recorder's host time is
most of what it adds. --parts adds two modes: "rec_no_backward", the default recorder without the hooks on
autograd nodes (no backward events), and "rec_idle_hooks", the default with those hooks registered but doing
nothing: the table then splits what remains into backward events (rec - rec_no_backward; of which torch's
calls of the two Python hooks per node: rec_idle_hooks - rec_no_backward), collectives (rec - ops; of which the
layers that catch them, their handler calling straight through: "rec_pass_colls" - ops) and forward op events (the
rest); on CUDA also "rec_no_cuda_events", the default without the pair of CUDA timing events per event.
Every block starts with DTensor's redistribution plan cache emptied: this workload leaves a stale entry in
it each step (see README), so a long run would otherwise compare the modes at different points of that drift.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import os
import statistics
import sys
import time


def _mode_context(m, R, recorder_ops, recorder_collectives, box, torch):
    """The context manager that times mode ``m``, and a function that undoes what the mode changed."""
    hook_backward = recorder_ops.hook_backward
    box_hooks = (box.pre_hook, box.post_hook)
    handle = recorder_collectives.CollectiveHooks.handle
    cuda_span = recorder_ops.CudaSpan

    def restore():
        recorder_ops.hook_backward = hook_backward
        box.pre_hook, box.post_hook = box_hooks
        recorder_collectives.CollectiveHooks.handle = handle
        recorder_ops.CudaSpan = recorder_collectives.CudaSpan = cuda_span

    if m == "none":
        return contextlib.nullcontext(), restore
    if m == "profiler":
        return torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], record_shapes=True), restore
    if m == "rec_no_backward":
        recorder_ops.hook_backward = lambda rec, ev, outs: None
    if m == "rec_idle_hooks":
        box.pre_hook, box.post_hook = (lambda self, grad_outputs: None), (lambda self, gi, go: None)
    if m == "rec_pass_colls":  # the collective layers in place, their handler only calls through
        recorder_collectives.CollectiveHooks.handle = lambda self, func, s, args, kwargs: func(*args, **kwargs)
    if m == "rec_no_cuda_events":  # no device timing: no CUDA event pair per op and collective
        recorder_ops.CudaSpan = recorder_collectives.CudaSpan = lambda track_memory: None
    return R.Recorder(comm=(m != "ops"), memory=(m == "rec_mem")), restore


def _time_shape(a, shape, mesh, R) -> dict:
    import torch
    import torch.nn as nn
    from physicsnemo.domain_parallel import ShardTensor
    from torch.distributed.tensor import Shard

    torch.manual_seed(0)
    dev = a.device
    sync = torch.cuda.synchronize if dev == "cuda" else (lambda: None)
    full = torch.randn(*shape, device=dev)
    x = ShardTensor.from_local(full.clone().requires_grad_(True), mesh, (Shard(2),),
                               sharding_shapes={0: [tuple(full.shape)]})
    cin = shape[1]
    net = nn.Sequential(nn.Conv2d(cin, 32, 3, padding=1), nn.GELU(), nn.Conv2d(32, 32, 3, padding=1), nn.ReLU(),
                        nn.Conv2d(32, 4, 3, padding=1)).to(dev)

    def step():
        net.zero_grad(set_to_none=True)
        net(x).square().mean().backward()

    for _ in range(5):
        step()
    sync()
    modes = ("none", "ops", "rec", "rec_mem")  # rec: the default; rec_mem: with the allocator's memory deltas
    if dev != "cuda":
        modes = modes[:3]
    modes += ("profiler",)  # the anchor: torch.profiler, CPU activities, record_shapes
    if a.parts:
        modes += ("rec_no_backward", "rec_idle_hooks", "rec_pass_colls")
        if dev == "cuda":
            modes += ("rec_no_cuda_events",)
    from torch.distributed.tensor._redistribute import _gen_transform_infos

    from sharddbg.engine.recorder import autograd as recorder_autograd
    from sharddbg.engine.recorder import collectives as recorder_collectives
    from sharddbg.engine.recorder import ops as recorder_ops
    box = recorder_autograd.BackwardBox
    wall = {m: [] for m in modes}
    host = {m: [] for m in modes}
    counts = {}
    internal: list[str] = []
    for r in range(a.rounds):
        order = modes[r % len(modes):] + modes[: r % len(modes)]
        for m in order:
            ctx, restore = _mode_context(m, R, recorder_ops, recorder_collectives, box, torch)
            _gen_transform_infos.cache_clear()
            step()  # its plans back in the cache, as in every other block
            gc.collect()  # garbage left by the previous block (the profiler's events) is not this one's
            sync()
            t0 = time.perf_counter()
            with ctx:
                for _ in range(a.iters):
                    step()
                t1 = time.perf_counter()
                sync()
            restore()
            wall[m].append((time.perf_counter() - t0) / a.iters * 1e3)
            host[m].append((t1 - t0) / a.iters * 1e3)
            if m not in ("none", "profiler"):
                ev = ctx.events
                counts[m] = (sum(e["kind"] == "op" for e in ev) // a.iters,
                             sum(e["kind"] == "collective" for e in ev) // a.iters,
                             sum(e.get("device_ms") is not None for e in ev if e["kind"] == "op") // a.iters)
                if ctx.internal_errors:  # a recorder bug would make these numbers meaningless
                    internal.append(ctx.internal_errors[-1])
    for m in a.profile or ():
        import cProfile
        import pstats

        ctx, restore = _mode_context(m, R, recorder_ops, recorder_collectives, box, torch)
        _gen_transform_infos.cache_clear()
        step()
        sync()
        pr = cProfile.Profile()
        try:
            with ctx:
                pr.enable()
                for _ in range(a.iters):
                    step()
                sync()
                pr.disable()
        finally:
            restore()
        print(f"--- profile of mode {m}, {shape}, {a.iters} steps (device synchronized at the end)")
        st = pstats.Stats(pr)
        st.sort_stats("tottime").print_stats(25)
        if m not in ("none", "profiler"):
            st.sort_stats("cumtime").print_stats("sharddbg", 25)

    def paired(d, m):
        return statistics.median(v / n for v, n in zip(d[m], d["none"]))

    del x, net, full
    return {"ms_per_step": {m: statistics.median(v) for m, v in wall.items()},
            "host_ms_per_step": {m: statistics.median(v) for m, v in host.items()},
            "wall_ratio": {m: paired(wall, m) for m in modes},
            "wall_ratio_range": {m: [min(v / n for v, n in zip(wall[m], wall["none"])),
                                     max(v / n for v, n in zip(wall[m], wall["none"]))] for m in modes},
            "host_ratio": {m: paired(host, m) for m in modes},
            "per_step_ops_colls_devtimed": counts,
            "recorder_internal_errors": len(internal), "first_internal_error": internal[0] if internal else None}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--shapes", nargs="+", default=["1x16x1024x1024", "1x32x4096x4096"])
    ap.add_argument("--profile", nargs="*", metavar="MODE",
                    help="cProfile one block of each mode named (rec when none is named), after the timed rounds")
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    ap.add_argument("--parts", action="store_true")
    ap.add_argument("--pkg", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
    a = ap.parse_args()
    if a.profile == []:
        a.profile = ["rec"]
    sys.path.insert(0, a.pkg)
    import physicsnemo.domain_parallel as dp
    import torch
    import torch.distributed as dist
    from physicsnemo.distributed import DistributedManager
    from physicsnemo.domain_parallel import ShardTensor
    from torch.distributed.device_mesh import init_device_mesh

    import sharddbg.engine.recorder as R

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29533")
    cuda = a.device == "cuda"
    if cuda:
        torch.cuda.set_device(0)
    dist.init_process_group("nccl" if cuda else "gloo", rank=0, world_size=1)
    gm = init_device_mesh(a.device, (1, 1), mesh_dim_names=("ddp", "domain"))
    DistributedManager._shared_state.update(
        _is_initialized=True, _distributed=True, _rank=0, _world_size=1, _local_rank=0,
        _device=torch.device("cuda:0" if cuda else "cpu"), _cuda=cuda, _global_mesh=gm,
        _mesh_dims={"ddp": 1, "domain": 1})
    if not ShardTensor._function_registry:
        dp.register_custom_ops()
    mesh = gm["domain"]
    results = {}
    for shape_s in a.shapes:
        shape = tuple(int(d) for d in shape_s.split("x"))
        results[shape_s] = _time_shape(a, shape, mesh, R)
        if cuda:
            torch.cuda.empty_cache()
    if not cuda:
        print(json.dumps({"pkg": a.pkg, "torch": torch.__version__, "device": "cpu", "shapes": results}, indent=1))
        dist.destroy_process_group()
        return

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
    try:
        from sharddbg.engine.recorder import cuda as recorder_cuda
    except ImportError:  # a sharddbg from before the recorder package (--pkg)
        recorder_cuda = None
    if recorder_cuda is not None:
        pieces["recorder.cuda.new_cuda_event()+record"] = us(lambda: recorder_cuda.new_cuda_event().record())
        pieces["recorder.cuda.allocated_bytes()"] = us(recorder_cuda.allocated_bytes)
        assert recorder_cuda.allocated_bytes() == torch.cuda.memory_allocated()
    out = {"pkg": a.pkg, "torch": torch.__version__, "gpu": torch.cuda.get_device_name(0),
           "shapes": results, "piece_us": pieces}
    print(json.dumps(out, indent=1))
    if os.environ.get("OUT"):
        with open(os.path.join(os.environ["OUT"], f"gpu_{abs(hash(a.pkg)) % 1000}.json"), "w") as f:
            json.dump(out, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
