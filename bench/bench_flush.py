"""How long a stream flush makes the job's own thread wait: the events of real steps (tests/data/jobs/conv_job.py,
the 3-conv net and the plain DTensor MLP, on a world of one process) are flushed again and again by the stream
writer on a background thread, as a recorded job's background thread does, while the main thread runs small
torch ops (each gives the GIL up and takes it back, as a training step's ops do). The main thread's longest gap
between two ops, and its 99.9th percentile, against the same loop with no flush running: the difference is what
a flush stalls a step.

    OMP_NUM_THREADS=1 .venv/bin/python bench/bench_flush.py --steps 20 --seconds 5
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests" / "data" / "jobs"))


def record_steps(steps: int):
    """A closed recorder holding ``steps`` recorded training steps of conv_job on a world of one."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=os.environ.get("PORT", "29787"), RANK="0",
                      WORLD_SIZE="1", LOCAL_RANK="0")
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo")
    import conv_job
    import physicsnemo.domain_parallel as pdp
    from torch.distributed.device_mesh import init_device_mesh

    import sharddbg

    pdp.register_custom_ops()
    mesh = init_device_mesh("cpu", (1, 1), mesh_dim_names=("ddp", "domain"))
    conv_job.fill_distributed_manager(mesh)
    model = conv_job.build_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    with sharddbg.record() as rec:
        for step in range(1, steps + 1):
            conv_job.train_step(model, opt, mesh, step)
    return rec


def main_thread_gaps(seconds: float, flushing: threading.Event | None) -> list[float]:
    """Gaps (ms) between consecutive small ops of the main thread for ``seconds`` (only while ``flushing`` is set,
    when given)."""
    import torch

    a, b = torch.ones(64), torch.ones(64)
    gaps = []
    end = time.perf_counter() + seconds
    last = time.perf_counter()
    while last < end:
        torch.add(a, b)
        now = time.perf_counter()
        if flushing is None or flushing.is_set():
            gaps.append((now - last) * 1e3)
        last = now
    return gaps


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=20, help="recorded steps: the events of one flush")
    parser.add_argument("--seconds", type=float, default=5.0, help="how long each loop runs")
    parser.add_argument("--jsonl", action="store_true", help="write JSON lines (stream version 1) instead of Arrow")
    args = parser.parse_args()
    import torch

    from sharddbg.engine.jobs.stream import RankStreamWriter

    rec = record_steps(args.steps)
    events = len(rec.buffer)
    print(f"{platform.node()}, {os.cpu_count()} cores, Python {platform.python_version()}, torch {torch.__version__}, "
          f"{time.strftime('%Y-%m-%d %H:%M')}; {events} events per flush ({args.steps} steps of conv_job)")
    quiet = main_thread_gaps(args.seconds, None)

    flushing, stop = threading.Event(), threading.Event()
    flush_ms: list[float] = []
    with tempfile.TemporaryDirectory() as tmp:
        # --jsonl: the JSON lines of stream version 1, to compare
        writer = RankStreamWriter(os.path.join(tmp, "rank-00000" + (".jsonl" if args.jsonl else ".arrows")))
        # a job's writer writes its header line when the recording starts, before any flush (an Arrow stream
        # imports pyarrow then, about 0.4 s): a line first, so that the flushes measured are the job's
        writer.write_lines([{"clock": {"offset_ns": 0, "uncertainty_ns": 0}}])

        def flush_again_and_again() -> None:
            while not stop.is_set():
                writer._scanned = 0  # the same events once more
                flushing.set()
                t0 = time.perf_counter()
                writer.flush(rec, 1)
                flush_ms.append((time.perf_counter() - t0) * 1e3)
                flushing.clear()
                time.sleep(0.05)

        thread = threading.Thread(target=flush_again_and_again, daemon=True)
        thread.start()
        busy = main_thread_gaps(args.seconds, flushing)
        stop.set()
        thread.join()
        writer.close()

    def q(values, p):
        return statistics.quantiles(values, n=1000)[int(p * 1000) - 1] if len(values) > 1000 else max(values)

    print(f"\nflushes: {len(flush_ms)}, each {statistics.median(flush_ms):.1f} ms (median) for {events} events; "
          f"the longest the writer held the GIL without giving it back: {writer.largest_piece_ms:.2f} ms")
    print("| main thread's gap between two ops | median ms | 99.9th percentile ms | longest ms |")
    print("|---|---|---|---|")
    for name, gaps in (("no flush running", quiet), ("while a flush runs", busy)):
        print(f"| {name} | {statistics.median(gaps):.3f} | {q(gaps, 0.999):.3f} | {max(gaps):.3f} |")
    print(f"\nthe longest stall a flush added: {max(busy) - max(quiet):.2f} ms; at the 99.9th percentile "
          f"{q(busy, 0.999) - q(quiet, 0.999):.2f} ms")


if __name__ == "__main__":
    main()
