"""``sharddbg demo``: a 4-rank CPU cluster, an uneven sample, a sharded conv net forward and backward,
per-rank shard shapes, and the check against the same net run unsharded in this process."""

from __future__ import annotations

import argparse
import sys

DEMO_SEED = 0
DEMO_SHAPE = (1, 3, 66, 64)  # 66 rows over 4 ranks: 17, 17, 16, 16

# Runs on every rank. The model is built from the same seed everywhere, so its weights are identical.
DEMO_CELL = f"""
torch.manual_seed({DEMO_SEED})
x_full = torch.randn{DEMO_SHAPE}
model = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.GELU(), nn.Conv2d(8, 8, 3, padding=1), nn.ReLU(),
                      nn.Conv2d(8, 2, 3, padding=1))
x = sharddbg.engine.scatter(x_full, dim=2)
y = model(x)
loss = y.square().mean()
loss.backward()
"""

SUMMARY = ("dict(x_local=tuple(x._local_tensor.shape), y_local=tuple(y._local_tensor.shape), "
           "y_full=y.full_tensor().detach().numpy(), "
           "grads={n: p.grad.detach().numpy() for n, p in model.named_parameters()})")


def reference():
    """The same net on the same sample, unsharded, in this process."""
    import torch
    from torch import nn

    torch.manual_seed(DEMO_SEED)
    x_full = torch.randn(*DEMO_SHAPE)
    model = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.GELU(), nn.Conv2d(8, 8, 3, padding=1), nn.ReLU(),
                          nn.Conv2d(8, 2, 3, padding=1))
    y = model(x_full)
    y.square().mean().backward()
    return y.detach().numpy(), {n: p.grad.numpy() for n, p in model.named_parameters()}


def _rel(a, b) -> float:
    import numpy as np

    return float(np.abs(a - b).max() / max(float(np.abs(b).max()), 1e-30))


def demo(n: int = 4, tolerance: float = 1e-5) -> int:
    import sharddbg

    print(f"sharddbg demo: starting {n} CPU ranks (gloo) ...", flush=True)
    cl = sharddbg.Cluster(n=n, mesh={"ddp": 1, "domain": n})
    cl.start()
    try:
        t = cl.timings
        print(f"  ready in {t['start_s']:.1f} s (preload {t['preload_s']:.1f} s overlapping controller "
              f"{t['controller_s']:.1f} s, engines {t['engines_s']:.1f} s, torch.distributed {t['dist_init_s']:.1f} s)")
        status = cl.status(full=True)
        print(status[["pid", "device", "backend", "ddp", "domain", "patch_mode", "torch", "physicsnemo"]].to_string())
        print(f"\nforward + backward of a 3-layer conv net on a {DEMO_SHAPE} sample sharded along H, recorded:")
        trace = cl.trace(DEMO_CELL, display=True)
        summaries = cl.eval(SUMMARY)
        y_ref, grads_ref = reference()
        ok = True
        print(f"\n{'rank':>4}  {'x local shape':<18} {'y local shape':<18} {'rows':>4}  {'|y - ref|':>10}  {'max |grad - ref|':>16}")
        for rank, s in enumerate(summaries):
            y_err = _rel(s["y_full"], y_ref)
            g_err = max(_rel(s["grads"][name], grads_ref[name]) for name in grads_ref)
            ok &= y_err <= tolerance and g_err <= tolerance
            print(f"{rank:>4}  {str(s['x_local']):<18} {str(s['y_local']):<18} {s['x_local'][2]:>4}  "
                  f"{y_err:>10.2e}  {g_err:>16.2e}")
        rows = [s["x_local"][2] for s in summaries]
        print(f"rows per rank {rows} sum to {sum(rows)} (global {DEMO_SHAPE[2]}); relative errors vs the "
              f"unsharded reference must be <= {tolerance:g}: {'OK' if ok else 'MISMATCH'}")
        ops = trace.get_ops()
        fallbacks = trace.get_fallbacks()
        print(f"\nrecorded {len(ops)} op calls on {len(trace.ranks)} ranks; dispatch paths: "
              + ", ".join(f"{p} {c}" for p, c in ops["path"].value_counts().items()))
        if len(fallbacks):
            print("ops that took a DTensor fallback:")
            print(fallbacks[["op", "path", "calls", "ranks"]].to_string(index=False))
        comm = trace.get_comm_by_op(by="op")
        comm = comm[comm["n_collectives"] > 0]
        if len(comm):
            print("\ncommunication per op (rank 0; every collective attributed to the op that issued it; forward "
                  "comm against forward time, backward apart):")
            print(comm[comm["rank"] == 0][["op", "calls", "n_collectives", "kinds", "bytes_sent", "bytes_recv",
                                           "comm_ms", "op_ms", "bwd_n_collectives", "bwd_comm_ms"]].to_string(index=False))
        return 0 if ok else 1
    finally:
        cl.stop()
        print(f"\nstopped in {cl.timings['stop_s']:.1f} s; no engine, controller or fork server left running")


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["record"]:  # its own parser: everything after -- is the job's, untouched
        from .job_launcher import main_record

        return main_record(argv[1:])
    parser = argparse.ArgumentParser(prog="sharddbg")
    sub = parser.add_subparsers(dest="command", required=True)
    run = sub.add_parser("demo", help="4-rank CPU demo: uneven shards, sharded conv net, check vs reference")
    run.add_argument("-n", type=int, default=4)
    stop = sub.add_parser("reap", help="stop every cluster sharddbg left on this machine (orphans included)")
    stop.add_argument("--all", action="store_true", help="also clusters whose owner still runs")
    sub.add_parser("record", help="record a job unchanged: sharddbg record [--out DIR] [--steps A:B] "
                                  "[--max-events N] [--hang-after S] [--force] -- torchrun ... train.py")
    summ = sub.add_parser("summary", help="a recorded job's (or trace file's) findings, as plain text")
    summ.add_argument("path", help="the folder sharddbg record wrote, or a .sdtrace.json file")
    summ.add_argument("--width", type=int, default=100, help="the longest line (default 100)")
    rep = sub.add_parser("report", help="a recorded job's (or trace file's) standalone HTML report")
    rep.add_argument("path", help="the folder sharddbg record wrote, or a .sdtrace.json file")
    rep.add_argument("-o", "--output", required=True, help="the HTML file to write")
    _add_cluster_commands(sub)
    args = parser.parse_args(argv)
    if args.command == "cluster":
        return _cluster_command(args)
    if args.command in ("summary", "report"):
        return _read_back(args)
    if args.command == "demo":
        return demo(args.n)
    if args.command == "reap":
        from .cluster import registry

        # A cluster's processes: those its record names, their children, and those whose command line
        # names it (the controller's children, also once the controller itself is dead).
        from .cluster import detached

        # a detached cluster's owner is its keeper: left alone while the keeper runs, reaped once it died
        reaped = registry.reap_orphans(include_live_owners=args.all)
        print(f"reaped {len(reaped)} cluster(s): {sorted(reaped)}")
        for name in detached.forget_dead_keepers():
            print(f"  detached cluster {name!r}: its keeper had died; its record is marked stopped")
        for cluster_id, pids in sorted(reaped.items()):
            print(f"  {cluster_id}: {len(pids)} process(es) killed{': ' if pids else ''}"
                  f"{', '.join(str(pid) for pid in sorted(pids))}")
        left = [r for r in registry.all_records() if r.owner_alive()]
        if left:
            print(f"left alone {len(left)} cluster(s) whose owner still runs (--all stops those too): "
                  + ", ".join(f"{r.cluster_id} (owner pid {r.owner.pid})" for r in left))
        return 0
    return 2


