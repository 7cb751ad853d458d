"""The magics through IPython itself (run_line_magic / run_cell_magic / run_cell), on a real cluster:
ipyparallel's %px conventions (targets, blocking or not, output grouping, streaming, --local, %pxresult,
%pxconfig, %autopx), the help every magic shows, and the usage errors."""

import contextlib
import io
import re
import time

import psutil
import pytest
from IPython.core.error import UsageError
from IPython.core.interactiveshell import InteractiveShell
from IPython.utils.capture import capture_output

import sharddbg
from sharddbg.cluster.execution import CellStillRunningError, PendingCell
from sharddbg.errors import ClusterError, MeshError, NoActiveClusterError, RankError, RankTimeoutError
from sharddbg.magics import PxDefaults, parse_targets, split_px_line

pytestmark = pytest.mark.cluster

MAGICS = {"line": ["shard_cluster", "px", "pxresult", "pxconfig", "autopx", "shard_inspect", "shard_doctor"],
          "cell": ["px", "shard_trace", "shard_check", "shard_patch", "shard_diff"]}


@pytest.fixture(scope="module")
def ip():
    from sharddbg.cluster import running_clusters

    running_before = running_clusters()  # e.g. the session's shared cluster: not ours to stop
    shell = InteractiveShell.instance()
    shell.run_line_magic("load_ext", "sharddbg")
    yield shell
    for cl in running_clusters():
        if cl not in running_before:
            cl.stop()


@pytest.fixture(scope="module")
def started(ip):
    """4 ranks started by %shard_cluster start (the tests that need them run after the ones that need none)."""
    with capture_output() as cap:
        ip.run_line_magic("shard_cluster", "start -n 4 --mesh ddp=1,domain=4")
    assert "4 ranks ready" in cap.stdout and "registered-by-sharddbg" in cap.stdout
    return sharddbg.active_cluster()


@contextlib.contextmanager
def one_stream():
    """stdout and stderr into one buffer, to see how they interleave; rich outputs in ``cap.outputs``."""
    buffer = io.StringIO()
    with capture_output() as cap, contextlib.redirect_stdout(buffer), contextlib.redirect_stderr(buffer):
        yield buffer, cap


def lines(text: str) -> list[str]:
    return [line for line in text.splitlines() if line]


def test_px_option_parsing():
    args, code = split_px_line("--timeout 5 -t 0,2 print(rank, '--timeout')")
    assert args.timeout == 5.0 and parse_targets(args.targets) == [0, 2]
    assert code == "print(rank, '--timeout')"
    args, code = split_px_line("-a --group-outputs=engine --targets=-1 --stream -o h x = -1")
    assert (args.block, args.groupby, args.targets, args.stream, args.save_name) == (False, "engine", "-1", True, "h")
    assert code == "x = -1"
    args, code = split_px_line("-b -r --local --verbose -t '1:3' -- -x")
    assert (args.block, args.groupby, args.local, args.verbose, args.targets) == (True, "order", True, True, "1:3")
    assert code == "-x"
    args, code = split_px_line("-t1:3 -o=h print(rank)")
    assert (args.targets, args.save_name, code) == ("1:3", "h", "print(rank)")
    args, code = split_px_line("print('-t 1')")
    assert args.targets is None and args.block is None and code == "print('-t 1')"
    with pytest.raises(UsageError, match=r"^%px: unknown option --tiemout \(%px\? lists the options"):
        split_px_line("--tiemout 5 print(1)")
    with pytest.raises(UsageError, match=r"^%px: argument --group-outputs: invalid choice: 'rank'"):
        split_px_line("--group-outputs rank print(1)")
    # ipyparallel's forms of --targets
    assert parse_targets("1:3") == slice(1, 3) and parse_targets("1:3", 4) == [1, 2]
    assert parse_targets("2:", 4) == [2, 3] and parse_targets("::2", 4) == [0, 2] and parse_targets("-2:", 4) == [2, 3]
    assert parse_targets("2") == [2] and parse_targets("[0,2]") == [0, 2] and parse_targets("(1, 3)") == [1, 3]
    assert parse_targets("all", 4) is None and parse_targets(None, 4) is None
    assert parse_targets("-1", 4) == [3] and parse_targets("0,-1", 4) == [0, 3] and parse_targets("-1") == [-1]
    assert parse_targets("-5", 4) == [-5]  # out of range: refused by the cluster, with its ranks
    for bad in ("a:b", "range(4)", "[]", "[0.5]", "0,,2", "x"):
        with pytest.raises(UsageError, match=rf"^-t {re.escape(bad)}: ranks are written 2, or 0,2, or \[0,2\]"):
            parse_targets(bad, 4)
    with pytest.raises(UsageError, match="names no rank"):
        parse_targets("3:1", 4)
    with pytest.raises(UsageError, match="step cannot be 0"):
        parse_targets("::0", 4)


