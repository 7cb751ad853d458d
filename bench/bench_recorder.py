"""Overhead of the sharddbg recorder on a small sharded conv net, forward + backward, 4 gloo CPU ranks.

    OMP_NUM_THREADS=1 .venv/bin/python bench/bench_recorder.py [--ranks 4] [--runs 3] [--rounds 11] [--iters 5]

Compares, in ONE run, interleaved round by round so that machine noise hits every mode alike:
  none          plain eager
  recorder_ops  Recorder(comm=False): ops only (dispatch paths, shapes, modules, user frames, backward
                events, promotions, errors, CUDA time and memory on GPUs)
  recorder      Recorder(): the default, the above plus every collective
  commdebug     torch.distributed.tensor.debug.CommDebugMode
  profiler      torch.profiler (CPU activity, record_shapes=True)
Each mode runs `iters` fwd+bwd steps per round with the tool started before and stopped after the
timed steps (as a traced cell); the time per step is the slowest rank's (wall) and the sum over ranks
(CPU); the table reports the median of per-round ratios to `none` with quartiles, over `runs` runs of
fresh rank processes. Input (1, 8, 128, 64) sharded on H over the domain ranks, patches registered.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import os
import socket
import statistics
import sys
import time
import traceback

os.environ.setdefault("OMP_NUM_THREADS", "1")
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

def _modes() -> tuple:
    left_out = set(os.environ.get("SHARDDBG_BENCH_LEAVE_OUT", "").split(","))
    return tuple(m for m in ("none", "recorder_ops", "recorder", "commdebug", "profiler") if m not in left_out)


MODES = _modes()
CRASHED: dict[str, str] = {}  # mode -> what it raised, over every run_pooled of this process (printed by the mains)


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


def _teardown() -> None:
    """Barrier, then physicsnemo's own clean-up: it destroys the process group and forgets it, so its exit
    hook does not destroy it a second time."""
    import torch.distributed as dist
    from physicsnemo.distributed import DistributedManager

    dist.barrier()
    DistributedManager.cleanup()


def _mode_ctx(mode: str):
    import torch

    if mode == "none":
        return contextlib.nullcontext()
    if mode in ("recorder", "recorder_ops"):
        from sharddbg.engine.recorder import Recorder

        return Recorder(comm=(mode == "recorder"))
    if mode == "commdebug":
        from torch.distributed.tensor.debug import CommDebugMode

        return CommDebugMode()
    if mode == "profiler":
        return torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], record_shapes=True)
    raise ValueError(mode)


def _worker(rank, world, port, rounds, iters, out):
    import torch
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
    _teardown()


_GLOBAL_HOOK_DICTS = ("_global_forward_hooks", "_global_forward_pre_hooks", "_global_backward_hooks",
                      "_global_backward_pre_hooks", "_global_forward_hooks_with_kwargs",
                      "_global_forward_hooks_always_called")


def _global_module_hooks() -> dict:
    """Copies of torch.nn's global module hook tables (what register_module_forward_hook & co. fill)."""
    from torch.nn.modules import module as nn_module

    return {name: dict(getattr(nn_module, name)) for name in _GLOBAL_HOOK_DICTS if hasattr(nn_module, name)}


def _restore_global_module_hooks(saved: dict) -> None:
    from torch.nn.modules import module as nn_module

    for name, entries in saved.items():
        table = getattr(nn_module, name)
        table.clear()
        table.update(entries)


