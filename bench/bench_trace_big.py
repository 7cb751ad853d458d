"""Big traces: a million events over 16 ranks, saved, loaded, analysed; and a gather from live engines.

The events are a real recorded trace's (by default the golden trace tests/data/conv4.sdtrace.json, a real
4-rank recording: convs with their halo exchange, a DTensor fallback, backward, an error), repeated on every
rank with their sequence numbers, the references between them (parent, forward op, op of a collective, wait,
group sequence, error origin) and their times shifted, until the trace holds ``--events`` events over
``--ranks`` ranks.

Measured in one run (wall and CPU seconds of each step; the CPU time is what a shared machine changes least):
- save as JSON the way it was written before (``json.dump``) and now, and as the columnar file
  (``.sdtrace.arrow``); ``load_trace`` of each in a fresh process, with its peak resident memory;
- the same table written and read as Arrow IPC and as Parquet by pyarrow alone;
- ``get_ops()`` and ``get_collectives()`` a row at a time (``ops_frame_by_record``,
  ``collectives_frame_by_record``: the builders they replaced) and now, the ratios beside;
  ``get_op_summary()`` and ``get_comm_by_op()``;
- with ``--gather``: a 2-rank cluster whose engines hold ``--gather-ranks`` payloads of ``--gather-events``
  records between them, pulled with ``cl.eval`` (what the recorders' payloads go through) and built into a
  Trace (``Trace.from_payloads``: every payload checked), three times;
- with ``--json-load FILE``: ``load_trace`` of a JSON trace file and the columnar save of what it gives, in fresh
  processes, this code's and ``--before-code``'s alternating, and the two saved files compared;
- with ``--gather-recorded``: the real path, ``cl.trace`` of a cell that records ``--gather-events`` records on
  each rank of a 2-rank cluster (``--recorded-ranks``), and what it takes beyond the cell (the recorders format their records, make
  them columns, the client pulls, checks and builds the Trace); ``--gather`` leaves the formatting out.

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
    ``source``'s records repeated (rank r repeats the records of ``source``'s rank ``r % len(ranks)``). The
    copies are shallow: their nested values (shapes, ...) are shared, which nothing here changes."""
    import sharddbg.schema as schema

    with open(source) as f:
        base = json.load(f)
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
        out: list[dict] = []
        copy_no = 0
        while len(out) < per_rank:
            for e in events[: per_rank - len(out)]:
                e = dict(e)
                e["seq"] += copy_no * seq_span
                for k in _SEQ_REFS:
                    if type(e.get(k)) is int:
                        e[k] += copy_no * seq_span
                if isinstance(e.get("error"), dict):
                    e["error"] = dict(e["error"], origin_seq=e["error"]["origin_seq"] + copy_no * seq_span)
                for k in _TIMES:
                    if type(e.get(k)) is int:
                        e[k] += copy_no * t_span
                if type(e.get("group_seq")) is int:
                    e["group_seq"] += copy_no * group_span
                out.append(e)
            copy_no += 1
        p = dict(src, rank=r, world_size=n_ranks, events=out, schema_version=schema.SCHEMA_VERSION)
        payloads.append(p)
    doc = dict(base, ranks=list(range(n_ranks)), payloads=payloads, schema_version=schema.SCHEMA_VERSION,
               clock_offsets_ns={str(r): 0 for r in range(n_ranks)}, incomplete_ranks=[])
    doc["meta"] = {k: v for k, v in base.get("meta", {}).items() if k not in ("clock_uncertainty_ns", "mesh")}
    return doc


_TIMES = ("t_start_ns", "t_end_ns", "t_issue_ns", "t_return_ns", "t_done_ns", "t_ns")


class Clock:
    """Wall and CPU seconds (this process, user + system) since it was made: CPU time is what a loaded,
    shared machine changes least."""

    def __init__(self) -> None:
        self.wall, self.cpu = time.perf_counter(), time.process_time()

    def read(self) -> tuple[float, float]:
        return time.perf_counter() - self.wall, time.process_time() - self.cpu


# the peak resident memory of the loading process: VmHWM, this process's own (getrusage's ru_maxrss keeps, across
# exec, what the process held when it was forked: the size of the bench itself)
_LOADER = """
import sys, time
import sharddbg
wall, cpu = time.perf_counter(), time.process_time()
t = sharddbg.load_trace(sys.argv[1])
peak = next(int(line.split()[1]) for line in open("/proc/self/status") if line.startswith("VmHWM:"))
print(time.perf_counter() - wall, time.process_time() - cpu, peak * 1024)
"""