def test_every_magic_has_help_and_usage_errors(ip):
    """Every magic is declared with IPython's magic_arguments: `%px?` shows its options; bad arguments give
    a UsageError that names the magic, before any cluster is needed."""
    for kind, names in MAGICS.items():
        for name in names:
            magic = ip.find_magic(name, kind)
            assert magic is not None, (kind, name)
            assert getattr(magic, "has_arguments", False) and magic.parser is not None, name
            assert magic.__doc__.startswith("::\n\n  %" + name), name
    with capture_output() as cap:
        ip.run_cell("%px?")
    help_text = " ".join(re.sub(r"\x1b\[[0-9;]*m", "", cap.stdout).split())  # one line: argparse wraps the help
    for words in ("%px [--timeout S] [-t RANKS] [-b] [-a]", "-a, --noblock", "-b, --block", "-t RANKS, --targets RANKS",
                  "--group-outputs", "--stream", "--no-stream", "--local", "--verbose", "-o NAME, --out NAME",
                  "every wait is bounded", "[0,2], 1:3, 2:, ::2, -1 (the last) or all", "%shard_cluster recover"):
        assert words in help_text, words
    for line, words in (("%shard_cluster?", ["{start,status,stop,connect,disconnect,restart,recover,diagnose}", "--mesh MESH", "--all"]),
                        ("%%shard_trace?", ["--max-events N", "--no-unmask", "under the recorder"]),
                        ("%pxresult?", ["-o NAME", "--timeout S", "--noblock"]),
                        ("%pxconfig?", ["-a, --noblock", "-t RANKS"]),
                        ("%autopx?", ["Toggle auto-parallel mode"]),
                        ("%shard_inspect?", ["NAME"])):
        with capture_output() as cap:
            ip.run_cell(line)
        for word in words:
            assert word in " ".join(cap.stdout.split()), (line, word)

    usage = [
        (("px", "--bogus print(1)"), r"^%px: unknown option --bogus"),
        (("px", "--timeout 0 print(1)"), r"^%px: argument --timeout: '0' is not a finite number of seconds above 0"),
        (("px", "-o 1x print(1)"), r"^%px: -o takes a variable name"),
        (("px", "--progress-after 2 print(1)"), r"^%px: --progress-after: sharddbg shows no progress bar; --stream"),
        (("px", "--signal-on-interrupt SIGKILL print(1)"),
         r"^%px: --signal-on-interrupt: Ctrl-C stops waiting .* %shard_cluster recover"),
        (("px", "-t 0"), r"^%px needs code"),
        (("shard_cluster", "launch"), r"^%shard_cluster: argument action: invalid choice: 'launch'"),
        (("shard_cluster", ""), r"^%shard_cluster: the following arguments are required: action"),
        (("shard_cluster", "stop -n 4"), r"^%shard_cluster stop: -n is an option of start"),
        (("shard_cluster", "stop --mesh ddp=1,domain=4"),
         r"^%shard_cluster stop: --mesh is an option of start \(%shard_cluster\? lists the options\)$"),
        (("shard_cluster", "start --bogus"),
         r"^%shard_cluster start: unrecognized arguments: --bogus \(%shard_cluster start --help lists its options\)$"),
        (("shard_cluster", "--full status"), r"^%shard_cluster: --full goes after the subcommand: "
                                             r"%shard_cluster status --full"),
        (("shard_cluster", "status --timeout 3"), r"^%shard_cluster status: --timeout is an option of start, "
                                                  r"connect, recover and diagnose"),
        (("shard_cluster", "start -n 0"), r"^%shard_cluster: argument -n: '0' must be at least 1"),
        (("shard_cluster", "start --mesh 'ddp=1"), r"^%shard_cluster: cannot read the options \(No closing quotation"),
        (("pxresult", ""), r"^%pxresult shows the output of the last %px cell; no %px cell ran yet"),
        (("pxconfig", "--progress-after 1"), r"^%pxconfig: --progress-after"),
        (("pxconfig", "-t x"), r"^-t x: ranks are written"),
        (("autopx", "on"), r"^%autopx: unrecognized arguments: on"),
        (("shard_inspect", "x + 1"), r"^%shard_inspect takes the name of a variable"),
    ]
    for (name, line), message in usage:
        with pytest.raises(UsageError, match=message):
            ip.run_line_magic(name, line)
    with pytest.raises(UsageError, match=r"^%%px: unrecognized arguments: print\(1\) \(%%px\? lists the options\)"):
        ip.run_cell_magic("px", "--block print(1)", "print(2)")
    with pytest.raises(UsageError, match=r"^%%shard_trace: argument --max-events: 'lots' is not a whole number"):
        ip.run_cell_magic("shard_trace", "--max-events lots", "pass")


