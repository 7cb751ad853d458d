"""What the wait after a traced cell is made of on the engines and the client, measured on a live cluster.

- default: the recorder formatting its records (``export.records``) on each engine of a ``--ranks`` cluster, after
  ``cl.trace`` of a cell of sharded adds and multiplies recording ``--events`` records per rank: this checkout's
  ``export.py`` and another one's (``--before-export``, e.g. ``git show REV:sharddbg/engine/recorder/export.py``),
  alternated ``--repeats`` times on the same recording in each engine, their CPU seconds, and whether the two made
  the same records (compared with ``==``); then again with the cyclic collector off (the formatting without the
  collection that walks its new records when the collector is back on);
- ``--clock-offsets``: ``ControlChannel.clock_offsets`` as the trace takes them (known for the ranks that read the
  client's own clock), measured with each rank asked in turn (``measure_all``), and with every rank asked at once in
  each round (the reply's arrival time taken where the client receives it), alternated: wall time and the
  uncertainty each gives (half its best round trip; 0 where known), and whether their offsets agree within their
  uncertainties.

    OMP_NUM_THREADS=1 .venv/bin/python bench/bench_format_records.py --before-export /tmp/export_before.py
    OMP_NUM_THREADS=1 .venv/bin/python bench/bench_format_records.py --clock-offsets --ranks 8
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--events", type=int, default=10_000, help="records per rank (formatting)")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--before-export", type=Path, help="the export.py to compare this checkout's with")
    ap.add_argument("--clock-offsets", action="store_true", help="measure the clock offsets instead")
    args = ap.parse_args(argv)
    if args.clock_offsets:
        return clock_offsets(args.ranks, args.repeats)
    if args.before_export is None or not args.before_export.is_file():
        ap.error(f"--before-export: no such file: {args.before_export}")
    return formatting(args.ranks, args.events, args.repeats, args.before_export.resolve())


def formatting(n_ranks: int, n_events: int, repeats: int, before: Path) -> int:
    import sharddbg

    cl = sharddbg.Cluster(n=n_ranks, timeout=300)
    cl.start()
    try:
        rows = 8 * n_ranks
        cl.run(f"x = sharddbg.engine.scatter(torch.arange({4.0 * rows}).reshape(1, 1, {rows}, 4), dim=2)", display=False)
        # the before module is loaded inside the recorder package, so that its relative imports resolve; the
        # recording's own stop calls the wrapper, which formats the recording both ways before it returns
        cl.run(f"""
import gc, importlib.util, time
from sharddbg.engine.recorder import export as _export
_spec = importlib.util.spec_from_file_location("sharddbg.engine.recorder._export_before", {str(before)!r})
_before = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_before)
_after_records = _export.records
_compared = []
def _both(rec, include_in_flight):
    if include_in_flight:
        return _after_records(rec, include_in_flight)
    cpu = {{"before": [], "after": [], "before, collector off": [], "after, collector off": []}}
    same = True
    for collector in ("", ", collector off"):
        for _ in range({repeats}):
            made = {{}}
            for side, records in (("before", _before.records), ("after", _after_records)):
                if collector:  # the formatting alone, without the collection of its records when it ends
                    gc.disable()
                t = time.process_time()
                made[side] = records(rec, include_in_flight)
                cpu[side + collector].append(time.process_time() - t)
                gc.enable()
            same = same and made["before"] == made["after"]
    _compared.append({{"records": len(made["after"]), "same": same, **cpu}})
    return made["after"]
_export.records = _both
""", display=False)
        cell = f"for _ in range({n_events // 2}):\n    y = x + 1\n    y = y * 2\n"
        cl.trace(cell, display=False)
        for rank, (compared,) in enumerate(cl.eval("_compared")):
            for collector in ("", ", collector off"):
                b, a = compared["before" + collector], compared["after" + collector]
                print(f"rank {rank}{collector}: {compared['records']} records formatted, before "
                      f"{statistics.median(b):.3f} s CPU (min {min(b):.3f}), after {statistics.median(a):.3f} s (min "
                      f"{min(a):.3f}); ratio of the medians {statistics.median(a) / statistics.median(b):.2f}; the same "
                      f"records: {compared['same']}", flush=True)
        print(f"{n_ranks} ranks, {os.cpu_count()} cores, load average {os.getloadavg()}")
        return 0
    finally:
        cl.stop()


def _all_at_once(channel, samples: int = 15, timeout: float = 5.0) -> dict[int, dict]:
    """``clock_offsets`` with every rank asked at once in each of ``samples`` rounds: a reply's arrival time is
    taken where the client's receiving thread completes its future."""
    from sharddbg.engine import api

    ranks = range(len(channel.engine_ids))
    best: dict[int, tuple[int, int]] = {}
    for _ in range(samples):
        sent, arrived, futures = {}, {}, {}
        for rank in ranks:
            sent[rank] = time.monotonic_ns()
            futures[rank] = channel._send(rank, api.CLOCK_REQUEST, None)
            futures[rank].add_done_callback(lambda _f, rank=rank: arrived.__setitem__(rank, time.monotonic_ns()))
        deadline = time.monotonic() + timeout
        for rank, future in futures.items():
            reply = future.result(timeout=max(0.01, deadline - time.monotonic()))["content"]
            t0, t1 = sent[rank], arrived.get(rank) or time.monotonic_ns()
            if rank not in best or t1 - t0 < best[rank][0]:
                best[rank] = (t1 - t0, int(reply["now_ns"]) - (t0 + t1) // 2)
    return {r: {"offset_ns": offset, "uncertainty_ns": round_trip // 2} for r, (round_trip, offset) in best.items()}


def clock_offsets(n_ranks: int, repeats: int) -> int:
    import sharddbg

    cl = sharddbg.Cluster(n=n_ranks, timeout=300)
    cl.start()
    try:
        channel = cl._control
        ways = {"known on one host (now)": channel.clock_offsets,
                "each rank in turn": lambda: channel.clock_offsets(measure_all=True),
                "every rank at once": lambda: _all_at_once(channel)}
        walls: dict[str, list[float]] = {w: [] for w in ways}
        measured: dict[str, list[dict]] = {w: [] for w in ways}
        for _ in range(repeats):
            for way, measure in ways.items():
                t = time.perf_counter()
                measured[way].append(measure())
                walls[way].append(time.perf_counter() - t)
        for way in ways:
            uncertainty_us = [o["uncertainty_ns"] / 1e3 for run in measured[way] for o in run.values()]
            print(f"{way}: {n_ranks} ranks, {statistics.median(walls[way]) * 1e3:.0f} ms wall (min "
                  f"{min(walls[way]) * 1e3:.0f}, max {max(walls[way]) * 1e3:.0f}); uncertainty median "
                  f"{statistics.median(uncertainty_us):.0f} us, max {max(uncertainty_us):.0f} us", flush=True)
        # every pair of measurements of a rank must agree within the sum of their uncertainties
        beyond = max(abs(a["offset_ns"] - b["offset_ns"]) - a["uncertainty_ns"] - b["uncertainty_ns"]
                     for r in range(n_ranks) for runs_a in measured.values() for runs_b in measured.values()
                     for a in (run[r] for run in runs_a) for b in (run[r] for run in runs_b))
        print(f"largest disagreement beyond the two uncertainties: {beyond / 1e3:.1f} us (0 or less: they agree); "
              f"{os.cpu_count()} cores, load average {os.getloadavg()}")
        return 0
    finally:
        cl.stop()


if __name__ == "__main__":
    sys.exit(main())
