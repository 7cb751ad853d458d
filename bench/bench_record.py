"""What recording a torchrun job costs: the same 4-rank job (tests/data/jobs/conv_job.py: the 3-conv net sharded
over a 2 x 2 mesh, a plain DTensor MLP, gradients averaged over ddp, SGD) run unrecorded, with the notebook's
recorder in the process (``sharddbg.record()`` around the steps: events kept in memory), under
``sharddbg record`` (the same recorder, streaming to a file per rank), and under ``sharddbg record --steps``
with a window the job never reaches (nothing recorded: the cost of being ready).

Each launch is a fresh torchrun; modes rotate round by round. The step time is rank 0's wall time per step
(the first ``--warmup`` steps left out); the ratio of a mode is the median of its per-round ratios to the
unrecorded run of the same round. For ``sharddbg record``: the longest piece of a flush (the time the rank's
background thread held the GIL without giving it back: the most a step waits for it), the largest whole flush
(formatting and writing, in pieces) and the bytes written per rank.

    OMP_NUM_THREADS=1 .venv/bin/python bench/bench_record.py --rounds 3 --steps 20
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
from sharddbg import job_files  # noqa: E402

JOB = REPO / "tests" / "data" / "jobs" / "conv_job.py"
TORCHRUN = str(Path(sys.executable).parent / "torchrun")
MODES = ("unrecorded", "notebook recorder", "sharddbg record", "record, outside the window")


def launch(mode: str, steps: int, workdir: Path, index: int, nproc: int = 4, device: str = "cpu") -> dict:
    times = workdir / f"times-{index}.json"
    job = [TORCHRUN, "--standalone", "--nproc-per-node", str(nproc), str(JOB), "--steps", str(steps), "--step-times",
           str(times), "--device", device]
    out = workdir / f"run-{index}"
    if mode == "unrecorded":
        command = job
    elif mode == "notebook recorder":
        command = job + ["--in-process-recorder"]
    elif mode == "sharddbg record":
        command = [sys.executable, "-m", "sharddbg.cli", "record", "--out", str(out), "--"] + job
    else:
        command = [sys.executable, "-m", "sharddbg.cli", "record", "--out", str(out), "--steps", "100000:100000",
                   "--"] + job
    env = dict(os.environ, OMP_NUM_THREADS="1")
    env["PYTHONPATH"] = str(REPO) + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    done = subprocess.run(command, capture_output=True, text=True, env=env, cwd=str(JOB.parent))
    if done.returncode != 0:
        raise SystemExit(f"{mode}: exit status {done.returncode}\n{done.stderr[-3000:]}")
    result = {"times": json.loads(times.read_text())}
    if mode == "record, outside the window":
        # sharddbg's own CPU time in each rank (its background thread, its step hook) over the rank's life: what
        # being ready costs, measured in the process itself, free of the launch-to-launch noise of step times
        shares = []
        for stream in sorted(out.glob("rank-*.arrows")):
            lines = job_files.stream_lines(str(stream))
            head, end = lines[0]["header"], lines[-1]["end"]
            wall_ms = (end["t_ns"] - head["clock"]["t_start_ns"]) / 1e6
            own = end["sharddbg_cpu_ms"]
            shares.append((own["background"] + own["step_hook"]) / wall_ms)
        result["own_cpu_share"] = max(shares)
    if mode == "sharddbg record":
        flushes, pieces, sizes = [], [], []
        for stream in sorted(out.glob("rank-*.arrows")):
            last = job_files.stream_lines(str(stream))[-1]
            flushes.append(last["end"]["largest_flush_ms"])
            pieces.append(last["end"]["largest_piece_ms"])
            sizes.append(stream.stat().st_size)
        result.update(largest_flush_ms=max(flushes), largest_piece_ms=max(pieces), bytes_per_rank=statistics.median(sizes))
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--nproc", type=int, default=4, help="ranks (an even number: a 2 x n/2 mesh; odd: 1 x n)")
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda"), help="cuda: one GPU per rank, NCCL")
    parser.add_argument("--modes", default=";".join(MODES),
                        help=f"which modes, separated by semicolons (the unrecorded one always runs): {', '.join(MODES)}")
    args = parser.parse_args()
    modes = tuple(m for m in MODES if m == "unrecorded" or m in args.modes.split(";"))
    unknown = set(args.modes.split(";")) - set(MODES)
    if unknown:
        parser.error(f"--modes: unknown {sorted(unknown)}; choose among {', '.join(MODES)}")
    import torch

    print(f"{platform.node()}, {os.cpu_count()} cores, Python {platform.python_version()}, torch {torch.__version__}, "
          f"{time.strftime('%Y-%m-%d %H:%M')}; {args.nproc} {args.device} ranks; {args.rounds} rounds x {len(modes)} "
          f"modes x {args.steps} steps "
          f"(first {args.warmup} left out)")
    ratios: dict[str, list[float]] = {m: [] for m in modes}
    step_ms: dict[str, list[float]] = {m: [] for m in modes}
    flush, piece, size, own_share = [], [], [], []
    with tempfile.TemporaryDirectory() as tmp:
        workdir = Path(tmp)
        index = 0
        for r in range(args.rounds):
            order = modes[r % len(modes):] + modes[:r % len(modes)]
            here = {}
            for mode in order:
                index += 1
                result = launch(mode, args.steps, workdir, index, args.nproc, args.device)
                here[mode] = statistics.median(result["times"][args.warmup:])
                if "own_cpu_share" in result:
                    own_share.append(result["own_cpu_share"])
                if "largest_flush_ms" in result:
                    flush.append(result["largest_flush_ms"])
                    piece.append(result["largest_piece_ms"])
                    size.append(result["bytes_per_rank"])
            for mode in modes:
                step_ms[mode].append(here[mode])
                ratios[mode].append(here[mode] / here["unrecorded"])
            print(f"round {r + 1}: " + ", ".join(f"{m} {here[m]:.1f} ms" for m in modes), flush=True)
    print()
    print("| mode | median step ms | ratio to unrecorded (median of rounds) [min, max] |")
    print("|---|---|---|")
    for mode in modes:
        rs = ratios[mode]
        print(f"| {mode} | {statistics.median(step_ms[mode]):.1f} | {statistics.median(rs):.3f} "
              f"[{min(rs):.3f}, {max(rs):.3f}] |")
    if own_share:
        print(f"\nrecord, outside the window: sharddbg's own CPU time (its background thread and step hook) is "
              f"{100 * max(own_share):.3f} % of a rank's life at most (median over runs "
              f"{100 * statistics.median(own_share):.3f} %): about the share of a step it can take")
    if not piece:
        return
    print(f"\nsharddbg record: the most CPU time the background thread ran between two hand-overs of the GIL "
          f"{max(piece):.2f} ms (median over runs {statistics.median(piece):.2f} ms)")
    print(f"sharddbg record: largest flush of any rank {max(flush):.1f} ms (median over runs "
          f"{statistics.median(flush):.1f} ms); stream {statistics.median(size) / 1024:.0f} KiB per rank for "
          f"{args.steps} steps")


if __name__ == "__main__":
    main()
