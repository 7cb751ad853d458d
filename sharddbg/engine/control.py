"""The control channel's side on a rank: messages answered on the kernel's control thread, which still runs
while the main thread is blocked inside a gloo/NCCL collective (they release the GIL while waiting).

- ``DIAGNOSE_REQUEST`` -> ``DIAGNOSE_REPLY`` ``{"status": "ok", "report": diagnosis()}``: the main thread's
  Python stack, torch's Flight Recorder entries (the collectives this rank issued and whether they
  completed), the ranks of each process group, and the recorder's events so far when one is running.
- ``CLOCK_REQUEST`` -> ``CLOCK_REPLY`` ``{"status": "ok", **clock.reading()}``: this rank's sharddbg clock, which
  monotonic clock it is made from and what it adds to it, for the client's offset (answered here, so no queue of user
  code lengthens the round trip).
- ``RELEASE_REQUEST`` ``{"peer_pids": [...]}`` -> ``RELEASE_REPLY`` ``{"status": "ok", "severed": n,
  "aborted": [group names]}``: end every collective this rank waits in, now: its TCP connections to the
  peer processes are shut (a gloo collective fails at once with "Connection closed by peer") and its NCCL
  communicators are aborted (a NCCL kernel cannot be released by its peers). The process group is unusable
  afterwards: the client tears it down and builds a new one (``Cluster.recover``).

The message types are defined here, with their handlers; ``sharddbg.engine.api`` lists them for the client.
"""

from __future__ import annotations

import json
import os
import sys
import threading
import traceback

from . import clock
from .frames import is_library_file
from .rank_state import STATE

DIAGNOSE_REQUEST = "sharddbg_diagnose_request"
DIAGNOSE_REPLY = "sharddbg_diagnose_reply"
CLOCK_REQUEST = "sharddbg_clock_request"
CLOCK_REPLY = "sharddbg_clock_reply"
RELEASE_REQUEST = "sharddbg_release_request"
RELEASE_REPLY = "sharddbg_release_reply"


def main_thread_stack() -> list[dict]:
    """The main thread's frames, outermost first, each tagged user/library; a cell's frame names the notebook's
    cell ("cell [7]"), not the file IPython compiled it to."""
    from .recorder.cells import cell_name

    frame = sys._current_frames().get(threading.main_thread().ident)
    frames = []
    for summary in traceback.extract_stack(frame) if frame is not None else []:
        frames.append({
            "file": cell_name(summary.filename) or summary.filename,
            "line": summary.lineno,
            "function": summary.name,
            "code": (summary.line or "").strip(),
            "user": not is_library_file(summary.filename),
        })
    return frames


def process_groups() -> dict[str, list[int]]:
    """Process-group name -> global ranks, for every group this rank knows."""
    try:
        import torch.distributed as dist
        from torch.distributed import distributed_c10d as c10d

        if not dist.is_initialized():
            return {}
        groups = {}
        for pg in list(c10d._world.pg_map):
            try:
                groups[str(pg.group_name)] = list(dist.get_process_group_ranks(pg))
            except Exception:
                continue
        return groups
    except Exception:
        return {}


def mesh_dim_names() -> dict[str, str]:
    """Process-group name -> the mesh dim it serves ("ddp", "domain"), for this rank's mesh."""
    mesh = STATE.mesh
    names = {}
    for dim in (getattr(mesh, "mesh_dim_names", None) or ()) if mesh is not None else ():
        try:
            names.setdefault(str(mesh.get_group(dim).group_name), dim)
        except Exception:
            continue
    return names


# torch's Flight Recorder dumps: gloo's (and the other CPU backends') and NCCL's are separate buffers
_FR_DUMPS = ("_dump_fr_trace_json", "_dump_nccl_trace_json")


def flight_recorder() -> dict:
    """torch's Flight Recorder entries for this rank (every backend's buffer) of its current process group,
    reduced to what a hang report needs: per collective its group, sequence number on that group, name, sizes
    and whether it completed."""
    try:
        from torch._C import _distributed_c10d as c10d_ext
    except ImportError:
        return {"available": False, "reason": "torch has no distributed support"}
    dumps = []
    errors = []
    for name in _FR_DUMPS:
        dump = getattr(c10d_ext, name, None)
        if dump is None:
            continue
        try:
            raw = dump(True, False)
            dumps.append(json.loads(raw if isinstance(raw, str) else raw.decode()))
        except Exception as exc:
            errors.append(f"{name}: {exc}")
    if not dumps:
        return {"available": False, "reason": "; ".join(errors) or "no flight recorder in this torch"}
    entries = []
    for data in dumps:
        for e in data.get("entries", []):
            if (e.get("time_created_ns") or 0) < STATE.group_created_ns:
                continue  # a collective of a process group destroyed since (the names are used again)
            group = e.get("process_group") or ["", ""]
            entries.append({
                "group": str(group[0]),
                "group_desc": str(group[1]) if len(group) > 1 else "",
                "seq": int(e.get("collective_seq_id", 0)),
                "p2p_seq": int(e.get("p2p_seq_id", 0)),
                "is_p2p": bool(e.get("is_p2p", False)),
                "name": e.get("profiling_name", ""),
                "input_sizes": e.get("input_sizes", []),
                "dtypes": e.get("input_dtypes", []),
                "completed": bool(e.get("retired")) or e.get("state") == "completed",
                "state": e.get("state", ""),
                "timeout_ms": e.get("timeout_ms"),
                "time_created_ns": e.get("time_created_ns"),
            })
    entries.sort(key=lambda e: (e["time_created_ns"] or 0))
    return {"available": True, "entries": entries, "version": dumps[0].get("version")}