def load_in_a_fresh_process(path: str, code: Path = ROOT) -> tuple[float, float, float]:
    """(wall s, CPU s, peak RSS GiB) of ``load_trace(path)`` in a process of its own, importing sharddbg from
    ``code`` (this checkout, or an older one's ``git archive``)."""
    env = dict(os.environ, PYTHONPATH=str(code))
    # run from ``code``: ``python -c`` puts the working folder before PYTHONPATH on sys.path
    out = subprocess.run([sys.executable, "-c", _LOADER, os.path.abspath(path)], capture_output=True, text=True,
                         env=env, check=True, cwd=str(code))
    wall, cpu, rss = (float(x) for x in out.stdout.split()[-3:])
    return wall, cpu, rss / 2**30


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--events", type=int, default=1_000_000)
    ap.add_argument("--ranks", type=int, default=16)
    ap.add_argument("--source", type=Path, default=GOLDEN, help="the recorded trace whose records are repeated")
    ap.add_argument("--folder", default=None, help="where the files go (default: a temp folder)")
    ap.add_argument("--gather", action="store_true", help="only the gather from live engines")
    ap.add_argument("--recorded-ranks", type=int, default=2, help="with --gather-recorded: the cluster's ranks")
    ap.add_argument("--backend", default=None, choices=("gloo", "nccl"),
                    help="with --gather-recorded: the cluster's backend (default: the cluster's own choice; a GPU host "
                         "picks NCCL, one GPU per rank)")
    ap.add_argument("--gather-recorded", action="store_true",
                    help="only the real path of a recording: cl.trace of a cell of --gather-events records per rank on "
                         "a 2-rank cluster; what it takes beyond the cell (the recorders stop and format their records, "
                         "make them columns, the client pulls and checks them)")
    ap.add_argument("--cell-latency", action="store_true",
                    help="only the latency of tracing a small cell, its payloads as dicts and as columns")
    ap.add_argument("--save-only", action="store_true",
                    help="only the columnar save: of a trace of dicts (this code, and --before-code's in a process of "
                         "its own) and of a trace gathered as columns (the payloads made columns as engines do)")
    ap.add_argument("--job-folder", action="store_true",
                    help="only a recorded job's folder of these records: written as Arrow streams (a batch per 1000 "
                         "lines, as a busy rank's flushes write them) and as JSON lines (stream version 1), each loaded "
                         "in a fresh process")
    ap.add_argument("--gather-ranks", type=int, default=8)
    ap.add_argument("--gather-events", type=int, default=10_000)
    ap.add_argument("--before-code", type=Path, default=None,
                    help="an older sharddbg (a folder holding its sharddbg/, e.g. from git archive) whose load_trace "
                         "of the columnar file is measured beside this one's")
    ap.add_argument("--skip-old-json", action="store_true", help="leave out the JSON save of before (json.dump: minutes)")
    ap.add_argument("--skip-json-load", action="store_true", help="leave out load_trace of the JSON file (minutes)")
    ap.add_argument("--compare-formats", action="store_true", help="also the table as Arrow IPC against Parquet")
    ap.add_argument("--json-load", default=None, metavar="FILE",
                    help="only a JSON trace file FILE (.sdtrace.json): load_trace of it and the columnar save after, each "
                         "in a fresh process, this code's and --before-code's alternating (--runs each); the two saved "
                         "files compared")
    ap.add_argument("--runs", type=int, default=2, help="with --json-load: the runs of each side")
    ap.add_argument("--columnar-only", default=None, metavar="FILE",
                    help="only the columnar file FILE (a .sdtrace.arrow this bench wrote): load it (a fresh process, "
                         "and this one), build its tables, save it again")
    args = ap.parse_args(argv)
    sys.path.insert(0, str(ROOT))
    if args.gather:
        return gather(args.gather_ranks, args.gather_events)
    if args.gather_recorded:
        return gather_recorded(args.gather_events, n_ranks=args.recorded_ranks, backend=args.backend)
    if args.cell_latency:
        return cell_latency()
    if args.job_folder:
        return job_folder(args.events, args.ranks, args.folder or tempfile.mkdtemp(prefix="sdbench-"), args.source,
                          args.skip_json_load)
    if args.save_only:
        return save_only(args.events, args.ranks, args.folder or tempfile.mkdtemp(prefix="sdbench-"), args.before_code,
                         args.source)
    if args.columnar_only:
        return columnar_only(args.columnar_only)
    if args.json_load:
        return json_load(args.json_load, args.folder or tempfile.mkdtemp(prefix="sdbench-"), args.before_code, args.runs)
    import pyarrow as pa
    import pyarrow.parquet as pq

    import sharddbg
    from sharddbg import columnar
    from sharddbg.analysis import comm, ops
    from sharddbg.trace import Trace

    rows: list[tuple[str, str]] = []

    def note(what: str, clock_or_values, extra: str = "") -> tuple[float, float]:
        wall, cpu = clock_or_values.read() if isinstance(clock_or_values, Clock) else clock_or_values
        rows.append((what, f"{wall:8.2f} s wall {cpu:8.2f} s CPU {extra}"))
        print(f"{what:58s} {rows[-1][1]}", flush=True)
        return wall, cpu

    c = Clock()
    doc = big_trace_document(args.events, args.ranks, args.source)
    note(f"build {args.events} events over {args.ranks} ranks (bench only)", c)
    t = Trace(dict(zip(doc["ranks"], doc["payloads"])), {r: 0 for r in doc["ranks"]}, [], doc["meta"])
    folder = args.folder or tempfile.mkdtemp(prefix="sdbench-")
    json_path, arrow_path = os.path.join(folder, "big.sdtrace.json"), os.path.join(folder, "big.sdtrace.arrow")

    if not args.skip_old_json:
        c = Clock()
        with open(json_path + ".old", "w") as f:  # how save wrote JSON before: json.dump, the pure-Python encoder
            json.dump(t.to_dict(), f, allow_nan=False, separators=(",", ":"))
        note("save JSON as before (json.dump)", c)
        os.unlink(json_path + ".old")
    c = Clock()
    t.save(json_path)
    note("save JSON now (json.dumps: the C encoder)", c)
    c = Clock()
    t.save(arrow_path)
    note("save columnar, a trace of dicts (one pass per kind)", c,
         f"{os.path.getsize(arrow_path) / 2**20:.0f} MiB vs JSON {os.path.getsize(json_path) / 2**20:.0f} MiB")
    before_path = os.path.join(folder, "big-before.sdtrace.arrow")
    if args.before_code and not os.path.exists(before_path):  # the file as the older code wrote it
        subprocess.run([sys.executable, "-c", "import sys, sharddbg; sharddbg.load_trace(sys.argv[1]).save(sys.argv[2])",
                        json_path, before_path], env=dict(os.environ, PYTHONPATH=str(args.before_code)), check=True,
                       cwd=str(args.before_code))
    if args.before_code:  # loaded by the older code
        wall, cpu, rss = load_in_a_fresh_process(before_path, args.before_code)
        note("load_trace columnar, the code before (fresh process)", (wall, cpu), f"peak RSS {rss:.2f} GiB")
    for label, path in (("JSON", json_path), ("columnar", arrow_path))[1 if args.skip_json_load else 0:]:
        wall, cpu, rss = load_in_a_fresh_process(path)
        note(f"load_trace {label} (fresh process)", (wall, cpu), f"peak RSS {rss:.2f} GiB")
    if args.before_code:
        wall, cpu, rss = load_in_a_fresh_process(before_path)
        note("load_trace columnar, the file the code before wrote", (wall, cpu), f"peak RSS {rss:.2f} GiB")

    # Arrow IPC against Parquet, the same table, pyarrow alone
    sink = pa.BufferOutputStream() if args.compare_formats else None
    if sink is not None:
        columnar.write_document(doc, sink)
        table = pa.ipc.open_file(pa.BufferReader(sink.getvalue())).read_all()
    for label, write, read, suffix in () if sink is None else (
            ("Arrow IPC (zstd)", lambda p: _write_ipc(pa, table, p), lambda p: pa.ipc.open_file(p).read_all(), ".arrow"),
            ("Parquet (snappy)", lambda p: pq.write_table(table, p), lambda p: pq.read_table(p), ".parquet")):
        path = os.path.join(folder, "table" + suffix)
        c = Clock()
        write(path)
        note(f"write the table as {label}", c, f"{os.path.getsize(path) / 2**20:.0f} MiB")
        c = Clock()
        read(path)
        note(f"read the table from {label}", c)

    events = t._events_by_rank()
    c = Clock()
    ops.ops_frame_by_record(events, t.clock_offsets_ns)
    old_ops = note("get_ops as before (a row at a time)", c)
    c = Clock()
    t.get_ops()
    note("get_ops, a trace of dicts (a column at a time)", c, f"x{old_ops[1] / max(c.read()[1], 1e-9):.1f} CPU")
    c = Clock()
    comm.collectives_frame_by_record(events, t.clock_offsets_ns)
    old_colls = note("get_collectives as before (a row at a time)", c)
    c = Clock()
    t.get_collectives()
    note("get_collectives, a trace of dicts", c, f"x{old_colls[1] / max(c.read()[1], 1e-9):.1f} CPU")
    del events, t, doc
    # the trace loaded from the columnar file: it keeps the columns
    c = Clock()
    held = sharddbg.load_trace(arrow_path)
    note("load_trace columnar (this process)", c)
    c = Clock()
    held.get_ops()
    note("get_ops, the columnar trace (from the columns)", c, f"x{old_ops[1] / max(c.read()[1], 1e-9):.1f} CPU")
    c = Clock()
    held.get_collectives()
    note("get_collectives, the columnar trace", c, f"x{old_colls[1] / max(c.read()[1], 1e-9):.1f} CPU")
    c = Clock()
    held.get_op_summary()
    note("get_op_summary, the columnar trace", c)
    c = Clock()
    held.get_comm_by_op()
    note("get_comm_by_op, the columnar trace", c)
    c = Clock()
    held.save(os.path.join(folder, "again.sdtrace.arrow"))
    note("save columnar, the columnar trace (its table written)", c)
    print(f"\nsharddbg {sharddbg.__version__ if hasattr(sharddbg, '__version__') else ''} pyarrow {pa.__version__} "
          f"python {sys.version.split()[0]} load average {os.getloadavg()}")


