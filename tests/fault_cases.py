"""The faults and the bad input sharddbg is tried against, as data: what the user does, and the first line
they read. tests/test_faults.py and tests/test_bad_input.py run every case on a real cluster and assert
that line, the time bound (nothing hangs) and that nothing recorded is lost; the table of docs/faults.md
("When things go wrong") is generated from these lists (``python tests/fault_cases.py`` prints it) and a test
checks that the page holds exactly that table.
"""

from __future__ import annotations

import re
from dataclasses import dataclass


@dataclass(frozen=True)
class Case:
    name: str  # pytest id
    what: str  # what the user does (a column of the docs' table)
    sees: str  # the start of what they read first (a column of the docs' table; regex-escaped to test)
    error: str  # the exception class they get


# Faults on a running cluster: every case ends within its bound, names its cause first, keeps the trace.
FAULTS = [
    Case("raise_while_peers_wait", "a rank raises (anywhere in the cell) while the others wait for it in a collective",
         "rank 3 raised IndexError: boom (line 3 of the cell: `raise IndexError('boom')`)", "RankError"),
    Case("raise_inside_collective", "a rank fails inside an op whose collective its peers entered (traced)",
         "rank 3 raised RuntimeError: index_select(): self indexing axis dim should be positive (line 5 of the cell: "
         "`y = torch.nn.functional.conv2d(x, torch.randn(4, 3, 3, 3), padding=1)`)", "RankError"),
    Case("raise_while_peer_computes", "a rank raises while another still computes, past the cell's timeout",
         "rank 3 raised IndexError: boom (line 3 of the cell: `raise IndexError('boom')`)", "RankTimeoutError"),
    Case("skip_collective", "a rank skips a collective the others entered",
         "3 of 4 ranks did not finish the cell within 3 s: ranks [0, 1, 2] still running; ranks [3] finished.",
         "RankTimeoutError"),
    Case("sizes_disagree", "ranks issue one collective with different sizes",
         "3 of 4 ranks did not finish the cell within 3 s: ranks [0, 2, 3] still running; ranks [1] finished.",
         "RankTimeoutError"),
    Case("collective_timeout", "a collective times out inside gloo (collective timeout reached): a peer never "
         "issued it", "rank 1 never issued the all_gather rank 0 waited in", "RankError"),
    Case("broken_group_refused", "the next cell after a broken process group",
         "The process group broke at the cell: ", "ClusterError"),
    Case("rank_killed", "a rank is killed (SIGKILL) during a cell",
         "rank 2 (pid <n>) died while running the cell: killed by signal 9 (SIGKILL)", "RankDiedError"),
    Case("rank_segfault", "a rank segfaults during a cell",
         "rank 1 (pid <n>) died while running the cell: killed by signal 11 (SIGSEGV)", "RankDiedError"),
    Case("rank_died_traced", "a rank exits during a traced cell (the others' events are kept)",
         "rank 1 (pid <n>) died while running the cell: exited with status 3", "RankDiedError"),
    Case("call_needs_dead_rank", "a call that needs a dead rank (`run`, `eval`, `recover`)",
         "rank 2 (pid <n>) killed by signal 9 (SIGKILL): its engine is gone. cl.restart() (%shard_cluster restart) "
         "starts new engines for every rank.", "ClusterError"),
    Case("exit_in_cell", "a cell calls `exit()` on a rank",
         "rank 1 (pid <n>) ended its engine: the cell called exit() or quit() there; its process exited with status <n>",
         "RankDiedError"),
    Case("rank_stalled", "a rank stops answering ipyparallel's heartbeat during a cell (SIGSTOP, a debugger, "
         "swapping)", "rank 1 (pid <n>) stopped answering ipyparallel's heartbeat for 5.1 s while running the cell; "
         "its process is stopped", "RankLostError"),
    Case("call_needs_lost_rank", "a call that needs a rank ipyparallel unregistered (`run`, `eval`, `recover`), "
         "also once its process goes on", "rank 1 (pid <n>) stopped answering ipyparallel's heartbeat for 5.1 s; its "
         "process is ", "RankLostError"),
    Case("controller_killed", "the controller is killed (every call after it: `status`, `run`, `recover`, ...)",
         "the controller (pid <n>) died: killed by signal 9 (SIGKILL).", "ClusterError"),
]

