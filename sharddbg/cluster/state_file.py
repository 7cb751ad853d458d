"""The live state of a running cluster in a small file under ``SHARDDBG_HOME``, for readers outside the owning
process (the JupyterLab extension's cluster panel, through ``sharddbg.labserver``).

While a cluster runs, a daemon thread of the process that owns it rewrites ``<home>/cluster-state/<id>.json``
every ``STATE_INTERVAL_S`` seconds, atomically (a temporary file, then a rename) and private (0600): the
cluster's ranks, mesh, backend and patch mode, the owning process and its Jupyter kernel, and each rank's
state: ``idle``, ``busy`` (a call of the owner's is in flight on it), ``stuck`` (busy for ``STUCK_AFTER_S``
seconds or more, waiting in a collective that has not completed: which one, on which group, since when, and the
group's ranks that never issued it) or ``dead`` with how its process ended.
The thread reads only what is safe beside the owner's own calls (the processes' pids and the fork server's
exit reports; the ipyparallel client's books of calls in flight, never a request to the controller); a rank
busy that long is asked for its Flight Recorder on its control thread (the same request as ``cl.diagnose()``,
which a rank answers while blocked; read by ``analysis.hang``), at most every ``STUCK_AFTER_S`` seconds.
The cluster's last trace (``cl.last_trace()``) is saved beside the state file (``<home>/cluster-state/
last-trace/<id>.sdtrace.arrow``, 0600) once per new trace, and the state file names it (``last_trace``), so the
panel opens it through the server's endpoint.
``stop()`` removes both files; so does the thread itself once the cluster's registry record is gone (the
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
LAST_TRACE_FOLDER = "last-trace"  # under STATE_FOLDER: read_states() reads the *.json directly in STATE_FOLDER only
# a rank busy this long is asked where it waits (a collective that does not complete is "stuck"); that long
# again before it is asked again while it waits in one
STUCK_AFTER_S = 2.0
# A busy rank found waiting in no collective is asked again after twice the last gap, up to this: each look reads
# its Flight Recorder (torch writes its 2,000 entries as JSON: 30-280 ms of the rank's time on a 2-core host, and
# the reply is decoded here), which every 2 s of a long cell cost each rank that much and the client 0.1 s of
# CPU a second with 16 ranks. A hang that starts late in a long cell shows on the panel within this long.
LOOK_GAP_MAX_S = 30.0


def next_look_gap(last_gap_s: float | None, waits: bool) -> float:
    """Seconds until a busy rank is asked again where it waits: ``STUCK_AFTER_S`` while it waits in a collective
    (``waits``), else twice ``last_gap_s`` (None: not asked before in this busy spell), at most ``LOOK_GAP_MAX_S``.

    Examples
    --------
    >>> [next_look_gap(g, False) for g in (None, 2.0, 16.0, 30.0)]
    [4.0, 4.0, 30.0, 30.0]
    >>> next_look_gap(30.0, True)
    2.0
    """
    if waits:
        return STUCK_AFTER_S
    return min(LOOK_GAP_MAX_S, 2 * (last_gap_s or STUCK_AFTER_S))


@dataclass
class RankState:
    """One rank as the state file tells it."""

    rank: int
    pid: int | None
    state: str  # idle | busy | stuck | dead
    how: str = ""  # for a dead rank: how its process ended, e.g. "killed by signal 9 (SIGKILL)"
    stuck_in: StuckCollective | None = None  # for a stuck rank: the collective it waits in


@dataclass
class StuckCollective:
    """The collective a stuck rank waits in, as its Flight Recorder tells it (``analysis.hang``)."""

    collective: str  # its kind, e.g. "all_reduce"
    group: str  # the mesh dim's name ("domain") or the process group's ("0")
    group_ranks: list[int]
    since: float | None  # when the rank issued it (seconds since the epoch), when the Flight Recorder says
    missing_ranks: list[int] = field(default_factory=list)  # the group's ranks that never issued it
    description: str = ""  # the hang report's sentence about it


@dataclass
class LastTrace:
    """The cluster's last trace as the owner saved it for readers outside its process."""

    path: str
    label: str  # e.g. "3 ranks · 41 ops"
    saved: float


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
    last_trace: LastTrace | None = None
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