def time_modes(step, modes, mode_ctx, rounds: int, iters: int, on_ctx=None, around_round=None):
    """Interleaved timing of ``step`` under each mode (rotated so no mode always goes first).

    Returns ({mode: [wall s/step of the slowest rank]}, {mode: [CPU s/step summed over ranks]}); CPU
    summed over ranks is the honest cost when ranks share fewer cores than there are ranks. The first
    dict also holds "_enter_exit_ms": {mode: median ms to start + stop the tool on this rank} and
    "_crashed": {mode: what it raised}; a mode that raised on any rank is dropped from then on (its lists
    empty), the others go on.
    ``on_ctx(mode, ctx)`` sees each mode's context after its timed block (e.g. to count events).
    ``around_round(r, "start" | "end")`` is called before and after each round (turn-taking with another
    group of ranks, bench_comm.py --against).
    """
    import torch
    import torch.distributed as dist

    try:  # DTensor's transform cache gains an entry every step of this workload (a ShardTensorSpec that
        # differs each time, with an equal hash): lookups get slower over the run. Emptied before each
        # block, for every mode alike, so the modes are not compared at different points of that drift.
        from torch.distributed.tensor._redistribute import _gen_transform_infos
    except ImportError:  # pragma: no cover - another torch layout
        _gen_transform_infos = None
    times = {m: [] for m in modes}
    cpu = {m: [] for m in modes}
    enter_exit = {m: [] for m in modes}
    crashed: dict[str, str] = {}  # mode -> what it raised: an anchor that crashes is reported, the rest goes on
    for r in range(rounds):
        if around_round is not None:
            around_round(r, "start")
        for mode in modes[r % len(modes):] + modes[: r % len(modes)]:
            if mode in crashed:
                continue
            if _gen_transform_infos is not None:
                _gen_transform_infos.cache_clear()
            gc.collect()  # garbage left by the previous block (CommDebugMode, the profiler) is not this one's
            # The tool is started before the clock starts and stopped after it stops, as a traced cell
            # does (%%shard_trace starts the recorder in one round trip and stops it in another):
            # the table is the cost per step; starting and stopping are timed apart (enter_exit_ms).
            error = None
            hooks_before = _global_module_hooks()
            try:
                cm = mode_ctx(mode)
                e0 = time.perf_counter()
                ctx = cm.__enter__()
                e1 = time.perf_counter()
                dist.barrier()
                c0 = time.process_time()
                t0 = time.perf_counter()
                try:
                    for _ in range(iters):
                        step()
                except BaseException as e:
                    cm.__exit__(type(e), e, e.__traceback__)
                    raise
                c1 = time.process_time()
                t1 = time.perf_counter()
                cm.__exit__(None, None, None)
            except Exception as e:  # noqa: BLE001 - the tool, not the bench, failed: say so and go on
                error = f"{type(e).__name__}: {e}"
                if dist.get_rank() == 0:
                    print(f"{mode} raised, round {r}:\n{traceback.format_exc()[-2500:]}", file=sys.stderr, flush=True)
                # a tool that raised inside its own module hook may leave that global hook installed (CommDebugMode
                # on torch 2.11): every later step would raise in it. Put the global hooks back as they were.
                _restore_global_module_hooks(hooks_before)
            # every rank drops a mode that crashed on any of them (the same crash, as a rule: the tools are
            # deterministic), so the ranks' collectives stay matched
            flag = torch.tensor([0 if error is None else 1], dtype=torch.int32)
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
            if int(flag):
                crashed[mode] = error or "crashed on another rank"
                continue
            enter_exit[mode].append((e1 - e0 + time.perf_counter() - t1) * 1e3)
            for store, value, op in ((times, (t1 - t0) / iters, dist.ReduceOp.MAX),
                                     (cpu, (c1 - c0) / iters, dist.ReduceOp.SUM)):
                t = torch.tensor([value], dtype=torch.float64)
                dist.all_reduce(t, op=op)
                store[mode].append(float(t))
            if on_ctx is not None and ctx is not None:
                on_ctx(mode, ctx)
        if around_round is not None:
            around_round(r, "end")
    for mode in crashed:  # rounds before the crash are not comparable with the others' full set: none kept
        times[mode], cpu[mode], enter_exit[mode] = [], [], []
    times["_enter_exit_ms"] = {m: statistics.median(v) for m, v in enter_exit.items() if v}
    times["_crashed"] = crashed
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


def paired_summary(values: dict, base: str = "none") -> dict:
    """Per mode: median, and the median / quartiles of its per-round ratio to ``base`` in the same round
    (rounds of all runs pooled). ``values``: {mode: [per-round value, ...]} in round order."""
    out = {}
    for m, v in values.items():
        if not v:  # a tool that crashed
            continue
        ratios = sorted(x / b for x, b in zip(v, values[base]))
        q = lambda p: ratios[min(len(ratios) - 1, int(p * len(ratios)))]  # noqa: E731
        out[m] = {"median": statistics.median(v), "ratio": statistics.median(ratios), "q1": q(0.25), "q3": q(0.75)}
    return out