_SAVER = """
import json, sys, time
sys.path.insert(0, sys.argv[4])
from bench_trace_big import big_trace_document
from sharddbg.trace import Trace
doc = big_trace_document(int(sys.argv[1]), int(sys.argv[2]))
t = Trace(dict(zip(doc["ranks"], doc["payloads"])), {r: 0 for r in doc["ranks"]}, [], doc["meta"])
wall, cpu = time.perf_counter(), time.process_time()
t.save(sys.argv[3])
print(time.perf_counter() - wall, time.process_time() - cpu)
del t
wall, cpu = time.perf_counter(), time.process_time()
t = Trace.from_payloads(doc["payloads"])
print(time.perf_counter() - wall, time.process_time() - cpu)
wall, cpu = time.perf_counter(), time.process_time()
t.save(sys.argv[3])
print(time.perf_counter() - wall, time.process_time() - cpu)
"""


# load_trace of a file, then its columnar save, in a process of its own: wall and CPU seconds of each, the peak
# resident memory (VmHWM) after the load, and whether the trace holds its records as columns
_LOAD_AND_SAVE = """
import sys, time
import sharddbg
wall, cpu = time.perf_counter(), time.process_time()
t = sharddbg.load_trace(sys.argv[1])
load = (time.perf_counter() - wall, time.process_time() - cpu)
peak = next(int(line.split()[1]) for line in open("/proc/self/status") if line.startswith("VmHWM:"))
wall, cpu = time.perf_counter(), time.process_time()
t.save(sys.argv[2])
print(*load, peak * 1024, time.perf_counter() - wall, time.process_time() - cpu, getattr(t, "_columns", None) is not None)
"""