# each %shard_cluster subcommand's own options, as its --help lists them
CLUSTER_SUBCOMMANDS = {"start": {"-h", "--help", "-n", "--mesh", "--backend", "--timeout", "--collective-timeout",
                                 "--force"},
                       "status": {"-h", "--help", "--full"},
                       "stop": {"-h", "--help", "--all"},
                       "connect": {"-h", "--help", "--timeout"},
                       "disconnect": {"-h", "--help"},
                       "restart": {"-h", "--help"},
                       "recover": {"-h", "--help", "--timeout"},
                       "diagnose": {"-h", "--help", "--timeout"}}


def listed_options(help_text: str) -> set[str]:
    """The flags of the options section of an argparse help text ("  -n N, --number N   help" -> -n, --number)."""
    options = help_text.split("\noptions:\n", 1)[1]
    invocations = [line.strip().split("  ")[0] for line in options.splitlines() if line.startswith("  -")]
    return {part.split()[0] for invocation in invocations for part in invocation.split(", ")}


def test_shard_cluster_subcommands_help(ip):
    """Each subcommand's help comes from its own parser: `%shard_cluster start --help` (or -h) prints start's
    options and none of another's, and does nothing else; `%shard_cluster?` lists every subcommand with its
    options."""
    from sharddbg.cluster import running_clusters

    running_before = running_clusters()
    children_before = {p.pid for p in psutil.Process().children(recursive=True)}
    for name, own in CLUSTER_SUBCOMMANDS.items():
        for help_flag in ("--help", "-h"):
            with capture_output() as cap:
                assert ip.run_line_magic("shard_cluster", f"{name} {help_flag}") is None
            assert cap.stdout.startswith(f"usage: %shard_cluster {name} [-h]"), cap.stdout
            assert listed_options(cap.stdout) == own, (name, cap.stdout)
    with capture_output() as cap:
        ip.run_line_magic("shard_cluster", "recover --help")
    assert "released, seconds (default: the cluster's time limit)" in " ".join(cap.stdout.split())
    with capture_output() as cap:
        ip.run_line_magic("shard_cluster", "diagnose --help")
    assert "how long each rank gets to answer, seconds (5)" in " ".join(cap.stdout.split())
    # `start -n 4 --help` too: the help wins, nothing starts
    with capture_output() as cap:
        ip.run_line_magic("shard_cluster", "start -n 4 --help")
    assert cap.stdout.startswith("usage: %shard_cluster start")

    with capture_output() as cap:
        ip.run_cell("%shard_cluster?")
    help_text = re.sub(r"\x1b\[[0-9;]*m", "", cap.stdout)
    assert "%shard_cluster {start,status,stop,connect,disconnect,restart,recover,diagnose} ..." in " ".join(help_text.split())
    for name, own in CLUSTER_SUBCOMMANDS.items():
        with capture_output() as cap:
            ip.run_line_magic("shard_cluster", f"{name} --help")
        assert cap.stdout.strip() in help_text, name  # the same help, from the same parser
    # IPython reads `%shard_cluster start?` as help on a name `start`: the magic never sees it (--help is the way)
    assert ip.transform_cell("%shard_cluster start?").strip() == "get_ipython().run_line_magic('pinfo', 'start')"

    # an option of another subcommand is refused before anything starts
    with pytest.raises(UsageError, match=r"^%shard_cluster start: --all is an option of stop \(%shard_cluster\? "
                                         r"lists the options\)$"):
        ip.run_line_magic("shard_cluster", "start -n 4 --mesh ddp=1,domain=4 --all")
    with pytest.raises(UsageError, match=r"^%shard_cluster start: --full is an option of status"):
        ip.run_line_magic("shard_cluster", "start -n 4 --full")
    assert running_clusters() == running_before
    assert {p.pid for p in psutil.Process().children(recursive=True)} <= children_before

    # --timeout's default is each subcommand's own
    parser = ip.find_magic("shard_cluster").parser
    assert [parser.parse_args([name]).timeout for name in ("start", "recover", "diagnose")] == [60.0, None, 5.0]
    assert parser.parse_args(["diagnose", "--timeout", "2"]).timeout == 2.0


