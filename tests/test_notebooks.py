"""The tutorial notebooks, executed top to bottom on a real 4-rank CPU cluster (nbclient, the venv's
kernel). Each notebook starts and stops its own cluster; checks read the cells' real outputs.

The module's notebooks run two at a time (``executed``), each in its own kernel with its own cluster: a
notebook spends most of its time waiting on messages between the kernel, the controller and the ranks, so a
second one uses the core the first leaves idle. Each test waits for its own notebook and checks it."""

from __future__ import annotations

import asyncio
import os
import re
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import nbformat
import pytest
from nbclient import NotebookClient

NOTEBOOKS = Path(__file__).resolve().parent.parent / "notebooks"
N = 4
ROWS = [66 // N + (1 if r < 66 % N else 0) for r in range(N)]

pytestmark = pytest.mark.cluster


def run_notebook(name: str, timeout: int = 240) -> nbformat.NotebookNode:
    nb = nbformat.read(NOTEBOOKS / name, as_version=4)
    # "python3" is the native kernel: jupyter_client starts it with this interpreter (the venv's)
    client = NotebookClient(nb, timeout=timeout, kernel_name="python3", resources={"metadata": {"path": str(NOTEBOOKS)}})
    # an event loop of its own: it may run in a worker thread, beside another notebook
    asyncio.run(client.async_execute(env=dict(os.environ, OMP_NUM_THREADS="1")))
    return nb


AT_ONCE = 2  # notebooks executed at the same time (a 4-rank cluster each)
# the longest first, so that the two at a time end together (seconds each on 2 cores, one at a time: 05 40,
# 06 37, 07 30, 01 26, 02 25, 04 23, 03 19)
LONGEST_FIRST = ("05_verify", "06_which_op", "07_write_a_patch", "01_quickstart", "02_dispatch_paths",
                 "04_comm_profile", "03_hidden_errors")


@pytest.fixture(scope="module")
def executed(request) -> dict[str, Future]:
    """The notebooks of this module's selected tests (``test_<name>`` checks ``<name>.ipynb``), started at once
    ``AT_ONCE`` at a time: notebook name -> its run (``.result()`` waits for it, raises what it raised)."""
    wanted = {item.name.removeprefix("test_") for item in request.session.items if item.path == request.node.path}
    pool = ThreadPoolExecutor(max_workers=AT_ONCE, thread_name_prefix="notebook")
    runs = {name: pool.submit(run_notebook, f"{name}.ipynb") for name in sorted(wanted, key=_longest_first)}
    yield runs
    pool.shutdown(wait=True, cancel_futures=True)  # a run already started ends (its kernel stops its cluster)


def _longest_first(name: str) -> int:
    return LONGEST_FIRST.index(name) if name in LONGEST_FIRST else -1  # a new notebook: at once (unmeasured)


def outputs_text(cell) -> str:
    parts = []
    for o in cell.get("outputs", []):
        if o.get("output_type") == "stream":
            parts.append(o["text"])
        elif "data" in o:
            parts.append(o["data"].get("text/plain", ""))
            parts.append(o["data"].get("text/html", ""))
        elif o.get("output_type") == "error":
            parts.append("\n".join(o["traceback"]))
    return "\n".join(parts)


def result_of(nb, snippet: str):
    """The value shown by the cell's execute_result (a Python literal, e.g. cl.eval's list per rank)."""
    import ast

    (res,) = [o for o in cell_with(nb, snippet).outputs if o.get("output_type") == "execute_result"]
    return ast.literal_eval(res["data"]["text/plain"])


def cell_with(nb, snippet: str):
    return next(c for c in nb.cells if c.cell_type == "code" and snippet in c.source)


VIEW_MIMETYPES = {"application/vnd.jupyter.widget-view+json", "text/html", "text/plain", "application/vnd.sharddbg.trace+json"}


def check_common(nb) -> None:
    """What every tutorial notebook must hold: the stop cell prints its one-line summary and nothing else;
    no file is written under a fixed name in a shared folder."""
    stop = cell_with(nb, "%shard_cluster stop")
    assert [o.get("name") for o in stop.outputs] == ["stdout"], stop.outputs
    assert re.fullmatch(r"sharddbg: stopped 4 ranks in \d+\.\d s\n", stop.outputs[0]["text"]), stop.outputs[0]["text"]
    assert not any("gettempdir()" in c.source for c in nb.cells if c.cell_type == "code")


def test_01_quickstart(executed):
    nb = executed["01_quickstart"].result()
    check_common(nb)
    assert result_of(nb, 'cl.eval("tuple(x._local_tensor.shape)")') == [(1, 3, r, 64) for r in ROWS]
    # the status table: eight columns by default, one row per rank
    (status,) = [o for o in cell_with(nb, "%shard_cluster status").outputs if o.get("output_type") == "execute_result"]
    header = re.search(r"<thead>\s*<tr[^>]*>(.*?)</tr>", status["data"]["text/html"], re.S).group(1)
    assert len(re.findall(r"<th", header)) - 1 <= 8  # the first is the index's
    assert status["data"]["text/html"].count("<tr>") >= N and "registered-by-sharddbg" in status["data"]["text/html"]
    # the inspector's output bundle: the widget, static HTML, the text grid, the snapshots
    insp = cell_with(nb, 'sharddbg.inspect("x")')
    (out,) = [o for o in insp.outputs if "data" in o]
    assert set(out["data"]) == VIEW_MIMETYPES
    text = out["data"]["text/plain"]
    for r in range(N):
        assert f"rank {r} [domain={r}] local (1, 3, {ROWS[r]}, 64) offsets (0, 0, {sum(ROWS[:r])}, 0)" in text
    assert re.search(r"│\s+rank 3\*\s+│", text) and '<pre class="sd-grid">' in out["data"]["text/html"]
    assert len(out["data"]["application/vnd.sharddbg.trace+json"]["data"]["snapshots"]) == N
    fb = outputs_text(cell_with(nb, "get_fallbacks()"))
    assert "Tensor.abs" in fb and "dtensor_fallback_function" in fb
    (explorer,) = [o for o in cell_with(nb, "t.show()").outputs if "data" in o]
    assert set(explorer["data"]) == VIEW_MIMETYPES
    assert explorer["data"]["text/plain"].startswith("Trace explorer: ") and "object at 0x" not in explorer["data"]["text/plain"]
    assert "broken_add: expected &lt;ShardTensor&gt;" in explorer["data"]["text/html"]
    assert explorer["data"]["application/vnd.sharddbg.trace+json"]["data"]["ranks"] == list(range(N))
    # the findings by what they mean: the exception the cell caught (an error, told as information) comes before
    # the backward's stale plan cache entry (performance); the plan cache's table has one row per rank
    shown = explorer["data"]["text/plain"]
    assert re.search(r"ℹ error: \d+ op calls raised and the cell handled them", shown), shown
    assert "⚠ performance: Ranks 0-3: ShardTensor.redistribute (in ShardTensor.backward)" in shown
    assert shown.index("ℹ error: ") < shown.index("⚠ performance: Ranks 0-3: ShardTensor.redistribute")
    (plan,) = [o for o in cell_with(nb, "t.get_plan_cache()").outputs if o.get("output_type") == "execute_result"]
    rows = re.findall(r"<tr>\s*<th>\d+</th>(.*?)</tr>", plan["data"]["text/html"], re.S)
    assert len(rows) == N and all("ShardTensor.redistribute" in r and "target._sharding_shapes" in r for r in rows)
    tl = cell_with(nb, "t.plot_timeline()").outputs[0]["data"]
    fig = tl["application/vnd.plotly.v1+json"]
    assert [t for t in fig["layout"]["yaxis"]["ticktext"] if t.startswith("rank")] == [f"rank {r}" for r in range(N)]
    assert fig["layout"]["yaxis"]["ticktext"].count("collectives") == N
    # the report goes to a fresh temporary folder, not a fixed shared name
    m = re.search(r"(\S+)/sharddbg_quickstart_report\.html \d+\.\d MB", outputs_text(cell_with(nb, "to_html(")))
    assert m and os.path.basename(m.group(1)).startswith("sharddbg-quickstart-")


def test_02_dispatch_paths(executed):
    nb = executed["02_dispatch_paths"].result()
    check_common(nb)
    fb = outputs_text(cell_with(nb, "fb = t_net.get_fallbacks()"))
    assert "gelu" in fb and "dtensor_fallback_function" in fb
    # host time per op and path: the backward() call, whose host time holds the whole backward pass, left out
    own = outputs_text(cell_with(nb, "s = t_net.get_op_summary()"))
    assert "torch.conv2d" in own and "Tensor.square" in own and "backward" not in own, own
    cost = outputs_text(cell_with(nb, "t_conv = sharddbg.last_trace()"))
    assert re.search(r"dtensor_fallback_function\s+4\s", cost) and re.search(r"function_handler\s+4\s", cost)
    check = result_of(nb, 'eval("check")')
    bounds = [sum(ROWS[:r]) for r in range(1, N)]  # 17, 34, 50: the first row of each later shard
    wrong = sorted({b - 1 for b in bounds} | set(bounds))  # rows on either side of a boundary need a halo
    assert len(check) == N
    for r, (patch_err, rows) in enumerate(check):
        lo, hi = sum(ROWS[:r]), sum(ROWS[:r + 1])
        assert patch_err < 1e-4 and rows == [i for i in wrong if lo <= i < hi], check
    # the fallback's output says Replicate while every rank holds only its own rows: drawn as they hold them
    insp = [o for o in cell_with(nb, 'inspect("y1_fb")').outputs if "data" in o][0]["data"]["text/plain"]
    assert "placements Replicate()" in insp, insp
    # the verdict first: the warnings come before the drawing
    assert insp.index("WARNING: rank 0: tensor dim 2 is not sharded") < insp.index("│"), insp
    for r in range(N):
        assert f"rank {r} [domain={r}] local (1, 8, {ROWS[r]}, 64) offsets (0, 0, {sum(ROWS[:r])}, 0) " in insp, insp
        assert f"WARNING: rank {r}: tensor dim 2 is not sharded, but its local size is {ROWS[r]} while the global " \
               f"size is 66" in insp, insp
        assert re.search(rf"│\s+rank {r}\*?!\s+│", insp), insp  # every rank's box, marked as a mismatch
    assert "drawn as the ranks really hold it" in insp


def test_03_hidden_errors(executed):
    nb = executed["03_hidden_errors"].result()
    check_common(nb)
    both = result_of(nb, 'eval("(plain, unmasked)")')
    assert both == [("TypeError: unsupported operand type(s) for +: 'ShardTensor' and 'ShardTensor' | cause: None",
                     "UnmaskedOpError -> TypeError('my_add() takes 2 positional arguments but 4 were given')")] * N
    errs = outputs_text(cell_with(nb, "errs = t.get_errors()"))
    assert errs.count("my_add() takes 2 positional arguments") >= N
    assert result_of(nb, 'eval("tuple(twice._local_tensor.shape)")') == [(1, 3, r, 64) for r in ROWS]


def test_04_comm_profile(executed):
    nb = executed["04_comm_profile"].result()
    check_common(nb)
    summary = outputs_text(cell_with(nb, "def summary"))
    # 3 conv2d calls per rank; the halo patch sends one row (8 channels x 64 columns x 4 B) to each
    # neighbour per call and receives as much; the fallback communicates nothing
    halo_bytes = 3 * sum(2 * ((r > 0) + (r < N - 1)) * 8 * 64 * 4 for r in range(N))
    row = r"<td>{}</td>\s*<td>{}</td>\s*<td>{}</td>\s*<td>[\d.]+</td>\s*<td>[\d.]+</td>\s*<td>{}</td>\s*<td>{}</td>"
    assert re.search(row.format("halo patch", "function_handler", 3 * N, 3 * N, halo_bytes), summary), summary
    assert re.search(row.format("DTensor fallback", "dtensor_fallback_function", 3 * N, 0, 0), summary), summary
    # the notebook says only what this run measured: the sentence is computed from the table's numbers
    means = [float(v) for v in re.findall(r"<td>(?:halo patch|DTensor fallback)</td>\s*<td>[^<]*</td>\s*<td>\d+</td>\s*"
                                           r"<td>([\d.]+)</td>", summary)]
    halo_ms, fb_ms = means
    said = outputs_text(cell_with(nb, "ratio = "))
    m = re.search(r"the fallback took ([\d.]+) ms per call, the halo patch ([\d.]+) ms: the fallback was (.*?)\. ", said)
    assert m and float(m.group(1)) == pytest.approx(fb_ms, abs=0.006) and float(m.group(2)) == pytest.approx(halo_ms, abs=0.006)
    ratio = fb_ms / halo_ms
    assert m.group(3) == (f"{ratio:.1f}x slower" if ratio > 1.05 else f"{1 / ratio:.1f}x faster" if ratio < 0.95 else "about as fast")
    assert not any("cheaper" in c.source or "faster" in c.source for c in nb.cells if c.cell_type == "markdown")
    comm = cell_with(nb, "t_halo.plot_comm_by_op()").outputs[0]["data"]["application/vnd.plotly.v1+json"]
    assert [d["name"] for d in comm["data"]] == ["all_to_all_single"] * 2
    empty = cell_with(nb, "t_fb.plot_comm_by_op()").outputs[0]["data"]["application/vnd.plotly.v1+json"]
    assert "no collectives recorded" in empty["layout"]["annotations"][0]["text"]
    imb = cell_with(nb, "plot_imbalance").outputs[0]["data"]["application/vnd.plotly.v1+json"]
    vol = [d for d in imb["data"] if d.get("name") == "shard volume" and d.get("visible") is True][0]
    # three conv2d calls per rank on (1, 8, rows, 64)
    assert list(_arr(vol["y"])) == [3 * 8 * r * 64 for r in ROWS]


def _arr(v):
    """A plotly JSON array: a list, or {"dtype", "bdata"} (base64 typed array, plotly >= 6)."""
    if isinstance(v, dict) and "bdata" in v:
        import base64

        import numpy as np

        return np.frombuffer(base64.b64decode(v["bdata"]), dtype=np.dtype(v["dtype"])).tolist()
    return v


def test_05_verify(executed):
    nb = executed["05_verify"].result()
    check_common(nb)
    bounds = [sum(ROWS[:r]) for r in range(1, N)]  # 17, 34, 50
    # 1. the numerical check: passes with every gradient; without the conv2d patch, wrong only near the boundaries
    passed = outputs_text(cell_with(nb, "%%shard_check --inputs x --model net"))
    assert f"check passed: 8 tensors (outputs and gradients) on {N} ranks agree with the unsharded reference" in passed
    failed = outputs_text(cell_with(nb, "no_halo = cl.check("))
    assert failed.startswith("check FAILED: 1 of 1 tensors differ from the unsharded reference: y (output, ranks 0-3")
    assert f"only in rows near the shard boundaries {', '.join(map(str, bounds))}" in failed and "a missing halo?" in failed
    rows = cell_with(nb, 'no_halo.plot_rows("y")').outputs[0]["data"]["application/vnd.plotly.v1+json"]
    assert sorted(s["x0"] for s in rows["layout"]["shapes"] if s.get("line", {}).get("dash") == "dash") == \
        [b - 0.5 for b in bounds]
    # 2. the spec alarm: the custom op, on every rank, in the summary line and the table (50 points: 13, 13, 12, 12)
    alarm = outputs_text(cell_with(nb, "feats = neighbor_features(pts, 17)"))
    assert f"{N} result(s) whose spec disagrees with the local tensor on ranks 0-3, first at " \
           f"verify_demo.neighbor_features.default" in alarm
    table = outputs_text(cell_with(nb, "get_spec_mismatches()"))
    for r, points in enumerate([13, 13, 12, 12]):
        assert re.search(rf"<td>{r}</td>\s*<td>verify_demo.neighbor_features.default</td>\s*<td>\({points}, 3\)</td>\s*"
                         rf"<td>\({points}, 17, 3\)</td>", table), table
    # 3. replicas: the weight changed on rank 3 is named at its first op, in a trace and stand-alone
    div = outputs_text(cell_with(nb, "%%shard_trace --replicas"))
    assert "replicas diverge first at torch.conv2d (parameter 2.weight, " in div
    assert "rank 3 differs from ranks 0, 1, 2 by up to " in div
    assert re.search(r"<td>torch.conv2d</td>\s*<td>parameter 2.weight</td>\s*<td>\(0, 1, 2, 3\)</td>\s*<td>\[3\]</td>",
                     outputs_text(cell_with(nb, "get_replica_divergence()")))
    standalone = outputs_text(cell_with(nb, 'cl.check_replicas("net")'))
    assert "net: 1 of 6 parameters and buffers differ" in standalone and "2.weight: rank 3 differs from rank 0" in standalone
    # 4. the doctor: both mistakes fail, with their fix; the sharded input is fine
    doctor = outputs_text(cell_with(nb, "%shard_doctor"))
    assert doctor.startswith("doctor: FAILED (") and "2 fail" in doctor
    assert "head.weight, head.bias" in doctor and "ddp_head is DDP over the whole world ([0, 1, 2, 3])" in doctor
    assert "DDP(model, process_group=mesh[&#x27;ddp&#x27;].get_group())" in doctor
    # 5. pre-flight: the uneven all_gather is named before it is issued, and the cell fails with it
    pre = cell_with(nb, "%%shard_trace --preflight")
    (error,) = [o for o in pre.outputs if o.get("output_type") == "error"]
    assert error["ename"] == "RankError"
    assert error["evalue"].startswith("ranks [0, 1, 2, 3] raised CollectiveMismatchError: all_gather_into_tensor on "
                                      "process group 'domain'")
    assert f"ranks 2, 3 send (1, 3, {ROWS[2]}, 16), the others (1, 3, {ROWS[0]}, 16)" in error["evalue"]
    # the user's frames with their source, a library's frame one line, never the magic's dispatch line
    shown = re.sub(r"\x1b\[[0-9;]*m", "", "\n".join(error["traceback"]))
    assert "run_cell_magic" not in shown and len(shown.splitlines()) < 30, shown
    # named by the notebook's count (the handler's frame: the cell that defined it), never the ranks'
    assert f"Cell In[{pre.execution_count}], line 1\n" in shown, shown
    assert re.search(r"shard_tensor.py:\d+, in ShardTensor.__torch_function__\n", shown), shown
    assert outputs_text(cell_with(nb, "get_preflight()")).count("<td>mismatch</td>") == N
    # 6. the smoke matrix: every configuration matches, the batch of 2 per domain group too; the loss error per step
    smoke = outputs_text(cell_with(nb, "smoke = cl.smoke("))
    assert smoke.startswith("smoke matrix on 4 ranks: all 5 configurations as expected (5 match the single-device run "
                            "within rtol 0.001)")
    assert smoke.count('class="sd-smoke-ok"') == 5
    losses = cell_with(nb, "smoke.plot_losses()").outputs[0]["data"]["application/vnd.plotly.v1+json"]
    assert [d["name"] for d in losses["data"]] == ["single-device", "domain=4", "ddp=2 x domain=2, DDP",
                                                   "ddp=2 x domain=2, FSDP2", "domain=4, 2 samples per domain group"]
    # a log axis with a floor for the exact matches, the tolerance labelled on its line (annotations on a log
    # axis take log10), each line in its own dash (DDP's and FSDP2's identical lines both show)
    assert losses["layout"]["yaxis"]["type"] == "log" and losses["layout"]["yaxis"]["range"][0] > -12
    assert [a["y"] for a in losses["layout"]["annotations"] if a["text"] == "rtol 0.001"] == [-3]
    assert len({d["line"]["dash"] for d in losses["data"]}) == 5


def test_07_write_a_patch(executed):
    nb = executed["07_write_a_patch"].result()
    check_common(nb)
    # 1. torch.diff fell back: a halo of one row, the fallback gathered the input whole
    families = outputs_text(cell_with(nb, "fb = sharddbg.last_trace().get_fallbacks()"))
    assert re.search(r"<td>torch.diff</td>\s*<td>halo</td>\s*<td>1</td>\s*<td>2 all_gather_into_tensor per call",
                     families), families
    evidence = outputs_text(cell_with(nb, 'print(fb.loc[0, "evidence"])'))
    assert "1 row shorter along the sharded dim 2" in evidence
    assert "closest physicsnemo patch: physicsnemo.domain_parallel.shard_utils.conv_patches.partial_conv_nd " \
           "(conv1d's halo patch" in evidence
    # 2-3. the scaffold, registered on every rank by the %%shard_patch cell
    assert outputs_text(cell_with(nb, 'print(scaffold("torch.diff"')).startswith(
        "def diff_handler(func, types, args, kwargs, halo=1, shrink=1):")
    assert "PatchRecord(op='torch.diff', kind='function', handler='__main__.diff_handler', replaces=None)" in \
        outputs_text(cell_with(nb, "%%shard_patch torch.diff"))
    # 4. the verdict: correct with the handler, the fallback's gathers replaced by a halo exchange of 1 row
    verdict = outputs_text(cell_with(nb, "r = cl.check_patch("))
    assert "patched: correct (the fallback was wrong: it fails the check)" in verdict, verdict
    assert "2 all_gather_into_tensor (960 B) replaced by 1 all_to_all_single (18 B) per call and rank" in verdict
    table = outputs_text(cell_with(nb, "r.table"))
    assert "dtensor_fallback_function" in table and "function_handler" in table
    # 5. taken back
    assert "PatchRecord(op='torch.diff', kind='function', handler='__main__.diff_handler'" in \
        outputs_text(cell_with(nb, 'cl.unpatch("torch.diff")'))


def test_06_which_op(executed):
    nb = executed["06_which_op"].result()
    check_common(nb)
    # without the conv2d patch: the first conv departs, at the shard boundaries, its inputs agreeing; the table follows
    no_halo = outputs_text(cell_with(nb, "%%shard_diff --no-grads"))
    assert no_halo.startswith("the first op that departs: `torch.conv2d` (1st call) at line 2 of the statement "
                              "(`y = net(x)`), module net.0: output max abs ")
    assert "on ranks 0-3, rows 16-17, 33-34, 49-50 (the shard boundaries are at rows 17, 34, 50): its inputs agreed" \
        in no_halo
    assert no_halo.count("sd-diff-departs") == 5 and "sd-diff-fail" in no_halo
    # the view names the call the explorer opens on; explore() is the explorer (widget, static rendering, trace)
    assert "r.explore(): the trace explorer opened on this op&#x27;s call on rank 0 (seq " in no_halo
    assert "application/vnd.sharddbg.trace+json" in cell_with(nb, "_.explore()").outputs[0]["data"]
    # with it: every op agrees, the backward too; ops= narrows the comparison
    agree = outputs_text(cell_with(nb, 'r = cl.diff("y = net(x)")'))
    assert agree.startswith("every op agrees with the single-device run: 16 op outputs and gradients compared on 4 ranks")
    assert agree.count("<td>agrees</td>") == 16 and "<td>net.0.weight.grad</td>" in agree
    assert outputs_text(cell_with(nb, 'ops="conv2d"')).count("<td>torch.conv2d</td>") == 3
