"""Checks of sharddbg on a CUDA host with NCCL, one script for any GPU count (run through the device tool;
results in bench/RESULTS.md). Writes one JSON ($OUT/gpu_check.json) listing every item as measured, or
not run and why.

    python bench/gpu_check.py [--only NAME,...] [--backend gloo]   # gloo: a dry run of the logic on CPU ranks

Items (each a check below, in this order):
  hang_report          a rank skips an all_reduce: the report names the pending collective and the rank that
                       never joined, within the cell's timeout; recover() then a collective works
  raise_releases_peers a rank raises while its peer waits in a collective (collective timeout 300 s): the
                       error leads with its exception, the peer is released within 5 s; recover()
  traced_hang          the same hang inside a trace: the trace keeps the hung rank's events, the report
                       names the collective by the trace's group_seq; recover()
  ring_attention       physicsnemo's sharded SDPA (ring attention): paths, point-to-point bytes against the
                       k/v shard sizes, output and gradients against one GPU
  ring_radius_search   physicsnemo's ring radius search (warp): paths, p2p bytes against the points shards,
                       result against one GPU (ring kNN needs cuML, which the GPU image lacks)
  halo_p2p             physicsnemo's halo exchange in p2p mode: bytes against the halo's shape, values
                       against the neighbour's edge rows
  bandwidth            all_reduce and all_gather of 256 MiB traced: sharddbg's duration and bandwidth
                       against CUDA-event timing of the same call and against the link
  net_and_overhead     the demo net forward+backward against one GPU, recorder overhead (traced/untraced)
  start_full_preload   a cluster whose fork server preloads torch and physicsnemo (SHARDDBG_GPU_PRELOAD=full):
                       time to ready, CUDA uninitialised in the fork server, 100 NCCL steps
  numerical_check      cl.check of a sharded 2-conv net against the unsharded reference (outputs, input and
                       weight gradients, TF32 off): passes; with the conv2d patch removed it fails, only in
                       rows next to the shard boundary
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
import traceback

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

RESULTS: dict = {"items": {}}
MiB = 1024 * 1024


def item(name, fn, only):
    if only and name not in only:
        return
    t0 = time.perf_counter()
    try:
        RESULTS["items"][name] = {"status": "measured", **(fn() or {})}
    except NotRun as exc:
        RESULTS["items"][name] = {"status": "not run", "why": str(exc)}
    except Exception as exc:  # what the item measured before it failed is kept
        RESULTS["items"][name] = {**RESULTS["items"].get(name, {}), "status": "failed",
                                  "error": f"{type(exc).__name__}: {str(exc)[:3000]}",
                                  "traceback": traceback.format_exc()[-4000:]}
    RESULTS["items"][name]["seconds"] = round(time.perf_counter() - t0, 2)
    shown = {k: v for k, v in RESULTS["items"][name].items() if k != "traceback"}
    try:
        text = json.dumps(shown, default=str)
    except TypeError:
        text = repr(shown)
    print(f"[{RESULTS['items'][name]['status']}] {name}: {text[:3000]}", flush=True)
    out = os.environ.get("OUT", ".")
    with open(os.path.join(out, "gpu_check.json"), "w") as f:  # after every item: a killed run keeps the rest
        try:
            json.dump(RESULTS, f, indent=1, default=str)
        except TypeError:
            f.write(repr(RESULTS))


class NotRun(Exception):
    """The item cannot run here; the message says why."""


def _counts(frame, by) -> dict:
    """Rows per group, keyed by "a/b" (JSON keys are strings)."""
    return {"/".join(map(str, k)) if isinstance(k, tuple) else str(k): int(v) for k, v in frame.groupby(by).size().items()}


def _sh(cmd: str) -> str:
    try:
        return subprocess.run(cmd, shell=True, capture_output=True, text=True, timeout=60).stdout
    except Exception as exc:
        return f"{type(exc).__name__}: {exc}"


SUM_EXPR = "(lambda t: (dist.all_reduce(t), t.item())[1])(torch.ones((), device=DEV))"
SETUP = """
DEV = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else torch.device("cpu")
torch.backends.cuda.matmul.allow_tf32 = False
torch.backends.cudnn.allow_tf32 = False
"""
SKIP = "t = torch.ones(4, device=DEV)\nif rank == 0:\n    dist.all_reduce(t)\n    print(t.sum().item())\n"
RAISE = "if rank == 1:\n    raise IndexError('boom')\nt = torch.ones(4, device=DEV)\ndist.all_reduce(t)\nprint(t.sum().item())\n"


def _works(cl) -> bool:
    return cl.eval(SUM_EXPR) == [float(cl.n)] * cl.n


def hang_report(cl):
    from sharddbg.errors import RankTimeoutError

    t0 = time.monotonic()
    try:
        cl.run(SKIP, timeout=15, display=False)
        raise AssertionError("no RankTimeoutError")
    except RankTimeoutError as exc:
        elapsed = time.monotonic() - t0
        report = exc.report
        pending = [(p.kind, p.missing_ranks, p.seq, p.mesh_dim) for d in report.ranks.values() for p in d.pending]
        text = str(exc)
    out = {"report_after_s": round(elapsed, 2), "pending": pending, "unfinished": report.unfinished,
           "names_collective_and_missing_rank": bool(pending) and pending[0][1] == [1] and "never joined by: rank 1" in text,
           "report_excerpt": text[:1800]}
    RESULTS["items"]["hang_report"] = dict(out, status="partial: recover() did not return")
    t1 = time.monotonic()
    cl.recover()
    out.update(recover_s=round(time.monotonic() - t1, 2), collective_after_recover=_works(cl))
    return out


def raise_releases_peers(cl):
    from sharddbg.errors import RankError

    t0 = time.monotonic()
    try:
        cl.run(RAISE, display=False)
        raise AssertionError("no RankError")
    except RankError as exc:
        elapsed = time.monotonic() - t0
        first = str(exc).splitlines()[0]
        out = {"error_after_s": round(elapsed, 2), "first_line": first, "causes": exc.causes, "released": exc.released,
               "leads_with_cause": first.startswith("rank 1 raised IndexError: boom"), "message": str(exc)[:2500],
               "broken": cl.broken}
    t1 = time.monotonic()
    cl.recover()
    out.update(recover_s=round(time.monotonic() - t1, 2), collective_after_recover=_works(cl))
    return out


def traced_hang(cl):
    from sharddbg.errors import RankTimeoutError

    try:
        cl.trace("x = torch.ones(8, device=DEV) * 2\n" + SKIP, timeout=15, display=False)
        raise AssertionError("no RankTimeoutError")
    except RankTimeoutError as exc:
        text = str(exc)
    t = cl.last_trace()
    colls = t.get_collectives()
    out = {"hang_reported": text[:300], "incomplete_ranks": t.incomplete_ranks, "incomplete_reasons": t.incomplete_reasons,
           "ops_per_rank": {int(k): int(v) for k, v in t.get_ops().groupby("rank").size().items()},
           "in_flight_collectives": [{k: (v if k == "kind" else int(v)) for k, v in r.items()} for r in
                                     colls[colls["in_flight"]][["rank", "kind", "group_seq"]].to_dict("records")],
           "named_by_group_seq": "group_seq" in text and "of this trace" in text, "report_excerpt": text[:1500]}
    cl.recover()
    out["collective_after_recover"] = _works(cl)
    return out


ATTN = """
torch.manual_seed(0)
B, H, S, D = 1, 8, {S}, 64
qf, kf, vf = (torch.randn(B, H, S, D, device=DEV) for _ in range(3))
q, k, v = (sharddbg.engine.scatter(t, dim=2, requires_grad=True) for t in (qf, kf, vf))
out = torch.nn.functional.scaled_dot_product_attention(q, k, v)
out.square().mean().backward()
"""


def ring_attention(cl, torch):
    S = 4096
    t = cl.trace(ATTN.format(S=S), display=False, timeout=300)
    ops, colls = t.get_ops(), t.get_collectives()
    sdpa = ops[ops["op"].str.contains("scaled_dot_product_attention")]
    local = cl.eval("tuple(k._local_tensor.shape)")
    kv_bytes = [2 * int(torch.tensor(s).prod()) * 4 for s in local]  # k and v shards, fp32
    fwd = colls[colls["phase"] == "forward"]
    sent = {int(k): int(v) for k, v in fwd[fwd["kind"] == "send"].groupby("rank")["bytes_sent"].sum().items()}
    outs = cl.eval("out.full_tensor().detach().cpu()")
    grads = cl.eval("[g.full_tensor().detach().cpu() for g in (q.grad, k.grad, v.grad)]")
    torch.manual_seed(0)
    qf, kf, vf = (torch.randn(1, 8, S, 64, device="cuda", requires_grad=True) for _ in range(3))
    ref = torch.nn.functional.scaled_dot_product_attention(qf, kf, vf)
    ref.square().mean().backward()
    rel = lambda a, b: float((a - b.cpu()).abs().max() / b.abs().max().clamp_min(1e-30).cpu())  # noqa: E731
    n = cl.n
    return {"sdpa_paths": {str(k): list(v) for k, v in sdpa.groupby("phase")["path"].unique().items()},
            "collective_kinds": _counts(colls, ["phase", "kind"]),
            "p2p_fwd_bytes_sent_per_rank": sent,
            "expected_fwd_bytes_per_rank": {r: (n - 1) * kv_bytes[r] for r in range(n)},
            "p2p_bytes_exact": all(sent.get(r) == (n - 1) * kv_bytes[r] for r in range(n)),
            "send_attributed_to": sorted(set(fwd[fwd["kind"] == "send"]["op"].dropna())),
            "out_rel_err": max(rel(o, ref.detach()) for o in outs),
            "grad_rel_err": max(rel(g[i], r.grad) for g in grads for i, r in enumerate((qf, kf, vf))),
            "tf32": False}


RADIUS = """
torch.manual_seed(0)
N, M = {N}, {M}
pf = torch.rand(N, 3, device=DEV); qf = torch.rand(M, 3, device=DEV)
points = sharddbg.engine.scatter(pf, dim=0, batch_dim=None)
queries = sharddbg.engine.scatter(qf, dim=0, batch_dim=None)
res = torch.ops.physicsnemo.radius_search_warp.default(points, queries, 0.05, 16, False, True)
neighbours, counts = res[1], res[3]  # the sharded search returns no distances: the neighbour points instead
"""


def ring_radius_search(cl, torch):
    N, M = 40000, 8000
    try:  # on a CUDA host physicsnemo registers its ops (the warp radius search among them) at import
        import physicsnemo.domain_parallel  # noqa: F401
        torch.ops.physicsnemo.radius_search_warp  # noqa: B018
    except Exception as exc:
        raise NotRun(f"physicsnemo's warp radius search is not registered here: {exc}")
    t = cl.trace(RADIUS.format(N=N, M=M), display=False, timeout=400)
    ops, colls = t.get_ops(), t.get_collectives()
    rs = ops[ops["op"].str.contains("radius_search")]
    local = cl.eval("tuple(points._local_tensor.shape)")
    fwd = colls[colls["phase"] == "forward"]
    sent = {int(k): int(v) for k, v in fwd[fwd["kind"] == "send"].groupby("rank")["bytes_sent"].sum().items()}
    n = cl.n
    pts_bytes = [s[0] * s[1] * 4 for s in local]
    pts_sh = cl.eval("neighbours.full_tensor().detach().cpu()")[0]
    cnt_sh = cl.eval("counts.full_tensor().detach().cpu()")[0]
    torch.manual_seed(0)
    pf = torch.rand(N, 3, device="cuda")
    qf = torch.rand(M, 3, device="cuda")
    ref = torch.ops.physicsnemo.radius_search_warp(pf, qf, 0.05, 16, False, True)
    # which neighbours a query keeps when more than max_points are in range depends on the visiting order:
    # compare the counts, and the neighbours of the queries that have fewer than max_points
    cnt_ref, pts_ref = ref[3].cpu(), ref[1].cpu()
    under = cnt_ref < 16
    same = bool(torch.equal(cnt_sh, cnt_ref)) and bool(torch.allclose(
        pts_sh[under].sum(dim=1), pts_ref[under].sum(dim=1), atol=1e-5))
    return {"paths": rs["path"].unique().tolist(), "collective_kinds": _counts(colls, ["phase", "kind"]),
            "p2p_fwd_bytes_sent_per_rank": sent,
            "points_shard_bytes": pts_bytes, "ring_sends_every_other_shard": sent and all(
                sent.get(r, 0) >= pts_bytes[r] for r in range(n)),
            "counts_and_neighbours_match_one_gpu": same}


HALO = """
from physicsnemo.domain_parallel.shard_utils.halo import HaloConfig, halo_padding
torch.manual_seed(rank)
local = torch.randn(1, 16, 256, 256, device=DEV)
cfg = HaloConfig(mesh_dim=0, tensor_dim=2, halo_size=2, edge_padding_size=2, communication_method="p2p")
padded = halo_padding(local, sharddbg.engine.domain_mesh(), cfg)
edges = (local[:, :, :2].cpu(), local[:, :, -2:].cpu())
"""


def halo_p2p(cl, torch):
    t = cl.trace(HALO, display=False, timeout=300)
    colls = t.get_collectives()
    p2p = colls[colls["kind"].isin(["send", "recv"])]
    halo_bytes = 16 * 2 * 256 * 4
    padded = cl.eval("tuple(padded.shape)")
    edges = cl.eval("edges")
    tops = cl.eval("padded[:, :, :2].cpu()")
    bottoms = cl.eval("padded[:, :, -2:].cpu()")
    n = cl.n
    values_ok = all(torch.equal(bottoms[r], edges[r + 1][0]) and torch.equal(tops[r + 1], edges[r][1])
                    for r in range(n - 1))
    per_rank = [{k: (int(v) if k != "kind" else v) for k, v in r.items()} for r in p2p.groupby(["rank", "kind"]).agg(
        calls=("kind", "size"), sent=("bytes_sent", "sum"), recv=("bytes_recv", "sum")).reset_index().to_dict("records")]
    interior = [r for r in range(n)]
    expected = {r: halo_bytes * ((r > 0) + (r < n - 1)) for r in interior}
    sent = {int(k): int(v) for k, v in p2p.groupby("rank")["bytes_sent"].sum().items()}
    return {"padded_shapes": padded, "p2p": per_rank, "expected_sent_per_rank": expected,
            "bytes_exact": all(sent.get(r, 0) == expected[r] for r in interior), "halo_values_match": values_ok}


BW = """
N = {elems}
big = torch.ones(N, device=DEV)
gather_out = torch.empty(N * world_size, device=DEV)
shard = torch.ones(N, device=DEV)
for _ in range(2):
    dist.all_reduce(big); dist.all_gather_into_tensor(gather_out, shard)
