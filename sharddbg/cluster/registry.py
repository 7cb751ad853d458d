"""Bookkeeping of the clusters sharddbg started on this machine, so that orphans can be found and reaped.

Each running cluster has a state file ``<home>/clusters/<cluster_id>.json`` naming its owner process and
every process it started (fork server, engines, controller and its children). A cluster is orphaned
when its owner is gone (a killed kernel). We only ever kill processes that a state file names AND whose
command line and start time still match, so a recycled pid is never hit.
"""

from __future__ import annotations

import json
import os
import signal
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import psutil


def sharddbg_home() -> Path:
    return Path(os.environ.get("SHARDDBG_HOME") or Path.home() / ".cache" / "sharddbg")


def clusters_dir() -> Path:
    path = sharddbg_home() / "clusters"
    path.mkdir(parents=True, exist_ok=True)
    return path


def profile_dir() -> Path:
    """sharddbg's own IPython profile: its controllers' connection files never mix with the user's."""
    path = sharddbg_home() / "profile_sharddbg"
    (path / "security").mkdir(parents=True, exist_ok=True)
    return path


@dataclass
class ProcessRef:
    pid: int
    create_time: float
    role: str  # zygote | engine | controller

    @classmethod
    def of(cls, pid: int, role: str) -> "ProcessRef":
        return cls(pid, psutil.Process(pid).create_time(), role)

    def alive(self) -> bool:
        try:
            proc = psutil.Process(self.pid)
            return abs(proc.create_time() - self.create_time) < 0.05 and proc.status() != psutil.STATUS_ZOMBIE
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            return False


@dataclass
class ClusterRecord:
    cluster_id: str
    owner: ProcessRef
    log_dir: str
    processes: list[ProcessRef] = field(default_factory=list)
    started: float = field(default_factory=time.time)

    @property
    def path(self) -> Path:
        return clusters_dir() / f"{self.cluster_id}.json"

    def save(self) -> None:
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(json.dumps(asdict(self), indent=1))
        tmp.replace(self.path)

    def remove(self) -> None:
        self.path.unlink(missing_ok=True)

    @classmethod
    def load(cls, path: Path) -> "ClusterRecord":
        data = json.loads(path.read_text())
        return cls(
            cluster_id=data["cluster_id"],
            owner=ProcessRef(**data["owner"]),
            log_dir=data.get("log_dir", ""),
            processes=[ProcessRef(**p) for p in data.get("processes", [])],
            started=data.get("started", 0.0),
        )

    def owner_alive(self) -> bool:
        return self.owner.alive()

    def live_processes(self) -> list[psutil.Process]:
        """Named processes that still run, plus the controller's children (its schedulers)."""
        found: dict[int, psutil.Process] = {}
        for ref in self.processes:
            if not ref.alive():
                continue
            try:
                proc = psutil.Process(ref.pid)
                found[proc.pid] = proc
                if ref.role in ("controller", "zygote"):
                    for child in proc.children(recursive=True):
                        found[child.pid] = child
            except psutil.NoSuchProcess:
                continue
        return list(found.values())


def all_records() -> list[ClusterRecord]:
    records = []
    for path in sorted(clusters_dir().glob("*.json")):
        try:
            records.append(ClusterRecord.load(path))
        except (ValueError, KeyError, TypeError, OSError):
            path.unlink(missing_ok=True)  # a half-written or foreign file: nothing we can act on
    return records


def kill_processes(procs: list[psutil.Process], grace_s: float = 1.0) -> list[int]:
    """SIGTERM, wait up to ``grace_s``, then SIGKILL. Returns the pids that were running."""
    pids = [p.pid for p in procs]
    for proc in procs:
        try:
            proc.send_signal(signal.SIGTERM)
        except psutil.NoSuchProcess:
            pass
    _, alive = psutil.wait_procs(procs, timeout=grace_s)
    for proc in alive:
        try:
            proc.kill()
        except psutil.NoSuchProcess:
            pass
    psutil.wait_procs(alive, timeout=5)
    return pids


def reap(record: ClusterRecord) -> list[int]:
    """Kill everything a cluster record names and forget it (and its controller's connection files)."""
    pids = kill_processes(record.live_processes())
    security = profile_dir() / "security"
    for path in security.glob(f"*{record.cluster_id}*"):
        path.unlink(missing_ok=True)
    record.remove()
    return pids


def reap_orphans(include_live_owners: bool = False, exclude: set[str] | None = None) -> dict[str, list[int]]:
    """Reap clusters whose owner died (or every sharddbg cluster with ``include_live_owners``)."""
    reaped = {}
    for record in all_records():
        if exclude and record.cluster_id in exclude:
            continue
        if include_live_owners or not record.owner_alive():
            reaped[record.cluster_id] = reap(record)
    return reaped
