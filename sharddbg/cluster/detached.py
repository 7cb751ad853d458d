"""Clusters that outlive the process that uses them: started from a terminal, owned by a keeper process.

``sharddbg cluster start`` starts a keeper (``sharddbg.cluster.keeper``): a small process in a session of its
own, its output going to ``<home>/detached/<name>.log``, that holds the ``Cluster`` and its fork server (so the
fork server's lifeline runs to the keeper, and the registry record names the keeper as the owner: ``sharddbg
reap`` leaves the cluster alone while the keeper lives, and reaps it once the keeper is gone). The keeper
answers requests on a Unix socket ``<home>/detached/<name>.sock`` (0600, in a 0700 folder): what the cluster
is, stop, restart, and the notes a connected process leaves (a broken process group, the last trace, the
mesh). Its record ``<home>/detached/<name>.json`` (0600) names the cluster, the keeper and the socket; once
stopped, it stays as a record of how the cluster ended, until its name is used again.

A process connects (``Cluster.connect``) like ipyparallel's clients do: its own client to the controller, from
the controller's connection file; the engines keep their variables across the connecting process's lifetime.
What the cluster is (ranks, mesh, backend, patch mode, collective timeout) is read back from the engines;
what only the client side knew (a broken process group, the last trace) from the keeper's notes.
"""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import psutil

from ..errors import ClusterError
from . import registry
from .execution import BrokenGroup, RankExecution
from .mesh import MeshSpec
from .processes import pid_alive
from .recording import CellTracer

DETACHED_FOLDER = "detached"
KEEPER_PROGRAM = "sharddbg.cluster.keeper"
NAME_PATTERN = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")
DEFAULT_NAME = "cluster"
# a request to the keeper that is not about starting, stopping or restarting is answered at once
KEEPER_ANSWER_S = 5.0


def detached_dir() -> Path:
    """``<home>/detached``: the keepers' records, sockets and logs (0700).

    Returns
    -------
    pathlib.Path
        The folder, created if missing.

    Examples
    --------
    >>> detached_dir().name
    'detached'
    """
    home = registry.private_dir(registry.sharddbg_home())
    return registry.private_dir(home / DETACHED_FOLDER)


def check_name(name: str) -> str:
    """``name`` if it can name a detached cluster (letters, digits, ``_ . -``; at most 64).

    Parameters
    ----------
    name : str
        The name asked for.

    Returns
    -------
    str
        The name.

    Raises
    ------
    ClusterError
        The name has other characters, or is empty or too long.

    Examples
    --------
    >>> check_name("dev")
    'dev'
    """
    if not isinstance(name, str) or not NAME_PATTERN.match(name):
        raise ClusterError(f"{name!r} cannot name a cluster: use letters, digits, '_', '.' and '-' (at most 64, "
                           f"starting with a letter or digit), e.g. --name dev")
    return name


@dataclass
class DetachedRecord:
    """What ``<home>/detached/<name>.json`` says of one detached cluster."""

    name: str
    keeper_pid: int
    keeper_create_time: float
    uid: int
    state: str  # starting | running | stopped
    started: float = field(default_factory=time.time)
    cluster_id: str = ""
    n: int = 0
    mesh: str = ""
    backend: str | None = None
    idle_timeout_s: float | None = None
    start_s: float | None = None
    stopped_at: float | None = None
    stop_reason: str = ""

    @property
    def path(self) -> Path:
        return detached_dir() / f"{self.name}.json"

    @property
    def socket_path(self) -> Path:
        return socket_path(self.name)

    def save(self) -> None:
        """Write the record (0600, atomically).

        Returns
        -------
        None

        Examples
        --------
        >>> record.save()
        """
        registry.write_private(self.path, json.dumps(asdict(self), indent=1))

    def keeper_alive(self) -> bool:
        """Whether the keeper the record names still runs (the same process: its start time matches).

        Returns
        -------
        bool
            True while it runs.

        Examples
        --------
        >>> record.keeper_alive()
        True
        """
        return registry.ProcessRef(self.keeper_pid, self.keeper_create_time, "keeper").alive()

    @property
    def live(self) -> bool:
        """Running or starting, and its keeper alive."""
        return self.state in ("starting", "running") and self.keeper_alive()


def socket_path(name: str) -> Path:
    """The keeper's socket of cluster ``name``.

    Parameters
    ----------
    name : str
        The cluster's name.

    Returns
    -------
    pathlib.Path
        ``<home>/detached/<name>.sock``.

    Examples
    --------
    >>> socket_path("dev").name
    'dev.sock'
    """
    return detached_dir() / f"{name}.sock"