def json_load(path: str, folder: str, before_code: Path | None, runs: int) -> None:
    """``load_trace`` of the JSON trace file ``path`` and the columnar save of the trace it gives, each in a fresh
    process, this code's and ``before_code``'s alternating (``runs`` of each); then the two saved files compared,
    byte for byte and as decoded tables."""
    import pyarrow as pa

    os.makedirs(folder, exist_ok=True)
    sides = [("after", ROOT)] + ([("before", before_code)] if before_code is not None else [])
    saved = {}
    for run in range(runs):
        for side, code in (sides if run % 2 == 0 else sides[::-1]):
            saved[side] = os.path.join(folder, f"{side}.sdtrace.arrow")
            out = subprocess.run([sys.executable, "-c", _LOAD_AND_SAVE, os.path.abspath(path), saved[side]],
                                 capture_output=True, text=True, env=dict(os.environ, PYTHONPATH=str(code)), check=True,
                                 cwd=str(code))
            load_wall, load_cpu, rss, save_wall, save_cpu, held = out.stdout.split()[-6:]
            print(f"{side:6s} run {run}: load_trace {float(load_wall):6.2f} s wall {float(load_cpu):6.2f} s CPU, peak RSS "
                  f"{float(rss) / 2**30:.2f} GiB; then save .sdtrace.arrow {float(save_wall):6.2f} s wall "
                  f"{float(save_cpu):6.2f} s CPU; held as columns: {held}; load average {os.getloadavg()[0]:.2f}",
                  flush=True)
    if len(saved) == 2:
        with open(saved["after"], "rb") as a, open(saved["before"], "rb") as b:
            same_bytes = a.read() == b.read()
        tables = [pa.ipc.open_file(pa.memory_map(saved[side])).read_all() for side in ("after", "before")]
        decoded = [t.replace_schema_metadata(None).cast(pa.schema([
            pa.field(f.name, f.type.value_type if pa.types.is_dictionary(f.type) else f.type) for f in t.schema]))
            for t in tables]
        print(f"the saved files: the same bytes {same_bytes}; the same header {tables[0].schema.metadata == tables[1].schema.metadata}; "
              f"the same decoded table {decoded[0].equals(decoded[1])}", flush=True)