torch.cuda.synchronize()
def _event_ms(fn, reps=3):
    out = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record(); fn(); b.record(); torch.cuda.synchronize(); out.append(a.elapsed_time(b))
    return out
ar_event_ms = _event_ms(lambda: dist.all_reduce(big))
ag_event_ms = _event_ms(lambda: dist.all_gather_into_tensor(gather_out, shard))
"""
BW_TRACED = "for _ in range(3):\n    dist.all_reduce(big)\n    dist.all_gather_into_tensor(gather_out, shard)\ntorch.cuda.synchronize()\n"


def bandwidth(cl, torch):
    size = 256 * MiB
    cl.run(BW.format(elems=size // 4), display=False, timeout=300)
    t = cl.trace(BW_TRACED, display=False, timeout=300)
    colls = t.get_collectives()
    n = cl.n
    ev = {"all_reduce": cl.eval("ar_event_ms"), "all_gather_into_tensor": cl.eval("ag_event_ms")}
    out = {"size_bytes": size, "ranks": n, "links": _sh("nvidia-smi nvlink -s | head -40"),
           "topology": _sh("nvidia-smi topo -m")}
    for kind, bus_factor in (("all_reduce", 2 * (n - 1) / n), ("all_gather_into_tensor", (n - 1) / n)):
        c = colls[colls["kind"] == kind]
        out[kind] = {
            "sharddbg_duration_ms": [round(x, 3) for x in c["duration_ms"]],
            "sharddbg_device_ms": [round(x, 3) for x in c["device_ms"]],
            "sharddbg_bandwidth_gbps": [round(x, 2) for x in c["bandwidth_gbps"]],
            "bytes_sent": c["bytes_sent"].tolist()[:2], "bytes_recv": c["bytes_recv"].tolist()[:2],
            "cuda_event_ms_untraced": [[round(x, 3) for x in r] for r in ev[kind]],
            "bus_factor": bus_factor,
        }
        # algorithm bandwidth (nccl-tests' algbw): the buffer size over the time; bus bandwidth: times the factor
        best = min(min(r) for r in ev[kind])
        data = size * (n if kind == "all_gather_into_tensor" else 1)
        out[kind]["event_algbw_gbps"] = round(data / (best / 1e3) / 1e9, 1)
        out[kind]["event_busbw_gbps"] = round(data / (best / 1e3) / 1e9 * bus_factor, 1)
    return out


NET = """
torch.manual_seed(0)
x_full = torch.randn({shape}, device=DEV)
model = nn.Sequential(nn.Conv2d({c}, 32, 3, padding=1), nn.GELU(), nn.Conv2d(32, 32, 3, padding=1), nn.ReLU(),
                      nn.Conv2d(32, 4, 3, padding=1)).to(DEV)