def test_magic_errors_before_start(ip):
    with pytest.raises(NoActiveClusterError, match="nothing to stop"):
        ip.run_line_magic("shard_cluster", "stop")
    with pytest.raises(NoActiveClusterError, match="no sharddbg cluster is running"):
        ip.run_cell_magic("px", "", "print(1)")
    with pytest.raises(NoActiveClusterError, match="no sharddbg cluster is running"):
        ip.run_line_magic("autopx", "")
    assert ip.run_cell("x_here = 1").success and ip.user_ns["x_here"] == 1  # %autopx stayed off
    with pytest.raises(MeshError, match="has 8 ranks but the cluster has n=6"):
        ip.run_line_magic("shard_cluster", "start -n 6 --mesh ddp=4,domain=2")


def test_start_px_trace_status(ip, started):
    cl = started
    with pytest.raises(ClusterError, match="already running"):
        ip.run_line_magic("shard_cluster", "start -n 4")
    with capture_output() as cap:
        ip.run_cell_magic("px", "", "torch.manual_seed(0)\n"
                          "x = sharddbg.engine.scatter(torch.randn(1, 3, 66, 64), dim=2)\n"
                          "w = torch.randn(4, 3, 3, 3)\n"
                          "y = torch.nn.functional.conv2d(x, w, padding=1)\n"
                          "print(tuple(y._local_tensor.shape))")
    assert cap.stdout.splitlines() == [f"[rank {r}] (1, 4, {h}, 64)" for r, h in enumerate([17, 17, 16, 16])]
    with capture_output() as cap:
        ip.run_line_magic("px", "-t 1 print('only', rank)")
    assert cap.stdout.strip() == "[rank 1] only 1"
    with capture_output() as cap:
        ip.run_cell_magic("shard_trace", "--max-events 1000", "z = torch.nn.functional.conv2d(x, w, padding=1).abs()")
    trace = sharddbg.last_trace()
    assert trace.ranks == [0, 1, 2, 3] and trace is cl.last_trace()
    ops = trace.get_ops()
    assert set(ops.loc[ops["op"].str.contains("conv2d"), "path"]) == {"function_handler"}
    assert f"recorded {len(ops)} op calls on 4 ranks" in cap.stdout and "DTensor fallback" in cap.stdout
    # a cell that fails is still traced and summarised, then its error is raised
    with capture_output() as cap, pytest.raises(RankError, match="ValueError: boom"):
        ip.run_cell_magic("shard_trace", "",
                          "z2 = torch.nn.functional.conv2d(x, w, padding=1)\nraise ValueError('boom')")
    failed = sharddbg.last_trace()
    assert failed is not trace
    assert failed.meta["failed"].startswith("RankError: ranks [0, 1, 2, 3] raised ValueError: boom")
    assert "op calls on 4 ranks" in cap.stdout
    with capture_output() as cap:
        assert ip.run_line_magic("shard_cluster", "diagnose") is None
    assert cap.stdout.strip() == "every rank is idle"
    status = ip.run_line_magic("shard_cluster", "status   # one row per rank")
    assert list(status.index) == [0, 1, 2, 3]
    assert set(status["patch_mode"]) == {"registered-by-sharddbg"}
    with pytest.raises(RankTimeoutError, match="never joined by: rank"):
        ip.run_cell_magic("px", "--timeout 2", "if rank == 0:\n    dist.barrier()")
    with capture_output() as cap:
        ip.run_line_magic("shard_cluster", "recover --timeout 20")
    assert "re-created" in cap.stdout


