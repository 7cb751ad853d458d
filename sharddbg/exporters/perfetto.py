"""Perfetto export: a Trace as Chrome trace-event JSON (open in ui.perfetto.dev or chrome://tracing).

One process per rank; on it one track per recorder thread for ops (forward, and a second one for the
autograd engine's top-level backward events, so slices nest properly on each track) and one track
for the collectives. Every op is a complete ("X") slice with its path, handler, module, shapes and user
frame; every collective a slice from issue to the return of its wait. What was still running at
snapshot time is an instant ("i") marker. Times are µs since the trace's first event
(``analysis.timeline.time_origin_ns``, the timeline's origin too). Data layer only: no plotting.
"""

from __future__ import annotations

import json
import os
from typing import TYPE_CHECKING

import pandas as pd

from .. import schema
from ..files import write_file_atomically
from ..analysis.formatting import json_value
from ..analysis.timeline import time_origin_ns

if TYPE_CHECKING:
    from ..trace import Trace

# Track ids on a rank's process: ops of recorder thread k on 2k (2k + 1: its top-level backward events),
# collectives of thread k on COLLECTIVE_TRACK + k.
COLLECTIVE_TRACK = 1000
OP_ARGS = ("seq", "path", "handler", "phase", "module", "user_frame", "in_local_shapes", "in_global_shapes",
           "out_local_shape", "out_global_shape", "placements", "dtype", "in_bytes", "out_bytes")
COLLECTIVE_ARGS = ("seq", "group_seq", "group_ranks", "mesh_dim", "bytes_sent", "bytes_recv", "async", "op", "op_seq",
                   "outer_op", "phase", "autograd_node", "param")


def _op_track(thread: int, phase: str, depth: int) -> int:
    return thread * 2 + (1 if phase == "backward" and depth == 0 else 0)


def _track_name(track: int) -> str:
    if track >= COLLECTIVE_TRACK:
        return "collectives" + (f" (thread {track - COLLECTIVE_TRACK})" if track > COLLECTIVE_TRACK else "")
    return f"thread {track // 2}" + (" backward" if track % 2 else "")


def _slice(name: str, cat: str, rank: int, track: int, start_ns: int, end_ns, t0_ns: int, args: dict) -> dict:
    """A complete slice, or an instant marker when ``end_ns`` is missing (still running at snapshot time)."""
    ev = {"name": name, "cat": cat, "ph": "X", "pid": rank, "tid": track, "ts": (start_ns - t0_ns) / 1000.0,
          "dur": (int(end_ns) - start_ns) / 1000.0 if not pd.isna(end_ns) else 0.0, "args": args}
    if pd.isna(end_ns):
        ev.update(ph="i", s="t")
        ev.pop("dur")
    return ev


def perfetto_dict(trace: Trace) -> dict:
    """The trace-event JSON document (a dict) for ``trace``."""
    ops = trace.get_ops()
    colls = trace.get_collectives()
    t0 = time_origin_ns(ops, colls)
    out: list[dict] = []
    for r in trace.ranks:
        label = f"rank {r}" + (" (incomplete)" if r in trace.incomplete_ranks else "")
        out.append({"name": "process_name", "ph": "M", "pid": r, "tid": 0, "args": {"name": label}})
        out.append({"name": "process_sort_index", "ph": "M", "pid": r, "tid": 0, "args": {"sort_index": r}})
    tracks: set[tuple[int, int]] = set()
    for e, arg_values in zip(ops.itertuples(index=False), ops[list(OP_ARGS)].itertuples(index=False, name=None)):
        track = _op_track(int(e.thread), e.phase, int(e.depth))
        tracks.add((int(e.rank), track))
        args = json_value(dict(zip(OP_ARGS, arg_values)))
        if isinstance(e.autograd_node, str):
            args["autograd_node"] = e.autograd_node
        if not pd.isna(e.fwd_seq):
            args["fwd_seq"] = int(e.fwd_seq)
        if isinstance(e.error, str):
            args["error"] = e.error
        if e.fallback:
            args["fallback"] = True
        out.append(_slice(e.op, f"{e.phase},{e.path}", int(e.rank), track, int(e.t_start_ns), e.t_end_ns, t0, args))
    for c in colls.to_dict("records"):
        track = COLLECTIVE_TRACK + int(c["thread"])
        tracks.add((int(c["rank"]), track))
        end = c["t_done_ns"] if not pd.isna(c["t_done_ns"]) else c["t_return_ns"]
        out.append(_slice(c["kind"], f"collective,{c['phase']}", int(c["rank"]), track, int(c["t_issue_ns"]), end, t0,
                          json_value({k: c[k] for k in COLLECTIVE_ARGS})))
    for rank, track in sorted(tracks):
        out.append({"name": "thread_name", "ph": "M", "pid": rank, "tid": track, "args": {"name": _track_name(track)}})
    return {"traceEvents": out, "displayTimeUnit": "ms",
            "otherData": {"generator": "sharddbg", "schema_version": schema.SCHEMA_VERSION}}


def write_perfetto(trace: Trace, path: str | os.PathLike) -> str:
    """Write ``perfetto_dict(trace)`` to ``path`` as strict JSON, whole or not at all. Returns the path."""
    doc = perfetto_dict(trace)
    return write_file_atomically(path, lambda f: json.dump(doc, f, allow_nan=False), example_name="trace.perfetto.json")