def keeper_log_path(name: str) -> Path:
    """Where the keeper of cluster ``name`` writes its output.

    Parameters
    ----------
    name : str
        The cluster's name.

    Returns
    -------
    pathlib.Path
        ``<home>/detached/<name>.log``.

    Examples
    --------
    >>> keeper_log_path("dev").name
    'dev.log'
    """
    return detached_dir() / f"{name}.log"


def read_record(name: str) -> DetachedRecord | None:
    """The record of cluster ``name``; None when there is none.

    Parameters
    ----------
    name : str
        The cluster's name.

    Returns
    -------
    DetachedRecord or None
        Its record.

    Raises
    ------
    ClusterError
        The record belongs to another user, or cannot be read.

    Examples
    --------
    >>> read_record("dev").state
    'running'
    """
    path = detached_dir() / f"{name}.json"
    try:
        info = path.stat()
        data = json.loads(path.read_text())
        record = DetachedRecord(**data)
    except FileNotFoundError:
        return None
    except PermissionError:
        raise ClusterError(f"the cluster {name!r} belongs to another user (its record {path} cannot be read): "
                           f"connect to a cluster of your own, or start one with "
                           f"`sharddbg cluster start -n 4 --name {name}-$USER`") from None
    except (ValueError, TypeError) as exc:
        raise ClusterError(f"the record of cluster {name!r} ({path}) is corrupt ({exc}); remove it and start the "
                           f"cluster again: `sharddbg cluster start -n 4 --name {name}`") from None
    owner = info.st_uid if info.st_uid != os.getuid() else record.uid
    if owner != os.getuid():
        raise ClusterError(f"the cluster {name!r} belongs to another user (uid {owner}; you are uid {os.getuid()}): "
                           f"sharddbg connects only to its own user's clusters; start one of yours with "
                           f"`sharddbg cluster start -n 4 --name {name}-$USER`")
    return record


def all_records() -> list[DetachedRecord]:
    """Every detached cluster record of this user, oldest first (another user's or a corrupt one left out).

    Returns
    -------
    list of DetachedRecord
        Running, starting and stopped ones.

    Examples
    --------
    >>> [r.name for r in all_records()]
    ['dev']
    """
    records = []
    for path in detached_dir().glob("*.json"):
        try:
            record = read_record(path.stem)
        except ClusterError:
            continue
        if record is not None:
            records.append(record)
    return sorted(records, key=lambda r: r.started)


def running_names() -> list[str]:
    """The names of this user's detached clusters that run (or are starting).

    Returns
    -------
    list of str
        Their names, oldest first.

    Examples
    --------
    >>> running_names()
    ['dev']
    """
    return [r.name for r in all_records() if r.live]


def _existing_text() -> str:
    names = running_names()
    return (f"running: {', '.join(names)}" if names else
            "none runs (start one in a terminal: `sharddbg cluster start -n 4 --name NAME`)")


def find(name: str | None) -> DetachedRecord:
    """The running detached cluster ``name`` (None: the only one of this user).

    Parameters
    ----------
    name : str or None
        Its name.

    Returns
    -------
    DetachedRecord
        Its record, its keeper alive.

    Raises
    ------
    ClusterError
        No cluster of that name (what exists is listed); it belongs to another user; it stopped (how and when);
        its keeper died; or, with no name, none or several run.

    Examples
    --------
    >>> find(None).name
    'dev'
    """
    if name is None:
        names = running_names()
        if len(names) == 1:
            return find(names[0])
        if not names:
            raise ClusterError("no detached sharddbg cluster runs for this user; start one in a terminal: "
                               "`sharddbg cluster start -n 4 --name NAME`, then Cluster.connect('NAME')")
        raise ClusterError(f"{len(names)} detached clusters run ({', '.join(names)}); name one: "
                           f"Cluster.connect({names[0]!r}) or %shard_cluster connect {names[0]}")
    check_name(name)
    record = read_record(name)
    if record is None:
        raise ClusterError(f"no detached cluster is named {name!r} ({_existing_text()}); "
                           f"`sharddbg cluster list` shows every cluster")
    if record.state == "stopped":
        when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(record.stopped_at or 0))
        raise ClusterError(f"the cluster {name!r} stopped at {when} ({record.stop_reason or 'stopped'}); start it "
                           f"again in a terminal: `sharddbg cluster start -n {record.n or 4} --name {name}`")
    if not record.keeper_alive():
        raise ClusterError(f"the keeper of cluster {name!r} (pid {record.keeper_pid}) is gone, so is the cluster; "
                           f"`sharddbg reap` cleans up what is left, then `sharddbg cluster start ... --name {name}` "
                           f"starts it again (its log: {keeper_log_path(name)})")
    if record.state != "running":
        raise ClusterError(f"the cluster {name!r} is still starting (keeper pid {record.keeper_pid}); wait for "
                           f"`sharddbg cluster start` to return, then connect")
    return record


