"""Engines started by ipyparallel's own launchers: ``mpiexec`` (``MPIEngineSetLauncher``), ssh
(``SSHEngineSetLauncher``) or Slurm (``SlurmEngineSetLauncher``), for ranks on more than one host.

``resolve_launcher`` checks the choice before anything starts (one sentence each, with the fix).
``LaunchedProcesses`` is ``ClusterProcesses`` with the engines started by that launcher instead of forked:
the fork server still starts the controller and keeps it under its lifeline, but preloads nothing (each
engine imports torch and physicsnemo itself). Each engine runs ``sharddbg.cluster._launched_engine``, which
takes its rank from the launcher's environment and does what the fork server does for a forked engine.

What stays on loopback: with ``ip=None`` the controller, the engines' connections, torch.distributed's
rendezvous store and gloo's sockets use 127.0.0.1 only (and MPICH's single-host process manager,
``mpiexec.gforker``, replaces ``mpiexec`` where it lies beside it: it opens no port). With ``ip=`` (an
interface name or one of this host's addresses) the controller listens there, each engine uses the interface
on which its host reaches the controller, and rank 0 serves the rendezvous store on its address there.
"""

from __future__ import annotations

import ipaddress
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field

import psutil

from ..errors import ClusterError
from . import registry
from .processes import POLL_S, ClusterProcesses, pid_alive, tail_of

LAUNCHERS = ("mpi", "ssh", "slurm")
# the MPI that .ci/requirements-tests.txt installs (its mpiexec lands in the venv's bin folder)
MPICH_REQUIREMENT = "mpich==4.3.2"
ENGINE_MODULE = "sharddbg.cluster._launched_engine"
# how long the ssh check of each host may take
SSH_CHECK_S = 15.0


@dataclass(frozen=True)
class LauncherChoice:
    """A checked ``Cluster(launcher=...)`` choice: which ipyparallel launcher starts the engines, where."""

    name: str  # mpi | ssh | slurm
    controller_ip: str  # where the controller listens: 127.0.0.1 unless ip= named another address
    hosts: dict[str, int] = field(default_factory=dict)  # ssh: host -> engines there, in rank order
    config: dict = field(default_factory=dict)  # traits for ipyparallel's launcher (mpi_args, ssh_args, ...)
    mpiexec: str | None = None

    @property
    def spans_hosts(self) -> bool:
        return not self.controller_ip.startswith("127.")


def _local_addresses() -> dict[str, str]:
    """This host's IPv4 addresses -> the interface holding each."""
    return {a.address: name for name, addrs in psutil.net_if_addrs().items()
            for a in addrs if a.family == socket.AF_INET}


def _resolve_ip(ip: str | None) -> str:
    """The controller's address for ``ip=``: 127.0.0.1 for None; an interface's IPv4 address for its name; an
    address of this host as it is. Raises ClusterError for anything else."""
    if ip is None:
        return "127.0.0.1"
    if not isinstance(ip, str) or not ip:
        raise ClusterError(f"ip must name a network interface of this host (e.g. 'eth0') or one of its addresses, "
                           f"got {ip!r}")
    addresses = _local_addresses()
    by_interface = {name: address for address, name in addresses.items()}
    if ip in by_interface:
        return by_interface[ip]
    try:
        ipaddress.IPv4Address(ip)
    except ValueError:
        raise ClusterError(f"ip={ip!r} is neither an interface nor an IPv4 address of this host; its interfaces: "
                           + ", ".join(f"{n} ({a})" for n, a in sorted(by_interface.items()))) from None
    if ip not in addresses:
        raise ClusterError(f"ip={ip!r} is not an address of this host, so the controller cannot listen there; give "
                           f"one of " + ", ".join(f"{a} ({n})" for a, n in sorted(addresses.items())))
    return ip


def _is_this_host(host: str) -> bool:
    """Whether ssh host ``host`` (``user@name:port`` allowed) is this machine."""
    name = host.split("@", 1)[-1].split(":", 1)[0]
    if name in ("localhost", socket.gethostname(), socket.getfqdn()):
        return True
    try:
        return socket.gethostbyname(name) in _local_addresses() or socket.gethostbyname(name).startswith("127.")
    except OSError:
        return False