def save_only(n_events: int, n_ranks: int, folder: str, before_code: Path | None, source: Path) -> None:
    """The columnar save of ``n_events`` records over ``n_ranks`` ranks: a trace of dicts (``--before-code``'s, in a
    process of its own, and this code's), ``Trace.from_payloads`` of the same dict payloads and the save after it,
    and a trace built from the payloads as the engines send them as columns
    (``columnar.payload_as_columns`` on each, ``Trace.from_payloads``): wall and CPU seconds of each step."""
    import sharddbg
    from sharddbg import columnar
    from sharddbg.trace import Trace

    def note(what: str, wall: float, cpu: float, extra: str = "") -> None:
        print(f"{what:62s} {wall:8.2f} s wall {cpu:8.2f} s CPU {extra}", flush=True)

    os.makedirs(folder, exist_ok=True)
    if before_code is not None:
        env = dict(os.environ, PYTHONPATH=str(before_code))
        out = subprocess.run([sys.executable, "-c", _SAVER, str(n_events), str(n_ranks),
                              os.path.join(folder, "before.sdtrace.arrow"), str(ROOT / "bench")],
                             capture_output=True, text=True, env=env, check=True, cwd=str(before_code))
        times = [float(x) for x in out.stdout.split()[-6:]]
        note("save columnar, a trace of dicts: the code before", *times[:2])
        note("Trace.from_payloads of dict payloads: the code before", *times[2:4])
        note("save columnar, after it: the code before", *times[4:])
    c = Clock()
    doc = big_trace_document(n_events, n_ranks, source)
    note(f"build {n_events} records over {n_ranks} ranks (bench only)", *c.read())
    t = Trace(dict(zip(doc["ranks"], doc["payloads"])), {r: 0 for r in doc["ranks"]}, [], doc["meta"])
    c = Clock()
    t.save(os.path.join(folder, "dicts.sdtrace.arrow"))
    note("save columnar, a trace of dicts: this code", *c.read())
    del t
    c = Clock()
    t = Trace.from_payloads(doc["payloads"])
    note("Trace.from_payloads of dict payloads: this code", *c.read(), f"held as columns: {t._columns is not None}")
    c = Clock()
    t.save(os.path.join(folder, "from_payloads.sdtrace.arrow"))
    note("save columnar, after it: this code", *c.read())
    del t
    c = Clock()
    shipped = [columnar.payload_as_columns(p) for p in doc["payloads"]]
    note(f"payloads as columns, {n_ranks} ranks' (the engines' share, here in one process)", *c.read())
    del doc
    c = Clock()
    live = Trace.from_payloads(shipped)
    note("Trace.from_payloads of payloads as columns (checked on columns)", *c.read(),
         f"held as columns: {live._columns is not None}")
    c = Clock()
    path = live.save(os.path.join(folder, "live.sdtrace.arrow"))
    note("save columnar, a trace gathered as columns (its table written)", *c.read())
    wall, cpu, rss = load_in_a_fresh_process(path)
    note("load_trace of it (fresh process)", wall, cpu, f"peak RSS {rss:.2f} GiB")
    print(f"pyarrow {__import__('pyarrow').__version__}, python {sys.version.split()[0]}, load average "
          f"{os.getloadavg()}", flush=True)
    del sharddbg