x = sharddbg.engine.scatter(x_full, dim=2)
def step():
    model.zero_grad(set_to_none=True)
    y = model(x)
    y.square().mean().backward()
    return y
y = step()
import time as _t
def _timed(n):
    torch.cuda.synchronize(); t0 = _t.perf_counter()
    for _ in range(n):
        step()
    torch.cuda.synchronize(); return (_t.perf_counter() - t0) / n
for _ in range(3): step()
rounds = []
for _ in range(5):
    p = _timed(10)
    with sharddbg.record(max_events=1_000_000) as _rec:
        tr = _timed(10)
    rounds.append((p, tr))
"""


CHECK_NET = """
torch.manual_seed(0)
ck_x = sharddbg.engine.scatter(torch.randn(1, 8, 258, 128, device=DEV), dim=2)
ck_net = nn.Sequential(nn.Conv2d(8, 16, 3, padding=1), nn.GELU(), nn.Conv2d(16, 8, 3, padding=1)).to(DEV)
"""


def numerical_check(cl):
    cl.run(CHECK_NET, display=False, timeout=300)
    good = cl.check("ck_y = ck_net(ck_x)", inputs=["ck_x"], outputs=["ck_y"], model="ck_net", display=False)
    bad = cl.check("with sharddbg.engine.without_patches(F.conv2d):\n    ck_y = ck_net(ck_x)", inputs=["ck_x"],
                   outputs=["ck_y"], model="ck_net", display=False)
    pattern = bad.boundary_pattern("ck_y")
    return {"passes": good.ok, "verdict": good.verdict, "tf32_was_on": good.tf32_was_on,
            "max_abs_err": float(good.table["max_abs"].max()), "tensors": good.tensors(),
            "without_patch_fails": not bad.ok, "without_patch_verdict": bad.verdict,
            "without_patch_backward": bad.backward,  # "failed": it raised on every rank (torch 2.11 H200s)
            "failing_rows_near_boundaries": pattern.near_boundaries, "max_distance_to_a_boundary": pattern.max_distance,
            "boundary_pattern": str(pattern)}


def net_and_overhead(cl, torch):
    shape, c = (1, 16, 1024, 1024), 16
    cl.run(NET.format(shape=shape, c=c), display=False, timeout=600)
    ys = cl.eval("y.full_tensor().detach().float().cpu()")
    grads = cl.eval("{n: p.grad.float().cpu() for n, p in model.named_parameters()}")
    rounds = cl.eval("rounds")
    torch.backends.cuda.matmul.allow_tf32 = False  # as on the ranks (SETUP): the comparison without TF32
    torch.backends.cudnn.allow_tf32 = False
    torch.manual_seed(0)
    x_full = torch.randn(*shape, device="cuda")
    model = torch.nn.Sequential(torch.nn.Conv2d(c, 32, 3, padding=1), torch.nn.GELU(),
                                torch.nn.Conv2d(32, 32, 3, padding=1), torch.nn.ReLU(),
                                torch.nn.Conv2d(32, 4, 3, padding=1)).cuda()
    y = model(x_full)
    y.square().mean().backward()
    rel = lambda a, b: float((a - b.cpu()).abs().max() / b.abs().max().clamp_min(1e-30).cpu())  # noqa: E731
    # per round: the slowest rank's traced step over the slowest rank's untraced step
    wall = [max(r[i][1] for r in rounds) / max(r[i][0] for r in rounds) for i in range(len(rounds[0]))]
    return {"y_rel_err": max(rel(v, y.detach()) for v in ys),
            "grad_rel_err": max(rel(g[k], p.grad) for g in grads for k, p in model.named_parameters()),
            "untraced_ms_per_step": [round(max(r[i][0] for r in rounds) * 1e3, 2) for i in range(len(rounds[0]))],
            "traced_ms_per_step": [round(max(r[i][1] for r in rounds) * 1e3, 2) for i in range(len(rounds[0]))],
            "wall_ratio_per_round": [round(w, 3) for w in wall], "wall_ratio_median": round(sorted(wall)[len(wall) // 2], 3)}


def start_full_preload(sharddbg, n):
    t0 = time.perf_counter()
    cl = sharddbg.Cluster(n=n, timeout=300, env={"SHARDDBG_GPU_PRELOAD": "full"})
    cl.start()
    try:
        ready_s = time.perf_counter() - t0
        cl.run(SETUP, display=False)
        t1 = time.perf_counter()
        cl.run("for _ in range(100):\n    t = torch.ones(1024, device=DEV)\n    dist.all_reduce(t)\n"
               "torch.cuda.synchronize()\nassert t[0].item() == world_size\n", display=False, timeout=120)
        steps_s = time.perf_counter() - t1
        t = cl.trace("x = sharddbg.engine.scatter(torch.randn(1, 4, 64, 64, device=DEV), dim=2)\n"
                     "y = torch.nn.functional.conv2d(x, torch.randn(8, 4, 3, 3, device=DEV), padding=1)\n", display=False)
        ops = t.get_ops()
        conv_paths = sorted(set(ops.loc[ops["op"].str.contains("conv2d"), "path"]))
        logs = {f: open(os.path.join(cl.log_dir, f), errors="replace").read() for f in os.listdir(cl.log_dir)
                if f.endswith(".log")}
        fork_warnings = [line for text in logs.values() for line in text.splitlines() if "fork" in line.lower()]
        return {"ready_s": round(ready_s, 2), "timings": {k: round(v, 2) for k, v in cl.timings.items()},
                "preload": cl.facts.get("preload"), "cuda_initialized_in_fork_server": cl.facts.get("cuda_initialized"),
                "cuda_initialized_at_fork": cl.facts.get("cuda_initialized_at_fork"),
                "fork_server_threads_after_preload": cl.facts.get("threads_after_preload"),
                "patch_mode": cl.patch_mode, "nccl_100_steps_s": round(steps_s, 2), "conv2d_paths": conv_paths,
                "fork_warnings": fork_warnings[:10]}
    finally:
        cl.stop()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--only", default="", help="comma-separated item names")
    ap.add_argument("--backend", default=None, help="gloo: a dry run on CPU ranks (CUDA items not run)")
    a = ap.parse_args()
    only = {x for x in a.only.split(",") if x}
    import torch

    import sharddbg

    n = torch.cuda.device_count() if a.backend != "gloo" else 2
    RESULTS["host"] = {"torch": torch.__version__, "cuda_devices": torch.cuda.device_count(),
                       "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
                       "python": sys.version.split()[0], "date": time.strftime("%Y-%m-%d"),
                       "command": " ".join(sys.argv), "nvidia_smi_topo": _sh("nvidia-smi topo -m")}
    print(json.dumps(RESULTS["host"], default=str), flush=True)
    if n < 2:
        raise SystemExit("these checks need at least 2 GPUs")
    t0 = time.perf_counter()
    cl = sharddbg.Cluster(n=n, backend=a.backend, timeout=120, collective_timeout=300)
    cl.start()
    RESULTS["cluster"] = {"ready_s": round(time.perf_counter() - t0, 2), "backend": cl.backend,
                          "timings": {k: round(v, 2) for k, v in cl.timings.items()}, "patch_mode": cl.patch_mode,
                          "preload": cl.facts.get("preload"),
                          # the preload's parts: torch, physicsnemo (with register_custom_ops), ipyparallel, and
                          # the GPU count probe that runs beside them (its own time, and what was left to wait)
                          "preload_parts_s": {k: round(v, 2) for k, v in cl.facts.items()
                                              if k.startswith("t_") and isinstance(v, (int, float))}}
    print(json.dumps(RESULTS["cluster"]), flush=True)
    cuda = cl.backend == "nccl"
    def ready():
        """Before each item: every rank alive and a working process group (a failed item may leave neither)."""
        if not (cl.dead_ranks() or cl.controller_failure()) and (cl.broken or cl.busy_ranks()):
            try:
                cl.recover()
                return
            except sharddbg.errors.ClusterError:
                pass  # a rank that cannot be released: new engines
        if cl.dead_ranks() or cl.controller_failure() or cl.broken or cl.busy_ranks():
            cl.restart()
            cl.run(SETUP, display=False)

    try:
        cl.run(SETUP, display=False)
        for name, fn in (("hang_report", hang_report), ("raise_releases_peers", raise_releases_peers),
                         ("traced_hang", traced_hang), ("numerical_check", numerical_check)):
            item(name, lambda fn=fn: (ready(), fn(cl))[1], only)
        for name, fn in (("ring_attention", ring_attention), ("halo_p2p", halo_p2p), ("bandwidth", bandwidth),
                         ("net_and_overhead", net_and_overhead), ("ring_radius_search", ring_radius_search)):
            def run(fn=fn):
                if not cuda:
                    raise NotRun("CUDA only")
                ready()
                return fn(cl, torch)
            item(name, run, only)
    finally:
        cl.stop()
    if "start_full_preload" in only:  # measured once: engines then fail to initialise CUDA (bench/RESULTS.md)
        item("start_full_preload", lambda: start_full_preload(sharddbg, n), only)
    item("ring_knn", lambda: (_ for _ in ()).throw(NotRun(
        "physicsnemo's ring kNN calls cuML, which the GPU image lacks (ring radius search, warp, stands in)")), only)


if __name__ == "__main__":
    main()