def _find_mpiexec(config: dict) -> str | None:
    """``mpi_cmd`` of ``launcher_config``, else ``mpiexec`` on PATH, else beside this Python (a venv's bin)."""
    if config.get("mpi_cmd"):
        return shutil.which(config["mpi_cmd"][0])
    beside = os.path.join(os.path.dirname(sys.executable), "mpiexec")
    return shutil.which("mpiexec") or (beside if os.access(beside, os.X_OK) else None)


def _hosts(hosts, n: int) -> dict[str, int]:
    if not hosts:
        raise ClusterError("launcher='ssh' needs hosts=: the ssh hosts and how many engines each runs, e.g. "
                           "hosts={'node1': 4, 'node2': 4} (or a list with one entry per engine)")
    if isinstance(hosts, (list, tuple)):
        counted: dict[str, int] = {}
        for host in hosts:
            counted[host] = counted.get(host, 0) + 1
        hosts = counted
    if not (isinstance(hosts, dict) and all(isinstance(h, str) and h and isinstance(c, int) and not isinstance(c, bool)
                                            and c >= 1 for h, c in hosts.items())):
        raise ClusterError(f"hosts must map ssh host names to engine counts of at least 1 (e.g. {{'node1': 4}}), got "
                           f"{hosts!r}")
    if sum(hosts.values()) != n:
        raise ClusterError(f"hosts= gives {sum(hosts.values())} engines ({hosts}) but the cluster has {n} ranks: make "
                           f"the counts add up to {n}")
    return dict(hosts)


def resolve_launcher(launcher, n: int, *, ip=None, hosts=None, launcher_config=None) -> LauncherChoice | None:
    """The checked launcher choice of ``Cluster(launcher=..., ip=..., hosts=..., launcher_config=...)``.

    Every refusal is one sentence with the fix, before anything starts (ssh hosts are asked to answer later,
    at the start: ``LaunchedProcesses.start``).

    Parameters
    ----------
    launcher : {None, "mpi", "ssh", "slurm"}
        Who starts the engines; None: sharddbg's fork server.
    n : int
        The number of ranks.
    ip : str or None
        An interface name or an IPv4 address of this host for the controller; None: loopback.
    hosts : dict of str to int, list of str, or None
        ssh only: host -> engines there (a list: one entry per engine).
    launcher_config : dict or None
        Settings of ipyparallel's launcher (``mpi_args``, ``ssh_args``, ``batch_template``, ...).

    Returns
    -------
    LauncherChoice or None
        None for the fork server.

    Raises
    ------
    ClusterError
        An unknown launcher; ``mpi`` without ``mpiexec``; ``ssh`` without hosts, with counts that are not ``n``
        or with other machines and no ``ip``; ``slurm`` without ``sbatch``/``srun``; an ``ip`` that is not this
        host's; ``ip``, ``hosts`` or ``launcher_config`` without a launcher.

    Examples
    --------
    >>> resolve_launcher("ssh", 2, hosts=["localhost", "localhost"]).hosts
    {'localhost': 2}
    >>> resolve_launcher("torchrun", 4)
    Traceback (most recent call last):
    ClusterError: launcher must be None (the local fork server), 'mpi', 'ssh' or 'slurm', got 'torchrun'
    """
    if launcher is None:
        given = [name for name, value in (("ip", ip), ("hosts", hosts), ("launcher_config", launcher_config))
                 if value is not None]
        if given:
            raise ClusterError(f"{', '.join(given)} only apply with launcher='mpi', 'ssh' or 'slurm'; the local fork "
                               f"server (launcher=None) keeps everything on this host's loopback")
        return None
    if launcher not in LAUNCHERS:
        raise ClusterError(f"launcher must be None (the local fork server), 'mpi', 'ssh' or 'slurm', got {launcher!r}")
    if not isinstance(launcher_config or {}, dict):
        raise ClusterError(f"launcher_config must be a dict of the ipyparallel launcher's settings (e.g. "
                           f"{{'mpi_args': ['-hosts', 'a,b']}}), got {launcher_config!r}")
    config = dict(launcher_config or {})
    controller_ip = _resolve_ip(ip)
    if launcher != "ssh" and hosts is not None:
        raise ClusterError(f"hosts= is for launcher='ssh'; with launcher={launcher!r} say where the ranks run in "
                           f"launcher_config (mpi: {{'mpi_args': ['-hosts', 'a,b']}}; slurm: the job's options)")
    if launcher == "mpi":
        mpiexec = _find_mpiexec(config)
        if mpiexec is None:
            raise ClusterError(f"launcher='mpi' needs mpiexec, and none is on PATH or beside {sys.executable}: "
                               f"pip install {MPICH_REQUIREMENT} (into this environment), or load your MPI module "
                               f"(module load openmpi)")
        return LauncherChoice("mpi", controller_ip, config=config, mpiexec=mpiexec)
    if launcher == "ssh":
        checked = _hosts(hosts, n)
        remote = [h for h in checked if not _is_this_host(h)]
        if remote and controller_ip.startswith("127."):
            raise ClusterError(f"hosts {remote} are other machines, and they cannot reach a controller on loopback: "
                               f"give ip= the interface or address of this host they reach (e.g. ip='eth0')")
        if shutil.which((config.get("ssh_cmd") or ["ssh"])[0]) is None:
            raise ClusterError("launcher='ssh' needs the ssh client, and none is on PATH: install openssh-client")
        return LauncherChoice("ssh", controller_ip, hosts=checked, config=config)
    missing = [tool for tool in ("sbatch", "srun") if shutil.which(tool) is None]
    if missing:
        raise ClusterError(f"launcher='slurm' needs Slurm's {' and '.join(missing)}, not found on PATH: run on a "
                           f"Slurm login node (or load its module: module load slurm)")
    return LauncherChoice("slurm", controller_ip, config=config)