def test_px_output_grouping_and_values(ip, started):
    cell = ("import sys\nfrom IPython.display import display\n"
            "print('out', rank); print('err', rank, file=sys.stderr)\n"
            "display(f'first {rank}'); display(f'second {rank}')\n"
            "rank * 10")
    ranks = range(4)
    for option, first in (("", "type"), ("--group-outputs type", "type"), ("-e", "engine"),
                          ("--group-outputs engine", "engine"), ("-r", "order"), ("--group-outputs order", "order")):
        with one_stream() as (text, cap):
            assert ip.run_cell_magic("px", option, cell) is None
        shown = [o.data["text/plain"] for o in cap.outputs]
        values = [f"[rank {r} Out] {10 * r}" for r in ranks]
        if first == "engine":  # each rank's output together, in rank order
            assert lines(text.getvalue()) == [s for r in ranks for s in
                                              (f"[rank {r}] out {r}", f"[rank {r} stderr] err {r}", values[r])]
            assert shown == [f"'{k} {r}'" for r in ranks for k in ("first", "second")]
        else:  # every rank's stdout, then every rank's stderr, rich outputs, then values
            assert lines(text.getvalue()) == ([f"[rank {r}] out {r}" for r in ranks]
                                              + [f"[rank {r} stderr] err {r}" for r in ranks] + values)
            if first == "type":
                assert shown == [f"'{k} {r}'" for r in ranks for k in ("first", "second")]
            else:  # collated: each rank's first, then each rank's second
                assert shown == [f"'{k} {r}'" for k in ("first", "second") for r in ranks]


def test_px_targets(ip, started):
    for line, ranks in (("-t 1", [1]), ("-t 0,2", [0, 2]), ("-t [1,3]", [1, 3]), ("-t (0,3)", [0, 3]),
                        ("-t 1:3", [1, 2]), ("-t ::2", [0, 2]), ("-t -1", [3]), ("-t=-2:", [2, 3]),
                        ("--targets all", [0, 1, 2, 3]), ("--targets=2", [2]), ("", [0, 1, 2, 3])):
        with capture_output() as cap:
            ip.run_line_magic("px", f"{line} print(rank)")
        assert cap.stdout.splitlines() == [f"[rank {r}] {r}" for r in ranks], line
        with capture_output() as cap:
            ip.run_cell_magic("px", line, "rank")
        assert cap.stdout.splitlines() == [f"[rank {r} Out] {r}" for r in ranks], line
    with pytest.raises(ClusterError, match=r"^ranks \[7\] do not exist; this cluster has ranks 0..3"):
        ip.run_line_magic("px", "-t 7 print(rank)")
    with pytest.raises(ClusterError, match=r"^ranks \[-5\] do not exist"):
        ip.run_line_magic("px", "-t -5 print(rank)")


def test_px_error_shows_the_output_then_the_cause_without_sharddbg_frames(ip, started):
    with capture_output() as cap:
        ip.run_cell("%%px -t 1:3\nprint('before', rank)\nraise ValueError('bad')")
    shown = cap.stdout + cap.stderr
    assert cap.stdout.splitlines()[:2] == ["[rank 1] before 1", "[rank 2] before 2"]
    assert re.search(r"RankError.*\n?.*ranks \[1, 2\] raised ValueError: bad \(line 2 of the cell", shown), shown
    assert "sharddbg/cluster" not in shown and "sharddbg/magics.py" not in shown


def test_rank_errors_and_traces_name_the_notebooks_cell_not_the_ranks(ip, started):
    engine_count = int(started.run("get_ipython().execution_count", display=False)[0].result)
    while ip.execution_count <= engine_count + 5:  # cells that never reach the ranks: the notebook counts ahead
        ip.run_cell("pass", store_history=True)
    define = ip.execution_count
    ip.run_cell("%%px\nclass Pick(nn.Module):\n    def forward(self, x):\n        return x[torch.tensor([9])]\n",
                store_history=True)
    failing = ip.execution_count
    with capture_output() as cap:
        ip.run_cell("%%px\nm = Pick()\ny = nn.Sequential(m)(torch.ones(3))", store_history=True)
    shown = re.sub(r"\x1b\[[0-9;]*m", "", cap.stdout + cap.stderr)
    assert f"Cell In[{failing}], line 2" in shown and f"Cell In[{define}], line 3, in Pick.forward" in shown, shown
    assert not re.search(r"Cell In\[(?!%d\]|%d\])" % (failing, define), shown), shown
    # the magic's own dispatch is not the user's line; torch's frames are one line each, without their source
    assert "run_cell_magic" not in shown, shown
    assert re.search(r"torch/nn/modules/container.py:\d+, in Sequential.forward\n", shown), shown
    assert "return self._call_impl" not in shown, shown
    traced = ip.execution_count
    with capture_output() as cap:
        ip.run_cell("%%shard_trace\nz = torch.ones(3)\nw = z[torch.tensor([7])]", store_history=True)
    shown = re.sub(r"\x1b\[[0-9;]*m", "", cap.stdout + cap.stderr)
    assert f"(cell [{traced}], line 2: `w = z[torch.tensor([7])]`)" in shown, shown
    assert f"Cell In[{traced}], line 2" in shown, shown


