"""How fast the notebook front end is, measured in a real browser (Debian's chromium via Playwright).

1. Timeline with 100k op events (4 ranks x 25k): Python time to build the figure, size of the
   standalone HTML, time for chromium to load and draw it (until plotly's first draw finished), and
   the latency of a hover (mouse move until the hover label shows) and of a zoom. The default (above
   30k spans: a binned overview, one image), every span drawn (WebGL lines), and a 10 s window.
   The 100k events are the golden trace's real events (tests/data/conv4.sdtrace.json), repeated on
   every rank with shifted times and sequence numbers.
2. Shard inspector with 4 ranks, from call to display: a real 4-rank cluster and JupyterLab; the time
   from running the cell ``sharddbg.inspect("x")`` until the browser shows its 4 blocks (and, apart,
   the Python side alone: ``cl.inspect("x")``: gather the snapshots, check, build the widget).
3. The static renderings (Python only, no browser, no cluster): ``explorer_html`` on the golden trace and
   on the 100k-event trace (whole, and its HTML alone once the explorer's tables are computed), the
   standalone report ``to_html``, ``inspector_html`` on the golden snapshots, and the verification views
   (``check_html``, ``doctor_html``, ``smoke_html``, ``replica_check_html``) on made-up tables of a
   realistic size.

4. A big trace's standalone report (``--only big --trace PATH``, a trace saved by bench/bench_trace_big.py):
   its size, when the first screen is drawn, every figure drawn, and the interactions (op filter, every call, a
   call's detail, scroll, the explorer's list scrolled to its end, timeline zoom); several reports (``--report``
   more than once: say one from the parent commit) are loaded in turn, so each sees the same load on the machine;
   ``--profile`` adds where a page load spends its time (a chromium performance trace, main-thread tasks);
   ``--before-code DIR`` builds the report with an older sharddbg too (CPU and wall, the same run); a zoom into a
   window not drawn in Python is timed with the spans the page drew; ``--screenshots DIR`` keeps the zoomed
   timeline in light and dark.

    OMP_NUM_THREADS=1 .venv/bin/python bench/bench_views.py [--events 100000] [--repeats 5] [--only static]
    OMP_NUM_THREADS=1 .venv/bin/python bench/bench_views.py --only big --trace big.sdtrace.arrow [--report r.html ...] [--profile]

Prints a table; with --append, adds a section to bench/RESULTS.md.
"""

from __future__ import annotations

import argparse
import copy
import datetime
import json
import os
import secrets
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
CHROMIUM = "/usr/bin/chromium"
ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
        "--disable-component-update", "--disable-sync", "--no-first-run"]


def big_trace(n_events: int):
    """The golden trace's events, repeated until there are ``n_events`` op events over all ranks."""
    import sharddbg
    from sharddbg.trace import Trace

    base = sharddbg.load_trace(ROOT / "tests" / "data" / "conv4.sdtrace.json")
    payloads = {}
    per_rank = n_events // len(base.ranks)
    for r in base.ranks:
        p = copy.deepcopy(base.payloads[r])
        evs = [e for e in p["events"] if e["kind"] == "op"]
        span = max(e["t_end_ns"] for e in evs) - min(e["t_start_ns"] for e in evs) + 1000
        n0 = len(evs)
        # the ops are numbered again without the collectives between them: a parent is named by its new number
        position = {e["seq"]: i for i, e in enumerate(evs)}
        out = []
        for k in range(per_rank):
            e = dict(evs[k % n0])
            rep = k // n0
            e["seq"] = k
            e["parent_seq"] = None if e["parent_seq"] is None else position[e["parent_seq"]] + rep * n0
            e["t_start_ns"] += rep * span
            e["t_end_ns"] += rep * span
            out.append(e)
        p["events"] = out
        payloads[r] = p
    return Trace(payloads, base.clock_offsets_ns, [], {"bench": f"{n_events} events"})