# Bad input: refused before anything is sent to a rank, the same error on every rank where ranks decide.
BAD_INPUT = [
    Case("timeout_nan", "`Cluster(timeout=float('nan'))`", "timeout must be a finite number of seconds above 0, got nan",
         "ClusterError"),
    Case("collective_timeout_inf", "`Cluster(collective_timeout=float('inf'))`",
         "collective_timeout must be a finite number of seconds above 0, got inf", "ClusterError"),
    Case("collective_timeout_tiny", "`Cluster(collective_timeout=1e-9)`",
         "collective_timeout must be at least 1 s, got 1e-09", "ClusterError"),
    Case("mesh_both_inferred", "`Cluster(mesh={'ddp': -1, 'domain': -1})`",
         "mesh {'ddp': -1, 'domain': -1} gives both axes as -1 (inferred), but at most one axis may be -1",
         "MeshError"),
    Case("mesh_axis_twice", "`Cluster(mesh='ddp=1,domain=4,ddp=2')`",
         "mesh 'ddp=1,domain=4,ddp=2' gives axis 'ddp' twice (ddp=1 and ddp=2)", "MeshError"),
    Case("threads_word", "`Cluster(threads_per_rank='x')`", "threads_per_rank must be a whole number of at least 1",
         "ClusterError"),
    Case("home_not_a_folder", "`SHARDDBG_HOME=/dev/null`, then `Cluster(n=2).start()`",
         "SHARDDBG_HOME='/dev/null' cannot hold sharddbg's state (cluster records, logs, connection files): "
         "/dev/null is not a folder", "ClusterError"),
    Case("too_many_ranks", "`Cluster(n=1000)` on a small host", "1000 ranks need about 700 GB", "ClusterError"),
    Case("run_timeout_word", "`cl.run(code, timeout='abc')`", "timeout must be a number of seconds (e.g. 60), got str 'abc'",
         "ClusterError"),
    Case("run_no_targets", "`cl.run(code, targets=[])`", "targets [] name no rank", "ClusterError"),
    Case("run_bad_target", "`cl.run(code, targets=[7])`", "ranks [7] do not exist", "ClusterError"),
    Case("run_target_twice", "`cl.run(code, targets=[0, 0])` (or `eval`, `apply`, `pull`, `submit`)",
         "targets [0, 0] name rank 0 more than once", "ClusterError"),
    Case("px_target_twice", "`%px -t 0,0 ...`", "-t 0,0 names rank 0 more than once", "UsageError"),
    Case("px_empty_slice", "`%px -t 1:0 ...`", "-t 1:0 names no rank", "UsageError"),
    Case("px_bad_slice", "`%px -t a:b ...`", "-t a:b: ranks are written", "UsageError"),
    Case("px_timeout_nan", "`%px --timeout nan ...`", "%px: argument --timeout: 'nan' is not a finite number",
         "UsageError"),
    Case("magic_unbalanced_quote", "`%shard_cluster start --mesh 'ddp=1`", "%shard_cluster: cannot read the options",
         "UsageError"),
    Case("load_device", "`sharddbg.load_trace('/dev/zero')` (or a FIFO, a folder)",
         "/dev/zero is a character device, not a trace file", "TraceFileError"),
    Case("save_to_folder", "`t.save('.')`", "'.' is a folder, not a file: give the path of the file to write, e.g. "
         "'./trace.sdtrace.json'", "IsADirectoryError"),
    Case("trace_max_events", "`cl.trace(code, max_events=0)`", "max_events must be a positive integer", "ClusterError"),
    Case("trace_option_not_bool", "`cl.trace(code, memory='yes')`", "memory must be True or False, got 'yes'",
         "ClusterError"),
    Case("scatter_dim_str", "`scatter(x, dim='2')`",
         "ranks [0, 1, 2, 3] raised ScatterError: sharddbg.engine.scatter: dim='2' is not an int or None (on every rank)",
         "RankError"),
    Case("scatter_dim_float", "`scatter(x, dim=2.0)`",
         "ranks [0, 1, 2, 3] raised ScatterError: sharddbg.engine.scatter: dim=2.0 is not an int or None (on every rank)",
         "RankError"),
    Case("scatter_batch_dim_str", "`scatter(x, 2, batch_dim='0')`",
         "ranks [0, 1, 2, 3] raised ScatterError: sharddbg.engine.scatter: batch_dim='0' is not an int or None",
         "RankError"),
    Case("scatter_empty_shards", "`scatter` of 3 rows over 4 ranks",
         "ranks [0, 1, 2, 3] raised ScatterError: sharddbg.engine.scatter: dim=2: 3 rows over 4 ranks would leave "
         "rank 3 with no rows", "RankError"),
]


def starts_with(case: Case):
    """A regex matching a message that starts with ``case.sees`` (``<n>`` there: any number, e.g. a pid)."""
    return re.compile(re.escape(case.sees).replace(re.escape("<n>"), r"\d+"))


TABLE_START = "<!-- fault table: generated by `python tests/fault_cases.py` -->"
TABLE_END = "<!-- end of fault table -->"


def table() -> str:
    """The table of docs/faults.md ("When things go wrong"), with the counts the tests assert."""
    rows = ["| what happens | what you read first | error |", "|---|---|---|"]
    for case in FAULTS + BAD_INPUT:
        rows.append(f"| {case.what} | {case.sees.replace('|', '&#124;')}… | `{case.error}` |")
    n = len(FAULTS) + len(BAD_INPUT)
    counts = (f"Cases tried: {n} ({len(FAULTS)} faults on a running cluster, {len(BAD_INPUT)} kinds of bad input), "
              f"each a test on a real cluster: clear errors {n}, hangs 0, data lost 0.")
    return "\n".join([TABLE_START, counts, "", *rows, TABLE_END])


if __name__ == "__main__":
    print(table())