def last_trace_path(cluster_id: str) -> Path:
    """Where the owner of cluster ``cluster_id`` saves its last trace for the panel.

    Parameters
    ----------
    cluster_id : str
        The cluster's id (``Cluster.cluster_id``).

    Returns
    -------
    pathlib.Path
        ``<SHARDDBG_HOME>/cluster-state/last-trace/<cluster_id>.sdtrace.arrow``: the columnar file, which a big
        trace saves in a fraction of a second, where JSON would take seconds of the owner's CPU.

    Examples
    --------
    >>> last_trace_path("c0ffee").name
    'c0ffee.sdtrace.arrow'
    """
    return registry.private_dir(registry.sharddbg_home() / STATE_FOLDER / LAST_TRACE_FOLDER) / f"{cluster_id}.sdtrace.arrow"


def forget(cluster_id: str) -> None:
    """Remove the state file and the saved last trace of cluster ``cluster_id`` (both may be gone already).

    Parameters
    ----------
    cluster_id : str
        The cluster's id.

    Returns
    -------
    None

    Examples
    --------
    >>> forget("c0ffee")
    """
    state_path(cluster_id).unlink(missing_ok=True)
    last_trace_path(cluster_id).unlink(missing_ok=True)


def stuck_collectives(diagnoses: dict[int, dict | None], pids: dict[int, int]) -> dict[int, StuckCollective]:
    """The collective each diagnosed rank waits in: the first one its Flight Recorder holds as not completed.

    Parameters
    ----------
    diagnoses : dict of int to (dict or None)
        Rank -> its diagnosis (``Cluster.diagnose()``), None for one that did not answer.
    pids : dict of int to int
        Rank -> its process id.

    Returns
    -------
    dict of int to StuckCollective
        Only the ranks that wait in a collective.

    Examples
    --------
    >>> stuck_collectives(cl.diagnose([0]), cl.pids)[0].collective
    'all_reduce'
    """
    from ..analysis.hang import build_report

    answered = [r for r, d in diagnoses.items() if d]
    report = build_report(0.0, [], answered, diagnoses, pids)
    out = {}
    for rank, diagnosis in report.ranks.items():
        if not diagnosis.pending:
            continue
        pending = diagnosis.pending[0]
        created = next((e.get("time_created_ns") for e in diagnoses[rank]["flight_recorder"].get("entries", [])
                        if e["group"] == pending.group and e["seq"] == pending.seq and not e.get("is_p2p")), None)
        out[rank] = StuckCollective(collective=pending.kind, group=pending.mesh_dim or pending.group,
                                    group_ranks=list(pending.group_ranks), since=created / 1e9 if created else None,
                                    missing_ranks=list(pending.missing_ranks), description=pending.describe())
    return out


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