def bench_timeline(n_events: int, repeats: int) -> list[dict]:
    from playwright.sync_api import sync_playwright

    from sharddbg.views.timeline import OP_LANE0, plot_timeline

    t = big_trace(n_events)
    n = len(t.get_ops())
    rows = []
    with tempfile.TemporaryDirectory() as tmp, sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=ARGS)
        for kwargs, label in (({}, "default: binned overview"), ({"aggregate": False, "overview": False}, "every span drawn (WebGL)"),
                              ({"time_range": (1000.0, 11000.0)}, "a 10 s window, op by op")):
            t0 = time.perf_counter()
            fig = plot_timeline(t, **kwargs)
            build_s = time.perf_counter() - t0
            d0 = fig.data[0]
            if d0.type == "heatmap":  # the binned overview: hover the middle of rank 0's op lane
                spans = f"{int(np.isfinite(np.array(d0.z, dtype=float)).sum())} bins"
                target = (float(np.mean(fig.layout.xaxis.range)), t.ranks[0] + OP_LANE0)
            else:
                spans = sum(int(np.isnan(d.x).sum()) for d in fig.data if d.mode == "lines")
                k = 3 * int(np.argmax(d0.x[1::3] - d0.x[0::3]))  # the longest span of the first trace
                target = ((d0.x[k] + d0.x[k + 1]) / 2, d0.y[k])
            path = os.path.join(tmp, "timeline.html")
            fig.write_html(path, include_plotlyjs=True, full_html=True, div_id="tl")
            size_mb = os.path.getsize(path) / 1e6
            loads, hovers, zooms = [], [], []
            for _ in range(repeats):
                page = browser.new_page(viewport={"width": 1400, "height": 700})
                t0 = time.perf_counter()
                page.goto("file://" + path, wait_until="domcontentloaded")
                page.wait_for_function("() => { const d = document.getElementById('tl');"
                                       " return d && d._fullLayout && d.querySelector('.ytick'); }", timeout=120_000)
                page.evaluate("() => new Promise(r => requestAnimationFrame(() => requestAnimationFrame(r)))")
                loads.append(time.perf_counter() - t0)
                # a point on the longest span of the figure's first trace: a span is under the pointer
                pos = page.evaluate(f"""() => {{ const d = document.getElementById('tl'), L = d._fullLayout;
                    const r = d.getBoundingClientRect();
                    return [r.left + L.xaxis._offset + L.xaxis.l2p({target[0]}), r.top + L.yaxis._offset + L.yaxis.l2p({target[1]})]; }}""")
                page.mouse.move(5, 5)
                t0 = time.perf_counter()
                page.mouse.move(pos[0], pos[1], steps=1)
                page.wait_for_selector("#tl .hoverlayer .hovertext", timeout=20_000)
                hovers.append(time.perf_counter() - t0)
                # zoom into the middle tenth of the time axis and back (a relayout redraws every trace)
                zooms.append(page.evaluate("""async () => { const d = document.getElementById('tl');
                    const [a, b] = d._fullLayout.xaxis.range, t0 = performance.now();
                    await Plotly.relayout(d, {'xaxis.range': [a + 0.45 * (b - a), a + 0.55 * (b - a)]});
                    await Plotly.relayout(d, {'xaxis.range': [a, b]});
                    return (performance.now() - t0) / 2000; }"""))
                page.close()
            rows.append({"what": f"timeline, {n} op events, {label}", "spans drawn": spans, "build_s": build_s,
                         "html_MB": size_mb, "load_draw_s": statistics.median(loads), "hover_s": statistics.median(hovers),
                         "zoom_s": statistics.median(zooms)})
        browser.close()
    return rows


# Checked every frame from the start of a navigation (ms since it started): when the explorer's list is first on
# the page, and when what the first screen shows is all drawn: the page parsed, the explorer's list there, and each
# figure whose box starts within the screen drawn by plotly (both kinds of report: figures drawn as they come into
# view, or all of them at once after plotly.js)
FIRST_SCREEN = """window.__sd = { explorer: null, firstScreen: null }; (function poll() {
    const now = performance.now();
    if (__sd.explorer == null && document.querySelector('#sd-explorer .sd-list tr')) __sd.explorer = now;
    const figs = [...document.querySelectorAll('[id^="sd-fig-"]')].filter((d) => !d.id.endsWith('-data'));
    const inView = figs.filter((d) => d.getBoundingClientRect().top < innerHeight);
    if (__sd.explorer != null && document.readyState !== 'loading' && inView.every((d) => d._fullLayout && d.querySelector('.main-svg')))
        __sd.firstScreen = now;
    else requestAnimationFrame(poll); })();"""
DRAWN = """(ids) => ids.every((i) => { const d = document.getElementById(i); return d && d._fullLayout && d.querySelector('.main-svg'); })"""
FIGURES = ["sd-fig-timeline", "sd-fig-comm", "sd-fig-imbalance"]