class KeeperLink:
    """Requests to the keeper of one detached cluster, over its Unix socket (one connection per request)."""

    def __init__(self, record: DetachedRecord):
        self.name = record.name
        self.keeper_pid = record.keeper_pid
        self.keeper_create_time = record.keeper_create_time
        self.path = str(record.socket_path)

    def keeper_alive(self) -> bool:
        """Whether the keeper still runs.

        Returns
        -------
        bool
            True while it runs.

        Examples
        --------
        >>> link.keeper_alive()
        True
        """
        return registry.ProcessRef(self.keeper_pid, self.keeper_create_time, "keeper").alive()

    def request(self, command: str, timeout: float = KEEPER_ANSWER_S, **fields) -> dict:
        """Send ``command`` (with ``fields``) and return the keeper's answer.

        Parameters
        ----------
        command : str
            ``info``, ``exits``, ``note``, ``restart`` or ``stop``.
        timeout : float
            Seconds to wait for the answer.
        **fields
            What the command carries (a note's ``broken``, ``last_trace``, ``mesh``).

        Returns
        -------
        dict
            The answer.

        Raises
        ------
        ClusterError
            The keeper cannot be reached, did not answer in time, or answered with an error.

        Examples
        --------
        >>> link.request("info")["n"]
        2
        """
        message = json.dumps({"cmd": command, **fields}).encode() + b"\n"
        try:
            with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as conn:
                conn.settimeout(timeout)
                conn.connect(self.path)
                conn.sendall(message)
                chunks = []
                while True:
                    chunk = conn.recv(65536)
                    if not chunk:
                        break
                    chunks.append(chunk)
            answer = json.loads(b"".join(chunks) or b"null")
        except (OSError, ValueError) as exc:
            alive = "runs" if self.keeper_alive() else "is gone"
            raise ClusterError(f"the keeper of cluster {self.name!r} (pid {self.keeper_pid}, which {alive}) did not "
                               f"answer {command!r}: {type(exc).__name__}: {exc}; its log: "
                               f"{keeper_log_path(self.name)}") from None
        if not isinstance(answer, dict):
            raise ClusterError(f"the keeper of cluster {self.name!r} closed the connection without answering "
                               f"{command!r}; its log: {keeper_log_path(self.name)}")
        if answer.get("error"):
            raise ClusterError(answer["error"])
        return answer

    def note(self, **fields) -> None:
        """Leave the keeper a note (best effort: a keeper gone is found by the next call that needs it).

        Parameters
        ----------
        **fields
            ``broken`` (the cause, or None), ``last_trace`` (a path), ``mesh`` (``"ddp=1,domain=2"``).

        Returns
        -------
        None

        Examples
        --------
        >>> link.note(broken=None)
        """
        try:
            self.request("note", **fields)
        except ClusterError:
            pass


