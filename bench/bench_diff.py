"""What ``cl.diff`` costs beside ``cl.check`` on the demo net: wall time, peak memory on the ranks and in the
single-device reference process, and what the diff says it keeps.

    OMP_NUM_THREADS=1 .venv/bin/python bench/bench_diff.py [--ranks 4] [--rows 66] [--cols 64] [--repeats 3]

One real cluster (CPU + gloo here). The demo's 3-conv net on one sample of (1, 3, rows, cols), sharded along
the rows. Each of ``check``, ``diff`` (every op, forward and backward) and ``diff(grads=False)`` runs
``--repeats`` times (after one warm-up run each); the table gives the median and the fastest wall time, the
largest peak RSS growth of a rank over the call (each rank's high-water mark reset first, read from
``/proc/self/status`` VmHWM), the reference process's peak RSS (``RUSAGE_CHILDREN``, the largest child so far:
check runs first, so a larger value after the diff is the diff's), and the diff's own accounting of what it kept.
"""

from __future__ import annotations

import argparse
import os
import platform
import resource
import statistics
import sys
import time

os.environ.setdefault("OMP_NUM_THREADS", "1")
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

SETUP = """
torch.manual_seed(0)
bx = sharddbg.engine.scatter(torch.randn(1, 3, {rows}, {cols}), dim=2, requires_grad=True)
bnet = nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), nn.ReLU(), nn.Conv2d(4, 4, 3, padding=1), nn.ReLU(),
                     nn.Conv2d(4, 2, 3, padding=1))
def _bench_reset_peak():
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
def _bench_rss_kib(field):
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(field))
"""


def _measure(cl, call) -> tuple[float, float, object]:
    """(seconds, the largest peak RSS growth of a rank over the call in MiB, the call's result)."""
    cl.run("_bench_reset_peak(); _bench_before = _bench_rss_kib('VmRSS:')", timeout=60)
    t0 = time.perf_counter()
    result = call()
    seconds = time.perf_counter() - t0
    growth = max(cl.eval("_bench_rss_kib('VmHWM:') - _bench_before")) / 1024
    return seconds, growth, result


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--ranks", type=int, default=4)
    parser.add_argument("--rows", type=int, default=66)
    parser.add_argument("--cols", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    import sharddbg

    stmt = "by = bnet(bx)"
    cl = sharddbg.Cluster(n=args.ranks, mesh={"ddp": 1, "domain": args.ranks}, timeout=300).start()
    try:
        cl.run(SETUP.format(rows=args.rows, cols=args.cols), timeout=120)
        cases = [("check", lambda: cl.check(stmt, display=False)),
                 ("diff", lambda: cl.diff(stmt, display=False)),
                 ("diff, grads=False", lambda: cl.diff(stmt, grads=False, display=False))]
        rows = []
        for name, call in cases:
            call()  # warm-up
            runs = [_measure(cl, call) for _ in range(args.repeats)]
            child_peak = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024
            result = runs[-1][2]
            kept = ""
            if hasattr(result, "memory"):
                kept = (f"{result.memory['rank_bytes'] / 1024:.0f} KiB per rank, "
                        f"{result.memory['reference_bytes'] / 1024:.0f} KiB whole outputs")
            rows.append((name, statistics.median(r[0] for r in runs), min(r[0] for r in runs),
                         max(r[1] for r in runs), child_peak, kept))
        import torch  # noqa: F401 - the versions only (the ranks and the reference have their own)

        print(f"{args.ranks} ranks, input (1, 3, {args.rows}, {args.cols}), {args.repeats} runs each; Python "
              f"{platform.python_version()}, torch {torch.__version__}, load {os.getloadavg()[0]:.1f}")
        print("| call | median s | min s | rank peak RSS growth, MiB | reference peak RSS so far, MiB | the diff keeps |")
        print("|---|---|---|---|---|---|")
        for name, med, low, growth, child, kept in rows:
            print(f"| {name} | {med:.2f} | {low:.2f} | {growth:.1f} | {child:.0f} | {kept} |")
    finally:
        cl.stop()


if __name__ == "__main__":
    main()