def job_folder(n_events: int, n_ranks: int, folder: str, source: Path, skip_json: bool = False) -> None:
    """A recorded job's folder holding ``n_events`` records over ``n_ranks`` ranks, as Arrow streams and as JSON
    lines: the bytes, the time to write them (this process) and ``load_trace`` of each folder in a fresh process."""
    from sharddbg import job_files, schema
    flush_lines = 1000  # the lines of one flush of a busy rank: a record batch

    doc = big_trace_document(n_events, n_ranks, source)
    for suffix in (job_files.STREAM_SUFFIX, job_files.JSON_LINES_SUFFIX)[:1 if skip_json else 2]:
        out = os.path.join(folder, "job" + suffix.replace(".", "-"))
        os.makedirs(out, exist_ok=True)
        c = Clock()
        size = 0
        for p in doc["payloads"]:
            head = {"format": job_files.STREAM_FORMAT, "version": 2 if suffix == job_files.STREAM_SUFFIX else 1,
                    "schema_version": schema.SCHEMA_VERSION, "run_id": "bench", "rank": p["rank"],
                    "world_size": n_ranks, "clock": p["clock"], "meta": p["meta"]}
            lines = [{"header": head}, {"clock": {"offset_ns": 0, "uncertainty_ns": 0}},
                     *({"event": ev} for ev in p["events"]),
                     {"end": {"meta": p["meta"], "dropped": 0, "clock": p["clock"]}}]
            path = os.path.join(out, job_files.rank_file_name(p["rank"], suffix))
            if suffix == job_files.STREAM_SUFFIX:
                encoder = job_files.StreamEncoder(p["rank"])
                data = b"".join(encoder.encode(lines[i:i + flush_lines]) for i in range(0, len(lines), flush_lines))
            else:
                data = "".join(json.dumps(line, separators=(",", ":")) + "\n" for line in lines).encode()
            with open(path, "wb") as f:
                f.write(data)
            size += len(data)
        wall, cpu = c.read()
        print(f"write the job's streams as {suffix:8s}: {wall:7.2f} s wall {cpu:7.2f} s CPU, {size / 2**20:.0f} MiB",
              flush=True)
        wall, cpu, rss = load_in_a_fresh_process(out)
        print(f"load_trace of the folder ({suffix}, fresh process): {wall:7.2f} s wall {cpu:7.2f} s CPU, peak RSS "
              f"{rss:.2f} GiB", flush=True)
    print(f"load average {os.getloadavg()}", flush=True)


def columnar_only(path: str) -> None:
    """Load the columnar file ``path`` in a fresh process and in this one, build the tables from its columns, save
    it again: wall and CPU seconds of each step, peak memory of the fresh process."""
    import sharddbg

    def note(what: str, wall: float, cpu: float, extra: str = "") -> None:
        print(f"{what:58s} {wall:8.2f} s wall {cpu:8.2f} s CPU {extra}", flush=True)

    wall, cpu, rss = load_in_a_fresh_process(path)
    note("load_trace columnar (fresh process)", wall, cpu, f"peak RSS {rss:.2f} GiB")
    c = Clock()
    t = sharddbg.load_trace(path)
    note("load_trace columnar (this process)", *c.read())
    for table in ("get_ops", "get_collectives", "get_op_summary", "get_comm_by_op"):
        c = Clock()
        getattr(t, table)()
        note(f"{table}, the columnar trace", *c.read())
    c = Clock()
    t.save(os.path.join(os.path.dirname(os.path.abspath(path)), "again.sdtrace.arrow"))
    note("save columnar, the columnar trace (its table written)", *c.read())
    peak = next(int(line.split()[1]) for line in open("/proc/self/status") if line.startswith("VmHWM:"))
    print(f"peak RSS of this process {peak / 2**20:.2f} GiB; load average {os.getloadavg()}")


def gather(n_payloads: int, n_events: int, runs: int = 3) -> None:
    """Pull ``n_payloads`` payloads of ``n_events`` records from the engines of a 2-rank cluster and build the
    Trace, as dicts (pickled, checked record by record) and as columns (each payload made into Arrow columns on its
    engine, ``columnar.payload_as_columns``, what ``api.recording_stop(columns_from=...)`` sends; the client reads
    and checks them on columns), ``runs`` times each, alternating: wall and CPU seconds of the client, CPU seconds
    of the engines."""
    import sharddbg
    from sharddbg.trace import Trace

    cl = sharddbg.Cluster(n=2, timeout=300)
    cl.start()
    try:
        cl.run(f"""
import pickle, sys, time
import torch.distributed as _dist
from sharddbg import columnar as _columnar
sys.path.insert(0, {str(ROOT / "bench")!r})
from bench_trace_big import big_trace_document
_doc = big_trace_document({n_payloads * n_events}, {n_payloads})
held = [pickle.loads(pickle.dumps(p)) for p in _doc["payloads"][_dist.get_rank()::2]]  # unshared
del _doc

def _shipped(as_columns):
    cpu = time.process_time()
    out = [_columnar.payload_as_columns(p) for p in held] if as_columns else held
    return out, time.process_time() - cpu
""", timeout=300)
        for _ in range(runs):
            for mode in ("dicts", "columns"):
                c = Clock()
                per_engine = cl.eval(f"_shipped({mode == 'columns'})", timeout=300)
                payloads = [p for shipped, _cpu in per_engine for p in shipped]
                pulled = c.read()
                t = Trace.from_payloads({p["rank"]: p for p in payloads})
                total = c.read()
                engine_cpu = sum(cpu for _shipped, cpu in per_engine)
                print(f"{mode:8s} {len(payloads)} x {n_events} records: engines' columns {engine_cpu:.2f} s CPU "
                      f"(both); pull {pulled[0]:.2f} s wall ({pulled[1]:.2f} s CPU); check and build the Trace: "
                      f"{total[0] - pulled[0]:.2f} s wall ({total[1] - pulled[1]:.2f} s CPU); total {total[0]:.2f} s "
                      f"wall, client {total[1]:.2f} s CPU; held as columns: {t._columns is not None}", flush=True)
                del t, payloads, per_engine
    finally:
        cl.stop()