def snapshot(cluster: Cluster, owner_kernel: str | None, started: float,
             stuck: dict[int, StuckCollective] | None = None, last_trace: LastTrace | None = None) -> ClusterState:
    """The state of ``cluster`` now, from what the owner's process can read without asking the ranks.

    Parameters
    ----------
    cluster : Cluster
        A running cluster of this process.
    owner_kernel : str or None
        The owning kernel's connection file name.
    started : float
        When the cluster started (seconds since the epoch).
    stuck : dict of int to StuckCollective, optional
        Busy ranks found waiting in a collective (``stuck_collectives``): their state is ``stuck``.
    last_trace : LastTrace, optional
        The last trace as saved for readers outside this process.

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
    stuck = {r: s for r, s in (stuck or {}).items() if r in busy}
    ranks = [RankState(rank=r, pid=pids.get(r),
                       state="dead" if r in dead else "stuck" if r in stuck else "busy" if r in busy else "idle",
                       how=dead.get(r, ""), stuck_in=stuck.get(r)) for r in range(cluster.n)]
    return ClusterState(cluster_id=cluster.cluster_id or "", ranks=cluster.n, mesh=str(cluster.mesh),
                        backend=cluster.backend, patch_mode=cluster.patch_mode, owner_pid=os.getpid(),
                        owner_kernel=owner_kernel, started=started, updated=time.time(), rank_states=ranks,
                        last_trace=last_trace)


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
        self._busy_since: dict[int, float] = {}  # rank -> when it was first seen busy (monotonic)
        self._next_look: dict[int, float] = {}  # rank -> when to ask it again where it waits (monotonic)
        self._look_gap: dict[int, float] = {}  # rank -> the gap before that look, seconds (next_look_gap)
        self._stuck: dict[int, StuckCollective] = {}
        self._saved_trace: object = None  # the Trace last saved for the panel (compared by identity)
        self._last_trace: LastTrace | None = None

    def _find_stuck(self) -> dict[int, StuckCollective]:
        """Busy ranks that wait in a collective: each asked once it has been busy ``STUCK_AFTER_S`` seconds,
        then again every ``STUCK_AFTER_S`` seconds while it waits in one, and at gaps doubling up to
        ``LOOK_GAP_MAX_S`` while it does not (``next_look_gap``)."""
        now = time.monotonic()
        busy = _busy_ranks(self.cluster, [r for r in range(self.cluster.n) if r not in self.cluster.dead_ranks()])
        self._busy_since = {r: self._busy_since.get(r, now) for r in busy}
        self._next_look = {r: t for r, t in self._next_look.items() if r in busy}  # a new busy spell starts afresh
        self._look_gap = {r: g for r, g in self._look_gap.items() if r in busy}
        self._stuck = {r: s for r, s in self._stuck.items() if r in busy}
        due = [r for r in busy if now - self._busy_since[r] >= STUCK_AFTER_S and now >= self._next_look.get(r, 0.0)]
        control = self.cluster._control
        if due and control is not None:
            found = stuck_collectives(control.diagnose(due, timeout=1.0, brief=True), self.cluster.pids)
            for r in due:
                self._look_gap[r] = next_look_gap(self._look_gap.get(r), waits=r in found)
                self._next_look[r] = now + self._look_gap[r]
            self._stuck = {r: s for r, s in self._stuck.items() if r not in due} | found
        return self._stuck

    def _save_last_trace(self) -> LastTrace | None:
        """Save the cluster's last trace for the panel once per new trace; what the state file says of it."""
        trace = self.cluster.last_trace(required=False)
        if trace is None or trace is self._saved_trace:
            return self._last_trace
        path = last_trace_path(self.cluster.cluster_id or "")
        trace.save(path)
        os.chmod(path, 0o600)
        self._saved_trace = trace
        self._last_trace = LastTrace(path=str(path), label=f"{len(trace.ranks)} ranks, "
                                     f"{sum(len(p['events']) for p in trace.payloads.values() if p)} events",
                                     saved=time.time())
        return self._last_trace

    def write(self) -> None:
        """Write the state now (atomically, 0600).

        Returns
        -------
        None

        Examples
        --------
        >>> writer.write()
        """
        stuck, last = {}, self._last_trace
        try:
            stuck = self._find_stuck()
        except Exception:  # a rank that cannot be asked now: busy, as far as this file can tell
            pass
        try:
            last = self._save_last_trace()
        except Exception:  # a trace that cannot be saved (disk full, NaN): the panel offers none
            pass
        registry.write_private(self.path, json.dumps(asdict(snapshot(self.cluster, self._kernel, self._started,
                                                                    stuck, last))))

    def _run(self) -> None:
        record = registry.clusters_dir() / f"{self.cluster.cluster_id}.json"
        while not self._stop.is_set():
            if not record.exists():  # reaped from outside: nothing runs that this file could tell of
                forget(self.cluster.cluster_id or "")
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
        forget(self.cluster.cluster_id or "")


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
            ranks = [RankState(**{**r, "stuck_in": StuckCollective(**r["stuck_in"]) if r.get("stuck_in") else None})
                     for r in data["rank_states"]]
            last = LastTrace(**data["last_trace"]) if data.get("last_trace") else None
            state = ClusterState(**{**data, "rank_states": ranks, "last_trace": last})
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
