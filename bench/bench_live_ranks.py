"""A big trace from live ranks: a real cluster of many CPU ranks starts, traces a cell, and the trace is gathered,
analysed, saved, loaded and checked, and the cluster stops.

    OMP_NUM_THREADS=1 .venv/bin/python bench/bench_live_ranks.py [--ranks 16] [--steps 40] [--folder DIR]

The cell runs the sharded 3-conv net (``bench_memory.py``'s: convs with their halo exchange, backward with its
gradient reductions) forward and backward ``--steps`` times on every rank, under the recorder. Every step is
the same work on every rank, so the per-rank counts must agree; the checks below fail the run (exit 1) where they
do not. Measured, wall and CPU seconds of this process (the client; the ranks' own time is in the wall time of
``trace``): the start, the traced cell (recording, stopping the recorders, gathering every rank's payload,
building the Trace), ``get_ops()``, ``get_collectives()``, ``get_op_summary()``, ``get_comm_by_op()``, the save as
``.sdtrace.arrow``, ``load_trace`` of it, and the stop. With ``--untraced`` the same cell runs untraced first, and
the traced cell's wall time is printed as a ratio of it (what recording, gathering and building the trace add).

Checks (correctness, not speed): every rank is in the trace, complete, nothing dropped; every rank recorded the
same number of op calls and of collectives; every step's collectives completed; the loaded file gives the same
ops and collectives tables as the live trace (``assert_frame_equal(check_exact=True)``); the bytes each rank's
collectives moved add up on the two sides (what a rank sent to its neighbours in point-to-point halo
exchanges, each neighbour received).
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
import tempfile
import time

os.environ.setdefault("OMP_NUM_THREADS", "1")
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

SETUP = """
import torch, torch.nn as nn
torch.manual_seed(0)
_x = sharddbg.engine.scatter(torch.randn(1, 8, {rows}, 64), dim=2)
_net = nn.Sequential(nn.Conv2d(8, 16, 3, padding=1), nn.ReLU(), nn.Conv2d(16, 16, 3, padding=1), nn.ReLU(),
                     nn.Conv2d(16, 8, 3, padding=1))
def _step():
    _net.zero_grad(set_to_none=True)
    _net(_x).square().mean().backward()
_step()
"""


class Clock:
    """Wall and CPU seconds of this process since it was made."""

    def __init__(self) -> None:
        self.wall, self.cpu = time.perf_counter(), time.process_time()

    def read(self) -> tuple[float, float]:
        return time.perf_counter() - self.wall, time.process_time() - self.cpu


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ranks", type=int, default=16)
    ap.add_argument("--steps", type=int, default=40, help="forward + backward steps of the net in the traced cell")
    ap.add_argument("--folder", default=None, help="where the trace file goes (default: a temporary folder)")
    ap.add_argument("--untraced", action="store_true",
                    help="run the same cell untraced first: the cell's own time, beside which the traced one is read")
    a = ap.parse_args(argv)
    import pandas as pd
    import torch

    import sharddbg
    from sharddbg.trace import load_trace

    failures: list[str] = []

    def note(what: str, clock: Clock, extra: str = "") -> None:
        wall, cpu = clock.read()
        print(f"{what:48s} {wall:8.2f} s wall {cpu:8.2f} s CPU {extra}", flush=True)

    def check(ok: bool, what: str) -> None:
        print(f"  {'ok  ' if ok else 'FAIL'} {what}", flush=True)
        if not ok:
            failures.append(what)

    print(f"{a.ranks} CPU ranks (gloo), sharded 3-conv net, {a.steps} steps; {os.cpu_count()} cores, torch "
          f"{torch.__version__}, {platform.node()}, {time.strftime('%Y-%m-%d %H:%M')}, load average "
          f"{tuple(round(x, 1) for x in os.getloadavg())}", flush=True)
    folder = a.folder or tempfile.mkdtemp(prefix="sharddbg-live-ranks-")
    c = Clock()
    cl = sharddbg.Cluster(n=a.ranks, timeout=1800)
    cl.start()
    try:
        note("start", c)
        cl.run(SETUP.format(rows=8 * a.ranks), timeout=1800, display=False)
        cell = f"for _ in range({a.steps}):\n    _step()"
        untraced = None
        if a.untraced:
            c = Clock()
            cl.run(cell, timeout=3600, display=False)
            untraced = c.read()[0]
            note("the same cell, untraced", c)
        c = Clock()
        t = cl.trace(cell, display=False, timeout=3600)
        traced = c.read()[0]
        note("trace the cell (record, stop, gather, build)", c,
             f"{traced / untraced:.2f}x the untraced cell" if untraced else "")
        c = Clock()
        ops = t.get_ops()
        note("get_ops()", c, f"{len(ops)} op calls")
        c = Clock()
        colls = t.get_collectives()
        note("get_collectives()", c, f"{len(colls)} collectives")
        c = Clock()
        t.get_op_summary()
        note("get_op_summary()", c)
        c = Clock()
        t.get_comm_by_op()
        note("get_comm_by_op()", c)
        path = os.path.join(folder, "live.sdtrace.arrow")
        c = Clock()
        t.save(path)
        note("save .sdtrace.arrow", c, f"{os.path.getsize(path) / 2**20:.1f} MiB")
        c = Clock()
        loaded = load_trace(path)
        note("load_trace", c)
        print(f"{len(ops) + len(colls)} events over {len(t.ranks)} ranks", flush=True)

        check(t.ranks == list(range(a.ranks)), f"every rank is in the trace ({t.ranks})")
        check(not t.incomplete_ranks and not t.dropped, "every rank complete, nothing dropped")
        per_rank_ops = ops.groupby("rank").size()
        per_rank_colls = colls.groupby("rank").size()
        check(per_rank_ops.nunique() == 1, f"the same number of op calls on every rank ({per_rank_ops.min()}"
              f"-{per_rank_ops.max()})")
        # the first and last shards have one neighbour, the others two: collectives agree within those two groups
        inner = per_rank_colls.iloc[1:-1]
        check(inner.nunique() <= 1 and per_rank_colls.iloc[0] == per_rank_colls.iloc[-1],
              f"the same number of collectives on every inner rank and on both edge ranks "
              f"({per_rank_colls.to_dict() if len(per_rank_colls) <= 4 else (per_rank_colls.min(), per_rank_colls.max())})")
        check(bool((colls["state"] == "completed").all()), "every collective completed")
        check(int(colls["bytes_sent"].fillna(0).sum()) == int(colls["bytes_recv"].fillna(0).sum()),
              "bytes sent over all ranks equal bytes received")
        pd.testing.assert_frame_equal(loaded.get_ops(), ops, check_exact=True)
        pd.testing.assert_frame_equal(loaded.get_collectives(), colls, check_exact=True)
        check(True, "the loaded file gives the live trace's ops and collectives, exactly")
    finally:
        c = Clock()
        cl.stop()
        note("stop", c)
    if failures:
        print(f"{len(failures)} check(s) failed: {failures}")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
