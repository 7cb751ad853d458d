"""The custom-patch workflow's before/after numbers: ``torch.diff`` along a sharded dim through DTensor's fallback
against the halo handler ``sharddbg.patches.scaffold`` writes, on a real cluster (gloo CPU ranks).

    OMP_NUM_THREADS=1 .venv/bin/python bench/bench_patch.py [--ranks 4] [--channels 16] [--rows 4096 16384]
                                                           [--repeat 10]

For each size: ``cl.check_patch("torch.diff", "y = torch.diff(x, dim=2)", handler, repeat=...)`` on an input
``(1, channels, rows)`` sharded along dim 2, input gradients on. Prints, per size, the verdict and the two sides'
host ms per call (median, the first call on each rank left out), collectives and bytes received per call and
rank, and whether each side passed the check against one device.
"""

from __future__ import annotations

import argparse
import os
import sys

os.environ.setdefault("OMP_NUM_THREADS", "1")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--ranks", type=int, default=4)
    ap.add_argument("--channels", type=int, default=16)
    ap.add_argument("--rows", type=int, nargs="+", default=[4096, 16384])
    ap.add_argument("--repeat", type=int, default=10)
    a = ap.parse_args()
    import sharddbg
    from sharddbg.cluster.patching import handler_from_source
    from sharddbg.patches import scaffold

    handler = handler_from_source(scaffold("torch.diff", "halo", halo_width=1))
    with sharddbg.Cluster(n=a.ranks, mesh={"ddp": 1, "domain": a.ranks}, timeout=300) as cl:
        print(f"torch {cl.eval('torch.__version__')[0]}, {a.ranks} gloo ranks")
        for rows in a.rows:
            cl.run(f"torch.manual_seed(0)\nx = sharddbg.engine.scatter(torch.randn(1, {a.channels}, {rows}), dim=2, "
                   f"requires_grad=True)", display=False)
            r = cl.check_patch("torch.diff", "y = torch.diff(x, dim=2)", handler, inputs="x", outputs="y",
                               repeat=a.repeat)
            print(f"\n(1, {a.channels}, {rows}) float32 over {a.ranks} ranks: {r.verdict}")
            for side in (r.before, r.after):
                print(f"  {side.label:6} {', '.join(side.paths):26} {side.ms_per_call:8.3f} ms/call  "
                      f"{side.collectives_text():45} check {'passed' if side.check.ok else 'FAILED'}")


if __name__ == "__main__":
    main()
