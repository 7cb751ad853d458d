"""Bookkeeping of the clusters sharddbg started on this machine, so that orphans can be found and reaped;
and sharddbg's state folder, private to the user.

Each running cluster has a state file ``<home>/clusters/<cluster_id>.json`` naming its owner process and
every process it started (fork server, engines, controller and the controller's children), each with its
start time. A cluster is orphaned when its owner is gone (a killed kernel). A process is killed as part
of a cluster only when a state file names it and its start time still matches (a recycled pid is never
hit), when it descends from such a process, or when its command line is one that sharddbg starts for that
cluster (``--cluster-id=<id>`` on the fork server's or the controller's command line; engines and the
controller's children inherit it): so the controller's children are found even after the controller died.

The state folder (``SHARDDBG_HOME``, default ``~/.cache/sharddbg``) holds records, logs, stack dumps and
the controllers' connection files (keys to the engines): its folders are 0700 and its files 0600.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import stat
import time
import uuid
from dataclasses import asdict, dataclass, field
from pathlib import Path

import psutil

from ..errors import ClusterError

PRIVATE_DIR_MODE = 0o700
PRIVATE_FILE_MODE = 0o600

# Log folders of this many clusters are kept (the newest); older ones go at each start.
KEPT_LOG_FOLDERS = 10

CLUSTER_ID_PREFIX = "sdbg-"

# The programs sharddbg starts for a cluster, each with ``--cluster-id=<id>`` on its command line. The
# engines are forks of the fork server and the controller's children forks of the controller: they show
# the same command line.
CLUSTER_PROGRAMS = ("sharddbg.cluster._zygote", "ipyparallel.controller",
                    # an engine started by ipyparallel's launchers, and mpiexec or srun, whose command line names it
                    "sharddbg.cluster._launched_engine")

# write_private writes here first; temporary files older than this are left-overs (prune_temp_files).
TEMP_SUFFIX = ".tmp"
STALE_TEMP_S = 60.0

# psutil derives start times from the boot time, which /proc gives in whole seconds.
START_TIME_SLACK_S = 2.0


# SHARDDBG_HOME's value -> the folder it named when first read: a relative value counts from the working
# folder of that moment (sharddbg's import), so that a later os.chdir does not start a second state folder.
_RESOLVED_HOMES: dict[str, Path] = {}


def sharddbg_home() -> Path:
    """The state folder's absolute path (not created: see ``private_dir``). A relative ``SHARDDBG_HOME`` is
    resolved once, against the working folder when it was first read (at import)."""
    raw = os.environ.get("SHARDDBG_HOME") or ""
    home = _RESOLVED_HOMES.get(raw)
    if home is None:
        home = _RESOLVED_HOMES[raw] = (Path(raw) if raw else Path.home() / ".cache" / "sharddbg").expanduser().absolute()
    return home


def private_dir(path: Path) -> Path:
    """``path`` as a folder only this user can read: created 0700, or its mode set to 0700."""
    path.mkdir(parents=True, exist_ok=True, mode=PRIVATE_DIR_MODE)
    if stat.S_IMODE(path.stat().st_mode) != PRIVATE_DIR_MODE:
        os.chmod(path, PRIVATE_DIR_MODE)
    return path


def _state_dir(*parts: str) -> Path:
    """``<home>/<parts...>``, each folder made private; ClusterError naming SHARDDBG_HOME when one cannot be."""
    home = sharddbg_home()
    path = home
    try:
        private_dir(path)
        for part in parts:
            path = path / part
            private_dir(path)
    except OSError as e:
        raise ClusterError(_home_unusable(home, path, e)) from None
    return path


def _home_unusable(home: Path, path: Path, error: OSError) -> str:
    """Why the state folder ``home`` cannot be used, ``path`` (it or a folder in it) having failed with
    ``error``; and what to do."""
    value = os.environ.get("SHARDDBG_HOME")
    named = (f"SHARDDBG_HOME={value!r}" if value else
             f"sharddbg's state folder {str(home)!r} (the default: SHARDDBG_HOME is not set)")
    blocker = _file_in_the_way(path)
    if blocker is not None:
        what = f"{blocker} is not a folder" + ("" if blocker == path else f", so {path} cannot be one")
    elif isinstance(error, PermissionError):
        what = f"no permission to create or use {path}"
    else:
        what = f"{path}: {error.strerror or error}"
    return (f"{named} cannot hold sharddbg's state (cluster records, logs, connection files): {what}. Set "
            f"SHARDDBG_HOME to a folder of yours (it is created if missing)"
            + (", or unset it to use ~/.cache/sharddbg." if value else "."))


def _file_in_the_way(path: Path) -> Path | None:
    """The nearest of ``path`` and its parents that exists, when it is not a folder."""
    for candidate in (path, *path.parents):
        if os.path.lexists(candidate):
            return None if candidate.is_dir() else candidate
    return None


def clusters_dir() -> Path:
    return _state_dir("clusters")


def logs_dir() -> Path:
    """``<home>/logs``: one folder per cluster (``cluster_log_dir``)."""
    return _state_dir("logs")


def cluster_log_dir(cluster_id: str) -> Path:
    """``<home>/logs/<cluster_id>``: the fork server's, the controller's and every engine's log, stack dumps."""
    return _state_dir("logs", cluster_id)