def page_profile(browser, report_path: str, trace_path: str) -> list[str]:
    """Where a page load's time goes: a chromium performance trace of one load of ``report_path`` (saved at
    ``trace_path``), as lines: each main-thread task over 30 ms (its start, its length) and what took the most of
    it (parsing HTML, evaluating a script, compiling, a function call, layout)."""
    import collections

    page = browser.new_page(viewport={"width": 1400, "height": 1000})
    browser.start_tracing(page=page, path=trace_path, categories=["devtools.timeline", "v8", "v8.execute", "loading"])
    page.add_init_script(FIRST_SCREEN)
    page.goto(f"file://{report_path}", timeout=600_000)
    page.wait_for_function("() => window.__sd.firstScreen != null", timeout=600_000)
    browser.stop_tracing()
    page.close()
    events = json.loads(Path(trace_path).read_text())["traceEvents"]
    main = collections.Counter((e["pid"], e["tid"]) for e in events if e.get("name") == "ParseHTML").most_common(1)[0][0]
    timed = sorted((e for e in events if (e["pid"], e["tid"]) == main and e.get("ph") == "X" and "dur" in e),
                   key=lambda e: (e["ts"], -e["dur"]))
    t0, end, lines = timed[0]["ts"], -1, []
    for e in timed:
        if e["ts"] < end:
            continue  # inside the task before
        end = e["ts"] + e["dur"]
        if e["dur"] < 30_000:
            continue
        inside = collections.Counter()
        for c in timed:
            if c is not e and e["ts"] <= c["ts"] and c["ts"] + c["dur"] <= end and c["dur"] > 20_000 and \
                    c["name"] in ("ParseHTML", "EvaluateScript", "v8.compile", "v8.run", "FunctionCall", "Layout",
                                  "UpdateLayoutTree", "Paint", "v8.parseOnBackground", "TimerFire", "FireAnimationFrame"):
                inside[c["name"]] += c["dur"]
        lines.append(f"{(e['ts'] - t0) / 1000:7.0f} ms  +{e['dur'] / 1000:6.0f} ms  " +
                     ", ".join(f"{k} {v / 1000:.0f} ms" for k, v in inside.most_common(4)))
    return lines


