"""The live state of a running cluster in a small file under ``SHARDDBG_HOME``, for readers outside the owning
process (the JupyterLab extension's cluster panel, through ``sharddbg.labserver``).

While a cluster runs, a daemon thread of the process that owns it rewrites ``<home>/cluster-state/<id>.json``
every ``STATE_INTERVAL_S`` seconds, atomically (a temporary file, then a rename) and private (0600): the
cluster's ranks, mesh, backend and patch mode, the owning process and its Jupyter kernel, and each rank's
state: ``idle``, ``busy`` (a call of the owner's is in flight on it) or ``dead`` with how its process ended.
The thread reads only what is safe beside the owner's own calls (the processes' pids and the fork server's
exit reports; the ipyparallel client's books of calls in flight, never a request to the controller).
``stop()`` removes the file; so does the thread itself once the cluster's registry record is gone (the
cluster was reaped from outside, e.g. stopped from the panel).

``read_states()`` is the reader's side: every state file, each a ``ClusterState`` or, for a file that is
corrupt or whose owner is gone, a ``GoneCluster`` with the reason.
"""

from __future__ import annotations

import json
import os
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from . import registry

if TYPE_CHECKING:
    from .cluster import Cluster

STATE_INTERVAL_S = 1.0
STATE_FOLDER = "cluster-state"  # beside clusters/ (the registry's records), which holds nothing else
STATE_FORMAT = "sharddbg.cluster-state"
STATE_VERSION = 1


@dataclass
class RankState:
    """One rank as the state file tells it."""

    rank: int
    pid: int | None
    state: str  # idle | busy | dead
    how: str = ""  # for a dead rank: how its process ended, e.g. "killed by signal 9 (SIGKILL)"


@dataclass
class ClusterState:
    """What the state file holds about one running cluster."""

    cluster_id: str
    ranks: int
    mesh: str
    backend: str | None
    patch_mode: str | None
    owner_pid: int
    owner_kernel: str | None  # the Jupyter kernel's connection file name, when the owner is a kernel
    started: float
    updated: float
    rank_states: list[RankState] = field(default_factory=list)
    format: str = STATE_FORMAT
    version: int = STATE_VERSION


@dataclass
class GoneCluster:
    """A state file that no longer stands for a running cluster, and why."""

    cluster_id: str
    reason: str
    owner_pid: int | None = None


def state_path(cluster_id: str) -> Path:
    """The state file of cluster ``cluster_id``.

    Parameters
    ----------
    cluster_id : str
        The cluster's id (``Cluster.cluster_id``).

    Returns
    -------
    pathlib.Path
        ``<SHARDDBG_HOME>/cluster-state/<cluster_id>.json``.

    Examples
    --------
    >>> state_path("c0ffee").name
    'c0ffee.json'
    """
    return registry.private_dir(registry.sharddbg_home() / STATE_FOLDER) / f"{cluster_id}.json"


def _owner_kernel() -> str | None:
    try:
        from ipykernel.connect import get_connection_file

        return os.path.basename(get_connection_file())
    except Exception:  # not a kernel, or no connection file: the panel says so
        return None


def _busy_ranks(cluster: Cluster, live: list[int]) -> set[int]:
    """Live ranks with a call of the owner's in flight, read from the ipyparallel client's books only."""
    try:
        client = cluster.client
        if not client.outstanding:
            return set()
        by_engine = {uuid: msgs for uuid, msgs in dict(client._outstanding_dict).items() if msgs}
        engines = dict(client._engines)
        return {rank for rank, eid in enumerate(cluster.engine_ids) if rank in live and engines.get(eid) in by_engine}
    except Exception:  # the client closing under us: nothing in flight that we can tell
        return set()


def snapshot(cluster: Cluster, owner_kernel: str | None, started: float) -> ClusterState:
    """The state of ``cluster`` now, from what the owner's process can read without asking the ranks.

    Parameters
    ----------
    cluster : Cluster
        A running cluster of this process.
    owner_kernel : str or None
        The owning kernel's connection file name.
    started : float
        When the cluster started (seconds since the epoch).

    Returns
    -------
    ClusterState
        The cluster's facts and each rank's state.

    Examples
    --------
    >>> snapshot(cl, None, time.time()).rank_states[0].state
    'idle'
    """
    pids = cluster.pids
    dead = cluster.dead_ranks()
    live = [r for r in range(cluster.n) if r not in dead]
    busy = _busy_ranks(cluster, live)
    ranks = [RankState(rank=r, pid=pids.get(r), state="dead" if r in dead else "busy" if r in busy else "idle",
                       how=dead.get(r, "")) for r in range(cluster.n)]
    return ClusterState(cluster_id=cluster.cluster_id or "", ranks=cluster.n, mesh=str(cluster.mesh),
                        backend=cluster.backend, patch_mode=cluster.patch_mode, owner_pid=os.getpid(),
                        owner_kernel=owner_kernel, started=started, updated=time.time(), rank_states=ranks)