def gather_recorded(n_events: int, runs: int = 4, n_ranks: int = 2, backend: str | None = None) -> None:
    """``cl.trace`` of a cell that records ``n_events`` records on each rank of an ``n_ranks`` cluster (sharded adds and
    multiplies), ``runs`` times: its wall time, the cell's own (``meta["wall_s"]``, the ranks running it under the
    recorder) and the rest, what the user waits for after the cell: the recorders stop and format their records
    (``api.recording_stop(columns_from=recording.COLUMNS_FROM)``: a payload of that many records or more goes as
    Arrow columns), the pull, the clock offsets, the client's checks and ``Trace.from_payloads``; and the gather
    alone, that without the recorder's start (made before the cell, and counted in the cell's wall time by nothing
    else)."""
    import statistics

    import sharddbg
    from sharddbg import trace as trace_module
    from sharddbg.cluster import control, execution

    # the client's phases of cl.trace, timed where CellTracer.trace calls them (wall seconds, this process)
    phases: dict[str, float] = {}

    def timed(what_of, call):
        def wrapper(*args, **kwargs):
            t0 = time.perf_counter()
            try:
                return call(*args, **kwargs)
            finally:
                what = what_of(kwargs)
                phases[what] = phases.get(what, 0.0) + time.perf_counter() - t0
        return wrapper

    execution.RankExecution.call = timed(lambda kw: kw.get("what", "call"), execution.RankExecution.call)
    # ipyparallel's own timestamps of each engine call (metadata: submitted, started, completed, received): how
    # much of the recorder stop's wait is the engines' work and how much the transport
    stamps: dict[str, list[dict]] = {}
    collect = execution.RankExecution.collect

    def collect_stamped(self, ar, ranks, *args, what: str, **kwargs):
        try:
            return collect(self, ar, ranks, *args, what=what, **kwargs)
        finally:
            stamps[what] = [dict(m) for m in ar._metadata]

    execution.RankExecution.collect = collect_stamped
    control.ControlChannel.clock_offsets = timed(lambda kw: "clock offsets", control.ControlChannel.clock_offsets)
    from_payloads = trace_module.Trace.from_payloads.__func__
    trace_module.Trace.from_payloads = classmethod(timed(lambda kw: "Trace.from_payloads", from_payloads))

    cl = sharddbg.Cluster(n=n_ranks, timeout=300, **({"backend": backend} if backend else {}))
    cl.start()
    try:
        rows = 8 * n_ranks
        cl.run(f"x = sharddbg.engine.scatter(torch.arange({4.0 * rows}).reshape(1, 1, {rows}, 4), dim=2)", display=False)
        where = cl.eval("sharddbg.__file__")
        # the engines' CPU seconds in recording_stop: the recorder's stop (its records formatted) and the columns
        # made of them, and the collections of each generation the collector ran meanwhile. ipyparallel sends
        # recording_stop's code, which finds these two by name in their modules: the wrappers below
        cl.run("""
import gc, time
from sharddbg import columnar as _columnar
from sharddbg.engine import recorder as _recorder
_stop_cpu = []
def _timing(what, call):
    def timed(*args, **kwargs):
        cpu, before = time.process_time(), [s["collections"] for s in gc.get_stats()]
        try:
            return call(*args, **kwargs)
        finally:
            _stop_cpu.append((what, time.process_time() - cpu,
                              [s["collections"] - b for s, b in zip(gc.get_stats(), before)]))
    return timed
_recorder.stop = _timing("stop", _recorder.stop)
_columnar.payload_as_columns = _timing("columns", _columnar.payload_as_columns)
""", display=False)
        cell = f"for _ in range({n_events // 2}):\n    y = x + 1\n    y = y * 2\n"
        after: list[float] = []
        gather_s: list[float] = []
        stop_cpu: list[float] = []
        by_phase: dict[str, list[float]] = {}
        for _ in range(runs):
            phases.clear()
            c = Clock()
            t = cl.trace(cell, display=False)
            wall, cpu = c.read()
            cell_s = t.meta["wall_s"]
            after.append(wall - cell_s)
            engines = cl.eval("_stop_cpu")
            cl.run("_stop_cpu.clear()", display=False)
            stop_cpu += [sum(cpu for _what, cpu, _collections in timed) for timed in engines]
            print(f"cl.trace of {len(t.events(0))} records per rank: {wall:.2f} s wall (client {cpu:.2f} s CPU), the "
                  f"cell {cell_s:.2f} s, after the cell {wall - cell_s:.2f} s; recording_stop on each engine (CPU s; "
                  f"collections per generation): " + "; ".join(
                      ", ".join(f"{what} {engine_cpu:.2f} {collections}" for what, engine_cpu, collections in timed)
                      for timed in engines) + f"; held as columns: {t._columns is not None}; client phases (s): "
                  + ", ".join(f"{what} {s:.3f}" for what, s in phases.items()), flush=True)
            for what, seconds in phases.items():
                by_phase.setdefault(what, []).append(seconds)
            gather_s.append(wall - cell_s - phases.get("recorder start", 0.0))
            stop_stamps = stamps.get("recorder stop", [])
            if stop_stamps:
                sent = min(m["submitted"] for m in stop_stamps)
                print("  recorder stop, ipyparallel's stamps per engine, s after it was sent (started, completed, "
                      "received): " + "; ".join(
                          f"{(m['started'] - sent).total_seconds():.3f}, {(m['completed'] - sent).total_seconds():.3f}, "
                          f"{(m['received'] - sent).total_seconds():.3f}" for m in stop_stamps), flush=True)
            del t
        print(f"recording_stop on an engine: median {statistics.median(stop_cpu):.2f} s CPU (min {min(stop_cpu):.2f}, "
              f"max {max(stop_cpu):.2f})", flush=True)
        print("client phases, median s: " + ", ".join(f"{what} {statistics.median(v):.3f}" for what, v in by_phase.items()),
              flush=True)
        print(f"the gather (after the cell, the recorder's start left out): median {statistics.median(gather_s):.2f} s "
              f"(min {min(gather_s):.2f}, max {max(gather_s):.2f})", flush=True)
        print(f"after the cell: median {statistics.median(after):.2f} s (min {min(after):.2f}, max {max(after):.2f}); "
              f"{n_ranks} ranks, {os.cpu_count()} cores; engines' sharddbg {where}; load average {os.getloadavg()}", flush=True)
    finally:
        cl.stop()