def profile_dir() -> Path:
    """sharddbg's own IPython profile: its controllers' connection files never mix with the user's."""
    path = _state_dir("profile_sharddbg")
    for folder in ("security", "log", "pid", "startup"):
        private_dir(path / folder)
    # IPython copies its startup README here, with the 0644 of its source, unless one exists.
    readme = path / "startup" / "README"
    if not readme.exists():
        write_private(readme, "sharddbg's own IPython profile, used by its controllers and engines.\n")
    return path


def open_private(path, flags: int = os.O_WRONLY | os.O_CREAT | os.O_APPEND) -> int:
    """A file descriptor on ``path``, a file only this user can read (0600, also when it existed)."""
    fd = os.open(path, flags, PRIVATE_FILE_MODE)
    os.fchmod(fd, PRIVATE_FILE_MODE)
    return fd


def write_private(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` (0600) through a temporary file: a reader never sees half of it."""
    tmp = path.with_name(path.name + TEMP_SUFFIX)
    try:
        with os.fdopen(open_private(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC), "w") as f:
            f.write(text)
        tmp.replace(path)
    except BaseException:
        tmp.unlink(missing_ok=True)  # a full disk must not leave half a file behind
        raise


def prune_temp_files(older_than_s: float = STALE_TEMP_S) -> list[Path]:
    """Remove the records' temporary files (``write_private``) older than ``older_than_s``: left by a process
    killed half-way through a write (a younger one may be another owner's write in progress). The removed."""
    removed = []
    for path in clusters_dir().glob(f"*{TEMP_SUFFIX}"):
        try:
            if time.time() - path.lstat().st_mtime > older_than_s:
                path.unlink()
                removed.append(path)
        except OSError:
            continue
    return removed


def make_home_private() -> None:
    """Every folder under the state folder 0700 and every file 0600 (a folder left by an older sharddbg
    had 0755 and 0644). Symbolic links are left alone."""
    home = _state_dir()
    for root, dirs, files in os.walk(home):
        for name, mode in [(d, PRIVATE_DIR_MODE) for d in dirs] + [(f, PRIVATE_FILE_MODE) for f in files]:
            path = os.path.join(root, name)
            try:
                info = os.lstat(path)
                if not stat.S_ISLNK(info.st_mode) and stat.S_IMODE(info.st_mode) != mode:
                    os.chmod(path, mode)
            except OSError:
                continue  # removed meanwhile (a stopping cluster's files)


def new_cluster_id() -> str:
    """A fresh cluster id: ``sdbg-<local date-time>-<6 hex digits>``."""
    return f"{CLUSTER_ID_PREFIX}{time.strftime('%Y%m%d-%H%M%S')}-{uuid.uuid4().hex[:6]}"


def cluster_id_arg(cluster_id: str) -> str:
    """The command-line argument that marks a process started for cluster ``cluster_id``."""
    return f"--cluster-id={cluster_id}"


def prune_logs(keep: int = KEPT_LOG_FOLDERS) -> list[Path]:
    """Remove the log folders of all but the newest ``keep`` clusters (by the folder's modification time),
    never the folder of a cluster that has a record (it runs, or its processes are still to be reaped).
    Returns the folders removed."""
    protected = {path.stem for path in clusters_dir().glob("*.json")}
    folders = []
    for path in logs_dir().iterdir():
        if path.name.startswith(CLUSTER_ID_PREFIX) and path.is_dir() and not path.is_symlink():
            try:
                folders.append((path.stat().st_mtime, path.name, path))
            except OSError:
                continue
    folders.sort(reverse=True)
    removed = []
    for _, name, path in folders[keep:]:
        if name not in protected:
            shutil.rmtree(path, ignore_errors=True)
            removed.append(path)
    return removed


@dataclass
class ProcessRef:
    pid: int
    create_time: float
    role: str  # owner | zygote | engine | controller | controller-child
    process_group: int = 0  # the process group (and session) it leads, 0 if none: the controller's

    @classmethod
    def of(cls, pid: int, role: str, process_group: int = 0) -> ProcessRef:
        """The running process ``pid`` (``psutil.NoSuchProcess`` if it is gone)."""
        return cls(pid, psutil.Process(pid).create_time(), role, process_group)

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
        write_private(self.path, json.dumps(asdict(self), indent=1))

    def remove(self) -> None:
        self.path.unlink(missing_ok=True)

    @classmethod
    def load(cls, path: Path) -> ClusterRecord:
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

    def track(self, pid: int, role: str, process_group: int = 0) -> ProcessRef | None:
        """Name process ``pid`` (leader of ``process_group``, if not 0) in the record, saved at once; its
        entry. None, and nothing saved, if it is already gone; the existing entry if it is already named."""
        try:
            ref = ProcessRef.of(pid, role, process_group)
        except psutil.NoSuchProcess:
            return None
        for known in self.processes:
            if known.pid == ref.pid and abs(known.create_time - ref.create_time) < 0.05:
                return known
        self.processes.append(ref)
        self.save()
        return ref

    def controller_groups(self) -> set[int]:
        return {ref.process_group for ref in self.processes if ref.role == "controller" and ref.process_group}

    def live_processes(self) -> list[psutil.Process]:
        """Every process of this cluster that still runs: the named ones, their children, and those whose
        command line marks them as this cluster's (``cluster_processes``)."""
        found: dict[int, psutil.Process] = {}
        for ref in self.processes:
            if not ref.alive():
                continue
            try:
                proc = psutil.Process(ref.pid)
                found[proc.pid] = proc
                # an engine's: processes a cell started; a launcher's (mpiexec): its proxies and engines
                if ref.role in ("controller", "zygote", "engine", "launcher"):
                    for child in proc.children(recursive=True):
                        found[child.pid] = child
            except psutil.NoSuchProcess:
                continue
        for proc in cluster_processes(self.cluster_id, since=self.started, groups=self.controller_groups()):
            found.setdefault(proc.pid, proc)
        found.pop(os.getpid(), None)
        return [proc for proc in found.values() if _running(proc)]


def _running(proc: psutil.Process) -> bool:
    try:
        return proc.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def cluster_processes(cluster_id: str, since: float = 0.0, groups: set[int] = frozenset()) -> list[psutil.Process]:
    """Processes on this machine started for cluster ``cluster_id``, found by their command line alone:
    ``--cluster-id=<id>`` and one of the programs sharddbg starts (``CLUSTER_PROGRAMS``), or the id in a
    process of one of the controller process ``groups``. Only processes started after ``since`` (a
    ``time.time()``) count. Zombies are left out."""
    token = cluster_id_arg(cluster_id)
    found = []
    for proc in psutil.process_iter(["cmdline", "create_time", "status"]):
        cmdline = proc.info["cmdline"] or []
        if token not in cmdline or proc.info["status"] == psutil.STATUS_ZOMBIE:
            continue
        if (proc.info["create_time"] or 0.0) < since - START_TIME_SLACK_S:
            continue
        if any(program in cmdline for program in CLUSTER_PROGRAMS) or _group_of(proc.pid) in groups:
            found.append(proc)
    return found


def _group_of(pid: int) -> int | None:
    try:
        return os.getpgid(pid)
    except OSError:
        return None


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
    """Kill everything of a cluster record (``live_processes``) and forget it, with its controller's
    files in the profile (connection files, the engine list it logs)."""
    pids = kill_processes(record.live_processes())
    profile = profile_dir()
    for folder in ("security", "log"):
        for path in (profile / folder).glob(f"*{record.cluster_id}*"):
            path.unlink(missing_ok=True)
    record.remove()
    return pids


def reap_orphans(include_live_owners: bool = False, exclude: set[str] | None = None) -> dict[str, list[int]]:
    """Reap clusters whose owner died (or every sharddbg cluster with ``include_live_owners``); the records'
    stale temporary files go too."""
    prune_temp_files()
    reaped = {}
    for record in all_records():
        if exclude and record.cluster_id in exclude:
            continue
        if include_live_owners or not record.owner_alive():
            reaped[record.cluster_id] = reap(record)
    return reaped


# resolved at import: a relative SHARDDBG_HOME counts from the folder sharddbg was imported in
sharddbg_home()