class KeeperProcesses:
    """The processes of a detached cluster as a connected process sees them: what ``ClusterProcesses`` tells
    its own cluster, read from the process table and asked of the keeper (which the fork server reports to)."""

    def __init__(self, link: KeeperLink, info: dict):
        self.link = link
        self.cluster_id = info["cluster_id"]
        self.log_dir = info["log_dir"]
        self.pids = {int(r): int(p) for r, p in info["pids"].items()}
        self.facts = dict(info.get("facts") or {})
        self.fork_server_pid = info.get("fork_server_pid")
        self.controller_pid = info.get("controller_pid")
        self.fork_server = None  # the keeper holds it
        self.reference = None

    def fork_server_alive(self) -> bool:
        """Whether the keeper's fork server runs.

        Returns
        -------
        bool
            True while it runs.

        Examples
        --------
        >>> processes.fork_server_alive()
        True
        """
        return self.fork_server_pid is not None and pid_alive(self.fork_server_pid)

    def controller_failure(self) -> str | None:
        """None while the controller runs; else how it died (asked of the keeper).

        Returns
        -------
        str or None
            How the controller died.

        Examples
        --------
        >>> processes.controller_failure() is None
        True
        """
        if self.controller_pid is None or pid_alive(self.controller_pid):
            return None
        try:
            return self.link.request("exits").get("controller") or f"the controller (pid {self.controller_pid}) died"
        except ClusterError:
            record = read_record(self.link.name)
            if record is not None and record.state == "stopped" and record.cluster_id == self.cluster_id:
                return f"the cluster {self.link.name!r} was {record.stop_reason or 'stopped'}"
            return f"the controller (pid {self.controller_pid}) died; how is unknown: its keeper does not answer"

    def dead_ranks(self) -> dict[int, str]:
        """Ranks whose engine has exited, with how (as the keeper's fork server saw it).

        Returns
        -------
        dict of int to str
            Rank -> how it ended.

        Examples
        --------
        >>> processes.dead_ranks()
        {}
        """
        gone = [rank for rank, pid in self.pids.items() if not pid_alive(pid)]
        if not gone:
            return {}
        try:
            how = {int(r): text for r, text in self.link.request("exits").get("ranks", {}).items()}
        except ClusterError:
            how = {}
        return {rank: how.get(rank, "is gone (its process no longer exists)") for rank in gone}

    def live(self) -> list[psutil.Process]:
        """Every process of the cluster that runs, its keeper included.

        Returns
        -------
        list of psutil.Process
            The processes.

        Examples
        --------
        >>> len(processes.live()) > 0
        True
        """
        return live_processes(self.cluster_id, self.link.keeper_pid, self.link.keeper_create_time)

    def log_tail(self, rank: int) -> str:
        """The end of rank ``rank``'s engine log.

        Parameters
        ----------
        rank : int
            The rank.

        Returns
        -------
        str
            Its last lines ("" when there is none).

        Examples
        --------
        >>> processes.log_tail(0)
        ''
        """
        from .processes import ClusterProcesses

        return ClusterProcesses.log_tail(self, rank)

    def describe_dead(self, dead: dict[int, str], what: str) -> str:
        """The message for ranks that died while running ``what`` (as ``ClusterProcesses.describe_dead``).

        Parameters
        ----------
        dead : dict of int to str
            Rank -> how it died.
        what : str
            What they ran.

        Returns
        -------
        str
            The message.

        Examples
        --------
        >>> processes.describe_dead({1: "killed by signal 9 (SIGKILL)"}, "the cell")
        'rank 1 (pid 4242) died while running the cell: killed by signal 9 (SIGKILL)'
        """
        from .processes import ClusterProcesses

        return ClusterProcesses.describe_dead(self, dead, what)

    def warm_reference(self):
        """The warm Python that forks the checks' reference processes, this process's own (its stdin is its
        lifeline to this process; ``close`` ends it); None where it cannot start.

        Returns
        -------
        WarmReference or None
            Serving now, or None.

        Examples
        --------
        >>> processes.warm_reference().serves_now()
        True
        """
        from .reference_process import WarmReference

        if self.reference is not None and self.reference.serves_now():
            return self.reference
        self.close()
        try:
            self.reference = WarmReference()
        except OSError:
            return None  # each reference then runs as a new Python
        return self.reference

    def close(self) -> None:
        """End this process's warm reference Python, if one runs (the cluster itself is the keeper's).

        Returns
        -------
        None

        Examples
        --------
        >>> processes.close()
        """
        if self.reference is not None:
            self.reference.close()
            self.reference = None


def live_processes(cluster_id: str, keeper_pid: int | None = None, keeper_create_time: float = 0.0) -> list[psutil.Process]:
    """Every process of cluster ``cluster_id`` that runs (registry record, command lines), and its keeper.

    Parameters
    ----------
    cluster_id : str
        The cluster's id.
    keeper_pid : int, optional
        Its keeper.
    keeper_create_time : float
        The keeper's start time (a recycled pid is not it).

    Returns
    -------
    list of psutil.Process
        What still runs.

    Examples
    --------
    >>> live_processes("sdbg-20260101-000000-abcdef")
    []
    """
    records = [r for r in registry.all_records() if r.cluster_id == cluster_id]
    found = {p.pid: p for r in records for p in r.live_processes()}
    for proc in registry.cluster_processes(cluster_id):
        found.setdefault(proc.pid, proc)
    if keeper_pid is not None and registry.ProcessRef(keeper_pid, keeper_create_time, "keeper").alive():
        found.setdefault(keeper_pid, psutil.Process(keeper_pid))
    found.pop(os.getpid(), None)
    return list(found.values())