def bench_big_report(trace_path: str | None, repeats: int, report_paths: list[str],
                     screenshots: str | None = None) -> list[dict]:
    """The standalone reports ``report_paths`` (made from the saved trace ``trace_path`` where one does not exist
    yet) in chromium, their page loads taken in turn (the same load on the machine for each): size, when the
    explorer's list is first on screen, when the first screen is drawn (what the reader sees on opening: the page,
    the explorer, the figures within the screen), when every figure is drawn (the bench scrolls to each in turn
    right after the first screen), and the interactions: type in the explorer's op filter, show every call, open a
    call's detail, scroll the page to the explorer, scroll the explorer's list to its end, zoom the timeline into
    its first window drawn op by op and back, and zoom anywhere (a window not drawn in Python: the page draws its
    spans from those the figure carries; the time, the spans drawn and their drawing). Interactions wait for the
    next frame after the change. A report made here is built in a fresh process (load and ``to_html``, CPU and
    wall apart); ``screenshots``: the zoomed timeline's light and dark screenshots go to that folder."""
    from playwright.sync_api import sync_playwright

    build: dict[str, dict] = {}
    for path in report_paths:
        if not os.path.exists(path):
            build[path] = build_report_in_a_fresh_process(trace_path, path)
    frame = "() => new Promise(r => requestAnimationFrame(() => setTimeout(r, 0)))"
    keys = ("explorer", "first_screen", "all_drawn", "filter", "every_call", "detail", "scroll", "list_end", "zoom",
            "zoom_any", "zoom_any_spans", "zoom_any_draw", "rows_in_dom", "dom")
    out = {path: {k: [] for k in keys} for path in report_paths}
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=ARGS)
        for _ in range(repeats):
            for path in report_paths:
                o = out[path]
                page = browser.new_page(viewport={"width": 1400, "height": 1000})
                page.add_init_script(FIRST_SCREEN)
                page.goto(f"file://{path}", timeout=600_000)
                page.wait_for_function("() => window.__sd.firstScreen != null", timeout=600_000)
                o["explorer"].append(page.evaluate("() => window.__sd.explorer") / 1000)
                o["first_screen"].append(page.evaluate("() => window.__sd.firstScreen") / 1000)
                for fig in FIGURES:  # the reader scrolls down the page: each figure drawn as it comes into view
                    page.evaluate(f"() => document.getElementById('{fig}').scrollIntoView()")
                    page.wait_for_function(DRAWN, arg=[fig], timeout=600_000)
                o["all_drawn"].append(page.evaluate("() => performance.now()") / 1000)
                page.evaluate("() => window.scrollTo(0, 0)")
                page.evaluate(frame)

                def timed(js: str) -> float:
                    return page.evaluate(f"""async () => {{ const t0 = performance.now(); {js};
                        await ({frame})(); return (performance.now() - t0) / 1000; }}""")

                o["filter"].append(timed("""const f = document.querySelector('#sd-explorer .sd-f-op'); f.value = 'conv';
                    f.dispatchEvent(new Event('input'))"""))
                timed("const f = document.querySelector('#sd-explorer .sd-f-op'); f.value = ''; f.dispatchEvent(new Event('input'))")
                o["every_call"].append(timed("""const v = document.querySelector('#sd-explorer .sd-f-view'); v.value = 'calls';
                    v.dispatchEvent(new Event('change'))"""))
                o["rows_in_dom"].append(page.evaluate("() => document.querySelectorAll('#sd-explorer .sd-list tr.sd-op').length"))
                o["detail"].append(timed("document.querySelector('#sd-explorer tr.sd-op').click()"))
                assert page.evaluate("() => document.querySelector('#sd-explorer .sd-detail').style.display !== 'none'")
                o["scroll"].append(timed("document.getElementById('sd-explorer').scrollIntoView()"))
                o["list_end"].append(timed("const l = document.querySelector('#sd-explorer .sd-list'); l.scrollTop = l.scrollHeight"))
                o["zoom"].append(page.evaluate("""async () => { const d = document.getElementById('sd-fig-timeline');
                    const s = (d.layout.shapes || []).find(s => s.type === 'rect'), [a, b] = d._fullLayout.xaxis.range;
                    const w = s ? [s.x0, s.x1] : [a + 0.45 * (b - a), a + 0.55 * (b - a)], t0 = performance.now();
                    await Plotly.relayout(d, {'xaxis.range': w}); await Plotly.relayout(d, {'xaxis.range': [a, b]});
                    return (performance.now() - t0) / 2000; }"""))
                # a window that is not one of those drawn in Python: the page draws its spans from the ones the
                # figure carries (views/_static/timeline_zoom.js); the time until they are on the canvas, and how many
                any_window = page.evaluate("""async () => { const d = document.getElementById('sd-fig-timeline');
                    if (!d.layout.meta || !d.layout.meta.sd_zoom) return [NaN, 0, NaN];
                    await d._sdZoomPending;
                    const [a, b] = d._fullLayout.xaxis.range, times = [], drawn = [], draw = [];
                    for (const f of [0.37, 0.61, 0.83]) {
                      const c = a + f * (b - a), t0 = performance.now();
                      await Plotly.relayout(d, {'xaxis.range': [c, c + (b - a) / 2000]});
                      await new Promise(r => requestAnimationFrame(() => setTimeout(r, 0)));
                      times.push(performance.now() - t0); drawn.push(d._sdZoomDrawn); draw.push(d._sdZoomDrawMs);
                    }
                    await Plotly.relayout(d, {'xaxis.range': [a, b]});
                    times.sort((x, y) => x - y);
                    return [times[1] / 1000, Math.min(...drawn), Math.max(...draw) / 1000]; }""")
                for key, value in zip(("zoom_any", "zoom_any_spans", "zoom_any_draw"), any_window):
                    o[key].append(value)
                o["dom"].append(page.evaluate("() => document.getElementsByTagName('*').length"))
                page.close()
        if screenshots:
            _zoom_screenshots(browser, report_paths[0], screenshots)
        browser.close()
    return [{"report": path, "report_MB": os.path.getsize(path) / 2**20, **build.get(path, {}),
             **{k: statistics.median(v) for k, v in out[path].items()}} for path in report_paths]


def _zoom_screenshots(browser, report_path: str, folder: str) -> None:
    """The timeline zoomed into a window that is not drawn in Python, light and dark (the reader's preference)."""
    os.makedirs(folder, exist_ok=True)
    for scheme in ("light", "dark"):
        page = browser.new_page(viewport={"width": 1400, "height": 1000}, color_scheme=scheme)
        page.goto(f"file://{report_path}", timeout=600_000)
        page.evaluate("() => document.getElementById('sd-fig-timeline').scrollIntoView()")  # drawn once in view
        page.wait_for_function(DRAWN, arg=["sd-fig-timeline"], timeout=600_000)
        page.evaluate("""async () => { const d = document.getElementById('sd-fig-timeline'); await d._sdZoomPending;
            const [a, b] = d._fullLayout.xaxis.range, c = a + 0.61 * (b - a);
            await Plotly.relayout(d, {'xaxis.range': [c, c + (b - a) / 4000]}); d.scrollIntoView(); }""")
        page.wait_for_timeout(500)
        page.locator("#sd-fig-timeline").screenshot(path=os.path.join(folder, f"report_timeline_zoomed_{scheme}.png"))
        page.close()