def _add_cluster_commands(sub) -> None:
    """``sharddbg cluster start|list|stop``: clusters that outlive the notebook (``cluster.detached``)."""
    group = sub.add_parser("cluster", help="start, list and stop clusters that outlive the notebook kernel")
    actions = group.add_subparsers(dest="action", required=True)
    start = actions.add_parser("start", help="start a detached cluster, kept by a process of its own; returns once "
                                             "it is up (connect with sharddbg.Cluster.connect(NAME))")
    start.add_argument("-n", type=int, default=None, help="number of ranks")
    start.add_argument("--mesh", default=None, help="e.g. ddp=1,domain=4 (one axis may be left out: it is inferred)")
    start.add_argument("--name", default=None, help="its name (default: cluster, cluster-2, ...)")
    start.add_argument("--idle-timeout", type=float, default=None, metavar="S",
                       help="stop it after S seconds without work on any engine (default: never)")
    start.add_argument("--backend", choices=["gloo", "nccl"], default=None,
                       help="the torch.distributed backend (default: nccl with GPUs, else gloo)")
    start.add_argument("--timeout", type=float, default=60.0, metavar="S",
                       help="the default time limit of a call on the ranks, seconds (60)")
    start.add_argument("--collective-timeout", type=float, default=60.0, metavar="S",
                       help="torch.distributed's collective timeout, seconds (60)")
    start.add_argument("--start-timeout", type=float, default=600.0, metavar="S",
                       help="how long the start, and each of its steps, may take, seconds (600)")
    start.add_argument("--force", action="store_true",
                       help="start even when the ranks would not fit in the memory available now")
    start.add_argument("--launcher", default=None, metavar="{mpi,ssh,slurm}",
                       help="start the engines with ipyparallel's own launcher (default: sharddbg's fork server, "
                            "one host)")
    start.add_argument("--ip", default=None, metavar="ADDR",
                       help="with --launcher: the interface or address of this host the ranks reach it on "
                            "(default: loopback)")
    start.add_argument("--hosts", default=None, metavar="HOST[:K],...",
                       help="with --launcher ssh: the hosts and how many engines each runs, e.g. node1:4,node2:4 "
                            "(a port goes before the count: user@node1:2222:4)")
    actions.add_parser("list", help="every cluster of this user: detached ones and those notebooks own")
    stop = actions.add_parser("stop", help="stop a detached cluster and check that no process of it is left")
    stop.add_argument("name", help="its name (sharddbg cluster list)")