def test_noblock_handle(ip, started, tmp_path):
    cl = started
    # the cell runs until `go` exists (made below, once the checks that need it still running are done: a sleep
    # could end before them on a loaded host); then rank 0 finishes last: the output still comes in rank order
    go = tmp_path / "go"
    cell = (f"import os, time\nwhile not os.path.exists({str(go)!r}):\n    time.sleep(0.05)\n"
            "time.sleep(0.4 * (3 - rank))\nprint('slept', rank)\nrank")
    t0 = time.monotonic()
    with capture_output() as cap:
        handle = ip.run_cell_magic("px", "--noblock -o named", cell)
    try:
        # --noblock returns without waiting for the cell, which cannot end before `go` exists (a call that waited
        # would never return here): a bound with room for a loaded host
        assert time.monotonic() - t0 < 10 and cap.stdout == ""
        assert isinstance(handle, PendingCell) and ip.user_ns["named"] is handle and handle.ranks == [0, 1, 2, 3]
        assert not handle.done() and "running for" in repr(handle)
        t0 = time.monotonic()
        assert handle.wait(0.3) is False
        assert 0.3 <= time.monotonic() - t0 < 3, "wait(seconds) is bounded by its argument"
        # new work for its ranks is refused (it would queue behind it, and spend its own time limit there)
        with pytest.raises(ClusterError, match=r"^ranks \[0, 1, 2, 3\] are still running an earlier cell that nothing "
                                               r"waits for .* get\(\) or %pxresult"):
            ip.run_line_magic("px", "print(1)")
        with pytest.raises(ClusterError, match="still running an earlier cell"):
            cl.eval("rank")
        t0 = time.monotonic()
        with capture_output() as cap, pytest.raises(CellStillRunningError, match=r"still run the cell after 0.2 s of "
                                                                                 r"waiting .* nothing is wrong yet"):
            handle.get(0.2)
        assert time.monotonic() - t0 < 3 and cap.stdout == ""
        assert not isinstance(CellStillRunningError("x"), RankTimeoutError) and cl.broken is None
    finally:
        go.touch()
    assert handle.wait(30) is True and handle.done()
    with capture_output() as cap:
        outputs = handle.get()
    assert [o.rank for o in outputs] == [0, 1, 2, 3] and [o.result for o in outputs] == ["0", "1", "2", "3"]
    assert cap.stdout.splitlines() == ([f"[rank {r}] slept {r}" for r in range(4)]
                                       + [f"[rank {r} Out] {r}" for r in range(4)])
    with capture_output() as cap:
        assert handle.get() is outputs
    assert cap.stdout == "", "get() prints the output once"
    with capture_output() as cap:
        ip.run_line_magic("pxresult", "-e")
    assert cap.stdout.splitlines() == [line for r in range(4)
                                       for line in (f"[rank {r}] slept {r}", f"[rank {r} Out] {r}")]

    # -a (ipyparallel's short form), then %pxresult waits and prints it, once
    with capture_output() as cap:
        handle = ip.run_line_magic("px", "-a -t 1:3 import time; time.sleep(0.5); print('later', rank)")
    assert cap.stdout == "" and handle.ranks == [1, 2]
    with capture_output() as cap:
        ip.run_line_magic("pxresult", "")
    assert cap.stdout.splitlines() == ["[rank 1] later 1", "[rank 2] later 2"] and handle.shown

    # without IPython: the same handle from Cluster.submit (each rank's output together, no values shown)
    handle = cl.submit("import sys\nprint('o', rank); print('e', rank, file=sys.stderr)\nrank", targets=[2, 3])
    with one_stream() as (text, _):
        outputs = handle.get()
    assert lines(text.getvalue()) == ["[rank 2] o 2", "[rank 2 stderr] e 2", "[rank 3] o 3", "[rank 3 stderr] e 3"]
    assert [o.result for o in outputs] == ["2", "3"]

    # its time limit counts from when it was sent, waited for or not
    with capture_output():
        handle = ip.run_cell_magic("px", "-a --timeout 2", "import time\ntime.sleep(60 if rank == 2 else 0)\n"
                                   "print('done', rank)")
    time.sleep(2.5)
    t0 = time.monotonic()
    with capture_output() as cap, pytest.raises(RankTimeoutError, match=r"^1 of 4 ranks did not finish the cell "
                                                                        r"within 2 s: ranks \[2\] still running"):
        handle.get()
    assert time.monotonic() - t0 < 10, "past its time limit, get() reports at once"
    assert cap.stdout.splitlines() == [f"[rank {r}] done {r}" for r in (0, 1, 3)]
    assert handle.wait(0.1) is True
    with pytest.raises(RankTimeoutError):
        handle.get()  # the same outcome again
    with capture_output():
        ip.run_line_magic("shard_cluster", "recover --timeout 20")