def cell_latency(runs: int = 7) -> None:
    """The wall time of ``cl.trace`` of a small cell (26 records per rank, the golden trace's size) on a 2-rank
    cluster, its payloads sent as dicts and as columns (``recording.COLUMNS_FROM`` None and 0), alternating."""
    import statistics

    import sharddbg
    from sharddbg.cluster import recording

    cl = sharddbg.Cluster(n=2, timeout=300)
    cl.start()
    try:
        cl.run("x = sharddbg.engine.scatter(torch.arange(64.).reshape(1, 1, 16, 4), dim=2)", display=False)
        cell = "for _ in range(13):\n    y = x + 1\n    y = y * 2\n"
        cl.trace(cell, display=False)
        times: dict[str, list[float]] = {"dicts": [], "columns": []}
        cpu: dict[str, list[float]] = {"dicts": [], "columns": []}
        for _ in range(runs):
            for mode, columns_from in (("dicts", None), ("columns", 0)):
                recording.COLUMNS_FROM = columns_from
                c = Clock()
                t = cl.trace(cell, display=False)
                wall, cpu_s = c.read()
                times[mode].append(wall)
                cpu[mode].append(cpu_s)
                assert (t._columns is not None) == (mode == "columns")
        for mode in times:
            print(f"cl.trace of a {len(t.events(0))}-record cell, payloads as {mode}: median {statistics.median(times[mode]):.3f} s "
                  f"wall (min {min(times[mode]):.3f}, max {max(times[mode]):.3f}), client CPU median "
                  f"{statistics.median(cpu[mode]):.3f} s", flush=True)
    finally:
        cl.stop()


def _write_ipc(pa, table, path: str) -> None:
    with pa.ipc.new_file(path, table.schema, options=pa.ipc.IpcWriteOptions(compression="zstd")) as writer:
        writer.write_table(table)


if __name__ == "__main__":
    main()
