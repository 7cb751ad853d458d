"""Recorder wall overhead on one GPU (run through the device tool), one process, world size 1, NCCL.

    python bench/bench_gpu_recorder.py [--rounds 7] [--iters 10] [--shapes 1x16x1024x1024 1x32x4096x4096]
                                       [--pkg DIR] [--profile [MODE ...]] [--device cpu] [--parts]
                                       [--modes none,ops,rec,...] [--runs N] [--opcodes]

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
--opcodes counts the Python bytecode instructions of one step in none / ops / rec and charges what the recorder
adds to its components (forward op events, backward events, collectives, the module stack, ...): a profile of
what remains that no timer noise blurs (count with --device cpu: on CUDA backward runs on another thread).
--runs N: N fresh processes one after another, their per-round ratios pooled (median and quartiles, and
each run's median); --modes times only the modes named.
Every block starts with DTensor's redistribution plan cache emptied: this workload leaves a stale entry in
it each step (see docs/trace.md), so a long run would otherwise compare the modes at different points of that drift.
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


# What each sharddbg entry point records (the outermost sharddbg frame of a call from torch or the user's code)
_ENTRY_COMPONENTS = {
    "__torch_function__": "forward op events", "__torch_dispatch__": "forward op events",
    "method": "forward op events", "end": "forward op events",
    "pre_hook": "backward events", "post_hook": "backward events",
    "__call__": "collectives", "kernel": "collectives", "wait": "collectives", "wrapper": "collectives",
    "pre": "module stack", "post": "module stack",
    "promote": "promotions and fallback marks", "marked": "promotions and fallback marks",
    "plan": "plan cache watch",
}
# torch / physicsnemo functions that run only because the recorder is installed
_ADDED_ELSEWHERE = {
    "inner": "module stack", "_call_impl": "module stack",  # nn.Module's slow path while global hooks exist
    "__init__": "backward events", "_register_hook": "backward events",  # a RemovableHandle per node hook
    "grad_fn": "backward events",  # ShardTensor's grad_fn property, read to find the node to hook
    "is_compiling": "compile checks", "is_scripting": "compile checks",
    "_conversion_active": "forward op events",
}


def _opcode_profile(step, sync, R, mode_context_args, modes=("none", "ops", "rec")) -> dict:
    """Python bytecode instructions executed in one step of each mode, counted with ``sys.settrace``: a profile
    of what the recorder adds that no timer noise blurs. Each sharddbg instruction is charged to the component
    whose entry point called it (``_ENTRY_COMPONENTS``); torch's and physicsnemo's extra instructions to the
    component that causes them (``_ADDED_ELSEWHERE``). Only this thread is traced: on CUDA the autograd engine
    runs backward on its own thread, so count on the CPU (``--device cpu``), where backward runs here."""
    import collections

    from torch.distributed.tensor._redistribute import _gen_transform_infos

    def ours(code) -> bool:
        return f"{os.sep}sharddbg{os.sep}" in code.co_filename

    per_mode = {}
    for m in modes:
        counts: collections.Counter = collections.Counter()

        def tracer(frame, event, arg, counts=counts):
            frame.f_trace_opcodes = True
            if event == "opcode":
                code = frame.f_code
                if ours(code):
                    f = frame
                    while f.f_back is not None and ours(f.f_back.f_code):
                        f = f.f_back
                    counts[_ENTRY_COMPONENTS.get(f.f_code.co_name, "other sharddbg: " + f.f_code.co_name)] += 1
                else:
                    counts[(code.co_filename, code.co_firstlineno, code.co_name)] += 1
            return tracer

        ctx, restore = _mode_context(m, R, *mode_context_args)
        _gen_transform_infos.cache_clear()
        step()
        sync()
        try:
            with ctx:
                step()  # the recorder's first sight of each module and group is not a step's cost
                sync()
                sys.settrace(tracer)
                try:
                    step()
                finally:
                    sys.settrace(None)
                sync()
        finally:
            restore()
        per_mode[m] = counts
    base = per_mode["none"]
    out = {"total": {m: sum(c.values()) for m, c in per_mode.items()}}
    for m in modes:
        if m == "none":
            continue
        added: collections.Counter = collections.Counter()
        for key in set(per_mode[m]) | set(base):
            d = per_mode[m][key] - base[key]
            if isinstance(key, tuple):
                if d:
                    added[_ADDED_ELSEWHERE.get(key[2], "torch / physicsnemo, other")] += d
            else:
                added[key] += d
        out[m] = dict(added.most_common())
    return out

def _time_shape(a, shape, mesh, R) -> dict:
    import torch
    from physicsnemo.domain_parallel import ShardTensor
    from torch import nn
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
    if a.modes:
        modes = tuple(m for m in a.modes.split(",") if m)
    from torch.distributed.tensor._redistribute import _gen_transform_infos

    from sharddbg.engine.recorder import autograd as recorder_autograd
    from sharddbg.engine.recorder import collectives as recorder_collectives
    from sharddbg.engine.recorder import ops as recorder_ops
    box = recorder_autograd.BackwardBox
    wall = {m: [] for m in modes}
    full_collections = {m: 0 for m in modes}  # the garbage collector's full collections inside timed blocks
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
            full_before = gc.get_stats()[2]["collections"]
            t0 = time.perf_counter()
            with ctx:
                for _ in range(a.iters):
                    step()
                t1 = time.perf_counter()
                sync()
            restore()
            wall[m].append((time.perf_counter() - t0) / a.iters * 1e3)
            host[m].append((t1 - t0) / a.iters * 1e3)
            full_collections[m] += gc.get_stats()[2]["collections"] - full_before
            if m not in ("none", "profiler"):
                ev = ctx.events
                counts[m] = (sum(e["kind"] == "op" for e in ev) // a.iters,
                             sum(e["kind"] == "collective" for e in ev) // a.iters,
                             sum(e.get("device_ms") is not None for e in ev if e["kind"] == "op") // a.iters)
                if ctx.internal_errors:  # a recorder bug would make these numbers meaningless
                    internal.append(ctx.internal_errors[-1])
    if a.opcodes:
        ops_out = _opcode_profile(step, sync, R, (recorder_ops, recorder_collectives, box, torch))
        print(f"--- Python instructions of one step, {shape}, this thread: {ops_out['total']}")
        for m in ("ops", "rec"):
            print(f"  added by {m}: {sum(ops_out[m].values())}")
            for name, n in ops_out[m].items():
                print(f"    {n:7d}  {name}")
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

    return {"ms_per_step": {m: statistics.median(v) for m, v in wall.items()},
            "host_ms_per_step": {m: statistics.median(v) for m, v in host.items()},
            "wall_ratio": {m: paired(wall, m) for m in modes},
            "wall_ratio_range": {m: [min(v / n for v, n in zip(wall[m], wall["none"])),
                                     max(v / n for v, n in zip(wall[m], wall["none"]))] for m in modes},
            "host_ratio": {m: paired(host, m) for m in modes},
            "wall_ratio_per_round": {m: [v / n for v, n in zip(wall[m], wall["none"])] for m in modes},
            "per_step_ops_colls_devtimed": counts,
            "gc_full_collections_in_blocks": full_collections,
            "python_instructions_per_step": ops_out if a.opcodes else None,
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
    ap.add_argument("--opcodes", action="store_true",
                    help="count the Python instructions of one step per mode and function (sys.settrace)")
    ap.add_argument("--modes", default="", help="comma-separated modes to time instead (none must be one)")
    ap.add_argument("--runs", type=int, default=1, help="fresh processes, one after another; rounds pooled")
    ap.add_argument("--result-file", default="", help=argparse.SUPPRESS)  # a child run's JSON, for --runs
    ap.add_argument("--pkg", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
    a = ap.parse_args()
    if a.profile == []:
        a.profile = ["rec"]
    if a.modes and "none" not in a.modes.split(","):
        ap.error("--modes must include none (every ratio is to it)")
    if a.runs > 1:
        _pooled_runs(a)
        return
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
        out = {"pkg": a.pkg, "torch": torch.__version__, "device": "cpu", "shapes": results}
        print(json.dumps(out, indent=1))
        if a.result_file:
            with open(a.result_file, "w") as f:
                json.dump(out, f)
        DistributedManager.cleanup()  # destroys the group, and leaves physicsnemo nothing to do at exit
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
    if a.result_file:
        with open(a.result_file, "w") as f:
            json.dump(out, f)
    if os.environ.get("OUT"):
        with open(os.path.join(os.environ["OUT"], f"gpu_{abs(hash(a.pkg)) % 1000}.json"), "w") as f:
            json.dump(out, f)
    DistributedManager.cleanup()  # destroys the group, and leaves physicsnemo nothing to do at exit


def _quantile(ordered: list, p: float) -> float:
    return ordered[min(len(ordered) - 1, int(p * len(ordered)))]


def _pooled_runs(a) -> None:
    """``--runs N``: N fresh processes one after another (memory layouts and clocks differ between them), each
    the same command with one run; per-round ratios to untraced pooled over every run."""
    import subprocess
    import tempfile

    argv = [x for x in sys.argv[1:]]
    i = argv.index("--runs")
    del argv[i:i + 2]
    runs = []
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(a.runs):
            path = os.path.join(tmp, f"run{r}.json")
            subprocess.run([sys.executable, os.path.abspath(__file__), *argv, "--result-file", path], check=True,
                           stdout=subprocess.DEVNULL)
            with open(path) as f:
                runs.append(json.load(f))
    first = runs[0]
    print(f"{a.runs} runs x {a.rounds} rounds x {a.iters} steps; torch {first['torch']}, "
          f"{first.get('gpu') or 'cpu'}, {os.cpu_count()} cores")
    pooled_out = {"runs": runs, "pooled": {}}
    for shape in first["shapes"]:
        modes = list(first["shapes"][shape]["wall_ratio"])
        print(f"\nshape {shape}: median of per-round wall ratios to none, pooled [q1, q3]; each run's median; "
              f"ms/step (median of runs)")
        pooled_out["pooled"][shape] = {}
        for m in modes:
            per_round = sorted(x for run in runs for x in run["shapes"][shape]["wall_ratio_per_round"][m])
            per_run = [run["shapes"][shape]["wall_ratio"][m] for run in runs]
            ms = statistics.median(run["shapes"][shape]["ms_per_step"][m] for run in runs)
            errors = sum(run["shapes"][shape]["recorder_internal_errors"] for run in runs)
            full_gcs = sum(run["shapes"][shape]["gc_full_collections_in_blocks"][m] for run in runs)
            print(f"  {m:<20} {statistics.median(per_round):6.3f} [{_quantile(per_round, 0.25):.3f}, {_quantile(per_round, 0.75):.3f}]   "
                  + " ".join(f"{v:.3f}" for v in per_run) + f"   {ms:8.2f} ms  {full_gcs} full GCs" + (f"  {errors} internal errors!" if errors else ""))
            pooled_out["pooled"][shape][m] = {"ratio": statistics.median(per_round),
                                              "q1": _quantile(per_round, 0.25), "q3": _quantile(per_round, 0.75),
                                              "per_run": per_run, "ms_per_step": ms,
                                              "gc_full_collections_in_blocks": full_gcs}
    if os.environ.get("OUT"):
        with open(os.path.join(os.environ["OUT"], "gpu_recorder_runs.json"), "w") as f:
            json.dump(pooled_out, f)


if __name__ == "__main__":
    main()