class StateFileWriter:
    """The thread that keeps one running cluster's state file (``start()`` / ``stop()``)."""

    def __init__(self, cluster: Cluster, interval_s: float = STATE_INTERVAL_S) -> None:
        self.cluster = cluster
        self.interval_s = interval_s
        self.path = state_path(cluster.cluster_id or "")
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._kernel = _owner_kernel()
        self._started = time.time()

    def write(self) -> None:
        """Write the state now (atomically, 0600)."""
        registry.write_private(self.path, json.dumps(asdict(snapshot(self.cluster, self._kernel, self._started))))

    def _run(self) -> None:
        record = registry.clusters_dir() / f"{self.cluster.cluster_id}.json"
        while not self._stop.is_set():
            if not record.exists():  # reaped from outside: nothing runs that this file could tell of
                self.path.unlink(missing_ok=True)
                return
            try:
                self.write()
            except Exception:  # a state file is a convenience: a full disk or a closing client never stops the owner
                pass
            self._stop.wait(self.interval_s)

    def start(self) -> StateFileWriter:
        """Write the state once, then every ``interval_s`` seconds from a daemon thread.

        Returns
        -------
        StateFileWriter
            This writer.

        Examples
        --------
        >>> writer = StateFileWriter(cl).start()
        """
        self.write()
        self._thread = threading.Thread(target=self._run, name=f"sharddbg-state-{self.cluster.cluster_id}",
                                        daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        """Stop the thread and remove the state file.

        Returns
        -------
        None

        Examples
        --------
        >>> writer.stop()
        """
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
        self.path.unlink(missing_ok=True)


def read_states(home: Path | None = None) -> list[ClusterState | GoneCluster]:
    """Every cluster state file under ``home`` (default: this user's ``SHARDDBG_HOME``), newest first.

    A file that is not valid JSON or not a state file, whose owning process has ended, or that was not
    refreshed for ``10 * STATE_INTERVAL_S`` seconds reads as a ``GoneCluster`` with the reason.

    Parameters
    ----------
    home : pathlib.Path, optional
        The state folder to read.

    Returns
    -------
    list of ClusterState or GoneCluster
        One entry per state file.

    Examples
    --------
    >>> [s.cluster_id for s in read_states()]
    ['1f2e3d4c']
    """
    folder = (home if home is not None else registry.sharddbg_home()) / STATE_FOLDER
    out: list[ClusterState | GoneCluster] = []
    paths = []
    for path in folder.glob("*.json"):
        try:
            paths.append((path.stat().st_mtime, path))
        except FileNotFoundError:
            continue
    for _, path in sorted(paths, reverse=True):
        cluster_id = path.stem
        try:
            if path.stat().st_uid != os.getuid():
                continue  # not this user's
            data = json.loads(path.read_text())
            if data.get("format") != STATE_FORMAT or data.get("version") != STATE_VERSION:
                raise ValueError(f"not a cluster state file of version {STATE_VERSION}")
            state = ClusterState(**{**data, "rank_states": [RankState(**r) for r in data["rank_states"]]})
        except FileNotFoundError:
            continue  # stopped while we read
        except (ValueError, TypeError, KeyError, AttributeError) as exc:
            out.append(GoneCluster(cluster_id, f"its state file is corrupt ({exc})"))
            continue
        if not _pid_alive(state.owner_pid):
            out.append(GoneCluster(cluster_id, f"its owning process (pid {state.owner_pid}) has ended", state.owner_pid))
        elif time.time() - state.updated > 10 * STATE_INTERVAL_S:
            out.append(GoneCluster(cluster_id, f"its state was last written {time.time() - state.updated:.0f} s ago "
                                               f"(its owner, pid {state.owner_pid}, does not refresh it)",
                                   state.owner_pid))
        else:
            out.append(state)
    return out


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