def build_report_in_a_fresh_process(trace_path: str, report_path: str, code: str | None = None) -> dict:
    """Load ``trace_path`` and write its report with the sharddbg of ``code`` (a folder holding a ``sharddbg``
    package; this tree's by default) in a fresh process: wall and CPU seconds (user + system of that process) of the
    load and of ``to_html`` apart (a shared machine changes CPU time least)."""
    script = """import json, sys, time
t0, c0 = time.perf_counter(), time.process_time()
import sharddbg
t = sharddbg.load_trace(sys.argv[1])
t1, c1 = time.perf_counter(), time.process_time()
t.to_html(sys.argv[2])
t2, c2 = time.perf_counter(), time.process_time()
print(json.dumps({"load_wall": t1 - t0, "load_cpu": c1 - c0, "build_wall": t2 - t1, "build_cpu": c2 - c1}))
"""
    env = dict(os.environ, PYTHONPATH=str(code or ROOT), OMP_NUM_THREADS="1")
    out = subprocess.run([sys.executable, "-c", script, trace_path, report_path], env=env, cwd=str(code or ROOT),
                         capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def load_average() -> str:
    """The machine's load average (1, 5, 15 minutes), as /proc/loadavg has it."""
    return " ".join(Path("/proc/loadavg").read_text().split()[:3])


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def bench_inspector(repeats: int) -> dict:
    import nbformat
    from playwright.sync_api import expect, sync_playwright

    import sharddbg

    # the Python side alone: gather 4 snapshots, check, build the widget
    with sharddbg.Cluster(n=4, mesh={"ddp": 1, "domain": 4}, timeout=120) as cl:
        cl.run("x = sharddbg.engine.scatter(torch.randn(1, 3, 66, 64), dim=2)", timeout=60, display=False)
        cl.inspect("x")
        py = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            cl.inspect("x")
            py.append(time.perf_counter() - t0)

    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        root = tmp / "root"
        root.mkdir()
        nb = nbformat.v4.new_notebook()
        nb.metadata["kernelspec"] = {"display_name": "Python 3 (ipykernel)", "language": "python", "name": "python3"}
        nb.cells = [nbformat.v4.new_code_cell("import sharddbg\n%load_ext sharddbg\ncl = sharddbg.Cluster(n=4, mesh={\"ddp\": 1, \"domain\": 4}).start()\n"
                                              "%px x = sharddbg.engine.scatter(torch.randn(1, 3, 66, 64), dim=2)"),
                    nbformat.v4.new_code_cell('sharddbg.inspect("x")'),
                    nbformat.v4.new_code_cell("%shard_cluster stop")]
        nbformat.write(nb, root / "bench.ipynb")
        settings = tmp / "settings" / "@jupyterlab" / "notebook-extension"
        settings.mkdir(parents=True)
        (settings / "tracker.jupyterlab-settings").write_text(json.dumps({"windowingMode": "none"}))
        token, port = secrets.token_hex(16), _free_port()
        env = dict(os.environ, OMP_NUM_THREADS="1", JUPYTERLAB_SETTINGS_DIR=str(tmp / "settings"),
                   JUPYTERLAB_WORKSPACES_DIR=str(tmp / "ws"), JUPYTER_CONFIG_DIR=str(tmp / "cfg"))
        proc = subprocess.Popen([sys.executable, "-m", "jupyterlab", "--allow-root", "--no-browser", "--ip=127.0.0.1",
                                 f"--port={port}", f"--ServerApp.token={token}", f"--ServerApp.root_dir={root}"],
                                cwd=root, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
        url = f"http://127.0.0.1:{port}"
        try:
            for _ in range(200):
                try:
                    urllib.request.urlopen(f"{url}/api/status?token={token}", timeout=2)
                    break
                except OSError:
                    time.sleep(0.3)
            with sync_playwright() as p:
                browser = p.chromium.launch(executable_path=CHROMIUM, args=ARGS)
                page = browser.new_page(viewport={"width": 1400, "height": 1000})
                page.goto(f"{url}/lab/tree/bench.ipynb?token={token}")
                expect(page.locator(".jp-StatusBar-Widget", has_text="Python 3 (ipykernel) | Idle")).to_have_count(1, timeout=60_000)
                cells = page.locator(".jp-CodeCell")
                prompts = page.locator(".jp-CodeCell .jp-InputPrompt")
                cells.nth(0).click()
                for _ in range(3):  # the kernel may need a moment after "Idle" before it takes a cell
                    page.keyboard.press("Control+Enter")
                    try:
                        expect(prompts.nth(0)).to_have_text("[1]:", timeout=120_000)
                        break
                    except AssertionError:
                        continue
                browser_times = []
                for i in range(repeats):
                    cells.nth(1).locator(".jp-InputArea-editor").click()
                    page.keyboard.press("Escape")
                    t0 = time.perf_counter()
                    page.keyboard.press("Control+Enter")
                    expect(prompts.nth(1)).to_have_text(f"[{i + 2}]:", timeout=60_000)
                    expect(cells.nth(1).locator(".sd-inspector .sd-block")).to_have_count(4, timeout=60_000)
                    browser_times.append(time.perf_counter() - t0)
                cells.nth(2).locator(".jp-InputArea-editor").click()
                page.keyboard.press("Escape")
                page.keyboard.press("Control+Enter")
                expect(page.locator(".jp-OutputArea-output", has_text="stopped 4 ranks")).to_have_count(1, timeout=60_000)
                browser.close()
        finally:
            proc.terminate()
            proc.wait(timeout=20)
    return {"python_s": statistics.median(py), "python_min_s": min(py),
            "browser_s": statistics.median(browser_times), "browser_min_s": min(browser_times), "repeats": repeats}


def _timed(fn, repeats: int) -> tuple[float, float]:
    """(median, min) seconds of ``fn()`` over ``repeats`` calls, after one call that warms caches."""
    fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times), min(times)


def _verification_results():
    """Results shaped like real ones: a check of 8 tensors on 4 ranks with 2 failing near the shard boundaries,
    a doctor of 8 checks, a smoke matrix of 8 configurations, a replica check of 32 parameters."""
    import pandas as pd

    from sharddbg.analysis.check import ROW_COLUMNS, TABLE_COLUMNS as CHECK_COLUMNS, CheckResult
    from sharddbg.analysis.doctor import DoctorReport
    from sharddbg.analysis.findings import Finding
    from sharddbg.analysis.replica_check import TABLE_COLUMNS as REPLICA_COLUMNS, ReplicaCheck
    from sharddbg.analysis.smoke import TABLE_COLUMNS as SMOKE_COLUMNS, SmokeConfig, SmokeResult

    check = pd.DataFrame([{"tensor": f"net.{t}.weight.grad", "kind": "parameter grad", "rank": r, "group": 0,
                           "ok": t >= 2, "max_abs": 1e-7 * (t + 1), "max_rel": 1e-6, "ratio": 0.01, "rtol": 1e-4,
                           "atol": 1e-6, "bad": 0 if t >= 2 else 12, "numel": 4096, "dtype": "torch.float32",
                           "shape": (1, 4, 17, 64), "reference_shape": (1, 4, 66, 64), "compared": "local shard",
                           "row_dim": 2, "note": "the spec says dim 2 is whole (66)" if t == 0 else None}
                          for t in range(8) for r in range(4)], columns=CHECK_COLUMNS)
    starts = [0, 17, 34, 50, 66]  # 66 rows over 4 ranks; the 2 failing tensors fail at rows 15-18 (the first cut)
    rows = pd.DataFrame([{"tensor": f"net.{t}.weight.grad", "group": 0, "rank": r, "row": row,
                          "max_abs": 1e-3 if t < 2 and 15 <= row <= 18 else 1e-8, "ok": not (t < 2 and 15 <= row <= 18)}
                         for t in range(8) for r in range(4) for row in range(starts[r], starts[r + 1])],
                        columns=ROW_COLUMNS)
    result = CheckResult("y = net(x)", check, rows, inputs=["x"], outputs=["y"], models=["net"], backward="check",
                         backward_note="", loss=1.0, reference_loss=1.0, tf32={"applies": False}, groups=[0])
    doctor = DoctorReport([Finding(f"check {i}", ("ok", "warn", "fail", "skip")[i % 4], "what was found " * 4,
                                   "what to do " * 4, (0, 1, 2, 3)) for i in range(8)], [])
    smoke = pd.DataFrame([{"config": f"ddp{i}", "ok": i != 3, "outcome": "matches the single-device run",
                           "mesh": "ddp=1 x domain=4", "wrapper": "ddp", "compiled": i % 2 == 0, "training": True,
                           "expected_error": "", "loss_off_step": None, "loss_off_error": float("nan"),
                           "loss_error": 1e-7, "loss_error_step": 2, "grad_error": 1e-6,
                           "grad_error_param": "net.0.weight", "step_ms": 12.5, "first_step_ms": 80.0,
                           "fallbacks": 3.0, "fallback_ops": "", "collectives_per_step": 12.0,
                           "losses": [1.0, 0.9], "reference_losses": [1.0, 0.9], "about": "a configuration"}
                          for i in range(8)]).set_index("config")[SMOKE_COLUMNS]
    smoke_result = SmokeResult(smoke, [SmokeConfig(f"ddp{i}") for i in range(8)], {}, 1e-4, 3, 4)
    replicas = pd.DataFrame([{"name": f"net.{i}.weight", "kind": "parameter", "group_ranks": [0, 1, 2, 3],
                              "state": "differs" if i == 5 else "same", "ranks_differing": [2] if i == 5 else [],
                              "reference_rank": 0, "max_abs_diff": 0.5 if i == 5 else float("nan"),
                              "shape": (4, 3, 3, 3), "dtype": "torch.float32", "placements": "(R,)", "detail": ""}
                             for i in range(32)], columns=REPLICA_COLUMNS)
    return result, doctor, smoke_result, ReplicaCheck(replicas, "net", "ddp", [[0, 1, 2, 3]])


def bench_static(n_events: int, repeats: int) -> list[dict]:
    import sharddbg
    from sharddbg.analysis.layout import ShardLayout
    from sharddbg.views import explorer as ex
    from sharddbg.views.check import check_html, doctor_html
    from sharddbg.views.inspector import inspector_html
    from sharddbg.views.replicas import replica_check_html
    from sharddbg.views.smoke import smoke_html

    golden = sharddbg.load_trace(ROOT / "tests" / "data" / "conv4.sdtrace.json")
    big = big_trace(n_events)
    layout = ShardLayout(json.loads((ROOT / "tests" / "data" / "x_snapshots.json").read_text()))
    check, doctor, smoke, replicas = _verification_results()
    n_big = len(big.get_ops())
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        cases = [
            (f"explorer_html, golden trace ({len(golden.get_ops())} op calls)", lambda: ex.explorer_html(golden)),
            (f"explorer_html, {n_big} op events", lambda: ex.explorer_html(big)),
        ]
        # the HTML alone, the explorer's tables computed once (what a template can change)
        big_tables = ex._tables(big)
        golden_tables = ex._tables(golden)
        cases += [
            ("explorer's HTML alone, golden trace", lambda: ex._html(golden, golden_tables, ex.STATIC_ROWS)),
            (f"explorer's HTML alone, {n_big} op events", lambda: ex._html(big, big_tables, ex.STATIC_ROWS)),
            ("to_html report, golden trace", lambda: golden.to_html(os.path.join(tmp, "golden.html"))),
            (f"to_html report, {n_big} op events", lambda: big.to_html(os.path.join(tmp, "big.html"))),
            ("inspector_html, 4 ranks", lambda: inspector_html(layout)),
            ("check_html, 8 tensors x 4 ranks", lambda: check_html(check)),
            ("doctor_html, 8 checks", lambda: doctor_html(doctor)),
            ("smoke_html, 8 configurations", lambda: smoke_html(smoke)),
            ("replica_check_html, 32 parameters", lambda: replica_check_html(replicas)),
        ]
        for what, fn in cases:
            median, best = _timed(fn, repeats)
            rows.append({"what": what, "median_s": median, "min_s": best})
    return rows


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--events", type=int, default=100_000)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--only", choices=("timeline", "inspector", "static", "big"), help="run one part only")
    ap.add_argument("--trace", help="with --only big: a saved big trace (bench/bench_trace_big.py --folder)")
    ap.add_argument("--report", action="append", default=[],
                    help="with --only big: a report's path (made from --trace unless it exists); several: measured in turn")
    ap.add_argument("--profile", action="store_true", help="with --only big: where each report's page load spends its time "
                                                            "(a chromium performance trace of one load)")
    ap.add_argument("--before-code", help="with --only big: also build the report with the sharddbg of this folder "
                                          "(e.g. `git archive REV sharddbg | tar -x -C DIR`), CPU and wall, in the same run")
    ap.add_argument("--screenshots", help="with --only big: the zoomed timeline's light and dark screenshots go here")
    ap.add_argument("--append", action="store_true", help="add the results to bench/RESULTS.md")
    args = ap.parse_args()
    lines = [f"machine: {os.cpu_count()} cores (shared), chromium headless without GPU (software WebGL), "
             f"medians of {args.repeats}"]
    if args.only in (None, "timeline"):
        tl = bench_timeline(args.events, args.repeats)
        lines += ["", "| view | drawn | build figure (Python) | standalone HTML | load + first draw in chromium | hover label shown | zoom redraw |",
                  "|---|---|---|---|---|---|---|"]
        for r in tl:
            lines.append(f"| {r['what']} | {r['spans drawn']} | {r['build_s']:.2f} s | {r['html_MB']:.1f} MB | "
                         f"{r['load_draw_s']:.2f} s | {r['hover_s'] * 1000:.0f} ms | {r['zoom_s'] * 1000:.0f} ms |")
    if args.only in (None, "inspector"):
        insp = bench_inspector(args.repeats)
        lines += ["", "| shard inspector, 4 ranks, (1, 3, 66, 64) on dim 2 | median | min |", "|---|---|---|",
                  f"| `cl.inspect(\"x\")` in Python (gather 4 snapshots, check, build the widget) | {insp['python_s'] * 1000:.0f} ms | {insp['python_min_s'] * 1000:.0f} ms |",
                  f"| JupyterLab: run the cell `sharddbg.inspect(\"x\")` until its 4 blocks are on screen | {insp['browser_s'] * 1000:.0f} ms | {insp['browser_min_s'] * 1000:.0f} ms |"]
    if args.only == "big":
        load_before = load_average()
        if args.before_code:
            with tempfile.TemporaryDirectory() as tmp:
                b = build_report_in_a_fresh_process(args.trace, os.path.join(tmp, "before.html"), args.before_code)
                size = os.path.getsize(os.path.join(tmp, "before.html")) / 2**20
            lines += ["", f"report of {os.path.basename(args.trace)} built by the code of {args.before_code}: load "
                          f"{b['load_cpu']:.1f} s CPU ({b['load_wall']:.1f} s), `to_html` {b['build_cpu']:.1f} s CPU "
                          f"({b['build_wall']:.1f} s), {size:.1f} MB"]
        reports = bench_big_report(args.trace, args.repeats, args.report or [tempfile.mktemp(suffix=".html")],
                                   args.screenshots)
        lines += ["", f"load average (1, 5, 15 min): {load_before} before, {load_average()} after",
                  "", "| report | size | load: CPU (wall) | build `to_html`: CPU (wall) | explorer on screen | first screen drawn | "
                      "every figure drawn (scrolled to) | op filter | every call | rows in the DOM | a call's detail | "
                      "scroll to the explorer | list to its end | timeline zoom (a shaded window) | zoom anywhere (spans drawn; "
                      "their drawing) | DOM elements |",
                  "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
        for r in reports:
            built = (f"{r['load_cpu']:.1f} s ({r['load_wall']:.1f} s) | {r['build_cpu']:.1f} s ({r['build_wall']:.1f} s)"
                     if "build_cpu" in r else "(report given) | (report given)")
            lines.append(f"| {os.path.basename(r['report'])} | {r['report_MB']:.1f} MB | {built} | {r['explorer']:.2f} s | "
                         f"{r['first_screen']:.2f} s | {r['all_drawn']:.2f} s | {r['filter'] * 1000:.0f} ms | "
                         f"{r['every_call'] * 1000:.0f} ms | {r['rows_in_dom']:.0f} | {r['detail'] * 1000:.0f} ms | "
                         f"{r['scroll'] * 1000:.0f} ms | {r['list_end'] * 1000:.0f} ms | {r['zoom'] * 1000:.0f} ms | "
                         f"{r['zoom_any'] * 1000:.0f} ms ({r['zoom_any_spans']:.0f}; {r['zoom_any_draw'] * 1000:.0f} ms) | "
                         f"{r['dom']:.0f} |")
        if args.profile:
            from playwright.sync_api import sync_playwright

            with sync_playwright() as p, tempfile.TemporaryDirectory() as tmp:
                browser = p.chromium.launch(executable_path=CHROMIUM, args=ARGS)
                for r in reports:
                    lines += ["", f"main-thread tasks over 30 ms loading {os.path.basename(r['report'])}, until the first screen is drawn:", ""]
                    lines += ["    " + x for x in page_profile(browser, r["report"], os.path.join(tmp, "trace.json"))]
                browser.close()
    if args.only in (None, "static"):
        lines += ["", "| static rendering (Python) | median | min |", "|---|---|---|"]
        lines += [f"| {r['what']} | {r['median_s'] * 1000:.2f} ms | {r['min_s'] * 1000:.2f} ms |"
                  for r in bench_static(args.events, args.repeats)]
    text = "\n".join(lines)
    print(text)
    if args.append:
        with open(ROOT / "bench" / "RESULTS.md", "a") as f:
            f.write(f"\n## Views in the browser (`bench/bench_views.py`, {datetime.date.today().isoformat()})\n\n{text}\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