def _check_ssh_hosts(choice: LauncherChoice) -> None:
    """Each ssh host answers a command without a password (``ssh -o BatchMode=yes HOST true``); raises a
    ClusterError naming the first that does not, with ssh's own reason."""
    ssh = list(choice.config.get("ssh_cmd") or ["ssh"]) + list(choice.config.get("ssh_args") or [])
    for host in choice.hosts:
        location, _, port = host.partition(":")
        command = ssh + ["-o", "BatchMode=yes", "-o", f"ConnectTimeout={int(SSH_CHECK_S)}"]
        command += (["-p", port] if port else []) + [location, "true"]
        try:
            done = subprocess.run(command, capture_output=True, text=True, timeout=SSH_CHECK_S + 5,
                                  stdin=subprocess.DEVNULL)
            reason = (done.stderr.strip().splitlines() or [f"exit status {done.returncode}"])[-1]
            ok = done.returncode == 0
        except subprocess.TimeoutExpired:
            ok, reason = False, f"no answer within {SSH_CHECK_S:g} s"
        if not ok:
            raise ClusterError(f"ssh host {host!r} is unreachable ({reason}): check that `{' '.join(command)}` works "
                               f"without a password (a key in ssh-agent or ~/.ssh/config), or fix hosts=")


@dataclass(frozen=True)
class EnginePlace:
    """Where one launched engine runs, as it said itself once registered."""

    rank: int
    local_rank: int
    pid: int
    host: str
    address: str
    cuda_count: int
    on_this_host: bool


