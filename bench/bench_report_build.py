"""How long the standalone report of a trace takes to build in Python (``Trace.to_html``), by phase, beside an older
sharddbg, and whether both write the same file.

Each build runs in a fresh process (load the trace, then ``to_html``; the CPU time of ``to_html`` alone: user +
system of that process, which a shared machine changes least); the two codes take turns, ``--repeats`` times each.
``--phases`` also says where each code's build spends its CPU: the time of each step below, its inner steps' time
taken out (so the steps add up to the whole build): the trace's op and collective tables (built once, at their first
use), the findings and the overview, each figure, the explorer's tables and its payload, the fallback table, the
errors, the figures' JSON and the page's template. Both reports are compared byte for byte, the line saying when
it was generated set aside (it holds the clock's time).

    OMP_NUM_THREADS=1 .venv/bin/python bench/bench_report_build.py --trace big.sdtrace.arrow --before-code DIR \\
        [--repeats 3] [--phases] [--keep FOLDER]

``DIR``: a folder holding an older ``sharddbg`` package (``git archive REV | tar -x -C DIR``).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

# Run in the fresh process: load, then to_html; with "phases", each step of PHASES wrapped by a timer that counts its
# own CPU time (its inner steps' taken out).
CHILD = r"""
import json, sys, time
trace_path, report_path, phases = sys.argv[1], sys.argv[2], sys.argv[3] == "1"
import sharddbg
t = sharddbg.load_trace(trace_path)
spent, stack = {}, []
if phases:
    import functools, importlib
    from sharddbg.trace import Trace

    def timed(name, fn):
        @functools.wraps(fn)
        def run(*a, **k):
            c0 = time.process_time()
            stack.append(0.0)
            try:
                return fn(*a, **k)
            finally:
                inner = stack.pop()
                took = time.process_time() - c0
                spent[name] = spent.get(name, 0.0) + took - inner
                if stack:
                    stack[-1] += took
        return run

    for where, name in PHASES:
        module_name, _, attr = where.rpartition(":")
        owner = Trace if module_name == "Trace" else importlib.import_module(module_name)
        original = owner.__dict__[attr] if isinstance(owner, type) else getattr(owner, attr)
        if isinstance(original, property):
            setattr(owner, attr, property(timed(name, original.fget)))
        else:
            setattr(owner, attr, timed(name, original))
c0 = time.process_time()
t.to_html(report_path)
total = time.process_time() - c0
print(json.dumps({"build_cpu": total, "phases": spent}))
"""
PHASES = [
    ("Trace:_ops_table", "op table (built at its first use)"),
    ("Trace:_collectives_table", "collectives table (built at its first use)"),
    ("Trace:findings", "findings"),
    ("Trace:overview", "overview (headline counts)"),
    ("Trace:get_op_summary", "op summary"),
    ("Trace:get_fallbacks", "fallbacks (get_fallbacks)"),
    ("sharddbg.exporters.html_report:plot_timeline", "timeline figure"),
    ("sharddbg.exporters.html_report:plot_comm_by_op", "comm figure"),
    ("sharddbg.exporters.html_report:plot_imbalance", "imbalance figure"),
    ("sharddbg.views.explorer:_build_tables", "explorer's tables"),
    ("sharddbg.exporters.html_report:explorer_data", "explorer's payload"),
    ("sharddbg.exporters.html_report:fallback_table", "fallback table"),
    ("sharddbg.exporters.html_report:error_entries", "errors"),
    ("sharddbg.exporters.html_report:json_text_for_script", "figures' JSON"),
    ("sharddbg.exporters.html_report:render", "page template"),
    ("sharddbg.exporters.html_report:to_html", "the rest of to_html"),
]
GENERATED = re.compile(rb" \xc2\xb7 generated [0-9T:-]+ by sharddbg")


def build(code: Path, trace_path: str, report_path: str, phases: bool) -> dict:
    """Load ``trace_path`` and write its report to ``report_path`` with the sharddbg of ``code``, in a fresh process."""
    script = CHILD.replace("for where, name in PHASES", f"for where, name in {PHASES!r}")
    env = dict(os.environ, PYTHONPATH=str(code), OMP_NUM_THREADS="1")
    out = subprocess.run([sys.executable, "-c", script, trace_path, report_path, "1" if phases else "0"], env=env,
                         cwd=str(code), capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def without_generated(path: str) -> bytes:
    """The report's bytes, the time it was generated set aside (exactly one such line)."""
    raw = Path(path).read_bytes()
    kept, n = GENERATED.subn(b" \xc2\xb7 generated (time) by sharddbg", raw)
    if n != 1:
        raise SystemExit(f"{path}: expected one 'generated ... by sharddbg' line, found {n}")
    return kept


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--trace", required=True, help="a saved trace (e.g. bench/bench_trace_big.py's big.sdtrace.arrow)")
    ap.add_argument("--before-code", required=True, help="a folder holding the older sharddbg package")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--phases", action="store_true", help="also time each step of the build (one more build each)")
    ap.add_argument("--keep", help="write the two reports into this folder (else a temporary one)")
    args = ap.parse_args()
    folder = args.keep or tempfile.mkdtemp(prefix="report_build_")
    os.makedirs(folder, exist_ok=True)
    codes = {"before": Path(args.before_code).resolve(), "this tree": ROOT}
    paths = {name: os.path.join(folder, f"{'before' if name == 'before' else 'after'}.html") for name in codes}
    load = [" ".join(Path("/proc/loadavg").read_text().split()[:3])]
    cpu: dict[str, list[float]] = {name: [] for name in codes}
    for _ in range(args.repeats):  # in turn: each code sees the same load
        for name, code in codes.items():
            cpu[name].append(build(code, args.trace, paths[name], False)["build_cpu"])
    phases = {name: build(code, args.trace, paths[name], True)["phases"] for name, code in codes.items()} \
        if args.phases else {}
    load.append(" ".join(Path("/proc/loadavg").read_text().split()[:3]))
    same = without_generated(paths["before"]) == without_generated(paths["this tree"])
    before, after = statistics.median(cpu["before"]), statistics.median(cpu["this tree"])
    print(f"trace {args.trace}; load average (1, 5, 15 min) {load[0]} before, {load[1]} after; "
          f"{os.cpu_count()} cores; medians of {args.repeats}")
    print(f"to_html CPU: before {before:.2f} s ({', '.join(f'{v:.2f}' for v in cpu['before'])}), "
          f"this tree {after:.2f} s ({', '.join(f'{v:.2f}' for v in cpu['this tree'])}); ratio {after / before:.2f}")
    print(f"reports ({paths['before']}, {paths['this tree']}): "
          + ("byte-identical but for the time generated" if same else "DIFFERENT"))
    if phases:
        print("\n| step (CPU s, its inner steps taken out) | before | this tree |\n|---|---|---|")
        for _, name in PHASES:
            print(f"| {name} | {phases['before'].get(name, 0.0):.2f} | {phases['this tree'].get(name, 0.0):.2f} |")
        print(f"| sum | {sum(phases['before'].values()):.2f} | {sum(phases['this tree'].values()):.2f} |")
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