def test_noblock_failure_releases_waiting_ranks(ip, started):
    """A rank that raises while the others wait for it in a collective: the handle's get() releases them and
    leads with the cause, as a blocking cell does."""
    cl = started
    with capture_output():
        handle = ip.run_cell_magic("px", "--noblock", "if rank == 3:\n    raise IndexError('boom')\ndist.barrier()")
    t0 = time.monotonic()
    with capture_output(), pytest.raises(RankError, match=r"^rank 3 raised IndexError: boom \(line 2 of the cell"):
        handle.get()
    assert time.monotonic() - t0 < 20, "released, not left to the collective timeout"
    assert cl.broken is not None
    with capture_output():
        ip.run_line_magic("shard_cluster", "recover --timeout 20")
    assert cl.broken is None


def test_stream(ip, started):
    """--stream prints each rank's lines as they arrive; without it they come once the cell is over."""
    cell = "import time\nprint('early', rank, flush=True)\ntime.sleep(3)\nprint('late', rank)"

    class Timed(io.StringIO):
        def __init__(self):
            super().__init__()
            self.when = []  # (seconds since start, text written)

        def write(self, text):
            self.when.append((time.monotonic() - t0, text))
            return super().write(text)

    for option, streamed in (("--stream", True), ("", False), ("--no-stream", False)):
        timed = Timed()
        t0 = time.monotonic()
        with capture_output(), contextlib.redirect_stdout(timed):
            ip.run_cell_magic("px", option, cell)
        assert sorted(lines(timed.getvalue())) == sorted([f"[rank {r}] {w} {r}" for r in range(4)
                                                          for w in ("early", "late")])
        early = max(t for t, text in timed.when if "early" in text)
        late = min(t for t, text in timed.when if "late" in text)
        assert (late - early > 1.5) == streamed, (option, timed.when)
        if not streamed:  # rank order once the cell is over
            assert lines(timed.getvalue()) == [f"[rank {r}] {w} {r}" for r in range(4) for w in ("early", "late")]


@pytest.fixture
def px_defaults(ip):
    """%pxconfig's settings, put back after the test (the shell and its magics outlive this module)."""
    magics = ip.magics_manager.registry["ShardMagics"]
    yield magics.px_defaults
    magics.px_defaults = PxDefaults()


