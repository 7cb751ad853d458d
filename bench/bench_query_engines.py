"""Which engine runs a big trace's analyses: pandas on pyarrow-backed columns (what sharddbg uses) against DuckDB,
on the same tables and the same questions, the answers checked equal.

    OMP_NUM_THREADS=1 .venv/bin/python bench/bench_query_engines.py TRACE.sdtrace.arrow [--repeats 5]

DuckDB is not a dependency of sharddbg: the bench imports it where it is installed (for a measurement without
touching the project's environment: ``pip install --target DIR duckdb==1.4.2`` and ``PYTHONPATH=DIR``). The
trace is loaded and its ``get_ops()`` / ``get_collectives()`` tables built once; both engines then answer, each
``--repeats`` times (the median and the range are printed, wall and CPU seconds):

- the op summary's core: the user's own calls (forward depth 0, every backward call) per (op, dispatch path,
  phase): calls, ranks, total, median and 95th percentile of the host time (linear interpolation in both);
- communication per op and rank: each collective's count, bytes sent and received and time, per the op it is
  attributed to, forward and backward apart, beside the host time of that op's calls on that rank (a join);
- one explorer filter: the calls of one op on one dispatch path, in time order, the first 200.

DuckDB reads the tables as Arrow (``pyarrow.Table.from_pandas`` of the same frames, made once, its time printed
apart) and gives pandas frames back; pandas runs on the frames as sharddbg holds them. Both answers are sorted the
same way and compared (integers exactly, floats within 1e-9 relative: the sums' order differs).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

SUMMARY_SQL = """
SELECT op, path, phase, count(*) AS calls, count(DISTINCT rank) AS ranks, sum(host_ms) AS host_ms_total,
       median(host_ms) AS host_ms_median, quantile_cont(host_ms, 0.95) AS host_ms_p95
FROM ops WHERE phase = 'backward' OR depth = 0
GROUP BY op, path, phase ORDER BY op, path, phase
"""
COMM_SQL = """
WITH c AS (SELECT op, rank, phase, count(*) AS n_collectives, sum(bytes_sent) AS bytes_sent,
                  sum(bytes_recv) AS bytes_recv, sum(duration_ms) AS comm_ms
           FROM colls WHERE op IS NOT NULL GROUP BY op, rank, phase),
     o AS (SELECT op, rank, sum(host_ms) AS op_ms FROM ops WHERE phase = 'forward' GROUP BY op, rank)