def run_pooled(worker, modes, a):
    """``a.runs`` runs of fresh rank processes (``spawn_ranks(worker, a.ranks, a.rounds, a.iters)``, the worker
    putting (times, cpu, extra) from ``time_modes``); per-round values pooled per mode.
    Returns (times, cpu, per-run median wall ratios, per-run start+stop ms, the last run's extra)."""
    times = {m: [] for m in modes}
    cpu = {m: [] for m in modes}
    per_run, enter_exit, extra = [], [], None
    crashed: dict[str, str] = {}
    for _ in range(a.runs):
        t, c, extra = spawn_ranks(worker, a.ranks, a.rounds, a.iters)
        enter_exit.append(t.pop("_enter_exit_ms"))
        crashed.update(t.pop("_crashed", {}))
        for m in modes:
            times[m] += t[m]
            cpu[m] += c[m]
        per_run.append({m: statistics.median(x / b for x, b in zip(t[m], t["none"])) for m in modes if t[m]})
    for m in crashed:  # crashed in one run: left out of every run's pool
        times[m], cpu[m] = [], []
    CRASHED.update(crashed)
    return times, cpu, per_run, enter_exit, extra


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ranks", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=11)
    ap.add_argument("--iters", type=int, default=5)
    ap.add_argument("--runs", type=int, default=3, help="fresh rank processes per run (memory layouts differ)")
    ap.add_argument("--leave-out", default="", help="modes left out, comma-separated (a tool that crashes on this "
                                                     "torch can leave the process broken for the others)")
    a = ap.parse_args(argv)
    global MODES
    os.environ["SHARDDBG_BENCH_LEAVE_OUT"] = a.leave_out  # the rank processes (spawned) read it at import
    MODES = _modes()
    times, cpu, per_run, enter_exit, n_events = run_pooled(_worker, MODES, a)
    wall, cpus = paired_summary(times), paired_summary(cpu)
    print(f"\nsharded 3-conv net fwd+bwd, input (1,8,128,64) over {a.ranks} gloo ranks; {a.runs} runs x "
          f"{a.rounds} rounds x {a.iters} steps, modes interleaved; recorder kept {n_events} events per round")
    print(f"cores: {os.cpu_count()}; wall = slowest rank, cpu = sum over ranks (process_time); ratio = median "
          "of per-round ratios to none [quartiles]")
    print(f"{'mode':<10} {'wall ms/step':>12} {'wall ratio':>11} {'[q1, q3]':>15} {'per-run wall ratios':>22} "
          f"{'cpu ms/step':>12} {'cpu ratio':>10} {'[q1, q3]':>15}")
    for m in MODES:
        if m not in wall:
            print(f"{m:<10} crashed: {CRASHED.get(m, 'no measurement')}")
            continue
        w, c = wall[m], cpus[m]
        runs = " ".join(f"{r[m]:.3f}" for r in per_run)
        wq = f"[{w['q1']:.3f}, {w['q3']:.3f}]"
        cq = f"[{c['q1']:.3f}, {c['q3']:.3f}]"
        print(f"{m:<10} {w['median'] * 1e3:>12.2f} {w['ratio']:>11.3f} {wq:>15} {runs:>22} "
              f"{c['median'] * 1e3:>12.2f} {c['ratio']:>10.3f} {cq:>15}")
    print("(recorder_ops: ops only; recorder: the default, ops and every collective)")
    print("start + stop of each tool, ms on rank 0 (median per run): "
          + "; ".join(f"{m} " + " ".join(f"{e[m]:.2f}" for e in enter_exit if m in e) for m in MODES
                       if m != "none" and m not in CRASHED))
    return {"wall": wall, "cpu": cpus, "per_run_wall": per_run, "enter_exit_ms": enter_exit, "crashed": dict(CRASHED)}


if __name__ == "__main__":
    main()
