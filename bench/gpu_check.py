"""Checks of the GPU paths on a CUDA host (run through the device tool; see bench/RESULTS.md).

For each GPU-count it finds: a 1-rank NCCL cluster (physicsnemo registers its patches itself), the demo
net forward+backward checked against the same net on one GPU unsharded, the recorder's wall overhead on a
GPU-sized input (traced vs untraced, one run, same process), the "more ranks than GPUs" error, and a
4-rank gloo cluster on the same host. Prints a table and writes JSON to $OUT (or ./gpu_check.json).

    python bench/gpu_check.py
"""

from __future__ import annotations

import json
import os
import sys
import time
import traceback

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

RESULTS: dict = {}

NET_CELL = """
torch.manual_seed(0)
x_full = torch.randn({shape}, device="cuda" if torch.cuda.is_available() and dist.get_backend() == "nccl" else "cpu")
model = nn.Sequential(nn.Conv2d({c}, 32, 3, padding=1), nn.GELU(), nn.Conv2d(32, 32, 3, padding=1), nn.ReLU(),
                      nn.Conv2d(32, 4, 3, padding=1)).to(x_full.device)
x = sharddbg.engine.scatter(x_full, dim=2)
def step():
    model.zero_grad(set_to_none=True)
    y = model(x)
    y.square().mean().backward()
    return y
y = step()
"""

TIMING_CELL = """
import time as _t
def _timed(n):
    if torch.cuda.is_available(): torch.cuda.synchronize()
    t0 = _t.perf_counter()
    for _ in range(n):
        step()
    if torch.cuda.is_available(): torch.cuda.synchronize()
    return (_t.perf_counter() - t0) / n
for _ in range(3): step()
plain_s = _timed({n})
with sharddbg.record(max_events=1_000_000) as _rec:
    traced_s = _timed({n})
plain2_s = _timed({n})
n_events = len(_rec.events)
"""


def check(name):
    def wrap(fn):
        t0 = time.perf_counter()
        try:
            RESULTS[name] = {"ok": True, **(fn() or {})}
        except Exception as exc:
            RESULTS[name] = {"ok": False, "error": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc()}
        RESULTS[name]["seconds"] = round(time.perf_counter() - t0, 2)
        print(f"[{'ok' if RESULTS[name]['ok'] else 'FAIL'}] {name}: "
              f"{ {k: v for k, v in RESULTS[name].items() if k != 'traceback'} }", flush=True)
        return fn
    return wrap


def main() -> None:
    import torch

    import sharddbg

    RESULTS["host"] = {"torch": torch.__version__, "cuda_devices": torch.cuda.device_count(),
                       "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
                       "python": sys.version.split()[0]}
    print(RESULTS["host"], flush=True)
    n_gpus = torch.cuda.device_count()

    @check("nccl_cluster")
    def _():
        shape, c = (1, 16, 1024, 1024), 16
        with sharddbg.Cluster(n=n_gpus, timeout=300) as cl:
            status = cl.status()
            cl.run(NET_CELL.format(shape=shape, c=c), display=False)
            ys = cl.eval("y.full_tensor().detach().float().cpu().numpy()")
            grads = cl.eval("{n: p.grad.float().cpu().numpy() for n, p in model.named_parameters()}")
            # reference: the same net on one GPU, unsharded, in this process
            torch.manual_seed(0)
            x_full = torch.randn(*shape, device="cuda")
            model = torch.nn.Sequential(torch.nn.Conv2d(c, 32, 3, padding=1), torch.nn.GELU(),
                                        torch.nn.Conv2d(32, 32, 3, padding=1), torch.nn.ReLU(),
                                        torch.nn.Conv2d(32, 4, 3, padding=1)).cuda()
            y = model(x_full)
            y.square().mean().backward()
            ref_y = y.detach().cpu().numpy()
            ref_g = {n: p.grad.cpu().numpy() for n, p in model.named_parameters()}
            import numpy as np

            def rel(a, b):
                return float(np.abs(a - b).max() / max(np.abs(b).max(), 1e-30))

            y_err = max(rel(v, ref_y) for v in ys)
            g_err = max(rel(g[k], ref_g[k]) for g in grads for k in ref_g)
            cl.run(TIMING_CELL.format(n=10), display=False, timeout=600)
            plain, traced, plain2, events = (cl.eval(v) for v in ("plain_s", "traced_s", "plain2_s", "n_events"))
            trace = cl.trace("y = step()", display=False)
            ops, colls = trace.get_ops(), trace.get_collectives()
            comm = trace.get_comm_by_op(by="op")
            return {
                "trace_ops": len(ops), "trace_paths": ops["path"].value_counts().to_dict(),
                "ops_with_device_ms": int(ops["device_ms"].notna().sum()),
                "device_ms_total": round(float(ops["device_ms"].sum()), 3),
                "host_ms_total": round(float(ops["host_ms"].sum()), 3),
                "mem_delta_nonzero": int((ops["mem_delta_bytes"].fillna(0) != 0).sum()),
                "collectives": len(colls), "collective_kinds": colls["kind"].value_counts().to_dict() if len(colls) else {},
                "collectives_with_duration": int(colls["duration_ms"].notna().sum()) if len(colls) else 0,
                "comm_by_op": comm.to_dict("records")[:6],
                "start_s": round(cl.timings["start_s"], 2),
                "backend": list(status["backend"]), "device": list(status["device"]),
                "patch_mode": list(status["patch_mode"]), "n_patches": list(status["n_patches"]),
                "y_rel_err": y_err, "grad_rel_err": g_err,
                "step_ms_plain": [round(v * 1e3, 3) for v in plain],
                "step_ms_traced": [round(v * 1e3, 3) for v in traced],
                "step_ms_plain_again": [round(v * 1e3, 3) for v in plain2],
                "recorder_overhead": [round(t / ((p + q) / 2) - 1, 4) for t, p, q in zip(traced, plain, plain2)],
                "events_per_rank": events,
            }

    @check("more_ranks_than_gpus_is_refused")
    def _():
        try:
            sharddbg.Cluster(n=n_gpus + 1).start()
        except sharddbg.errors.ClusterError as exc:
            return {"message": str(exc)}
        raise AssertionError("no error for more ranks than GPUs")

    @check("gloo_cluster_on_gpu_host")
    def _():
        with sharddbg.Cluster(n=4, backend="gloo", timeout=300) as cl:
            cl.run("x = sharddbg.engine.scatter(torch.randn(1, 3, 66, 64), dim=2)", display=False)
            status = cl.status()
            return {"heights": [s[2] for s in cl.eval("tuple(x._local_tensor.shape)")],
                    "device": list(status["device"]), "patch_mode": list(status["patch_mode"]),
                    "start_s": round(cl.timings["start_s"], 2)}

    out = os.environ.get("OUT", ".")
    with open(os.path.join(out, "gpu_check.json"), "w") as f:
        json.dump(RESULTS, f, indent=1, default=str)


if __name__ == "__main__":
    main()