class ConnectedExecution(RankExecution):
    """``RankExecution`` of a connected process: a process group found broken (or recovered) is noted with the
    keeper at once, so that the next process that connects reads it back."""

    def __init__(self, client, engine_ids, processes, control, default_timeout: float, link: KeeperLink,
                 broken: str | None):
        self._link = None  # no note while the base class sets its fields
        super().__init__(client, engine_ids, processes, control, default_timeout)
        self._broken = BrokenGroup(broken) if broken else None
        self._link = link

    @property
    def broken(self) -> BrokenGroup | None:
        return self._broken

    @broken.setter
    def broken(self, value: BrokenGroup | None) -> None:
        changed = (value.cause if value else None) != (getattr(self, "_broken", None) and self._broken.cause)
        self._broken = value
        if changed and self._link is not None:
            self._link.note(broken=value.cause if value else None)


class ConnectedTracer(CellTracer):
    """``CellTracer`` of a connected process: each new trace is saved where the keeper can name it (read back by
    the next process that connects, lazily, when it asks for the last trace)."""

    def __init__(self, link: KeeperLink, cluster_id: str, saved: str | None):
        super().__init__()
        self._link = link
        self._cluster_id = cluster_id
        self._saved = saved  # a path to load from when asked
        self._trace = None

    @property
    def last(self):
        if self._trace is None and self._saved and os.path.exists(self._saved):
            from ..trace import load_trace

            self._trace = load_trace(self._saved)
        return self._trace

    @last.setter
    def last(self, trace) -> None:
        self._trace = trace
        if trace is None or getattr(self, "_link", None) is None:
            return
        from .state_file import last_trace_path

        path = last_trace_path(self._cluster_id)
        try:
            trace.save(path)
            os.chmod(path, registry.PRIVATE_FILE_MODE)
        except Exception:  # a trace that cannot be saved stays this process's only
            return
        self._saved = str(path)
        self._link.note(last_trace=str(path))


@dataclass
class ReadBack:
    """What a connected process reads back from the engines: each rank's status row, the mesh, backend."""

    statuses: list[dict]
    mesh: MeshSpec
    backend: str | None
    use_cuda: bool
    collective_timeout: float | None


