"""Cold start to ready, restart (fork server kept) and stop of a cluster (dist up, physicsnemo imported, patches
registered).

Prints one table: median of several runs of each phase, and the ratio of start/stop to the targets
(ready <= 15 s, stop <= 3 s). Also the naive path for comparison in the same run: 4 plain processes that
each import physicsnemo and register its patches at once (what one engine per rank would pay without
the fork server).

    .venv/bin/python bench/bench_cluster.py [--runs 5] [-n 4] [--restarts 2]

With ``--detached``: a cluster outside the notebook instead, each run: ``sharddbg cluster start`` from a new
process (to the moment it returns, the cluster up), three ``Cluster.connect`` + ``disconnect`` in this process
(sharddbg imported: a kernel that reconnects), one connect from a new Python that imports sharddbg first (a
restarted kernel's first cell), and ``sharddbg cluster stop``.

    .venv/bin/python bench/bench_cluster.py --detached [--runs 3] [-n 2]
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time

NAIVE = ("import torch; torch.set_num_threads(1); import physicsnemo, physicsnemo.distributed;"
         "import physicsnemo.domain_parallel as dp; dp.register_custom_ops()")


def naive_parallel_import(n: int) -> float:
    env = dict(os.environ, OMP_NUM_THREADS="1")
    t0 = time.perf_counter()
    procs = [subprocess.Popen([sys.executable, "-c", NAIVE], env=env, stderr=subprocess.DEVNULL) for _ in range(n)]
    for p in procs:
        p.wait()
    return time.perf_counter() - t0


FRESH_CONNECT = ("import time; t0 = time.perf_counter(); import sharddbg; cl = sharddbg.Cluster.connect({name!r}); "
                 "print(time.perf_counter() - t0); cl.disconnect()")


def bench_detached(runs: int, n: int) -> None:
    """Detached start, reconnects and stop (see the module's docstring)."""
    import sharddbg

    cli = [sys.executable, "-m", "sharddbg.cli", "cluster"]
    times: dict[str, list[float]] = {"start": [], "connect": [], "fresh": [], "stop": []}
    for run in range(runs):
        name = f"bench-{os.getpid()}-{run}"
        t0 = time.perf_counter()
        subprocess.run([*cli, "start", "-n", str(n), "--name", name, "--force"], check=True, capture_output=True)
        times["start"].append(time.perf_counter() - t0)
        try:
            for _ in range(3):
                t0 = time.perf_counter()
                cl = sharddbg.Cluster.connect(name)
                times["connect"].append(time.perf_counter() - t0)
                cl.disconnect()
            fresh = subprocess.run([sys.executable, "-c", FRESH_CONNECT.format(name=name)], check=True,
                                   capture_output=True, text=True)
            times["fresh"].append(float(fresh.stdout.split()[-1]))
        finally:
            t0 = time.perf_counter()
            subprocess.run([*cli, "stop", name], check=True, capture_output=True)
            times["stop"].append(time.perf_counter() - t0)
    print(f"machine: {os.cpu_count()} cores, python {sys.version.split()[0]}, n={n} ranks, {runs} runs, "
          f"load {os.getloadavg()[0]:.1f}")
    print(f"{'phase':<52} {'median s':>9} {'min s':>7} {'max s':>7}")
    for label, key in (("sharddbg cluster start (new process, to up)", "start"),
                       ("Cluster.connect, sharddbg imported", "connect"),
                       ("new Python: import sharddbg + Cluster.connect", "fresh"),
                       ("sharddbg cluster stop (nothing left)", "stop")):
        values = times[key]
        print(f"{label:<52} {statistics.median(values):>9.2f} {min(values):>7.2f} {max(values):>7.2f}")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("-n", type=int, default=4)
    parser.add_argument("--restarts", type=int, default=2, help="restart() calls per run (fork server kept)")
    parser.add_argument("--detached", action="store_true", help="a cluster outside the notebook: start, connect, stop")
    args = parser.parse_args()
    if args.detached:
        bench_detached(args.runs, args.n)
        return
    import sharddbg

    phases: dict[str, list[float]] = {}
    parts: dict[str, list[float]] = {}
    for _ in range(args.runs):
        cl = sharddbg.Cluster(n=args.n)
        cl.start()
        assert cl.eval("dist.get_world_size()") == [args.n] * args.n
        backend = cl.backend
        for key, value in cl.timings.items():
            phases.setdefault(key, []).append(value)
        # what sharddbg controls in a cold start: everything but torch's and physicsnemo's own imports
        own = cl.timings["start_s"] - cl.facts.get("t_torch_s", 0.0) - cl.facts.get("t_physicsnemo_s", 0.0)
        phases.setdefault("own_start_s", []).append(own)
        for _ in range(args.restarts):
            cl.restart()
            assert cl.eval("dist.get_world_size()") == [args.n] * args.n
            phases.setdefault("restart_s", []).append(cl.timings["restart_s"])
            phases.setdefault("restart_engines_s", []).append(cl.timings["engines_s"])
            phases.setdefault("restart_dist_init_s", []).append(cl.timings["dist_init_s"])
        cl.stop()
        phases.setdefault("stop_s", []).append(cl.timings["stop_s"])
        # the fork server's preload, part by part (imports, patches, the GPU count probe beside them)
        for key, value in cl.facts.items():
            if key.startswith("t_") and isinstance(value, (int, float)):
                parts.setdefault(key, []).append(value)
    naive = [naive_parallel_import(args.n) for _ in range(max(2, args.runs // 2))]
    med = {k: statistics.median(v) for k, v in phases.items()}
    print(f"machine: {os.cpu_count()} cores, python {sys.version.split()[0]}, n={args.n} ranks ({backend}), "
          f"{args.runs} runs")
    print(f"{'phase':<44} {'median s':>9} {'min s':>7} {'max s':>7}")
    rows = [("fork server preload (torch+physicsnemo+patches)", "preload_s"),
            ("controller start (overlaps the preload)", "controller_s"),
            ("engines forked and registered", "engines_s"),
            ("torch.distributed + mesh on every rank", "dist_init_s"),
            ("cold start to ready (total)", "start_s"),
            ("  of it sharddbg's own (all but torch/physicsnemo imports)", "own_start_s"),
            ("restart(), fork server kept (total)", "restart_s"),
            ("  restart: controller, engines forked and registered", "restart_engines_s"),
            ("  restart: torch.distributed + mesh", "restart_dist_init_s"),
            ("stop (nothing left running)", "stop_s")]
    for label, key in rows:
        if key not in phases:
            continue
        values = phases[key]
        print(f"{label:<44} {med[key]:>9.2f} {min(values):>7.2f} {max(values):>7.2f}")
    print(f"{'naive: %d processes import + register at once' % args.n:<44} {statistics.median(naive):>9.2f} "
          f"{min(naive):>7.2f} {max(naive):>7.2f}")
    for key, values in parts.items():
        print(f"{'  preload part ' + key:<44} {statistics.median(values):>9.2f} {min(values):>7.2f} {max(values):>7.2f}")
    print()
    print(f"ratio start / 15 s target:            {med['start_s'] / 15:.2f}")
    print(f"ratio stop / 3 s target:              {med['stop_s'] / 3:.2f}")
    print(f"ratio own start / 3 s target:         {med['own_start_s'] / 3:.2f}")
    if "restart_s" in med:
        print(f"ratio restart / 5 s target:           {med['restart_s'] / 5:.2f}")
    print(f"ratio naive import / fork-server preload: {statistics.median(naive) / med['preload_s']:.2f}")


if __name__ == "__main__":
    main()
