"""Regenerate the golden traces under tests/data from a real 4-rank CPU cluster.

    OMP_NUM_THREADS=1 .venv/bin/python tests/data/make_golden.py

conv4.sdtrace.json: a (1, 3, 66, 64) sample scattered over 4 ranks along H (17, 17, 16, 16 rows), a
2-layer conv net forward and backward (conv2d through its halo handler), ``abs`` (no patch: a DTensor
fallback), ``linear`` on the sharded rows (its handler reads ``ndim``: a nested metadata read through the
fallback; no collective), and ``x + x`` with a handler registered for ``Tensor.add`` that raises a TypeError whose
message contains HTML (the escaping tests need one). The expectations of tests/test_views.py are
computed from the shapes above, not from this file.

x_snapshots.json: every rank's ``sharddbg.engine.snapshot`` of x (the shard inspector's input).

conv4_schema3.sdtrace.json: the same recording made by sharddbg at schema version 3 (kept, never rewritten:
it proves that files of an older schema still load and every analysis reads them).
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
HTML_MESSAGE = "<b>bold</b> & <script>alert('sharddbg')</script> in the add handler"

SETUP = f"""
torch.manual_seed(0)
x = sharddbg.engine.scatter(torch.randn(1, 3, 66, 64), dim=2)
net = nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), nn.ReLU(), nn.Conv2d(4, 2, 3, padding=1))
def _html_boom(func, types, args, kwargs):
    raise TypeError({HTML_MESSAGE!r})
ShardTensor.register_function_handler(torch.Tensor.add, _html_boom)
"""

CELL = """
y = net(x)
z = y.abs()
w = torch.nn.functional.linear(z, torch.ones(5, 64))
y.square().mean().backward()
try:
    x + x
except Exception as e:
    caught = type(e).__name__
"""

CLEANUP = "ShardTensor._function_registry.pop(torch.Tensor.add, None)"


def main() -> int:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    sys.path.insert(0, str(HERE.parent.parent))
    import sharddbg
    from sharddbg.trace import Trace

    with sharddbg.Cluster(n=4, mesh={"ddp": 1, "domain": 4}, timeout=120) as cl:
        cl.run(SETUP, timeout=60)
        try:
            t = cl.trace(CELL, timeout=120)
        finally:
            cl.run(CLEANUP, timeout=30)
        t = Trace.from_payloads(t.payloads, t.clock_offsets_ns, incomplete_ranks=t.incomplete_ranks,
                                meta={**t.meta, "golden": "conv4: see tests/data/make_golden.py"})
        path = t.save(HERE / "conv4.sdtrace.json")
        print(t, "->", path, f"{os.path.getsize(path) / 1024:.0f} KiB")
        print(t.get_fallbacks()[["op", "path", "calls", "ranks"]].to_string(index=False))
        print(t.get_errors()[["rank", "op", "exc_type", "message"]].to_string(index=False))
        # every rank's snapshot of x: the inspector's input, for tests without a cluster
        from sharddbg.engine import api

        snaps = cl.apply(api.tensor_snapshot, "x", timeout=60)
        (HERE / "x_snapshots.json").write_text(json.dumps(snaps, indent=1) + "\n")
        print("x local shapes:", [s["local_shape"] for s in snaps])
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