def diagnosis(brief: bool = False) -> dict:
    """Where this rank is now: the ``report`` of a ``DIAGNOSE_REPLY`` (read by ``sharddbg.analysis.hang``).
    ``brief``: its collectives only (no stack, no recording so far), for a look every few seconds."""
    report = {
        "rank": STATE.rank,
        "pid": os.getpid(),
        "stack": [] if brief else main_thread_stack(),
        "flight_recorder": flight_recorder(),
        "groups": process_groups(),
        "mesh_dims": mesh_dim_names(),
    }
    if brief:
        return report
    try:
        from . import recorder

        if recorder.is_recording():
            report["recording"] = recorder.peek()
    except Exception as exc:  # a diagnosis must answer even when the recorder is broken
        report["recording_error"] = f"{type(exc).__name__}: {exc}"
    return report


def sever_connections_to(pids) -> int:
    """Shut down this process's TCP connections to the processes ``pids`` (local peers only); how many.

    Destroying the process group would close them only once nothing references it, and live
    ShardTensors, meshes or autograd graphs in the user's namespace can keep it referenced. Safe from any
    thread: a collective blocked on one of these sockets in the main thread fails at once.
    """
    import socket

    import psutil

    peer_ports = set()
    for pid in pids:
        try:
            peer_ports.update(c.laddr.port for c in psutil.Process(pid).net_connections(kind="tcp") if c.laddr)
        except psutil.Error:
            continue
    severed = 0
    for conn in psutil.Process().net_connections(kind="tcp"):
        if conn.raddr and conn.raddr.port in peer_ports and conn.fd >= 0:
            try:
                dup = socket.fromfd(conn.fd, socket.AF_INET6 if ":" in conn.raddr.ip else socket.AF_INET,
                                    socket.SOCK_STREAM)
                dup.shutdown(socket.SHUT_RDWR)
                dup.close()
                severed += 1
            except OSError:
                continue
    return severed


def abort_communicators() -> list[str]:
    """Abort every NCCL process group of this rank (from any thread: a kernel waiting for a peer returns);
    the names of the groups aborted. Other backends are left to ``sever_connections_to``."""
    try:
        import torch.distributed as dist
        from torch.distributed import distributed_c10d as c10d
    except ImportError:
        return []
    if not dist.is_initialized() or STATE.backend != "nccl":
        return []
    aborted = []
    for pg in list(c10d._world.pg_map):
        try:
            pg.abort()
            aborted.append(str(pg.group_name))
        except Exception:
            continue
    return aborted


def release(peer_pids) -> dict:
    """End every collective this rank waits in (see ``RELEASE_REQUEST``)."""
    return {"severed": sever_connections_to(peer_pids), "aborted": abort_communicators()}


def install_handlers() -> bool:
    """Answer ``DIAGNOSE_REQUEST``, ``CLOCK_REQUEST`` and ``RELEASE_REQUEST`` on this engine's control channel
    (idempotent)."""
    try:
        from IPython import get_ipython
    except ImportError:
        return False
    shell = get_ipython()
    kernel = getattr(shell, "kernel", None)
    if kernel is None:
        return False

    def answer_diagnose(stream, ident, parent):
        try:
            content = {"status": "ok", "report": diagnosis(brief=bool(parent.get("content", {}).get("brief")))}
        except Exception as exc:
            content = {"status": "error", "ename": type(exc).__name__, "evalue": str(exc),
                       "traceback": traceback.format_exc().splitlines()}
        kernel.session.send(stream, DIAGNOSE_REPLY, content, parent, ident=ident)

    def answer_clock(stream, ident, parent):
        kernel.session.send(stream, CLOCK_REPLY, {"status": "ok", **clock.reading()}, parent, ident=ident)

    def answer_release(stream, ident, parent):
        try:
            content = {"status": "ok", **release(parent.get("content", {}).get("peer_pids", []))}
        except Exception as exc:
            content = {"status": "error", "ename": type(exc).__name__, "evalue": str(exc)}
        kernel.session.send(stream, RELEASE_REPLY, content, parent, ident=ident)

    kernel.control_handlers[DIAGNOSE_REQUEST] = answer_diagnose
    kernel.control_handlers[CLOCK_REQUEST] = answer_clock
    kernel.control_handlers[RELEASE_REQUEST] = answer_release
    return True
