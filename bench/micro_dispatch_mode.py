"""Per-aten-op cost of the recorder's collective dispatch mode (used only for the torch.distributed calls its
kernels cannot see) vs an empty TorchDispatchMode (1 process, CPU).

    OMP_NUM_THREADS=1 .venv/bin/python bench/micro_dispatch_mode.py
"""
import time, torch
from sharddbg.engine.recorder.collectives import CollectiveMode
class NoHooks:  # the mode calls its hooks only for collectives; this loop has none
    pass
x = torch.randn(16, 16)
def loop(n=20000):
    y = x
    for _ in range(n):
        y = y + 1.0
    return y
loop(2000)
def tm():
    best = 1e9
    for _ in range(5):
        t0 = time.perf_counter(); loop(); best = min(best, time.perf_counter() - t0)
    return best / 20000 * 1e6
base = tm()
m = CollectiveMode(NoHooks())
with m:
    with_mode = tm()
print(f"plain add: {base:.2f} us/op; under the collective mode: {with_mode:.2f} us/op; +{with_mode-base:.2f} us per aten op")
from torch.utils._python_dispatch import TorchDispatchMode
class E(TorchDispatchMode):
    def __torch_dispatch__(s, f, t, a=(), k=None):
        return f(*a, **(k or {}))
with E():
    e = tm()
print(f"empty mode: {e:.2f} us/op (+{e-base:.2f})")