def test_local_verbose_pxconfig_and_autopx(ip, started, px_defaults):
    cl = started
    with capture_output() as cap:
        ip.run_cell_magic("px", "--local --verbose", "local_mark = 7\nprint('here')")
    assert ip.user_ns["local_mark"] == 7 and cl.eval("local_mark") == [7] * 4
    assert cap.stdout.splitlines()[0] == "Parallel execution on ranks [0, 1, 2, 3], time limit 60 s"
    assert "here" in cap.stdout.splitlines()  # the local run's own print, unprefixed
    ranks_lines = [line for line in cap.stdout.splitlines() if line.startswith("[rank")]
    assert ranks_lines == [f"[rank {r}] here" for r in range(4)]

    with capture_output() as cap:
        ip.run_line_magic("pxconfig", "-t 1:3 --verbose --timeout 30")
    assert cap.stdout.strip() == ("%px waits for the cell, on ranks 1:3, time limit 30 s, output in rank order at "
                                  "the end, verbose")
    with capture_output() as cap:
        ip.run_line_magic("px", "print(rank)")
    assert cap.stdout.splitlines() == ["Parallel execution on ranks [1, 2], time limit 30 s",
                                       "[rank 1] 1", "[rank 2] 2"]
    with capture_output() as cap:
        ip.run_line_magic("px", "-t 0 --no-verbose print(rank)")  # a cell's own options win
    assert cap.stdout.splitlines() == ["[rank 0] 0"]
    with capture_output():
        ip.run_line_magic("pxconfig", "--noblock -t all --no-verbose")
    assert px_defaults.block is False and px_defaults.targets is None and px_defaults.timeout == 30
    with capture_output() as cap:
        handle = ip.run_line_magic("px", "print(rank)")
    assert isinstance(handle, PendingCell) and handle.ranks == [0, 1, 2, 3] and handle.timeout == 30
    with capture_output() as cap:
        handle.get()
    assert cap.stdout.splitlines() == [f"[rank {r}] {r}" for r in range(4)]
    with capture_output():
        ip.run_line_magic("pxconfig", "--block")

    with capture_output() as cap:
        ip.run_line_magic("autopx", "")
    assert cap.stdout.startswith("%autopx enabled")
    try:
        with capture_output() as cap:
            assert ip.run_cell("auto_mark = rank + 100\nprint('auto', rank)").success
        assert cap.stdout.splitlines() == [f"[rank {r}] auto {r}" for r in range(4)]
        assert cl.eval("auto_mark") == [100, 101, 102, 103] and "auto_mark" not in ip.user_ns
        with capture_output() as cap:  # a cell that starts with a sharddbg magic runs here
            ip.run_cell("%shard_cluster diagnose")
        assert cap.stdout.strip() == "every rank is idle"
    finally:
        with capture_output() as cap:
            ip.run_cell("%autopx")
    assert cap.stdout.strip() == "%autopx disabled"
    with capture_output() as cap:
        ip.run_cell("print('local again')")
    assert cap.stdout.strip() == "local again"


def test_cluster_timeout_defaults_reach_the_calls(ip, started, monkeypatch, tmp_path):
    """Each subcommand's --timeout default reaches its call: start's 60 s is the cluster's time limit, recover
    passes None (the cluster's), diagnose gives each rank 5 s to answer."""
    cl = started
    assert cl.timeout == 60.0  # `started` ran %shard_cluster start without --timeout
    calls = []

    def recorded(name):
        method = getattr(cl, name)

        def call(*args, **kwargs):
            calls.append((name, kwargs))
            return method(*args, **kwargs)

        monkeypatch.setattr(cl, name, call)

    recorded("recover")
    recorded("hang_report")
    with capture_output() as cap:
        ip.run_line_magic("shard_cluster", "recover")
    assert "re-created" in cap.stdout
    go = tmp_path / "go"
    with capture_output():  # busy until `go` exists, so that diagnose reports on them
        handle = ip.run_cell_magic("px", "--noblock", f"import os, time\nwhile not os.path.exists({str(go)!r}):\n"
                                                      f"    time.sleep(0.05)")
    try:
        deadline = time.monotonic() + 20
        while cl.busy_ranks() != [0, 1, 2, 3]:  # the controller counts the cell a moment after it is sent
            assert time.monotonic() < deadline, "the ranks never started the cell"
            time.sleep(0.05)
        with capture_output() as cap:
            ip.run_line_magic("shard_cluster", "diagnose")
            ip.run_line_magic("shard_cluster", "diagnose --timeout 2")
    finally:
        go.touch()
    with capture_output():
        handle.get()
    assert [(name, kwargs.get("timeout", kwargs.get("diagnose_timeout"))) for name, kwargs in calls] == [
        ("recover", None), ("hang_report", 5.0), ("hang_report", 2.0)]



def test_stop(ip, started):
    cl = started
    pids = {p.pid for p in cl.processes()}
    with capture_output():
        running = ip.run_line_magic("px", "--noblock import time; time.sleep(60)")
    with capture_output() as cap:
        ip.run_line_magic("shard_cluster", "stop")
    assert "stopped 4 ranks" in cap.stdout
    # a cell sent before the stop has no outcome to wait for: its handle says so at once
    t0 = time.monotonic()
    assert running.wait(30) is True and time.monotonic() - t0 < 3
    with pytest.raises(ClusterError, match="^the cluster this cell was sent to was stopped or restarted since"):
        running.get()
    assert not [p for p in pids if psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE]
    assert sharddbg.active_cluster(required=False) is not cl  # a stopped cluster is never the active one

