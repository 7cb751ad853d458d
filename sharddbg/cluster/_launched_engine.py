"""One rank's engine when ipyparallel's own launchers start the engines (``mpiexec``, ssh, Slurm's ``srun``).

Run as ``python -m sharddbg.cluster._launched_engine --cluster-id=ID [ipengine arguments]`` by
``MPIEngineSetLauncher``, ``SSHEngineSetLauncher`` or ``SlurmEngineSetLauncher`` (set up in
:mod:`sharddbg.cluster.engine_launchers`). It does what the fork server does for a forked engine
(``_zygote._run_engine``), then becomes an ipyparallel engine:

- its global rank from the launcher's environment: ``PMI_RANK`` (MPICH, Intel MPI), ``OMPI_COMM_WORLD_RANK``
  (Open MPI), ``SLURM_PROCID`` (srun); under ssh, the ranks sharddbg gave this host
  (``SHARDDBG_HOST_RANKS``), one claimed per engine in start order; ``LOCAL_RANK`` likewise, per host;
- its output into ``engine-rank<R>.log`` of the cluster's log folder on its host (0600);
- its address for torch.distributed: 127.0.0.1 when the cluster stays on one host, else the address on
  which this host reaches the controller (the interface the user named), and gloo's and NCCL's sockets on
  that interface only;
- ``bootstrap.on_fork(rank)`` (its stack dump on SIGUSR1), and, on the owner's host, the thread that ends
  the cluster when its owner is gone.
"""

from __future__ import annotations

import json
import os
import socket
import sys
import traceback

# where each launcher says which process of the job this is (global, then per host)
RANK_VARIABLES = ("PMI_RANK", "OMPI_COMM_WORLD_RANK", "SLURM_PROCID")
LOCAL_RANK_VARIABLES = ("MPI_LOCALRANKID", "OMPI_COMM_WORLD_LOCAL_RANK", "SLURM_LOCALID")
SIZE_VARIABLES = ("PMI_SIZE", "OMPI_COMM_WORLD_SIZE", "SLURM_NTASKS")


def _first(names, env) -> int | None:
    for name in names:
        if env.get(name, "").strip().isdigit():
            return int(env[name])
    return None


def _claim_slot(slot_dir: str, count: int) -> int:
    """Under ssh: the first of this host's ``count`` slots no other engine of the cluster has claimed (a file
    made with O_EXCL: two engines started at once never get the same one)."""
    os.makedirs(slot_dir, mode=0o700, exist_ok=True)
    for slot in range(count):
        try:
            os.close(os.open(os.path.join(slot_dir, f"slot-{slot}"), os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600))
            return slot
        except FileExistsError:
            continue
    raise RuntimeError(f"all {count} engine slots of this host are taken ({slot_dir}): more engines were "
                       f"started here than sharddbg gave it ranks")


def _rank_and_local_rank(env) -> tuple[int, int]:
    """This engine's (global rank, rank on its host), from the launcher's environment."""
    host_ranks = env.get("SHARDDBG_HOST_RANKS")
    if host_ranks:  # ssh: sharddbg's order
        ranks = [int(r) for r in host_ranks.split(",")]
        slot = _claim_slot(os.path.join(env["SHARDDBG_LOG_DIR"], "slots", env.get("SHARDDBG_HOST_KEY", "host")),
                           len(ranks))
        return ranks[slot], slot
    rank = _first(RANK_VARIABLES, env)
    if rank is None:
        raise RuntimeError("no rank in the environment: this engine was started by neither mpiexec (PMI_RANK, "
                           "OMPI_COMM_WORLD_RANK) nor srun (SLURM_PROCID) nor sharddbg's ssh set-up")
    local = _first(LOCAL_RANK_VARIABLES, env)
    return rank, rank if local is None else local


def _reachable_address(controller_ip: str) -> str:
    """This host's address toward the controller (no packet is sent: a UDP socket only picks its route)."""
    if controller_ip.startswith("127."):
        return "127.0.0.1"
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        probe.connect((controller_ip, 9))
        return probe.getsockname()[0]


def _interface_of(address: str) -> str | None:
    """The name of this host's network interface that holds ``address`` (None if none does)."""
    import psutil

    for name, addresses in psutil.net_if_addrs().items():
        if any(a.family == socket.AF_INET and a.address == address for a in addresses):
            return name
    return None


def identity() -> dict:
    """Where this engine runs: rank, rank on its host, pid, host name, address and GPU count (the cluster
    records them after the engines registered)."""
    import torch

    return {"rank": int(os.environ["RANK"]), "local_rank": int(os.environ["LOCAL_RANK"]), "pid": os.getpid(),
            "host": socket.gethostname(), "address": os.environ["SHARDDBG_ADDRESS"],
            "cuda_count": torch.cuda.device_count()}


def set_rendezvous(master_addr: str) -> None:
    """Rank 0's address, where every rank's torch.distributed meets (rank 0 serves the store there)."""
    os.environ["MASTER_ADDR"] = os.environ["SHARDDBG_MASTER_ADDR"] = master_addr


def _redirect_output(log_path: str) -> None:
    fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    os.fchmod(fd, 0o600)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    sys.stdout = open(1, "w", buffering=1, closefd=False)
    sys.stderr = open(2, "w", buffering=1, closefd=False)


def main(argv: list[str]) -> None:
    env = os.environ
    log_dir = env["SHARDDBG_LOG_DIR"]
    os.makedirs(log_dir, mode=0o700, exist_ok=True)  # on another host, the folder is made there
    rank, local_rank = _rank_and_local_rank(env)
    _redirect_output(os.path.join(log_dir, f"engine-rank{rank}.log"))
    controller_ip = env.get("SHARDDBG_CONTROLLER_IP", "127.0.0.1")
    address = _reachable_address(controller_ip)
    size = _first(SIZE_VARIABLES, env)
    env.update(RANK=str(rank), LOCAL_RANK=str(local_rank), SHARDDBG_LOCAL_RANK=str(local_rank), SHARDDBG_ADDRESS=address,
               WORLD_SIZE=str(size if size is not None else env.get("SHARDDBG_WORLD_SIZE", "")))
    if not address.startswith("127."):
        interface = _interface_of(address)
        if interface:  # only the interface the controller is reached on, unless the user set them
            env.setdefault("GLOO_SOCKET_IFNAME", interface)
            env.setdefault("NCCL_SOCKET_IFNAME", interface)
    print(json.dumps({"sharddbg_engine": {"rank": rank, "local_rank": local_rank, "pid": os.getpid(),
                                          "host": socket.gethostname(), "address": address}}), flush=True)
    from sharddbg.engine import bootstrap

    bootstrap.on_fork(rank)
    owner = env.get("SHARDDBG_OWNER")
    if owner and env.get("SHARDDBG_OWNER_HOST") == socket.gethostname():
        from sharddbg.cluster._zygote import end_cluster_when_owner_gone

        end_cluster_when_owner_gone(json.loads(owner), env["SHARDDBG_CLUSTER_ID"])
    from ipyparallel.engine.app import IPEngine

    # --mpi (added by MPIEngineSetLauncher) would import mpi4py for the rank: it comes from the environment here
    IPEngine.launch_instance(argv=[a for a in argv if a != "--mpi"] + [f"--IPEngine.id={rank}"])


if __name__ == "__main__":
    try:
        main(sys.argv[1:])
    except SystemExit:
        raise
    except BaseException:
        traceback.print_exc()
        sys.stdout.flush()
        os._exit(1)