class LaunchedProcesses(ClusterProcesses):
    """The processes of a cluster whose engines ipyparallel's launcher starts (``choice``).

    Bookkeeping: the launcher's process (``mpiexec``, with its proxies and engines below it) and every engine
    on this host are named in the cluster's registry record as they start; ``processes()``, ``stop()`` and the
    reaping of orphans cover them (engines and ``mpiexec``/``srun`` are also found by their command line).
    Engines on other hosts are ended by their launcher (``mpiexec``, ``ssh ... kill``, ``scancel``), and end
    themselves when the controller is gone (ipyparallel's heartbeat).
    """

    def __init__(self, *, choice: LauncherChoice, **kwargs):
        super().__init__(**kwargs)
        self.choice = choice
        self.controller_ip = choice.controller_ip
        self.launcher = None  # ipyparallel's EngineSetLauncher while engines run
        self._loop = None  # the IOLoop the launcher reports on (never run: sharddbg watches the processes itself)
        self.places: dict[int, EnginePlace] = {}
        self._launched_n = 0  # how many engines the launcher was last asked for

    # ------------------------------------------------------------------ start
    def fork_server_config(self) -> dict:
        return {**super().fork_server_config(), "preload": False}

    def start(self, start_timeout: float) -> dict:
        if self.choice.name == "ssh":
            _check_ssh_hosts(self.choice)
        facts = super().start(start_timeout)
        facts["launcher"] = self.choice.name
        return facts

    def engine_env(self) -> dict:
        env = super().engine_env()
        owner = self.record.owner
        env.update(SHARDDBG_CONTROLLER_IP=self.controller_ip, SHARDDBG_OWNER_HOST=socket.gethostname(),
                   SHARDDBG_OWNER=json.dumps({"pid": owner.pid, "create_time": owner.create_time}))
        if self.choice.spans_hosts:
            # each engine picks the interface on which its host reaches the controller (``_launched_engine``)
            for name in ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME"):
                if name not in os.environ:
                    env.pop(name, None)
        if os.environ.get("PYTHONPATH"):  # ssh starts a bare environment: the same code as this process
            env.setdefault("PYTHONPATH", os.environ["PYTHONPATH"])
        env.update(self.extra_env)
        return env

    def _engine_args(self) -> list[str]:
        return [f"--profile-dir={registry.profile_dir()}", registry.cluster_id_arg(self.cluster_id),
                os.environ.get("SHARDDBG_ENGINE_LOG", "--log-level=WARN"), "--IPEngine.enable_nanny=False"]

    @property
    def launcher_log(self) -> str:
        """The launcher's own output (mpiexec's, sbatch's job output)."""
        return os.path.join(self.log_dir, "launcher.log")

    def _make_launcher(self, n: int):
        from ipyparallel.cluster import launcher as ipp_launchers
        from tornado.ioloop import IOLoop

        if self._loop is None:
            self._loop = IOLoop(make_current=False)
        os.close(registry.open_private(self.launcher_log))  # 0600 before the launcher appends to it
        env = self.engine_env()
        common = dict(profile_dir=str(registry.profile_dir()), cluster_id=self.cluster_id, loop=self._loop,
                      work_dir=self.log_dir, log=_quiet_log())
        config = dict(self.choice.config)
        engine_cmd = [config.pop("remote_python", sys.executable), "-m", ENGINE_MODULE]
        if self.choice.name == "mpi":
            mpi_cmd = config.pop("mpi_cmd", None) or [self._mpi_command()]
            return ipp_launchers.MPIEngineSetLauncher(
                **common, mpi_cmd=mpi_cmd, engine_cmd=engine_cmd, engine_args=self._engine_args(),
                environment={**env, "SHARDDBG_WORLD_SIZE": str(n)}, output_file=self.launcher_log, **config)
        if self.choice.name == "slurm":
            return ipp_launchers.SlurmEngineSetLauncher(
                **common, engine_cmd=engine_cmd, engine_args=self._engine_args(),
                environment={**env, "SHARDDBG_WORLD_SIZE": str(n)}, output_file=self.launcher_log, **config)
        engines, first = {}, 0
        for host, count in self.choice.hosts.items():
            host_env = {**env, "SHARDDBG_WORLD_SIZE": str(n), "SHARDDBG_HOST_KEY": f"{first}",
                        "SHARDDBG_HOST_RANKS": ",".join(str(r) for r in range(first, first + count))}
            engines[host] = {"n": count, "environment": host_env}
            if _is_this_host(host):
                engines[host]["to_send"] = []  # the connection files are here already (scp onto itself truncates)
            first += count
        return ipp_launchers.SSHEngineSetLauncher(
            **common, engines=engines, engine_cmd=engine_cmd, engine_args=self._engine_args(),
            remote_python=engine_cmd[0], delay=0.0, **config)

    def _mpi_command(self) -> str:
        """``mpiexec``; on one host MPICH's ``mpiexec.gforker`` beside it where it exists (it opens no port,
        while hydra's ``mpiexec`` listens on every interface for its proxies)."""
        gforker = os.path.join(os.path.dirname(self.choice.mpiexec), "mpiexec.gforker")
        if not self.choice.spans_hosts and not self.choice.config.get("mpi_args") and os.access(gforker, os.X_OK):
            return gforker
        return self.choice.mpiexec

    def launch_engines(self, n: int, start_timeout: float):
        """The launcher starts ``n`` engines; waits until all registered; records where each runs (its rank,
        host, pid, address) and tells every engine rank 0's address for the rendezvous; returns a connected
        ipyparallel Client."""
        import ipyparallel as ipp

        from . import _launched_engine

        deadline = time.monotonic() + start_timeout
        client_file = self._wait_connection_files(deadline)
        shutil.rmtree(os.path.join(self.log_dir, "slots"), ignore_errors=True)  # ssh: the last start's claims
        self._launched_n = n
        self.launcher = self._make_launcher(n)
        try:
            self.launcher.start(n)
        except Exception as exc:
            raise ClusterError(f"{self.choice.name}: ipyparallel's launcher could not start the engines: "
                               f"{type(exc).__name__}: {exc}{self._launcher_log_tail()}") from exc
        if self.choice.name == "mpi":
            self.record.track(self.launcher.pid, "launcher")
        with open(client_file) as f:
            connection = json.load(f)
        client = ipp.Client(connection, profile_dir=str(registry.profile_dir()),
                            timeout=max(1.0, deadline - time.monotonic()))
        try:
            while len(client.ids) < n:
                failure = self.controller_failure() or self._launcher_failure()
                if failure:
                    raise ClusterError(f"{failure} while {n} engines were registering.{self._launcher_log_tail()}"
                                       f"{self._engine_logs_tail()}")
                if time.monotonic() > deadline:
                    raise ClusterError(f"only {len(client.ids)} of {n} engines registered within {start_timeout:.0f} s "
                                       f"(launcher {self.choice.name}).{self._launcher_log_tail()}"
                                       f"{self._engine_logs_tail()}")
                time.sleep(POLL_S)
            rows = client[:].apply_async(_launched_engine.identity).get(timeout=max(1.0, deadline - time.monotonic()))
            here = socket.gethostname()
            self.places = {row["rank"]: EnginePlace(**row, on_this_host=row["host"] == here) for row in rows}
            if sorted(self.places) != list(range(n)):
                raise ClusterError(f"the launcher's engines say they are ranks {sorted(self.places)}, not 0..{n - 1}: "
                                   f"start exactly {n} engines (one per rank)")
            self.pids = {rank: place.pid for rank, place in self.places.items()}
            for place in self.places.values():
                if place.on_this_host:
                    self.record.track(place.pid, "engine")
            client[:].apply_async(_launched_engine.set_rendezvous, self.places[0].address).get(
                timeout=max(1.0, deadline - time.monotonic()))
        except BaseException:
            client.close()
            raise
        self._track_controller_children()
        self.facts["hosts"] = sorted({place.host for place in self.places.values()})
        self.facts["cuda_count"] = min(place.cuda_count for place in self.places.values())
        return client

    def engine_backend(self, requested: str | None) -> str:
        """``requested``, or NCCL when every engine sees a GPU and gloo otherwise; refuses NCCL on a host with
        fewer GPUs than ranks."""
        per_host: dict[str, list[EnginePlace]] = {}
        for place in self.places.values():
            per_host.setdefault(place.host, []).append(place)
        backend = requested or ("nccl" if all(p.cuda_count > 0 for p in self.places.values()) else "gloo")
        if backend == "nccl":
            short = {host: (len(ps), min(p.cuda_count for p in ps)) for host, ps in per_host.items()
                     if len(ps) > min(p.cuda_count for p in ps)}
            if short:
                raise ClusterError(f"backend='nccl' needs one GPU per rank, and hosts have fewer ({short}: ranks, "
                                   f"GPUs); start fewer engines per host, or use backend='gloo'")
        return backend

    def _launcher_failure(self) -> str | None:
        """How the launcher's own process ended, for mpiexec (None while it runs, or for ssh and Slurm)."""
        process = getattr(self.launcher, "process", None) if self.choice.name == "mpi" else None
        if process is None:
            return None
        try:
            if process.status() != psutil.STATUS_ZOMBIE:
                return None
            code = process.wait(0)
        except psutil.NoSuchProcess:
            code = None
        except psutil.TimeoutExpired:
            return None
        return f"mpiexec (pid {process.pid}) ended" + (f" with status {code}" if code is not None else "")

    def _launcher_log_tail(self) -> str:
        tail = tail_of(self.launcher_log)
        return f"\nlast lines of the launcher's output ({self.launcher_log}):\n    " + "\n    ".join(
            tail.splitlines()) if tail else ""

    def _engine_logs_tail(self) -> str:
        parts = []
        for rank in range(self._launched_n):
            tail = self.log_tail(rank)
            if tail:
                parts.append(f"\nlast lines of rank {rank}'s log:\n    " + "\n    ".join(tail.splitlines()[-6:]))
        return "".join(parts[:4])

    # ------------------------------------------------------------------ restart, stop
    def replace_engines(self) -> None:
        """The launcher's engines ended and the controller started again (the fork server stays): ready for
        ``launch_engines``, which starts new engines through the launcher (a restart imports torch and
        physicsnemo in every engine again: no fork server preloads them)."""
        self._end_engines()
        self.pids = {}
        self.stop_controller()
        self.start_controller()

    def _end_engines(self) -> None:
        """Every engine down: the launcher's way (mpiexec's tree killed, ``kill`` over ssh, ``scancel``), then
        whatever still runs of them on this host."""
        launcher, self.launcher = self.launcher, None
        doomed: list[psutil.Process] = []
        for place in self.places.values():
            if place.on_this_host and pid_alive(place.pid):
                try:
                    doomed.append(psutil.Process(place.pid))
                except psutil.NoSuchProcess:
                    pass
        if launcher is not None:
            try:
                if self.choice.name == "mpi" and launcher.process is not None:
                    top = psutil.Process(launcher.pid)
                    doomed += [top] + top.children(recursive=True)
                elif self.choice.name == "slurm" and launcher.job_id:
                    launcher.stop()  # scancel
                elif self.choice.name == "ssh":
                    for host, one in launcher.launchers.items():
                        if not _is_this_host(host.rsplit("/", 1)[0]):
                            one.signal(signal.SIGKILL)
            except (psutil.Error, OSError, subprocess.CalledProcessError, Exception):  # noqa: BLE001 - best effort
                pass
        registry.kill_processes(doomed)
        self.places = {}

    def shut_down(self) -> list[psutil.Process]:
        try:
            self._end_engines()
        except (psutil.Error, OSError):
            pass
        if self._loop is not None:
            self._loop.close(all_fds=False)
            self._loop = None
        return super().shut_down()

    # ------------------------------------------------------------------ state
    def dead_ranks(self) -> dict[int, str]:
        """Ranks on this host whose engine process has exited (a rank elsewhere shows as lost once ipyparallel's
        heartbeat misses it: its pid means nothing here)."""
        return {rank: "is gone (its process no longer exists)" for rank, pid in self.pids.items()
                if rank in self.places and self.places[rank].on_this_host and not pid_alive(pid)}


def _quiet_log():
    """A logger for ipyparallel's launcher that says only warnings (sharddbg reports failures itself)."""
    import logging

    log = logging.getLogger("sharddbg.launcher")
    log.setLevel(logging.WARNING)
    return log