def read_back(execution: RankExecution, n: int, timeout: float) -> ReadBack:
    """Ask every live rank what it is (``engine.api.status``); the mesh from their coordinates.

    Parameters
    ----------
    execution : RankExecution
        The connected execution.
    n : int
        The number of ranks.
    timeout : float
        Seconds the ranks get to answer.

    Returns
    -------
    ReadBack
        The statuses and what they say.

    Raises
    ------
    ClusterError
        No rank answered (every one is dead or busy).

    Examples
    --------
    >>> read_back(execution, 2, 10.0).mesh
    MeshSpec(ddp=1, domain=2)
    """
    from ..engine import api

    dead = execution.processes.dead_ranks()
    live = [r for r in range(n) if r not in dead]
    rows = dict(zip(live, execution.call(api.status, ranks=live, timeout=timeout, what="reading the cluster back")))
    if not rows:
        raise ClusterError(f"no rank of the cluster answered ({execution.dead_message(dead)})")
    statuses = [rows.get(r, {"rank": r}) for r in range(n)]
    answered = list(rows.values())
    domain = max(int(row.get("domain") or 0) for row in answered) + 1
    mesh = MeshSpec(n // domain, domain)
    backend = answered[0].get("backend")
    device = str(answered[0].get("device") or "cpu")
    return ReadBack(statuses, mesh, backend, device.startswith("cuda"), answered[0].get("collective_timeout_s"))


def client_file(cluster_id: str) -> Path:
    """The controller's client connection file of cluster ``cluster_id`` (in sharddbg's profile, 0600).

    Parameters
    ----------
    cluster_id : str
        The cluster's id.

    Returns
    -------
    pathlib.Path
        ``<home>/profile_sharddbg/security/ipcontroller-<id>-client.json``.

    Examples
    --------
    >>> client_file("sdbg-x").name
    'ipcontroller-sdbg-x-client.json'
    """
    return registry.profile_dir() / "security" / f"ipcontroller-{cluster_id}-client.json"


def connect_client(info: dict, timeout: float):
    """An ipyparallel client connected to the detached cluster's controller.

    Parameters
    ----------
    info : dict
        The keeper's ``info`` answer.
    timeout : float
        Seconds to connect.

    Returns
    -------
    ipyparallel.Client
        Connected.

    Raises
    ------
    ClusterError
        The connection file is missing or the controller does not answer.

    Examples
    --------
    >>> connect_client(link.request("info"), 10.0).ids
    [0, 1]
    """
    import ipyparallel as ipp

    path = info["client_file"]
    try:
        with open(path) as f:
            connection = json.load(f)
        return ipp.Client(connection, profile_dir=str(registry.profile_dir()), timeout=timeout)
    except Exception as exc:
        raise ClusterError(f"could not connect to the controller of cluster {info.get('name')!r} ({path}): "
                           f"{type(exc).__name__}: {exc}; `sharddbg cluster list` shows its state") from None


def open_link(name: str | None) -> tuple[KeeperLink, dict]:
    """The keeper of cluster ``name`` (None: the only one) and its ``info`` answer.

    Parameters
    ----------
    name : str or None
        The cluster's name.

    Returns
    -------
    tuple of (KeeperLink, dict)
        The link and what the keeper says of the cluster.

    Raises
    ------
    ClusterError
        What ``find`` raises; the keeper does not answer.

    Examples
    --------
    >>> link, info = open_link("dev")
    """
    record = find(name)
    link = KeeperLink(record)
    return link, link.request("info")


# ---------------------------------------------------------------------------------------------------- terminal
@dataclass
class StartReport:
    """What ``sharddbg cluster start`` prints: the keeper's answer once the cluster is up."""

    name: str
    cluster_id: str
    n: int
    mesh: str
    backend: str
    patch_mode: str | None
    keeper_pid: int
    seconds: float
    idle_timeout_s: float | None
    log: str


def default_name() -> str:
    """The first of ``cluster``, ``cluster-2``, ... that no running cluster uses.

    Returns
    -------
    str
        A free name.

    Examples
    --------
    >>> default_name()
    'cluster'
    """
    used = set(running_names())
    if DEFAULT_NAME not in used:
        return DEFAULT_NAME
    return next(f"{DEFAULT_NAME}-{i}" for i in range(2, 1000) if f"{DEFAULT_NAME}-{i}" not in used)


def check_free(name: str) -> None:
    """Refuse ``name`` if a running (or starting) detached cluster has it.

    Parameters
    ----------
    name : str
        The name asked for.

    Returns
    -------
    None

    Raises
    ------
    ClusterError
        The name is in use (or not a valid name, or another user's).

    Examples
    --------
    >>> check_free("fresh")
    """
    check_name(name)
    record = read_record(name)
    if record is not None and record.live:
        raise ClusterError(f"a cluster named {name!r} runs already (keeper pid {record.keeper_pid}, {record.n} "
                           f"ranks): pick another --name, or `sharddbg cluster stop {name}` first")


def prune_stopped(keep: int = registry.KEPT_LOG_FOLDERS) -> list[str]:
    """Remove the records (and keeper logs) of all but the newest ``keep`` stopped clusters.

    Parameters
    ----------
    keep : int
        How many stopped clusters' records to keep.

    Returns
    -------
    list of str
        The names removed.

    Examples
    --------
    >>> prune_stopped()
    []
    """
    stopped = sorted((r for r in all_records() if r.state == "stopped"), key=lambda r: r.stopped_at or 0, reverse=True)
    for record in stopped[keep:]:
        record.path.unlink(missing_ok=True)
        keeper_log_path(record.name).unlink(missing_ok=True)
    return [r.name for r in stopped[keep:]]


def start(config: dict, wait_s: float) -> StartReport:
    """Start a keeper for a detached cluster and wait until the cluster is up.

    Parameters
    ----------
    config : dict
        ``name``, ``n``, ``mesh``, ``backend``, ``timeout``, ``collective_timeout``, ``idle_timeout``, ``force``.
    wait_s : float
        Seconds to wait for the start.

    Returns
    -------
    StartReport
        The cluster, up.

    Raises
    ------
    ClusterError
        The start failed (the keeper's reason; nothing is left running) or took longer than ``wait_s``.

    Examples
    --------
    >>> start({"name": "dev", "n": 2, "mesh": None}, 300).n
    2
    """
    name = config["name"]
    check_free(name)
    prune_stopped()
    log = keeper_log_path(name)
    read_end, write_end = os.pipe()
    out = registry.open_private(log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
    t0 = time.perf_counter()
    try:
        proc = subprocess.Popen(
            [sys.executable, "-m", KEEPER_PROGRAM, f"--detached-name={name}", json.dumps({**config, "ready_fd": write_end})],
            stdin=subprocess.DEVNULL, stdout=out, stderr=out, pass_fds=(write_end,), start_new_session=True,
            close_fds=True)
    finally:
        os.close(out)
        os.close(write_end)
    deadline = time.monotonic() + wait_s
    with os.fdopen(read_end, "rb") as ready:
        try:
            answer = _wait_answer(ready, deadline)
        except KeyboardInterrupt:  # Ctrl-C in the terminal: the start is abandoned, nothing of it left running
            _end_keeper(proc, config)
            raise
    try:
        reply = json.loads(answer) if answer else None
    except ValueError:
        reply = None
    if not reply or not reply.get("ok"):
        if reply is None:
            from .launcher import returncode_description

            ended = proc.poll()
            _end_keeper(proc, config)
            why = (f"it did not come up within {wait_s:.0f} s" if ended is None else
                   f"its keeper {returncode_description(ended)} without saying why")
        else:
            proc.wait(30)
            why = reply.get("error", "unknown")
        raise ClusterError(f"the cluster {name!r} did not start: {why}\n(keeper log: {log}; nothing of it is left "
                           f"running)")
    return StartReport(name=name, cluster_id=reply["cluster_id"], n=reply["n"], mesh=reply["mesh"],
                       backend=reply["backend"], patch_mode=reply.get("patch_mode"), keeper_pid=proc.pid,
                       seconds=time.perf_counter() - t0, idle_timeout_s=config.get("idle_timeout"), log=str(log))


def _wait_answer(ready, deadline: float) -> bytes:
    """The keeper's one line on the pipe (its start's outcome); what came until it closed or ``deadline``."""
    import select

    answer = b""
    while time.monotonic() < deadline:
        readable, _, _ = select.select([ready], [], [], 0.5)
        if readable:
            chunk = os.read(ready.fileno(), 65536)
            if not chunk:
                break
            answer += chunk
            if answer.endswith(b"\n"):
                break
    return answer


def _end_keeper(proc: subprocess.Popen, config: dict) -> None:
    """A keeper that did not report in time: SIGTERM (it stops what it started), SIGKILL after a while."""
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(5)
    registry.reap_orphans()  # its fork server ends with it; what is left is an orphan now
    record = read_record(config["name"])
    if record is not None and record.keeper_pid == proc.pid:
        record.path.unlink(missing_ok=True)


@dataclass
class StopReport:
    """What ``sharddbg cluster stop`` prints."""

    name: str
    cluster_id: str
    seconds: float
    survivors: list[int]


def stop(name: str, how: str = "stopped by `sharddbg cluster stop`") -> StopReport:
    """Stop the detached cluster ``name`` through its keeper; check that none of its processes is left.

    Parameters
    ----------
    name : str
        The cluster's name.
    how : str
        What the record says stopped it.

    Returns
    -------
    StopReport
        How long it took, and the pids left running (normally none).

    Raises
    ------
    ClusterError
        No running cluster has that name (what runs is listed).

    Examples
    --------
    >>> stop("dev").survivors
    []
    """
    check_name(name)
    record = read_record(name)
    if record is None or record.state == "stopped":
        raise ClusterError(f"no running detached cluster is named {name!r} ({_existing_text()})")
    t0 = time.perf_counter()
    if record.keeper_alive():
        link = KeeperLink(record)
        try:
            link.request("stop", timeout=120.0, reason=how)
        except ClusterError:
            try:
                os.kill(record.keeper_pid, 15)  # the keeper stops the cluster on SIGTERM too
            except ProcessLookupError:
                pass
        try:
            psutil.Process(record.keeper_pid).wait(60)
        except (psutil.NoSuchProcess, psutil.TimeoutExpired):
            pass
    return finish_stop(record, how, t0)


def finish_stop(record: DetachedRecord, how: str, t0: float) -> StopReport:
    """After the keeper was asked to stop: reap what is left, mark the record stopped, list survivors.

    Parameters
    ----------
    record : DetachedRecord
        The cluster's record as it was.
    how : str
        What stopped it.
    t0 : float
        When the stop began (``time.perf_counter()``).

    Returns
    -------
    StopReport
        The survivors (normally none).

    Examples
    --------
    >>> finish_stop(record, "stopped", time.perf_counter()).survivors
    []
    """
    if record.keeper_alive():  # it answered the stop: it ends a moment later
        try:
            psutil.Process(record.keeper_pid).wait(30)
        except (psutil.NoSuchProcess, psutil.TimeoutExpired):
            pass
    left = live_processes(record.cluster_id, record.keeper_pid, record.keeper_create_time)
    if left:
        registry.kill_processes(left)
        for kept in registry.all_records():
            if kept.cluster_id == record.cluster_id:
                registry.reap(kept)
        left = live_processes(record.cluster_id, record.keeper_pid, record.keeper_create_time)
    stopped = read_record(record.name) or record
    if stopped.state != "stopped" and stopped.keeper_pid == record.keeper_pid:
        stopped.state, stopped.stopped_at, stopped.stop_reason = "stopped", time.time(), how
        stopped.save()
    socket_path(record.name).unlink(missing_ok=True)
    return StopReport(record.name, record.cluster_id, time.perf_counter() - t0, [p.pid for p in left])


def forget_dead_keepers() -> list[str]:
    """Mark stopped the records of detached clusters whose keeper died without stopping them (``sharddbg reap``
    reaps their processes: the keeper was their owner); their sockets go too.

    Returns
    -------
    list of str
        The names marked.

    Examples
    --------
    >>> forget_dead_keepers()
    []
    """
    marked = []
    for record in all_records():
        if record.state != "stopped" and not record.keeper_alive():
            record.state, record.stopped_at = "stopped", time.time()
            record.stop_reason = f"its keeper (pid {record.keeper_pid}) ended without stopping it; reaped"
            record.save()
            socket_path(record.name).unlink(missing_ok=True)
            marked.append(record.name)
    return marked


@dataclass
class ClusterRow:
    """One row of ``sharddbg cluster list``."""

    name: str
    kind: str  # detached | notebook
    owner: str
    ranks: int
    mesh: str
    backend: str
    state: str
    age_s: float


def list_rows() -> list[ClusterRow]:
    """Every cluster of this user: detached ones (asked of their keepers) and those notebooks own (their state
    files).

    Returns
    -------
    list of ClusterRow
        Detached clusters first, then the notebooks'.

    Examples
    --------
    >>> [r.kind for r in list_rows()]
    ['detached', 'notebook']
    """
    from .state_file import ClusterState, read_states

    now = time.time()
    rows, detached_ids = [], set()
    for record in all_records():
        if record.state == "stopped":
            continue
        detached_ids.add(record.cluster_id)
        mesh, backend, state = record.mesh, record.backend or "", record.state
        if not record.keeper_alive():
            state = "keeper gone (`sharddbg reap` cleans up)"
        elif record.state == "running":
            try:
                info = KeeperLink(record).request("info")
                mesh, backend = info["mesh"], info["backend"] or ""
                dead = info.get("dead") or {}
                state = (f"broken: {info['broken']}" if info.get("broken") else
                         f"ranks {sorted(int(r) for r in dead)} dead" if dead else "running")
                if info.get("idle_timeout"):
                    state += f", idle {info['idle_s']:.0f}/{info['idle_timeout']:.0f} s"
            except ClusterError:
                state = "keeper does not answer"
        rows.append(ClusterRow(record.name, "detached", f"keeper pid {record.keeper_pid}", record.n, mesh, backend,
                               state, now - record.started))
    for state in read_states():
        if state.cluster_id in detached_ids or not isinstance(state, ClusterState):
            continue
        kernel = f", kernel {state.owner_kernel}" if state.owner_kernel else ""
        counts: dict[str, int] = {}
        for rank in state.rank_states:
            counts[rank.state] = counts.get(rank.state, 0) + 1
        rows.append(ClusterRow(state.cluster_id, "notebook", f"pid {state.owner_pid}{kernel}", state.ranks,
                               state.mesh, state.backend or "",
                               ", ".join(f"{c} {s}" for s, c in sorted(counts.items())) or "running",
                               now - state.started))
    return rows


def format_rows(rows: list[ClusterRow]) -> str:
    """``rows`` as a plain-text table.

    Parameters
    ----------
    rows : list of ClusterRow
        The clusters.

    Returns
    -------
    str
        The table (a line saying none runs when empty).

    Examples
    --------
    >>> print(format_rows(list_rows()))
    NAME  KIND      OWNER ...
    """
    if not rows:
        return "no sharddbg cluster runs (start one: `sharddbg cluster start -n 4 --name NAME`)"
    header = ["NAME", "KIND", "OWNER", "RANKS", "MESH", "BACKEND", "STATE", "AGE"]
    table = [[r.name, r.kind, r.owner, str(r.ranks), r.mesh, r.backend, r.state, _age(r.age_s)] for r in rows]
    widths = [max(len(row[i]) for row in [header, *table]) for i in range(len(header))]
    return "\n".join("  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip() for row in [header, *table])


def _age(seconds: float) -> str:
    seconds = max(0, int(seconds))
    if seconds < 120:
        return f"{seconds} s"
    if seconds < 7200:
        return f"{seconds // 60} min"
    return f"{seconds // 3600} h {seconds % 3600 // 60} min"
