"""Big traces: a million events over 16 ranks, saved, loaded, analysed; and a gather from live engines.

The events are a real recorded trace's (by default the golden trace tests/data/conv4.sdtrace.json, a real
4-rank recording: convs with their halo exchange, a DTensor fallback, backward, an error), repeated on every
rank with their sequence numbers, the references between them (parent, forward op, op of a collective, wait,
group sequence, error origin) and their times shifted, until the trace holds ``--events`` events over
``--ranks`` ranks.

Measured in one run, each the least of ``--repeats``:
- save and load (``load_trace``) as JSON and as the columnar file (``.sdtrace.arrow``), and the loading
  process's peak resident memory (a fresh process per load: its ``ru_maxrss``);
- ``get_ops()``, ``get_collectives()``, ``get_op_summary()``, ``get_comm_by_op()`` on a loaded trace, on the
  columnar path and on the per-record path they replace (``SHARDDBG_ROW_FRAMES=1``), the ratios beside;
- with ``--gather``: a 8-rank cluster (``--gather-ranks``), each rank recording ``--gather-events`` events, and
  the time of ``Cluster.gather`` of the payloads, as dicts and as columns.

    OMP_NUM_THREADS=1 .venv/bin/python bench/bench_trace_big.py [--events 1000000] [--ranks 16] [--gather]
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
GOLDEN = ROOT / "tests" / "data" / "conv4.sdtrace.json"

# fields that name another record's seq (shifted with it) and the collective's per-group number
_SEQ_REFS = ("parent_seq", "fwd_seq", "op_seq", "outer_op_seq", "wait_op_seq", "origin_seq", "first_op_seq")


def big_trace_document(n_events: int, n_ranks: int, source: Path = GOLDEN) -> dict:
    """A trace file's document (``Trace.to_dict``) with ``n_events`` events over ``n_ranks`` ranks, made of
    ``source``'s records repeated (rank r repeats the records of ``source``'s rank ``r % len(ranks)``)."""
    with open(source) as f:
        base = json.load(f)
    import sharddbg.schema as schema

    per_rank = n_events // n_ranks
    payloads = []
    for r in range(n_ranks):
        src = base["payloads"][r % len(base["payloads"])]
        events = schema.current_events(src)
        seq_span = max(e["seq"] for e in events) + 1
        times = [t for e in events for t in (e.get("t_start_ns"), e.get("t_end_ns"), e.get("t_issue_ns"),
                                              e.get("t_done_ns"), e.get("t_ns")) if isinstance(t, int)]
        t_span = max(times) - min(times) + 1000
        group_span = max((e.get("group_seq") or 0) for e in events) + 1
        out = []
        copy_no = 0
        while len(out) < per_rank:
            for e in events:
                if len(out) >= per_rank:
                    break
                e = copy.deepcopy(e)
                e["seq"] += copy_no * seq_span
                for k in _SEQ_REFS:
                    if isinstance(e.get(k), int):
                        e[k] += copy_no * seq_span
                if isinstance(e.get("error"), dict) and isinstance(e["error"].get("origin_seq"), int):
                    e["error"]["origin_seq"] += copy_no * seq_span
                for k in ("t_start_ns", "t_end_ns", "t_issue_ns", "t_return_ns", "t_done_ns", "t_ns"):
                    if isinstance(e.get(k), int):
                        e[k] += copy_no * t_span
                if isinstance(e.get("group_seq"), int):
                    e["group_seq"] += copy_no * group_span
                out.append(e)
            copy_no += 1
        p = dict(src, rank=r, world_size=n_ranks, events=out, schema_version=schema.SCHEMA_VERSION)
        p["meta"] = dict(src["meta"])
        payloads.append(p)
    doc = dict(base, ranks=list(range(n_ranks)), payloads=payloads, schema_version=schema.SCHEMA_VERSION,
               clock_offsets_ns={str(r): 0 for r in range(n_ranks)}, incomplete_ranks=[])
    doc["meta"] = {k: v for k, v in base.get("meta", {}).items() if k not in ("clock_uncertainty_ns", "mesh")}
    return doc
