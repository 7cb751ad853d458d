"""The whole smoke matrix (``Cluster.smoke``) on a CPU cluster: every configuration of the ShardTensor checklist
(single device; ddp=N; domain=N; ddp x domain with DDP and with FSDP2; FSDP2 with ddp=1; each with and without
torch.compile; inference only; a batch of 2 per domain group; the invalid mesh that must fail), on a small
3-conv net, against the same net trained on a single device. CI runs the reduced matrix (tests/test_smoke.py);
this runs the whole one by hand.

Prints the view as text (the verdict, one row per configuration) and how long the matrix took; ``--json``
writes the table. Exits 1 when a configuration is not as expected.

    OMP_NUM_THREADS=1 .venv/bin/python bench/smoke_matrix.py [-n 4] [--steps 3] [--rows 34] [--json FILE]
"""

from __future__ import annotations

import argparse
import os
import sys
import time

ROWS = 34  # rows of the sharded axis (uneven over 4 ranks: 9, 9, 8, 8)


def setup():
    from torch import nn

    return nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(), nn.Conv2d(8, 8, 3, padding=1), nn.ReLU(),
                         nn.Conv2d(8, 2, 3, padding=1))


def step(model, ctx):
    import torch

    x = ctx.shard(torch.randn(1, 3, ROWS, 16), 2)
    return model(x).pow(2).mean()


def main() -> int:
    global ROWS
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("-n", type=int, default=4, help="ranks (default 4)")
    parser.add_argument("--steps", type=int, default=3, help="SGD steps per configuration (default 3)")
    parser.add_argument("--rows", type=int, default=ROWS, help=f"rows of the sharded axis (default {ROWS})")
    parser.add_argument("--configs", default=None, help="'reduced' for the CI matrix (default: the whole one)")
    parser.add_argument("--json", default=None, metavar="FILE", help="write the table as JSON records")
    args = parser.parse_args()
    ROWS = args.rows
    import sharddbg

    cl = sharddbg.Cluster(n=args.n, mesh={"ddp": 1, "domain": args.n}, timeout=120)
    cl.start()
    try:
        t0 = time.perf_counter()
        result = cl.smoke(setup, step, args.configs, steps=args.steps)
        took = time.perf_counter() - t0
    finally:
        cl.stop()
    print(f"machine: {os.cpu_count()} cores, python {sys.version.split()[0]}, n={args.n} ranks, "
          f"{args.steps} steps, {args.rows} rows; the matrix took {took:.1f} s")
    print(result.show().text())
    if args.json:
        result.table.reset_index().to_json(args.json, orient="records", indent=1)
        print(f"table written to {args.json}")
    return 0 if result.ok else 1


if __name__ == "__main__":
    sys.exit(main())