SELECT c.*, o.op_ms FROM c LEFT JOIN o USING (op, rank) ORDER BY op, rank, phase
"""
FILTER_SQL = """
SELECT rank, seq, t_start_ns, host_ms FROM ops WHERE op = ? AND path = ?
ORDER BY t_start_ns, rank, seq LIMIT 200
"""


def pandas_summary(ops):
    own = ops[(ops["phase"] == "backward") | (ops["depth"] == 0)][["op", "path", "phase", "rank", "host_ms"]]
    g = own.groupby(["op", "path", "phase"], sort=True, observed=True)
    out = g.agg(calls=("host_ms", "size"), ranks=("rank", "nunique"), host_ms_total=("host_ms", "sum"),
                host_ms_median=("host_ms", "median"))
    out["host_ms_p95"] = g["host_ms"].quantile(0.95)
    return out.reset_index()


def pandas_comm(ops, colls):
    c = colls[colls["op"].notna()][["op", "rank", "phase", "bytes_sent", "bytes_recv", "duration_ms"]]
    per = c.groupby(["op", "rank", "phase"], sort=True, observed=True).agg(
        n_collectives=("bytes_sent", "size"), bytes_sent=("bytes_sent", "sum"), bytes_recv=("bytes_recv", "sum"),
        comm_ms=("duration_ms", "sum")).reset_index()
    f = ops[ops["phase"] == "forward"][["op", "rank", "host_ms"]]
    op_ms = f.groupby(["op", "rank"], sort=False, observed=True)["host_ms"].sum().rename("op_ms").reset_index()
    return per.merge(op_ms, on=["op", "rank"], how="left")


def pandas_filter(ops, op, path):
    part = ops[(ops["op"] == op) & (ops["path"] == path)][["rank", "seq", "t_start_ns", "host_ms"]]
    return part.sort_values(["t_start_ns", "rank", "seq"], kind="stable").head(200)


def timed(fn, repeats):
    walls, cpus, out = [], [], None
    for _ in range(repeats):
        w, c = time.perf_counter(), time.process_time()
        out = fn()
        walls.append(time.perf_counter() - w)
        cpus.append(time.process_time() - c)
    return out, walls, cpus


def same(a, b, what: str) -> bool:
    import numpy as np
    import pandas as pd

    a, b = a.reset_index(drop=True), b.reset_index(drop=True)
    if list(a.columns) != list(b.columns) or len(a) != len(b):
        print(f"  DIFFER {what}: columns {list(a.columns)} / {list(b.columns)}, rows {len(a)} / {len(b)}")
        return False
    for col in a.columns:
        x, y = a[col], b[col]
        if pd.api.types.is_float_dtype(x) or pd.api.types.is_float_dtype(y):
            ok = np.allclose(x.to_numpy(float, na_value=np.nan), y.to_numpy(float, na_value=np.nan), rtol=1e-9,
                             atol=0.0, equal_nan=True)
        else:
            ok = [None if pd.isna(v) else (int(v) if isinstance(v, (int, np.integer)) else str(v)) for v in x] == \
                 [None if pd.isna(v) else (int(v) if isinstance(v, (int, np.integer)) else str(v)) for v in y]
        if not ok:
            print(f"  DIFFER {what}: column {col}")
            return False
    return True


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("trace")
    ap.add_argument("--repeats", type=int, default=5)
    a = ap.parse_args(argv)
    try:
        import duckdb
    except ImportError:
        print("DuckDB is not installed: `pip install --target DIR duckdb==1.4.2`, then run with PYTHONPATH=DIR")
        return 2
    import pandas as pd
    import pyarrow as pa

    from sharddbg.trace import load_trace

    t = load_trace(a.trace)
    ops, colls = t.get_ops(), t.get_collectives()
    top = ops.groupby(["op", "path"]).size().idxmax()
    print(f"{a.trace}: {len(ops)} op calls, {len(colls)} collectives; pandas {pd.__version__}, pyarrow "
          f"{pa.__version__}, duckdb {duckdb.__version__}; {os.cpu_count()} cores, load average "
          f"{tuple(round(x, 1) for x in os.getloadavg())}, {time.strftime('%Y-%m-%d %H:%M')}")

    w, c = time.perf_counter(), time.process_time()
    keep_ops = ["op", "path", "phase", "depth", "rank", "seq", "host_ms", "t_start_ns"]
    keep_colls = ["op", "rank", "phase", "bytes_sent", "bytes_recv", "duration_ms"]
    tables = {"ops": pa.Table.from_pandas(ops[keep_ops], preserve_index=False),
              "colls": pa.Table.from_pandas(colls[keep_colls], preserve_index=False)}
    print(f"{'the frames as Arrow tables for DuckDB (once)':52s} {time.perf_counter() - w:6.3f} s wall "
          f"{time.process_time() - c:6.3f} s CPU")
    con = duckdb.connect()
    con.execute("SET threads TO 1")  # as the bench's pandas: one core each (the box has two, shared)
    for name, table in tables.items():
        con.register(name, table)

    questions = [
        ("the op summary's core", lambda: pandas_summary(ops), lambda: con.execute(SUMMARY_SQL).df()),
        ("communication per op and rank", lambda: pandas_comm(ops, colls), lambda: con.execute(COMM_SQL).df()),
        (f"explorer filter ({top[0]}, {top[1]})", lambda: pandas_filter(ops, *top),
         lambda: con.execute(FILTER_SQL, list(top)).df()),
    ]
    failures = 0
    for what, with_pandas, with_duckdb in questions:
        p, pw, pc = timed(with_pandas, a.repeats)
        d, dw, dc = timed(with_duckdb, a.repeats)
        ok = same(p, d, what)
        failures += not ok
        print(f"{what:52s} pandas {statistics.median(pw):6.3f} s wall ({min(pw):.3f}-{max(pw):.3f}), "
              f"{statistics.median(pc):6.3f} s CPU | duckdb {statistics.median(dw):6.3f} s wall "
              f"({min(dw):.3f}-{max(dw):.3f}), {statistics.median(dc):6.3f} s CPU | duckdb / pandas (CPU) "
              f"{statistics.median(dc) / statistics.median(pc):5.2f} | {len(p)} rows, "
              f"{'the same answers' if ok else 'ANSWERS DIFFER'}", flush=True)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
