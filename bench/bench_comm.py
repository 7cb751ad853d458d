"""Extra overhead of collective recording on top of the recorder, 4 gloo CPU ranks, one run; and the same
workload timed for this checkout against another revision of sharddbg, interleaved in one run.

    OMP_NUM_THREADS=1 .venv/bin/python bench/bench_comm.py [--ranks 4] [--runs 3] [--rounds 11] [--iters 5]
    OMP_NUM_THREADS=1 .venv/bin/python bench/bench_comm.py --against HEAD~1   # this tree vs a revision
    OMP_NUM_THREADS=1 .venv/bin/python bench/bench_comm.py --verification     # what each check costs

Same workload as bench_recorder.py (3-conv net, input (1, 8, 128, 64) sharded on H, forward + backward,
patches registered), modes interleaved round by round (rotated), in ONE run:
  none            plain eager
  recorder_ops    Recorder(comm=False): ShardTensor ops only
  recorder        Recorder(): ops + every collective (the default)
Reports wall ms/step (slowest rank), CPU ms/step (sum over ranks), and the ratios recorder/recorder_ops
(the cost of collective recording alone) and each mode/none.

``--verification``: the recorder's checks instead, in one run, each paired per round with the default
recorder (which includes the spec check):
  recorder          the default: ops + collectives + the spec check (results' specs against local tensors)
  recorder_nospec   the same, spec_check=False
  recorder_preflight  + preflight=True: every collective inside an op compared across its group first
  recorder_replicas   + replicas=True: every Replicate result and promoted weight copied and digested
The spec check runs when the events are formatted, after the timed steps: the time to format them
(``export ms``, per step, rank 0) is reported beside the step ratios.

``--against REV``: the revision is checked out in a git worktree; each run starts two groups of rank
processes, one importing sharddbg from this tree and one from the worktree, alive side by side. They take
turns round by round (the order alternates), so machine noise hits both alike; only one group runs at a
time. Each round gives each group its own ratio mode/none (its own untraced steps, same processes); the
table reports the median over rounds of new ratio / old ratio, with quartiles.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import subprocess
import sys
import tempfile
import time

os.environ.setdefault("OMP_NUM_THREADS", "1")
HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, HERE)
sys.path.insert(0, ROOT)

from bench_recorder import _free_port, _setup, _teardown, paired_summary, run_pooled, time_modes  # noqa: E402

MODES = ("none", "recorder_ops", "recorder")
VERIFICATION_MODES = ("none", "recorder", "recorder_nospec", "recorder_preflight", "recorder_replicas")


def _mode_ctx(mode: str):
    if mode == "none":
        return contextlib.nullcontext()
    from sharddbg.engine.recorder import Recorder

    if mode == "recorder_nospec":
        return Recorder(spec_check=False)
    if mode == "recorder_preflight":
        return Recorder(preflight=True)
    if mode == "recorder_replicas":
        return Recorder(replicas=True)
    return Recorder(comm=(mode == "recorder"))


def _workload(rank, world, port):
    import torch
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
    return step


def _event_counter(iters, counts):
    def count(mode, ctx):
        ev = ctx.events
        counts[mode] = (sum(e["kind"] == "op" for e in ev) // iters,
                        sum(e["kind"] == "collective" for e in ev) // iters)

    return count


def _export_timer(iters, export_ms):
    """Times the first read of ``ctx.events`` (the formatting, the spec check included), per step."""
    def count(mode, ctx):
        t0 = time.perf_counter()
        ctx.events
        export_ms.setdefault(mode, []).append((time.perf_counter() - t0) * 1e3 / iters)

    return count


def _verification_worker(rank, world, port, rounds, iters, out):
    step = _workload(rank, world, port)
    export_ms = {}
    times, cpu = time_modes(step, VERIFICATION_MODES, _mode_ctx, rounds, iters, _export_timer(iters, export_ms))
    if rank == 0:
        out.put((times, cpu, {m: statistics.median(v) for m, v in export_ms.items()}))
    _teardown()


def verification(a) -> dict:
    times, cpu, _per_run, _enter_exit, export_ms = run_pooled(_verification_worker, VERIFICATION_MODES, a)
    wall = paired_summary(times)
    print(f"\nthe recorder's checks; sharded 3-conv net fwd+bwd, input (1,8,128,64) over {a.ranks} gloo ranks; "
          f"{a.runs} runs x {a.rounds} rounds x {a.iters} steps; cores: {os.cpu_count()}")
    print(f"{'mode':<19} {'wall ms/step':>13} {'/ none':>7} {'/ recorder [q1, q3]':>26} {'cpu / recorder':>15} "
          f"{'export ms/step':>15}")
    out = {}
    for m in VERIFICATION_MODES:
        pair = sorted(x / y for x, y in zip(times[m], times["recorder"]))
        cpair = statistics.median(x / y for x, y in zip(cpu[m], cpu["recorder"]))
        q = lambda p: pair[min(len(pair) - 1, int(p * len(pair)))]  # noqa: E731
        e = export_ms.get(m)
        print(f"{m:<19} {wall[m]['median'] * 1e3:>13.2f} {wall[m]['ratio']:>7.3f} "
              f"{statistics.median(pair):>8.3f} [{q(0.25):.3f}, {q(0.75):.3f}] {cpair:>15.3f} "
              f"{'' if e is None else f'{e:.2f}':>15}")
        out[m] = {"wall_ms": wall[m]["median"] * 1e3, "over_none": wall[m]["ratio"],
                  "over_recorder": statistics.median(pair), "q1": q(0.25), "q3": q(0.75), "cpu_over_recorder": cpair,
                  "export_ms_per_step": e}
    return out


def _worker(rank, world, port, rounds, iters, out):
    step = _workload(rank, world, port)
    counts = {}
    times, cpu = time_modes(step, MODES, _mode_ctx, rounds, iters, _event_counter(iters, counts))
    if rank == 0:
        out.put((times, cpu, counts))
    _teardown()


# ---- this tree against another revision --------------------------------------------------------

def _group_worker(tree, rank, world, port, rounds, iters, go, done, out):
    """One rank of one group: sharddbg imported from ``tree``; each round starts when the parent says so."""
    sys.path.insert(0, tree)
    import sharddbg

    step = _workload(rank, world, port)
    counts = {}

    def around_round(r, when):
        if rank != 0:
            return  # the other ranks wait in the round's first barrier
        if when == "start":
            go.get()
        else:
            done.put(r)

    times, cpu = time_modes(step, MODES, _mode_ctx, rounds, iters, _event_counter(iters, counts), around_round)
    if rank == 0:
        out.put((times, cpu, counts, os.path.dirname(os.path.dirname(os.path.abspath(sharddbg.__file__)))))
    _teardown()


def _start_group(ctx, tree, ranks, rounds, iters):
    go, done, out = ctx.Queue(), ctx.Queue(), ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=_group_worker, args=(tree, r, ranks, port, rounds, iters, go, done, out))
             for r in range(ranks)]
    for p in procs:
        p.start()
    return {"go": go, "done": done, "out": out, "procs": procs}


def _worktree(rev: str) -> str:
    path = os.path.join(tempfile.mkdtemp(prefix="sharddbg-rev-"), "tree")
    subprocess.run(["git", "-C", ROOT, "worktree", "add", "--detach", "-q", path, rev], check=True)
    return path


def compare(a) -> dict:
    import torch.multiprocessing as mp

    old_tree = _worktree(a.against)
    sha = subprocess.run(["git", "-C", old_tree, "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    ctx = mp.get_context("spawn")
    per_round = {m: [] for m in MODES if m != "none"}  # new ratio / old ratio, per round
    own = {"new": {m: [] for m in MODES}, "old": {m: [] for m in MODES}}
    counts = {}
    try:
        for run in range(a.runs):
            groups = {"new": _start_group(ctx, ROOT, a.ranks, a.rounds, a.iters),
                      "old": _start_group(ctx, old_tree, a.ranks, a.rounds, a.iters)}
            for r in range(a.rounds):
                for name in (("new", "old") if (r + run) % 2 == 0 else ("old", "new")):
                    groups[name]["go"].put(r)
                    groups[name]["done"].get(timeout=900)
            results = {}
            for name, g in groups.items():
                times, _cpu, c, imported_from = g["out"].get(timeout=300)
                times.pop("_enter_exit_ms")
                results[name] = times
                counts[name] = (c, imported_from)
                for p in g["procs"]:
                    p.join(60)
            for m in MODES:
                own["new"][m] += results["new"][m]
                own["old"][m] += results["old"][m]
            for m in per_round:
                per_round[m] += [(n / nn) / (o / on) for n, nn, o, on in
                                 zip(results["new"][m], results["new"]["none"], results["old"][m], results["old"]["none"])]
    finally:
        subprocess.run(["git", "-C", ROOT, "worktree", "remove", "--force", old_tree], check=False)
    print(f"\nthis tree ({counts['new'][1]}) against {a.against} = {sha} ({counts['old'][1]}); 3-conv net fwd+bwd, "
          f"input (1,8,128,64) over {a.ranks} gloo ranks; {a.runs} runs x {a.rounds} rounds x {a.iters} steps; "
          f"per step on rank 0 (ops, collectives): new {counts['new'][0]}, old {counts['old'][0]}")
    print(f"cores: {os.cpu_count()}; each group's ratio = mode / none in the same round and processes; "
          "new/old = median over rounds of the ratio of the two groups' ratios [quartiles]")
    summary = {}
    for m in per_round:
        v = sorted(per_round[m])
        q = lambda p: v[min(len(v) - 1, int(p * len(v)))]  # noqa: E731
        new = statistics.median(x / b for x, b in zip(own["new"][m], own["new"]["none"]))
        old = statistics.median(x / b for x, b in zip(own["old"][m], own["old"]["none"]))
        summary[m] = {"new_over_old": statistics.median(v), "q1": q(0.25), "q3": q(0.75), "new": new, "old": old}
        print(f"{m:<13} new {new:.3f}  old {old:.3f}  new/old {statistics.median(v):.3f} [{q(0.25):.3f}, {q(0.75):.3f}]")
    print(f"untraced ms/step: new {statistics.median(own['new']['none']) * 1e3:.2f}, "
          f"old {statistics.median(own['old']['none']) * 1e3:.2f}")
    return summary


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ranks", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=11)
    ap.add_argument("--iters", type=int, default=5)
    ap.add_argument("--runs", type=int, default=3, help="fresh rank processes per run (memory layouts differ)")
    ap.add_argument("--against", metavar="REV", help="time this tree against git revision REV (a worktree)")
    ap.add_argument("--verification", action="store_true", help="time the recorder's checks (see above)")
    a = ap.parse_args(argv)
    if a.against:
        return compare(a)
    if a.verification:
        return verification(a)
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