def _ssh_hosts(text: str | None) -> dict[str, int] | None:
    """``--hosts node1:4,node2:4`` -> {"node1": 4, "node2": 4}; a host without a count runs one engine. A host
    given as ``user@host:port`` keeps its port when a count follows it (``user@host:2222:4``)."""
    if text is None:
        return None
    from .errors import ClusterError

    hosts: dict[str, int] = {}
    for item in filter(None, (part.strip() for part in text.split(","))):
        host, _, count = item.rpartition(":")
        if not host or not count.isdigit():
            host, count = item, "1"
        if int(count) < 1:
            raise ClusterError(f"--hosts: {item!r} gives {count} engines; give each host at least 1 (HOST:K)")
        hosts[host] = hosts.get(host, 0) + int(count)
    if not hosts:
        raise ClusterError(f"--hosts {text!r} names no host: give HOST[:K],... (e.g. node1:4,node2:4)")
    return hosts


def _cluster_command(args) -> int:
    from .cluster import arguments, detached
    from .cluster.engine_launchers import resolve_launcher
    from .cluster.mesh import resolve_mesh
    from .errors import ShardDbgError

    try:
        if args.action == "list":
            print(detached.format_rows(detached.list_rows()))
            return 0
        if args.action == "stop":
            report = detached.stop(args.name)
            if report.survivors:
                print(f"sharddbg: cluster {report.name!r} stopped, but processes survived: {report.survivors}",
                      file=sys.stderr)
                return 1
            print(f"sharddbg: stopped cluster {report.name!r} ({report.cluster_id}) in {report.seconds:.1f} s; "
                  f"no process of it is left")
            return 0
        # everything is checked before anything starts
        mesh = resolve_mesh(args.n, args.mesh)
        name = detached.check_name(args.name) if args.name is not None else detached.default_name()
        detached.check_free(name)
        for option in ("timeout", "collective_timeout", "start_timeout"):
            arguments.seconds(option.replace("_", "-"), getattr(args, option))
        arguments.collective_timeout(args.collective_timeout)
        if args.idle_timeout is not None:
            arguments.seconds("idle-timeout", args.idle_timeout)
        hosts = _ssh_hosts(args.hosts)
        launcher = resolve_launcher(args.launcher, mesh.size, ip=args.ip, hosts=hosts)
        if not args.force and (launcher is None or not launcher.spans_hosts):  # every engine on this host
            arguments.check_memory(mesh.size)
        config = {"name": name, "n": mesh.size, "mesh": str(mesh), "backend": args.backend, "timeout": args.timeout,
                  "collective_timeout": args.collective_timeout, "idle_timeout": args.idle_timeout,
                  "start_timeout": args.start_timeout, "force": True,
                  "launcher": args.launcher, "ip": args.ip, "hosts": hosts}
        print(f"sharddbg: starting detached cluster {name!r}: {mesh.size} ranks, mesh {mesh} ...", flush=True)
        report = detached.start(config, args.start_timeout)
    except ShardDbgError as e:
        print(f"sharddbg cluster {args.action}: {e}", file=sys.stderr)
        return 1
    idle = f"; stops after {report.idle_timeout_s:g} s without work" if report.idle_timeout_s else ""
    print(f"sharddbg: cluster {report.name!r} is up in {report.seconds:.1f} s: {report.n} ranks, mesh {report.mesh}, "
          f"backend {report.backend}, patches {report.patch_mode}; keeper pid {report.keeper_pid}{idle}\n"
          f"  connect from a notebook: sharddbg.Cluster.connect({report.name!r})  or  "
          f"%shard_cluster connect {report.name}\n"
          f"  stop it: sharddbg cluster stop {report.name}   (keeper log: {report.log})")
    return 0


def _read_back(args) -> int:
    """``sharddbg summary`` / ``sharddbg report``: load the trace, then print or write it."""
    import warnings

    from .errors import TraceFileError
    from .trace import load_trace

    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            trace = load_trace(args.path)
    except (TraceFileError, OSError) as e:
        print(f"sharddbg {args.command}: {e}", file=sys.stderr)
        return 1
    if args.command == "report":
        trace.to_html(args.output)
        print(f"sharddbg: wrote {args.output} ({len(trace.ranks)} ranks, {len(trace.findings)} findings)")
        return 0
    from .job_launcher import summary_text

    print(summary_text(trace, width=args.width))
    for w in caught:
        print(f"note: {w.message}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
