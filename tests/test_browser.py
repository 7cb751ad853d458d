"""The notebook front end in a real browser: JupyterLab on loopback, Debian's chromium driven by Playwright,
the quickstart notebook run for real on a 4-rank CPU cluster (with a few cells more for the checks below).

Checks what a user sees, with assertions on the page: the inspector's blocks (one per rank, the right local
shapes; a spec that disagrees drawn as the ranks hold it; both mesh coordinates; no two labels overlapping),
the timeline (a hover anywhere on a span, names inside spans, labelled lanes, the same collective linked
across ranks, room after the last span, colours apart, no cloud button), the explorer (opens on the op summary,
a click expands a row to its calls on each rank with identical ones as one "ranks 0-3"; shapes on one line,
a list that fits its box, a detail that closes when filtered out, a caught error marked as handled, not as a
failure), a narrow output (op names whole, backward rows marked "bwd", path chips whole, the smoke and check
tables' pass/fail column inside the output, the inspector's warnings above its drawing), the magics' output
(status table, stop, diagnose), the dark theme, and the notebook after save: reopened by its owner
(widgets from the saved widget state, no kernel) and by someone else (the static views). Screenshots go
to test-artifacts/ (gitignored).
"""

from __future__ import annotations

import colorsys
import contextlib
import copy
import functools
import json
import os
import re
import secrets
import shutil
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path

import nbformat
import pytest

import sharddbg

ROOT = Path(__file__).resolve().parent.parent
ARTIFACTS = ROOT / "test-artifacts"
CHROMIUM = "/usr/bin/chromium"
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync", "--no-first-run"]
NOTEBOOK = "quickstart_checked.ipynb"
N = 4
ROWS = [66 // N + (1 if r < 66 % N else 0) for r in range(N)]  # 17, 17, 16, 16
OFFS = [sum(ROWS[:r]) for r in range(N)]
VIEW_MIMETYPE = "application/vnd.sharddbg.trace+json"
VIEW_MIMETYPES = {"application/vnd.jupyter.widget-view+json", "text/html", "text/plain", VIEW_MIMETYPE}
# Cells the browser checks need beyond the quickstart, run before its last cell (%shard_cluster stop): a
# tensor on a 2 x 2 (ddp x domain) mesh, a conv through the DTensor fallback (its output's spec says
# Replicate while each rank holds its own rows), and %shard_cluster diagnose.
EXTRA_CELLS = [
    '%%px\n'
    'from torch.distributed.device_mesh import DeviceMesh\n'
    'mesh22 = DeviceMesh("cpu", torch.arange(4).reshape(2, 2), mesh_dim_names=("ddp", "domain"))\n'
    '_i, _j = mesh22.get_coordinate()\n'
    'x22 = ShardTensor.from_local(torch.randn(1, 3, [34, 32][_i], [33, 31][_j]), mesh22, (Shard(2), Shard(3)),\n'
    '    sharding_shapes={0: [(1, 3, r, [33, 31][_j]) for r in (34, 32)], 1: [(1, 3, [34, 32][_i], c) for c in (33, 31)]})\n'
    'with sharddbg.engine.without_patches(F.conv2d):\n'
    '    y_fb = F.conv2d(x, torch.randn(2, 3, 3, 3), padding=1)',
    'sharddbg.inspect("x22")',
    'sharddbg.inspect("y_fb")',
    '%shard_cluster diagnose',
]

pytestmark = [pytest.mark.browser, pytest.mark.cluster]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _settings(directory: Path, save_widget_state: bool) -> None:
    """JupyterLab user settings: render every cell (no windowing), no news or update checks; optionally save
    the widgets' state with the notebook (Settings > Save Widget State Automatically)."""
    files = {
        "@jupyterlab/notebook-extension/tracker.jupyterlab-settings": {"windowingMode": "none"},
        "@jupyterlab/apputils-extension/notification.jupyterlab-settings": {"fetchNews": "false", "checkForUpdates": False},
        "@jupyter-widgets/jupyterlab-manager/plugin.jupyterlab-settings": {"saveState": save_widget_state},
    }
    for rel, content in files.items():
        p = directory / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(json.dumps(content))


def _this_checkouts_extension(work: Path) -> dict[str, str]:
    """The environment that has JupyterLab load this checkout's extension: its build (sharddbg/labextension,
    made by ``bash .ci/setup``) ahead of any copy installed in the venv, and its server extension by the
    config file the wheel installs."""
    built = ROOT / "sharddbg" / "labextension"
    assert (built / "package.json").exists(), \
        f"{built} is missing: the JupyterLab extension is not built (bash .ci/setup builds it)"
    data = work / "jupyter-path"
    (data / "labextensions").mkdir(parents=True, exist_ok=True)
    link = data / "labextensions" / "sharddbg-jupyterlab"
    if not link.exists():
        link.symlink_to(built, target_is_directory=True)
    return {"JUPYTER_PATH": str(data), "JUPYTER_CONFIG_PATH": str(ROOT / "jupyter-config")}


@dataclass
class _LabStarted:
    """A JupyterLab server started and not yet waited for (its start overlaps with other work)."""

    proc: subprocess.Popen
    work: Path
    root: Path
    url: str
    token: str
    log: object

    def ready(self) -> tuple[str, str]:
        """Wait until it answers (60 s from now at most); (url, token)."""
        deadline = time.monotonic() + 60
        while True:
            try:
                urllib.request.urlopen(f"{self.url}/api/status?token={self.token}", timeout=2).read()
                return self.url, self.token
            except OSError:
                if self.proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(
                        f"JupyterLab did not start; log:\n{(self.work / 'lab.log').read_text()[-3000:]}")
                time.sleep(0.3)

    def stop(self) -> None:
        """Stopped (nothing to do when it was already)."""
        if self.log.closed:
            return
        self.proc.terminate()
        try:
            self.proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.log.close()


def _start_jupyterlab(work: Path, root: Path, save_widget_state: bool) -> _LabStarted:
    """A JupyterLab server on 127.0.0.1 serving ``root``, with its own settings and data folders under
    ``work`` (its own notebook-signing key: a notebook saved by another server is not trusted here), started."""
    _settings(work / "settings", save_widget_state)
    token, port = secrets.token_hex(16), _free_port()
    env = dict(os.environ, OMP_NUM_THREADS="1", JUPYTERLAB_SETTINGS_DIR=str(work / "settings"),
               JUPYTERLAB_WORKSPACES_DIR=str(work / "workspaces"), JUPYTER_CONFIG_DIR=str(work / "config"),
               JUPYTER_RUNTIME_DIR=str(work / "runtime"), JUPYTER_DATA_DIR=str(work / "data"),
               **_this_checkouts_extension(work))
    log = open(work / "lab.log", "w")
    proc = subprocess.Popen(
        [sys.executable, "-m", "jupyterlab", "--allow-root", "--no-browser", "--ip=127.0.0.1", f"--port={port}",
         f"--ServerApp.token={token}", f"--ServerApp.root_dir={root}", "--ServerApp.open_browser=False",
         "--LabApp.news_url=", "--ServerApp.disable_check_xsrf=False"],
        cwd=root, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    return _LabStarted(proc, work, root, f"http://127.0.0.1:{port}", token, log)


@contextlib.contextmanager
def _ready(lab: _LabStarted):
    """``lab`` waited for; yields (url, token); stopped at the end."""
    try:
        yield lab.ready()
    finally:
        lab.stop()


@contextlib.contextmanager
def _jupyterlab(work: Path, root: Path, save_widget_state: bool):
    """A JupyterLab server (``_start_jupyterlab``) waited for; yields (url, token); stopped at the end."""
    with _ready(_start_jupyterlab(work, root, save_widget_state)) as url_and_token:
        yield url_and_token


def _started_early(request, tmp_path_factory) -> _LabStarted | None:
    """The JupyterLab of "someone else" that test_saved_notebook opens the saved notebook in (default settings: no
    widget state), started with the module when that test runs, so that its start overlaps with the owner's
    JupyterLab and notebook; its root is empty until the test writes the files it serves."""
    if not any(item.path == request.node.path and item.originalname == "test_saved_notebook"
               for item in request.session.items):
        return None
    return _start_jupyterlab(*_other_folders(tmp_path_factory.mktemp("other")), save_widget_state=False)


def _other_folders(work: Path) -> tuple[Path, Path]:
    """The other JupyterLab's own folder under ``work`` and the root it serves (made empty)."""
    other = work / "other"
    (other / "root").mkdir(parents=True)
    return other, other / "root"


_OTHER_LAB: dict[str, _LabStarted] = {}  # "lab" -> the other JupyterLab started with the module


def _notebook(root: Path) -> None:
    """The quickstart with EXTRA_CELLS before its last cell (%shard_cluster stop)."""
    nb = nbformat.read(ROOT / "notebooks" / "01_quickstart.ipynb", as_version=4)
    assert nb.cells[-1].source.strip() == "%shard_cluster stop"
    for k, src in enumerate(EXTRA_CELLS):
        cell = nbformat.v4.new_code_cell(src)
        cell.id = f"browser-check-{k}"
        nb.cells.insert(len(nb.cells) - 1, cell)
    nbformat.write(nb, root / NOTEBOOK)


def _api(url: str, token: str, path: str, method: str = "GET"):
    req = urllib.request.Request(f"{url}{path}?token={token}", method=method)
    body = urllib.request.urlopen(req, timeout=10).read()
    return json.loads(body) if body else None


def _wait_kernel_idle(url: str, token: str, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    state = None
    while time.monotonic() < deadline:
        states = [s["kernel"]["execution_state"] for s in _api(url, token, "/api/sessions") if s.get("kernel")]
        state = states
        if states == ["idle"]:
            return
        time.sleep(0.3)
    raise AssertionError(f"the notebook's kernel did not become idle within {timeout} s: {state}")


def _hue(rgb: str) -> float:
    r, g, b = (int(v) / 255 for v in re.findall(r"\d+", rgb)[:3])
    return colorsys.rgb_to_hls(r, g, b)[0] * 360


def _overlaps(boxes: list[dict]) -> list[tuple[str, str]]:
    """Pairs of label boxes ({text, x, y, w, h}) that intersect."""
    out = []
    for i, a in enumerate(boxes):
        for b in boxes[i + 1:]:
            if a["x"] < b["x"] + b["w"] and b["x"] < a["x"] + a["w"] and a["y"] < b["y"] + b["h"] and b["y"] < a["y"] + a["h"]:
                out.append((a["text"], b["text"]))
    return out


LABEL_BOXES = """(svg) => [...svg.querySelectorAll('text')].map((t) => { const r = t.getBoundingClientRect();
    return { text: t.textContent, x: r.x, y: r.y, w: r.width, h: r.height }; }).filter((b) => b.w > 0)"""


@pytest.fixture(scope="module")
def chromium():
    """Debian's chromium driven by Playwright, one for the module (Playwright's sync API runs once in a process):
    the notebook session's pages and the standalone reports' open in it."""
    assert os.path.exists(CHROMIUM), f"{CHROMIUM} is missing: install Debian's chromium (bash .ci/setup does)"
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        try:
            yield browser
        finally:
            browser.close()


@pytest.fixture(scope="module")
def session(request, tmp_path_factory, chromium):
    """JupyterLab and chromium with the notebook run top to bottom; yields (page, url, token, root, work)."""
    from playwright.sync_api import expect

    ARTIFACTS.mkdir(exist_ok=True)
    work = tmp_path_factory.mktemp("lab")
    root = work / "root"
    root.mkdir()
    _notebook(root)
    owner = _start_jupyterlab(work / "owner", root, save_widget_state=True)
    other = _started_early(request, tmp_path_factory)
    if other is not None:
        _OTHER_LAB["lab"] = other
    with contextlib.ExitStack() as stack:
        for lab in (owner, other):
            if lab is not None:
                stack.callback(lab.stop)
        url, token = owner.ready()
        page = chromium.new_page(viewport={"width": 1500, "height": 1100})
        errors: list[str] = []
        page.on("pageerror", lambda e: errors.append(str(e)))
        try:
            page.goto(f"{url}/lab/tree/{NOTEBOOK}?token={token}", wait_until="domcontentloaded")
            # the kernel must really be connected and idle before we run anything: the server says so,
            # and so does the page's status bar
            expect(page.locator(".jp-Notebook")).to_be_visible(timeout=60_000)
            _wait_kernel_idle(url, token)
            expect(page.locator(".jp-StatusBar-Widget", has_text="Python 3 (ipykernel) | Idle")).to_have_count(
                1, timeout=60_000)
            first_prompt = page.locator(".jp-CodeCell .jp-InputPrompt").first
            for attempt in range(3):
                page.locator(".jp-Notebook").click()
                page.locator(".lm-MenuBar-itemLabel").get_by_text("Run", exact=True).click()
                page.locator(".lm-Menu-itemLabel").get_by_text("Run All Cells", exact=True).click()
                try:  # started: the first cell shows [*] or its execution count
                    expect(first_prompt).to_contain_text(re.compile(r"\[(\*|\d+)\]"), timeout=20_000)
                    break
                except AssertionError:
                    if attempt == 2:
                        raise
            # done when the last cell (%shard_cluster stop) has printed its line
            try:
                expect(page.locator(".jp-OutputArea-output", has_text="sharddbg: stopped 4 ranks")).to_have_count(
                    1, timeout=180_000)
            except AssertionError as exc:  # say which cell failed, with its error
                failed = page.locator(".jp-OutputArea-output[data-mime-type='application/vnd.jupyter.stderr']")
                raise AssertionError(f"the notebook did not run to its end; error outputs: "
                                     f"{[t[-1500:] for t in failed.all_inner_texts()]}") from exc
            expect(page.locator(".jp-Notebook-ExecutionIndicator[data-status='idle']")).to_have_count(1, timeout=30_000)
            yield page, url, token, root, work
            assert not errors, errors
        except Exception:
            page.screenshot(path=str(ARTIFACTS / "browser_failure.png"))
            raise
        finally:
            page.close()


def _cell(page, line: str):
    """The code cell that has ``line`` as one of its lines."""
    cells = page.locator(".jp-CodeCell")
    for k in range(cells.count()):
        text = cells.nth(k).locator(".jp-InputArea .cm-content").inner_text()
        if line in [t.strip() for t in text.splitlines()]:
            return cells.nth(k)
    raise AssertionError(f"no cell has the line {line!r}")


def _inspector(page, name: str):
    return page.locator(".sd-inspector", has=page.locator(f"code.sd-name:text-is('{name}')"))


def test_inspector(session):
    from playwright.sync_api import expect

    page = session[0]
    insp = _inspector(page, "x")
    expect(insp).to_have_count(1)
    blocks = insp.locator(".sd-block")
    expect(blocks).to_have_count(N)
    for r in range(N):
        b = insp.locator(f".sd-block[data-ranks='{r}']")
        expect(b).to_have_attribute("data-local-shape", f"1,3,{ROWS[r]},64")
        expect(b).to_have_attribute("data-rows", f"{OFFS[r]}-{OFFS[r] + ROWS[r]}")
        expect(b).to_contain_text(f"rank {r}")
        expect(insp.locator(f"tr[data-rank='{r}'] td.sd-col-local_shape")).to_have_text(f"(1, 3, {ROWS[r]}, 64)")
    # uneven shards are marked, and drawn smaller
    expect(insp.locator(".sd-block.sd-uneven")).to_have_count(2)
    h = [insp.locator(f".sd-block[data-ranks='{r}'] rect").first.bounding_box()["height"] for r in range(N)]
    assert h[0] == pytest.approx(h[1], abs=0.5) and h[2] == pytest.approx(h[3], abs=0.5) and h[0] > h[2] + 2
    insp.scroll_into_view_if_needed()
    insp.screenshot(path=str(ARTIFACTS / "browser_inspector.png"))
    # another pair of dims: channels x H; W is not sharded, so still one block per rank
    insp.locator("select.sd-dims").select_option(label="rows: dim 1 (3) × cols: dim 2 (66)")
    for r in range(N):
        expect(insp.locator(f".sd-block[data-ranks='{r}']")).to_have_attribute("data-cols", f"{OFFS[r]}-{OFFS[r] + ROWS[r]}")
    # dims 0 x 1: every slice of dim 2 would show the same single block: one diagram, no facets
    insp.locator("select.sd-dims").select_option(label="rows: dim 0 (1) × cols: dim 1 (3)")
    expect(insp.locator(".sd-facet")).to_have_count(1)
    expect(insp.locator(".sd-block")).to_have_count(1)
    expect(insp.locator(".sd-block")).to_have_attribute("data-ranks", "0,1,2,3")

    # a spec that disagrees with the local tensors (Replicate, while each rank holds its own rows): drawn as
    # the ranks hold them, one after the other, each outlined as a mismatch
    fb = _inspector(page, "y_fb")
    expect(fb.locator(".sd-block")).to_have_count(N)
    for r in range(N):
        b = fb.locator(f".sd-block[data-ranks='{r}']")
        expect(b).to_have_attribute("data-rows", f"{OFFS[r]}-{OFFS[r] + ROWS[r]}")
        expect(b).to_have_class(re.compile(r"\bsd-bad\b"))
        expect(b.locator("rect").first).to_have_attribute("stroke", "#d32f2f")
    fb.scroll_into_view_if_needed()
    fb.screenshot(path=str(ARTIFACTS / "browser_inspector_spec_disagrees.png"))

    # a ddp x domain mesh: the header names it, each rank shows both coordinates (blocks and table)
    m = _inspector(page, "x22")
    expect(m.locator(".sd-title")).to_contain_text("mesh ddp=2 × domain=2")
    for r in range(N):
        i, j = divmod(r, 2)
        expect(m.locator(f".sd-block[data-ranks='{r}']")).to_contain_text(f"ddp={i}, domain={j}")
        expect(m.locator(f"tr[data-rank='{r}'] td.sd-col-coordinate")).to_have_text(f"ddp={i}, domain={j}")
    m.scroll_into_view_if_needed()
    m.screenshot(path=str(ARTIFACTS / "browser_inspector_mesh22.png"))

    # no two labels overlap, in any diagram of any inspector, for every pair of dims
    for view in (insp, fb, m):
        sel = view.locator("select.sd-dims")
        for label in sel.locator("option").all_inner_texts():
            sel.select_option(label=label)
            for svg in view.locator("svg.sd-diagram").all():
                boxes = svg.evaluate(LABEL_BOXES)
                assert boxes and not _overlaps(boxes), (label, _overlaps(boxes))
    insp.locator("select.sd-dims").select_option(label="rows: dim 2 (66) × cols: dim 3 (64)")


def _plot_geometry(plot):
    """Per bar trace of the timeline: its name, colour as drawn, and each span's pixel box in the page."""
    return plot.evaluate("""(d) => {
        const L = d._fullLayout, r = d.getBoundingClientRect(), out = [];
        const bars = [...d.querySelectorAll('.barlayer .trace')];
        let k = 0;
        for (const t of d._fullData) {
          if (t.type !== 'bar') continue;
          const g = bars[k++];
          const path = g && g.querySelector('path');
          const spans = Array.from(t.base).map((b, i) => ({
            x0: r.left + L.xaxis._offset + L.xaxis.l2p(b), x1: r.left + L.xaxis._offset + L.xaxis.l2p(b + t.x[i]),
            y: r.top + L.yaxis._offset + L.yaxis.l2p(t.y[i]), hover: t.hovertext[i] }));
          out.push({ name: t.name, fill: path ? getComputedStyle(path).fill : null, spans: spans });
        }
        return { traces: out, right: r.left + L.xaxis._offset + L.xaxis._length };
    }""")


def test_timeline(session):
    from playwright.sync_api import expect

    page = session[0]
    plot = page.locator(".js-plotly-plot")
    expect(plot).to_have_count(1)
    plot.scroll_into_view_if_needed()
    # every lane labelled: the rank at its op lane, the autograd and collectives lanes by name
    ticks = plot.locator(".ytick text").all_text_contents()
    assert [t for t in ticks if t.startswith("rank")] == [f"rank {r}" for r in range(N)]
    assert ticks.count("collectives") == N and ticks.count("autograd") == N
    plot.screenshot(path=str(ARTIFACTS / "browser_timeline.png"))
    geo = _plot_geometry(plot)
    spans = [(t, s) for t in geo["traces"] for s in t["spans"]]
    # hover anywhere on a span: 6 px inside either end of rank 2's widest forward op, far from its middle
    fwd = [s for t, s in spans if "rank 2 " in s["hover"] and "<br>forward ·" in s["hover"] and "backward" not in s["hover"]]
    span = max(fwd, key=lambda s: s["x1"] - s["x0"])
    assert span["x1"] - span["x0"] > 60, span
    op = re.match(r"<b>(.*?)</b>", span["hover"]).group(1)
    hover = plot.locator(".hoverlayer .hovertext")
    for x in (span["x0"] + 6, span["x1"] - 6):
        page.mouse.move(5, 5)
        page.mouse.move(x, span["y"] + 3)
        expect(hover).to_contain_text(f"{op} · rank 2 ")
        expect(hover).to_contain_text(f", {ROWS[2]}, 64)")
        expect(hover).to_contain_text("bytes in")
    page.mouse.move(5, 5)
    # op names inside the spans wide enough to hold them, and only there
    labels = plot.evaluate("""(d) => [...d.querySelectorAll('.barlayer .point')].map((g) => {
        const t = g.querySelector('text'), p = g.querySelector('path');
        if (!t || !p || !t.textContent) return null;
        const a = t.getBoundingClientRect(), b = p.getBoundingClientRect(), st = getComputedStyle(t);
        if (a.width === 0 || st.display === 'none' || st.visibility === 'hidden' || Number(st.opacity) === 0) return null;  // hidden: too wide
        return { text: t.textContent, inside: a.left >= b.left - 1 && a.right <= b.right + 1 && a.top >= b.top - 1 && a.bottom <= b.bottom + 1 };
      }).filter((x) => x)""")
    assert any(x["text"] == "conv2d" for x in labels) and any(x["text"] == "backward" for x in labels)
    assert all(x["inside"] for x in labels), [x for x in labels if not x["inside"]]
    # the whole backward pass in its own lane, above the ops it contains (they stay visible)
    backward = [s for t, s in spans if s["hover"].startswith("<b>ShardTensor.backward</b>")]
    bwd_ops = [s for t, s in spans if "backward ·" in s["hover"] and "torch.conv2d" in s["hover"]]
    rank_of = lambda s: int(re.search(r" · rank (\d+) ", s["hover"]).group(1))  # noqa: E731
    assert backward and bwd_ops and all(b["y"] < o["y"] - 8 for b in backward for o in bwd_ops if rank_of(b) == rank_of(o))
    assert {rank_of(b) for b in backward} == {rank_of(o) for o in bwd_ops} == set(range(N))
    # the same collective joined across ranks
    expect(plot.locator(".legendtext", has_text="same collective on every rank")).to_have_count(1)
    assert plot.evaluate("(d) => d._fullData.filter((t) => t.name === 'same collective on every rank')[0].x.filter((v) => v !== null).length") == 8 * N
    # room after the last span
    assert max(s["x1"] for _, s in spans) < geo["right"] - 5
    # DTensor fallbacks and all_to_all in colours apart (hue)
    fills = {t["name"]: t["fill"] for t in geo["traces"]}
    a2a = _hue(fills["all_to_all_single"])
    for name in ("dtensor fallback function",):
        d = abs(_hue(fills[name]) - a2a)
        assert min(d, 360 - d) >= 60, fills
    # no modebar button that sends the chart to a cloud service
    titles = plot.locator(".modebar-btn").evaluate_all("bs => bs.map(b => b.getAttribute('data-title') || '')")
    assert titles and not [t for t in titles if re.search(r"cloud|chart studio|share chart", t, re.I)], titles


FITS_ITS_BOX = """(l) => { const r = l.getBoundingClientRect();
    return { scroll: l.scrollWidth, client: l.clientWidth,
             beyond: [...l.querySelectorAll('td')].filter((td) => td.getBoundingClientRect().right > r.right + 1).length }; }"""


def test_explorer(session):
    from playwright.sync_api import expect

    page = session[0]
    exp = page.locator(".sd-explorer")
    expect(exp).to_have_count(1)
    listing = exp.locator(".sd-list")
    # what is wrong with the recording comes under the title, as the trace's findings list it, by what each
    # means: first the exception of x + x (an error the cell caught: information, no failure), then, as
    # performance, the stale entry the cell's backward() left in DTensor's redistribution plan cache on every
    # rank; each one line (its category, its first clause) that opens on a click to the rest and the fix
    findings = exp.locator(".sd-findings .sd-finding")
    expect(findings.first).to_have_class(re.compile(r"\bsd-finding-info\b.*\bsd-category-error\b"))
    expect(findings.first.locator(".sd-finding-category")).to_have_text("error")
    expect(exp.locator(".sd-findings .sd-finding-fail")).to_have_count(0)
    handled = exp.locator(".sd-findings .sd-finding-info", has_text="raised and the cell handled them")
    expect(handled).to_have_count(1)
    expect(handled.locator("summary")).to_contain_text("broken_add: expected <ShardTensor> & got <b>None</b>")
    plan = exp.locator(".sd-findings details.sd-finding-warn", has_text="ShardTensor.redistribute (in ShardTensor.backward)")
    expect(plan).to_have_count(1)
    expect(plan.locator(".sd-finding-category")).to_have_text("performance")
    expect(plan.locator("summary")).to_contain_text("Ranks 0-3: ShardTensor.redistribute (in ShardTensor.backward), "
                                                    "Partial(sum) -> Replicate()")
    details = plan.locator(".sd-finding-details")
    expect(details).to_be_hidden()  # closed: the fix is one click away
    plan.locator("summary").click()
    expect(details).to_be_visible()
    expect(details).to_contain_text("changed its target spec's _sharding_shapes")
    expect(details).to_contain_text("torch.distributed.tensor._redistribute")  # the fix: how to clear the cache
    exp.locator(".sd-findings").screenshot(path=str(ARTIFACTS / "browser_explorer_findings.png"))
    plan.locator("summary").click()  # closed again: the views below are as the test found them
    # it opens on the op summary: one row per op / path / phase, errors first (none: the one exception was
    # caught), then the fallbacks; no call yet
    expect(exp.locator("select.sd-f-view")).to_have_value("summary")
    summary = listing.locator("tr.sd-summary-row")
    n_rows = int(re.search(r"op summary \((\d+) rows\)", exp.locator("select.sd-f-view option").first.inner_text()).group(1))
    expect(summary).to_have_count(n_rows)
    kinds = summary.evaluate_all("rs => rs.map(r => r.dataset.kind)")
    assert kinds[0] == "fallback" and kinds == sorted(kinds, key=["error", "fallback", "op"].index) and "error" not in kinds, kinds
    expect(listing.locator("tr.sd-op")).to_have_count(0)
    # the caught exception's row is no error row: no error mark, no red tint
    add_row = listing.locator("tr.sd-summary-row[data-op='Tensor.add']")
    expect(add_row).to_have_attribute("data-kind", "op")
    expect(exp.locator(".sd-chip-error")).to_have_count(0)
    # a click expands a row to its calls on each rank; identical ones (backward(): the same call on every rank
    # but for its time) as one row "ranks 0-3" with the range of their times
    bwd = listing.locator("tr.sd-summary-row[data-op='ShardTensor.backward']")
    bwd.click()
    groups = listing.locator("tr.sd-call-group")
    expect(groups).to_have_count(1)
    expect(groups.first.locator("td.sd-col-ranks_text")).to_have_text("ranks 0-3")
    expect(groups.first).to_have_attribute("data-ranks", "0,1,2,3")
    expect(groups.first.locator("td.sd-col-calls")).to_have_text("4")
    expect(groups.first.locator("td.sd-col-host_ms")).to_have_text(re.compile(r"^\d+\.\d{3}–\d+\.\d{3}$"))
    # the convs: 17 rows on ranks 0-1, 16 on ranks 2-3 -> two rows per conv, each with its own local shapes
    conv = listing.locator("tr.sd-summary-row[data-op='torch.conv2d'][data-phase='forward']")
    conv.click()
    conv_groups = listing.locator(f"tr.sd-expansion[data-index='{conv.get_attribute('data-index')}'] tr.sd-call-group")
    expect(conv_groups).to_have_count(4)
    assert conv_groups.locator("td.sd-col-ranks_text").all_inner_texts() == ["ranks 0-1", "ranks 2-3"] * 2
    assert [t.split("), ")[0] + ")" for t in conv_groups.locator("td.sd-col-in_local_shapes").all_inner_texts()] == \
        [f"(1, {c}, {ROWS[r]}, 64)" for c in (3, 4) for r in (0, 2)]
    fit = listing.evaluate(FITS_ITS_BOX)  # the summary, expanded, fits its box too
    assert fit["scroll"] <= fit["client"] and fit["beyond"] == 0, fit
    exp.screenshot(path=str(ARTIFACTS / "browser_explorer_summary.png"))
    bwd.click()  # a second click collapses it
    expect(groups).to_have_count(4)
    # a collapsed row's click opens the detail of its call: the same call on every rank, each shape on one line
    fb_row = listing.locator("tr.sd-summary-row[data-op='Tensor.abs'][data-phase='forward']")
    expect(fb_row).to_have_attribute("data-kind", "fallback")
    fb_row.click()
    fb = listing.locator("tr.sd-call-group[data-op='Tensor.abs'][data-ranks='0,1']")
    fb.click()
    detail = exp.locator(".sd-detail")
    expect(detail).to_be_visible()
    expect(fb).to_have_class(re.compile(r"\bsd-selected\b"))
    expect(detail.locator(".sd-detail-op")).to_have_text("Tensor.abs")
    expect(detail).to_contain_text("ran through the DTensor fallback")
    rows = detail.locator("table.sd-per-rank tbody tr")
    expect(rows).to_have_count(N)
    for r in range(N):
        expect(rows.nth(r).locator("td.sd-col-in_local_shapes")).to_have_text(f"(1, 2, {ROWS[r]}, 64)")
    lines = detail.locator(".sd-shape").evaluate_all("""ss => ss.map(s => { const r = document.createRange();
        r.selectNodeContents(s); return r.getClientRects().length; })""")
    assert lines and set(lines) == {1}, lines
    exp.screenshot(path=str(ARTIFACTS / "browser_explorer_fallback.png"))
    # filters act on the summary too: rank 2 keeps the rows and groups with calls there; the open detail's
    # row (ranks 0-1) is filtered out: it closes
    exp.locator("select.sd-f-rank").select_option("2")
    expect(detail).to_be_hidden()
    assert set(listing.locator("tr.sd-call-group").evaluate_all("rs => rs.map(r => r.dataset.ranks)")) == {"2,3"}
    exp.locator("select.sd-f-path").select_option("@fallback")
    assert set(summary.evaluate_all("rs => rs.map(r => r.dataset.kind)")) == {"fallback"}

    # the list of every call, with the same filters
    exp.locator("select.sd-f-view").select_option("calls")
    listed = listing.locator("tr.sd-op")
    assert listed.count() > 0
    assert set(listed.evaluate_all("rs => rs.map(r => r.dataset.rank + ':' + r.dataset.kind)")) == {"2:fallback"}
    exp.locator("select.sd-f-rank").select_option("")
    exp.locator("select.sd-f-path").select_option("")
    # the list fits its box: no horizontal scrolling, no cell beyond its right edge; a cut cell keeps its text
    fit = listing.evaluate(FITS_ITS_BOX)
    assert fit["scroll"] <= fit["client"] and fit["beyond"] == 0, fit
    sources = listing.locator("td.sd-col-user_frame").evaluate_all("tds => tds.map(td => td.title)")
    # where each call was made: the notebook's own cell and line, never a kernel's temporary file
    assert sources and all(re.match(r"cell \[\d+\], line \d+", s) for s in sources if s), sources[:3]
    assert not [s for s in sources if "ipykernel_" in s], sources[:3]
    # a call whose exception the cell caught is marked as handled; its message, which contains HTML, is shown as
    # text, not rendered
    err_call = listing.locator("tr.sd-op[data-op='Tensor.add']").first
    expect(err_call.locator(".sd-chip-handled")).to_have_text("raised, handled")
    err_call.click()
    msg = detail.locator(".sd-error-msg")
    expect(msg).to_have_text("TypeError: broken_add: expected <ShardTensor> & got <b>None</b>")
    expect(detail.locator("b")).to_have_count(0)
    expect(detail.locator("pre.sd-tb")).to_contain_text("broken_add")
    expect(detail).not_to_contain_text("ipykernel_")  # the source line names the notebook's cell
    expect(detail.locator(".sd-chip-error")).to_have_count(0)
    expect(detail.locator(".sd-chip-handled")).to_have_count(1)
    exp.screenshot(path=str(ARTIFACTS / "browser_explorer_error.png"))
    # the list's keys in the notebook: ↓ opens the next call's detail, ↑ the one before, and JupyterLab does not
    # take them (the active cell stays where it was)
    call = "d => d.dataset.rank + ':' + d.dataset.seq"
    active = "() => [...document.querySelectorAll('.jp-Notebook .jp-Cell')].findIndex((c) => c.classList.contains('jp-mod-active'))"
    opened_call, active_cell = detail.evaluate(call), page.evaluate(active)
    page.keyboard.press("ArrowDown")
    page.wait_for_function(f"([d, was]) => ({call})(d) !== was", arg=[detail.element_handle(), opened_call], timeout=10_000)
    page.keyboard.press("ArrowUp")
    page.wait_for_function(f"([d, was]) => ({call})(d) === was", arg=[detail.element_handle(), opened_call], timeout=10_000)
    assert page.evaluate(active) == active_cell
    # back to the summary: the row of the open detail opens with it, its group marked
    exp.locator("select.sd-f-view").select_option("summary")
    expect(detail).to_be_visible()
    expect(listing.locator("tr.sd-call-group.sd-selected")).to_have_count(1)
    expect(listing.locator("tr.sd-call-group.sd-selected")).to_have_attribute("data-op", "Tensor.add")

    # opened on a call, as a diff's answer opens it on the first op that departs: without a click, that call's
    # summary row is expanded, its row selected and in view, its detail open; the cell is taken away afterwards
    _run_new_cell(page, "_c = t.get_ops().query(\"op == 'torch.conv2d' and rank == 2 and phase == 'forward'\")"
                        ".iloc[1]; t.show(selected=[2, int(_c.seq)], rank=2)")
    opened = page.locator(".sd-explorer").nth(1)
    expect(opened.locator(".sd-detail .sd-detail-op")).to_have_text("torch.conv2d", timeout=30_000)
    # a part of the trace (rank 2): the page says what the list holds and how to see the rest
    expect(opened.locator(".sd-left-out")).to_contain_text("op calls on rank 2 (with the same calls on the other ranks)")
    expect(opened.locator(".sd-left-out")).to_contain_text("t.show() for the whole trace")
    chosen = opened.locator(".sd-list tr.sd-selected")
    expect(chosen).to_have_count(1)
    expect(chosen).to_have_attribute("data-rank", "2")
    expect(chosen).to_have_attribute("data-op", "torch.conv2d")
    opened.scroll_into_view_if_needed()  # the new cell's output may lie below the notebook's fold
    expect(chosen).to_be_in_viewport()  # and within it, the list scrolled to the row
    # the convs' row, expanded, filtered to rank 2 (t.show(rank=2)): the groups of calls that ran on rank 2
    expect(opened.locator("select.sd-f-rank")).to_have_value("2")
    expect(opened.locator(".sd-list tr.sd-expansion tr.sd-call-group")).to_have_count(2)
    assert all("2" in g.split(",") for g in opened.locator(".sd-list tr.sd-expansion tr.sd-call-group").evaluate_all(
        "rs => rs.map(r => r.dataset.ranks)"))
    opened.screenshot(path=str(ARTIFACTS / "browser_explorer_rank_part.png"))
    page.locator(".jp-Notebook .jp-Cell", has_text="t.show(selected=").locator(".jp-InputPrompt").click()
    page.keyboard.press("Escape")
    page.keyboard.press("d")
    page.keyboard.press("d")
    expect(page.locator(".sd-explorer")).to_have_count(1)


NARROW = {"width": 900, "height": 1100}  # a JupyterLab window with its file browser open leaves outputs as narrow
WIDE = {"width": 1500, "height": 1100}


def _wait_for_layout_within(page, viewport: dict) -> None:
    """Until the notebook is laid out within ``viewport``'s width (JupyterLab's panels follow a resize a moment
    later, from their own event loop): a wait on that, instead of a fixed sleep that a loaded host can outlast."""
    page.wait_for_function("w => { const nb = document.querySelector('.jp-Notebook');"
                           " return nb !== null && nb.getBoundingClientRect().right <= w; }",
                           arg=viewport["width"], timeout=20_000)


def _wait_for_dark_colours(page) -> None:
    """Until the page's background colour (``var(--jp-layout-color0)``) is dark, 20 s at most (the checks after it
    say what it is when it never gets there): the dark theme's stylesheet applied, instead of a fixed sleep."""
    from playwright.sync_api import TimeoutError as PlaywrightTimeoutError

    with contextlib.suppress(PlaywrightTimeoutError):
        page.wait_for_function("""() => { const e = document.createElement('div');
            e.style.backgroundColor = 'var(--jp-layout-color0)'; document.body.append(e);
            const v = getComputedStyle(e).backgroundColor; e.remove();
            return (v.match(/\\d+/g) || []).slice(0, 3).reduce((sum, x) => sum + Number(x), 0) < 150; }""",
                               timeout=20_000)


# elements whose text is cut: wider than their box (an ellipsis, or clipped)
CUT = """(els) => els.filter((e) => e.scrollWidth > e.clientWidth + 1).map((e) => e.textContent)"""


def _show_html(page, html: str, cls: str):
    """``html`` shown in a notebook output (the diagnose cell's; ``_hide_html`` takes it away again), as a
    static view is: its box is the output area's."""
    out = _cell(page, "%shard_cluster diagnose").locator(".jp-OutputArea-output").first
    out.evaluate("(o, [html, cls]) => { o.querySelectorAll('.' + cls).forEach((e) => e.remove());"
                 " const d = document.createElement('div'); d.className = cls; d.innerHTML = html; o.append(d); }", [html, cls])
    return out, out.locator("." + cls)


def _hide_html(page) -> None:
    page.evaluate("() => document.querySelectorAll('.sd-test-smoke, .sd-test-check').forEach((e) => e.remove())")


def _inside(inner: dict, outer: dict) -> bool:
    return inner["x"] >= outer["x"] - 1 and inner["x"] + inner["width"] <= outer["x"] + outer["width"] + 1


def test_narrow_output(session):
    """In a narrow output (900 px window): explorer op names whole (wrapped, never cut), backward rows marked
    "bwd", path chips never narrower than their text; the smoke and check tables' verdict column inside the
    output; the inspector's verdict (its warnings) above its drawing."""
    from playwright.sync_api import expect

    from sharddbg.views.check import check_html
    from sharddbg.views.smoke import smoke_html

    page = session[0]
    page.set_viewport_size(NARROW)
    try:
        _wait_for_layout_within(page, NARROW)
        exp = page.locator(".sd-explorer")
        exp.locator("select.sd-f-view").select_option("summary")
        listing = exp.locator(".sd-list")
        ops = listing.locator("tr.sd-summary-row td.sd-col-op")
        assert ops.count() > 0
        assert not ops.evaluate_all(CUT), ops.evaluate_all(CUT)
        # forward and backward rows of the same op read apart
        bwd = listing.locator("tr.sd-summary-row[data-op='torch.conv2d'][data-phase='backward'] td.sd-col-op")
        fwd = listing.locator("tr.sd-summary-row[data-op='torch.conv2d'][data-phase='forward'] td.sd-col-op")
        expect(bwd.locator(".sd-chip-phase")).to_have_text("bwd")
        expect(fwd.locator(".sd-chip-phase")).to_have_count(0)
        # path chips whole, inside their cells
        chips = listing.locator("tr.sd-summary-row .sd-path")
        assert not chips.evaluate_all(CUT), chips.evaluate_all(CUT)
        outside = chips.evaluate_all("""cs => cs.map((c) => { const a = c.getBoundingClientRect(),
            b = c.closest('td').getBoundingClientRect(); return { text: c.textContent, chip: [a.left, a.right],
            cell: [b.left, b.right], font: getComputedStyle(c).font }; }).filter((x) => x.chip[1] > x.cell[1] + 1)""")
        assert not outside, outside
        exp.scroll_into_view_if_needed()
        exp.screenshot(path=str(ARTIFACTS / "browser_narrow_explorer.png"))
        # the list of every call: its op names whole too
        exp.locator("select.sd-f-view").select_option("calls")
        ops = listing.locator("tr.sd-op td.sd-col-op")
        assert ops.count() > 0 and not ops.evaluate_all(CUT), ops.evaluate_all(CUT)[:5]
        exp.locator("select.sd-f-view").select_option("summary")

        # the smoke matrix and the numerical check: the column that says pass/fail within the output
        smoke_result, check_result = _long_smoke_and_check()
        for cls, html, verdict_cells in (("sd-test-smoke", smoke_html(smoke_result), "td.sd-smoke-verdict"),
                                         ("sd-test-check", check_html(check_result), "tbody tr td:first-child")):
            out, shown = _show_html(page, html, cls)
            box = out.bounding_box()
            cells = shown.locator(verdict_cells)
            assert cells.count() > 0
            for k in range(cells.count()):
                assert _inside(cells.nth(k).bounding_box(), box), (cls, cells.nth(k).bounding_box(), box)
            assert _inside(shown.locator(".sd-scroll").bounding_box(), box), cls
            shown.scroll_into_view_if_needed()
            shown.screenshot(path=str(ARTIFACTS / f"browser_narrow_{cls.split('-')[-1]}.png"))

        # the inspector: its verdict first (the warnings), then the drawing
        fb = _inspector(page, "y_fb")
        warning = fb.locator(".sd-warning").first
        expect(warning).to_contain_text("tensor dim 2 is not sharded")
        assert warning.bounding_box()["y"] + warning.bounding_box()["height"] <= fb.locator("svg.sd-diagram").first.bounding_box()["y"]
        # beside that real problem, the uneven shards are no label on the blocks
        assert not [t for t in fb.locator("svg.sd-diagram text").all_text_contents() if "uneven" in t]
        ok = _inspector(page, "x")
        expect(ok.locator(".sd-verdict-ok")).to_have_text("✓ spec and data agree")
        fb.scroll_into_view_if_needed()
        fb.screenshot(path=str(ARTIFACTS / "browser_narrow_inspector.png"))
    finally:
        _hide_html(page)
        page.set_viewport_size(WIDE)


def test_magics_output(session):
    page = session[0]
    # %shard_cluster status: at most 8 columns besides the rank, no cell wrapped over two lines
    table = _cell(page, "%shard_cluster status").locator(".jp-OutputArea-output table")
    header = table.locator("thead tr").first.locator("th")
    assert 2 <= header.count() <= 9, header.all_inner_texts()
    wrapped = table.evaluate("""(t) => [...t.querySelectorAll('td, th')].filter((c) => {
        const r = document.createRange(); r.selectNodeContents(c); return r.getClientRects().length > 1; }).map((c) => c.textContent)""")
    assert not wrapped, wrapped
    assert table.locator("tbody tr").count() == N
    table.screenshot(path=str(ARTIFACTS / "browser_status.png"))
    # %shard_cluster stop: its one-line summary and nothing else (no controller log)
    stop = _cell(page, "%shard_cluster stop").locator(".jp-OutputArea-output")
    assert stop.count() == 1 and re.fullmatch(r"sharddbg: stopped 4 ranks in \d+\.\d s", stop.inner_text().strip())
    # %shard_cluster diagnose: a readable report, not a repr
    diag = _cell(page, "%shard_cluster diagnose").locator(".jp-OutputArea-output")
    assert [o.strip() for o in diag.all_inner_texts()] == ["every rank is idle"]


def _css_color(page, expression: str, prop: str = "backgroundColor") -> str:
    """A CSS colour expression (e.g. ``var(--jp-layout-color0)``) as the page computes it."""
    return page.evaluate("""([expr, prop]) => { const e = document.createElement('div');
        e.style[prop === 'color' ? 'color' : 'backgroundColor'] = expr; document.body.append(e);
        const v = getComputedStyle(e)[prop === 'color' ? 'color' : 'backgroundColor']; e.remove(); return v; }""",
                         [expression, prop])


def test_dark_theme(session):
    from playwright.sync_api import expect

    page = session[0]
    page.locator(".lm-MenuBar-itemLabel").get_by_text("Settings", exact=True).click()
    page.locator(".lm-Menu-itemLabel").get_by_text("Theme", exact=True).hover()
    page.locator(".lm-Menu-itemLabel").get_by_text("JupyterLab Dark", exact=True).click()
    expect(page.locator("body[data-jp-theme-light='false']")).to_have_count(1, timeout=20_000)
    _wait_for_dark_colours(page)
    background, text = _css_color(page, "var(--jp-layout-color0)"), _css_color(page, "var(--jp-ui-font-color1)", "color")
    assert sum(int(v) for v in re.findall(r"\d+", background)[:3]) < 150, background  # a dark background
    for view in (page.locator(".sd-explorer").first, _inspector(page, "x")):
        view.scroll_into_view_if_needed()
        assert view.evaluate("e => getComputedStyle(e).backgroundColor") == background
        assert view.evaluate("e => getComputedStyle(e).color") == text
        head = view.locator("th").first.evaluate("e => getComputedStyle(e).backgroundColor")
        assert sum(int(v) for v in re.findall(r"\d+", head)[:3]) < 300, head  # table headers dark too
    page.locator(".sd-explorer").first.screenshot(path=str(ARTIFACTS / "browser_explorer_dark.png"))
    findings = page.locator(".sd-explorer .sd-findings").first
    findings.scroll_into_view_if_needed()
    findings.screenshot(path=str(ARTIFACTS / "browser_explorer_findings_dark.png"))
    _inspector(page, "x").screenshot(path=str(ARTIFACTS / "browser_inspector_dark.png"))
    # native dropdowns follow the theme: their open list drawn dark, the closed one on the view's background
    select = page.locator(".sd-explorer select").first
    assert select.evaluate("e => getComputedStyle(e).colorScheme") == "dark"
    assert select.evaluate("e => getComputedStyle(e).backgroundColor") == background
    # the plotly figure (plotly's own renderer) on the page's dark background, its text readable there
    plot = page.locator(".js-plotly-plot")
    plot.scroll_into_view_if_needed()
    png = ARTIFACTS / "browser_timeline_dark.png"
    plot.screenshot(path=str(png))
    shares = _pixel_shares(png)
    assert shares.bright < 0.05 and shares.dark > 0.6, shares  # not a white slab: mostly the page's dark background
    tick = plot.locator(".ytick text").first.evaluate("e => getComputedStyle(e).fill")
    assert sum(int(v) for v in re.findall(r"\d+", tick)[:3]) > 3 * 90, tick  # light enough to read on #111

    page.set_viewport_size(NARROW)  # narrow too: the explorer, the inspector with its warnings, smoke and check
    try:
        from sharddbg.views.check import check_html
        from sharddbg.views.smoke import smoke_html

        smoke_result, check_result = _long_smoke_and_check()
        _show_html(page, smoke_html(smoke_result), "sd-test-smoke")
        _show_html(page, check_html(check_result), "sd-test-check")
        _wait_for_layout_within(page, NARROW)
        for name, view in (("explorer", page.locator(".sd-explorer").first), ("inspector", _inspector(page, "y_fb")),
                           ("smoke", page.locator(".sd-test-smoke")), ("check", page.locator(".sd-test-check"))):
            view.scroll_into_view_if_needed()
            view.screenshot(path=str(ARTIFACTS / f"browser_narrow_{name}_dark.png"))
    finally:
        _hide_html(page)
        page.set_viewport_size(WIDE)


@dataclass(frozen=True)
class PixelShares:
    """How much of a screenshot is near white (every channel above 230) and how much near black (below 50)."""

    bright: float
    dark: float


def _pixel_shares(png: Path) -> PixelShares:
    import numpy as np
    from PIL import Image

    pixels = np.asarray(Image.open(png).convert("RGB"))
    return PixelShares(bright=float((pixels.min(axis=2) > 230).mean()), dark=float((pixels.max(axis=2) < 50).mean()))


def _request(url: str, method: str = "GET", headers: dict | None = None) -> int:
    """The HTTP status of a request to the session's server."""
    req = urllib.request.Request(url, method=method, headers=headers or {}, data=b"" if method == "POST" else None)
    try:
        return urllib.request.urlopen(req, timeout=10).status
    except urllib.error.HTTPError as exc:
        return exc.code


# What the notebook's kernel runs for the panel, one line per cell (typed into new cells at the end of the session's
# notebook): a 2-rank cluster, a trace on it, then a cell sent without waiting in which rank 0 waits in an all_reduce
# that rank 1 never issues
PANEL_CELLS = [
    "cl2 = sharddbg.Cluster(n=2, timeout=60).start(); "
    "cl2.trace('y2 = torch.ones(3) * rank\\ntorch.distributed.all_reduce(y2)', display=False); print(cl2.cluster_id)",
    "pending = cl2.submit('import time\\nz2 = torch.ones(4)\\nif rank == 0:\\n    torch.distributed.all_reduce(z2)"
    "\\nelse:\\n    time.sleep(300)')",
]


def _run_new_cell(page, code: str) -> None:
    """Type ``code`` (one line) into a new cell at the end of the notebook and run it."""
    page.locator(".jp-Notebook .jp-Cell").last.locator(".jp-InputPrompt").click()
    page.keyboard.press("Escape")
    page.keyboard.press("b")
    page.keyboard.press("Enter")
    page.keyboard.insert_text(code)
    page.keyboard.press("Shift+Enter")


def test_cluster_panel(session):
    """The side bar's cluster panel, from the state file the owner of a cluster keeps: here a cluster started
    from the notebook's kernel, as a user starts one. Its ranks within 5 s; a rank stuck in a collective shows
    as stuck with the collective, its group, since when and the rank it waits for; the last trace opens in the
    main area with its views; a killed rank shows dead with its signal; stop from the panel stops every
    process of it and the panel drops it. The state file is private and refreshed; the server's endpoint
    refuses a request without authentication and a cookie-authenticated one without the XSRF token; a corrupt
    state file shows its cluster as gone with the reason."""
    import signal

    import psutil
    from playwright.sync_api import expect

    from sharddbg.cluster import registry, state_file

    page, url, token, root, work = session
    # Jupyter's own authentication and XSRF protection: nothing without them, even on loopback
    assert _request(f"{url}/sharddbg/clusters") == 403
    assert _request(f"{url}/sharddbg/clusters?token={token}") == 200
    cookies = "; ".join(f"{c['name']}={c['value']}" for c in page.context.cookies(url))
    assert _request(f"{url}/sharddbg/clusters", headers={"Cookie": cookies}) == 200  # the page's own login
    assert _request(f"{url}/sharddbg/clusters/0000/stop", "POST", headers={"Cookie": cookies}) == 403  # forged
    assert _request(f"{url}/sharddbg/clusters/0000/trace") == 403  # the last trace: the same protection

    page.locator(".jp-SideBar .lm-TabBar-tab[title='sharddbg clusters']").click()
    panel = page.locator("#sharddbg-clusters")
    expect(panel.locator(".sd-ext-cluster")).to_have_count(0)
    cluster_id = None
    try:
        _run_new_cell(page, PANEL_CELLS[0])
        card = panel.locator(".sd-ext-cluster[data-state='running']")
        expect(card).to_have_count(1, timeout=60_000)  # started (the card comes within a second of it)
        cluster_id = card.get_attribute("data-cluster-id")
        expect(card.locator(".sd-ext-rank[data-state='idle']")).to_have_count(2, timeout=5_000)
        expect(card.locator(".sd-ext-cluster-facts")).to_contain_text("2 ranks")
        expect(card.locator(".sd-ext-cluster-owner")).to_contain_text("kernel kernel-")  # a notebook's kernel
        path = state_file.state_path(cluster_id)
        assert path.exists() and (path.stat().st_mode & 0o777) == 0o600
        first = json.loads(path.read_text())["updated"]
        deadline = time.monotonic() + 10
        while json.loads(path.read_text())["updated"] == first:  # refreshed (every second)
            assert time.monotonic() < deadline, "the state file was not refreshed"
            time.sleep(0.2)

        # rank 0 waits in an all_reduce rank 1 never issues: stuck, with the collective, its group, since when
        _run_new_cell(page, PANEL_CELLS[1])
        stuck = card.locator(".sd-ext-rank[data-rank='0'][data-state='stuck']")
        expect(stuck).to_have_attribute("data-collective", "all_reduce", timeout=15_000)
        expect(stuck.locator(".sd-ext-rank-state")).to_contain_text(
            re.compile(r"stuck in all_reduce on 'domain' since \d{1,2}:\d\d:\d\d \(\d+ s\), waiting for rank 1"))
        expect(card.locator(".sd-ext-rank[data-rank='1']")).to_have_attribute("data-state", "busy")
        saved = json.loads(path.read_text())
        stuck_in = saved["rank_states"][0]["stuck_in"]
        assert stuck_in["collective"] == "all_reduce" and stuck_in["missing_ranks"] == [1], stuck_in
        assert time.time() - 60 < stuck_in["since"] <= time.time(), stuck_in
        assert "never joined by: rank 1" in stuck_in["description"]
        panel.screenshot(path=str(ARTIFACTS / "browser_cluster_panel_stuck.png"))

        # the last trace, opened from the panel: its views in the main area, read by the server from the file the
        # owner saved (private) under SHARDDBG_HOME
        trace_file = Path(saved["last_trace"]["path"])
        assert trace_file == state_file.last_trace_path(cluster_id) and (trace_file.stat().st_mode & 0o777) == 0o600
        card.locator("button.sd-ext-open-trace").click()
        doc = page.locator(".jp-MainAreaWidget .sd-ext-document[data-sd-drawn-by='extension']")
        # the traced cell: one all_reduce per rank, outside any recorded op
        expect(doc.locator(".sd-explorer")).to_contain_text("0 op calls on 2 ranks", timeout=30_000)
        expect(doc.locator(".sd-explorer")).to_contain_text("2 collectives")
        expect(doc.locator(".sd-ext-section-timeline .js-plotly-plot .legendtext", has_text="all_reduce")).to_have_count(
            1, timeout=30_000)
        expect(doc.locator(".sd-ext-section-comm .js-plotly-plot")).to_have_count(1)
        page.screenshot(path=str(ARTIFACTS / "browser_cluster_last_trace.png"))
        page.locator(".lm-DockPanel-tabBar .lm-TabBar-tab", has_text=f"last trace of {cluster_id}").locator(
            ".lm-TabBar-tabCloseIcon").click()
        expect(doc).to_have_count(0)

        # a killed rank: dead, with the signal
        pid1 = int(card.locator(".sd-ext-rank[data-rank='1'] td").nth(1).inner_text().split()[-1])
        processes = registry.ClusterRecord.load(registry.clusters_dir() / f"{cluster_id}.json").live_processes()
        assert len(processes) >= 3  # the engines, the controller, the fork server
        os.kill(pid1, signal.SIGKILL)
        expect(card.locator(".sd-ext-rank[data-rank='1'] .sd-ext-rank-state")).to_contain_text("signal 9", timeout=10_000)
        panel.screenshot(path=str(ARTIFACTS / "browser_cluster_panel.png"))
        # a corrupt state file: that cluster, gone, with the reason
        bad = state_file.state_path("corrupt0")
        bad.write_text('{"format": "sharddbg.cluster-state", "vers')
        gone = panel.locator(".sd-ext-cluster[data-cluster-id='corrupt0']")
        expect(gone.locator(".sd-ext-gone")).to_contain_text("its state file is corrupt", timeout=5_000)
        bad.unlink()
        # stop from the panel: every process of the cluster ends, the panel drops it
        card.locator("button.sd-ext-stop").click()
        expect(panel.locator(f".sd-ext-cluster[data-cluster-id='{cluster_id}']")).to_have_count(0, timeout=20_000)
        _, alive = psutil.wait_procs([p for p in processes if p.pid != pid1], timeout=10)
        assert not alive, alive
        assert not registry.cluster_processes(cluster_id)
        assert not path.exists() and not trace_file.exists()
    finally:
        if cluster_id is not None:  # whatever the test left: reaped
            with contextlib.suppress(Exception):
                registry.reap(registry.ClusterRecord.load(registry.clusters_dir() / f"{cluster_id}.json"))
        page.locator(".jp-SideBar .lm-TabBar-tab[title='sharddbg clusters']").click()  # the panel closed again


@functools.cache
def _long_smoke_and_check():
    """tests/test_views.py's smoke matrix and check with long texts, made once for this module."""
    from test_views import long_smoke_and_check

    return long_smoke_and_check()


def _verification_outputs() -> dict[str, list[dict]]:
    """The outputs a kernel shows for the verification views and communication per op (the golden trace's), as
    display_data outputs: the check and the smoke matrix each with their figure, the doctor with 2 failing checks
    and 1 warning."""
    from sharddbg.analysis.doctor import CHECKS, DoctorReport
    from sharddbg.analysis.findings import Finding
    from sharddbg.views.check import CheckView, plot_row_errors
    from sharddbg.views.comm import plot_comm_by_op
    from sharddbg.views.smoke import SmokeView, plot_smoke_losses

    def output(shown) -> dict:
        data = shown._repr_mimebundle_()
        data.setdefault("text/plain", repr(shown)[:200])
        return nbformat.v4.new_output("display_data", data=data)

    smoke_result, check_result = _long_smoke_and_check()
    statuses = ["ok", "fail", "warn", "fail", "skip"]
    doctor = DoctorReport([Finding(kind, status, f"{kind}: what was found", f"the fix for {kind}", (0,))
                           for kind, status in zip(CHECKS, statuses)], [])
    check = CheckView(check_result)
    return {"comm": [output(plot_comm_by_op(sharddbg.load_trace(ROOT / "tests" / "data" / "conv4.sdtrace.json")))],
            "check": [output(check), output(plot_row_errors(check_result))],
            "doctor": [output(doctor.show())],
            "smoke": [output(SmokeView(smoke_result)), output(plot_smoke_losses(smoke_result))]}


def _with_payload(output: dict, change) -> dict:
    """A copy of a view's output whose payload ``change(payload)`` returns."""
    out = copy.deepcopy(output)
    out["data"][VIEW_MIMETYPE] = change(out["data"][VIEW_MIMETYPE])
    return out


# saved payloads the extension cannot draw, each with the start of the one line it says why
BAD_PAYLOADS = {
    "newer": (lambda p: p | {"version": 99}, "the view was saved by a newer sharddbg (data version 99"),
    "format": (lambda p: p | {"format": "someone.else"}, 'the view\'s data is of format "someone.else"'),
    "truncated": (lambda p: p | {"drawn": {"rows": [[1, 2]]}}, "the view could not be drawn from its saved data"),
    "not an object": (lambda p: "{\"format\": \"sharddbg.view\", \"vers", "the view's data is not an object"),
    "no drawn data": (lambda p: {k: v for k, v in p.items() if k != "drawn"}, "the view was saved by an older sharddbg"),
}


def test_saved_notebook(session):
    """Save, shut the kernel down, reopen: the owner's JupyterLab draws the widgets from the state saved with
    the notebook (no kernel); another JupyterLab (another signing key: the notebook is not trusted there, and
    no widget state is saved) shows every view live, drawn by the extension from the payload saved in its
    output. There, a payload the extension cannot draw shows the view's static rendering under one line
    saying why, with no error in the console; a trace file opens from the file browser with the explorer,
    a broken one with its TraceFileError; nothing opened is rewritten."""
    from playwright.sync_api import expect

    page, url, token, root, work = session
    # while the kernel runs, each view is its live widget (its selection reaches Python), not the saved drawing
    widgets = page.locator(".sd-ext-view[data-sd-drawn-by='widget']")
    expect(widgets).to_have_count(4)
    expect(widgets.locator(".sd-explorer")).to_have_count(1)
    expect(widgets.locator(".sd-inspector")).to_have_count(3)
    page.locator(".jp-Notebook").click()
    page.keyboard.press("Control+s")
    path = root / NOTEBOOK
    deadline = time.monotonic() + 30
    while True:
        try:
            nb = nbformat.read(path, as_version=4)
        except nbformat.reader.NotJSONError:  # read while JupyterLab writes it
            time.sleep(0.5)
            continue
        outputs = [o for c in nb.cells if c.cell_type == "code" for o in c.outputs]
        # every view's output (an autosave made while the notebook ran has fewer), and the widgets' state
        if sum(VIEW_MIMETYPE in o.get("data", {}) for o in outputs) == 5 and nb.metadata.get("widgets"):
            break
        assert time.monotonic() < deadline, "the notebook was not saved with its outputs"
        time.sleep(0.5)
    # each view left one output bundle: widget, static HTML, text, payload (with what its front end draws); the
    # timeline plotly's own bundle and the payload (its figure)
    views = [o for o in outputs if VIEW_MIMETYPE in o.get("data", {})]
    widget_views = [o for o in views if o["data"][VIEW_MIMETYPE]["view"] != "timeline"]
    assert len(widget_views) == 4 and all(set(o["data"]) == VIEW_MIMETYPES for o in widget_views)  # 3 inspectors, 1 explorer
    assert all(o["data"][VIEW_MIMETYPE]["version"] == 1 and o["data"][VIEW_MIMETYPE]["drawn"] for o in views)
    (timeline_output,) = [o for o in views if o["data"][VIEW_MIMETYPE]["view"] == "timeline"]
    assert "application/vnd.plotly.v1+json" in timeline_output["data"]
    assert timeline_output["data"][VIEW_MIMETYPE]["drawn"]["figure"]["data"]
    for s in _api(url, token, "/api/sessions"):
        _api(url, token, f"/api/sessions/{s['id']}", method="DELETE")
    assert _api(url, token, "/api/kernels") == []

    # the owner reloads: the widgets come back from the saved widget state, without the kernel that made
    # them (JupyterLab starts a fresh one), and their filters work
    page.reload(wait_until="domcontentloaded")
    expect(page.locator(".sd-explorer:not(.sd-static)")).to_have_count(1, timeout=60_000)
    expect(page.get_by_text("Error displaying widget")).to_have_count(0)
    exp = page.locator(".sd-explorer")
    expect(exp.locator("select.sd-f-view")).to_have_value("summary")
    expect(exp.locator(".sd-list tr.sd-summary-row").first).to_have_attribute("data-kind", "fallback")
    exp.locator("select.sd-f-view").select_option("calls")
    exp.locator("select.sd-f-rank").select_option("3")
    assert set(exp.locator(".sd-list tr.sd-op").evaluate_all("rs => rs.map(r => r.dataset.rank)")) == {"3"}
    expect(_inspector(page, "x").locator(".sd-block")).to_have_count(N)

    # someone else opens the saved file (default settings: no widget state), with a copy whose payloads the
    # extension cannot draw, and two trace files
    # its JupyterLab started with the module (``_started_early``); its root is empty until now
    other_lab = _OTHER_LAB.pop("lab", None) or _start_jupyterlab(*_other_folders(work), save_widget_state=False)
    other_root = other_lab.root
    # the saved notebook, with the verification views and the communication per op saved after it (outputs made
    # here, as a kernel shows them)
    shared = nbformat.read(path, as_version=4)
    verification = _verification_outputs()
    for name, outputs in verification.items():
        cell = nbformat.v4.new_code_cell(f"# {name}")
        cell.outputs = [nbformat.from_dict(o) for o in outputs]
        shared.cells.append(cell)
    nbformat.write(shared, other_root / NOTEBOOK)
    explorer_output = next(o for o in views if o["data"][VIEW_MIMETYPE]["view"] == "explorer")
    bad = nbformat.v4.new_notebook(metadata=nb.metadata)
    for case, (change, _) in BAD_PAYLOADS.items():
        cell = nbformat.v4.new_code_cell(f"# {case}")
        cell.outputs = [nbformat.from_dict(_with_payload(explorer_output, change))]
        bad.cells.append(cell)
    newer_check = nbformat.v4.new_code_cell("# a check saved by a newer sharddbg")
    newer_check.outputs = [nbformat.from_dict(_with_payload(verification["check"][0], lambda p: p | {"version": 2}))]
    bad.cells.append(newer_check)
    bad.metadata.pop("widgets", None)
    nbformat.write(bad, other_root / "unreadable_payloads.ipynb")
    shutil.copy(ROOT / "tests" / "data" / "conv4.sdtrace.json", other_root / "conv4.sdtrace.json")
    shutil.copytree(ROOT / "tests" / "data" / "recorded_job", other_root / "recorded_job")
    (other_root / "broken.sdtrace.json").write_text('{"format": "sharddbg.trace", "version": 1')
    # the binary forms: the golden trace as columns, and the recorded job's lines written again as Arrow streams by
    # the rank streams' own writer (what `sharddbg record` writes now)
    sharddbg.load_trace(ROOT / "tests" / "data" / "conv4.sdtrace.json").save(other_root / "columns.sdtrace.arrow")
    _as_arrow_streams(ROOT / "tests" / "data" / "recorded_job", other_root / "job_as_arrow_streams")
    saved = {p: p.read_bytes() for p in other_root.rglob("*") if p.is_file()}
    console: list[str] = []
    on_console = lambda m: console.append(m.text) if m.type == "error" else None  # noqa: E731
    page.on("console", on_console)
    try:
        with _ready(other_lab) as (url2, token2):
            page.goto(f"{url2}/lab/tree/{NOTEBOOK}?token={token2}", wait_until="domcontentloaded")
            live = page.locator(".sd-ext-view[data-sd-drawn-by='extension']")
            # the explorer, 3 inspectors, the timeline, and the views saved after them
            expect(live).to_have_count(5 + sum(map(len, verification.values())), timeout=60_000)
            expect(page.get_by_text("Error displaying widget")).to_have_count(0)
            expect(page.locator(".sd-static")).to_have_count(0)
            # live: a filter narrows the explorer, a click opens a call's detail, the inspector draws every rank
            exp = page.locator(".sd-ext-view .sd-explorer")
            expect(exp.locator(".sd-findings .sd-finding").first).to_contain_text("raised and the cell handled them")
            exp.locator("select.sd-f-view").select_option("calls")
            exp.locator("select.sd-f-rank").select_option("2")
            assert set(exp.locator(".sd-list tr.sd-op").evaluate_all("rs => rs.map(r => r.dataset.rank)")) == {"2"}
            exp.locator(".sd-list tr.sd-op").first.click()
            expect(exp.locator(".sd-detail")).to_be_visible()
            expect(exp.locator(".sd-detail")).to_have_attribute("data-rank", "2")
            for name in ("x", "x22", "y_fb"):
                expect(_inspector(page, name).locator(".sd-block")).not_to_have_count(0)
            expect(_inspector(page, "x").locator(".sd-block")).to_have_count(N)
            # the timeline, drawn by plotly.js from the saved figure: a hover on a span names its op and rank
            timeline = page.locator(".sd-ext-view[data-sd-view='timeline'] .js-plotly-plot")
            expect(timeline).to_have_count(1)
            expect(page.locator(".sd-ext-view[data-sd-view='timeline'] .sd-ext-figure[data-sd-drawn='true']")).to_have_count(1)
            timeline.scroll_into_view_if_needed()
            geo = _plot_geometry(timeline)
            widest = max((sp for t in geo["traces"] for sp in t["spans"] if " · rank " in sp["hover"]),
                         key=lambda sp: sp["x1"] - sp["x0"])
            page.mouse.move(5, 5)
            page.mouse.move((widest["x0"] + widest["x1"]) / 2, widest["y"] + 3)
            op = re.match(r"<b>(.*?)</b>", widest["hover"]).group(1)
            expect(timeline.locator(".hoverlayer .hovertext")).to_contain_text(re.compile(re.escape(op) + r" · rank \d"))
            page.mouse.move(5, 5)
            # the figures saved with the check, the smoke matrix and communication per op: drawn by plotly.js
            for view in ("comm", "check_rows", "smoke_losses"):
                expect(page.locator(f".sd-ext-view[data-sd-view='{view}'] .sd-ext-figure.js-plotly-plot"
                                    "[data-sd-drawn='true']")).to_have_count(1, timeout=30_000)
            # the verification tables: as the Python side orders them; the filter keeps the rows that are not ok
            for view, failing in (("check", 1), ("doctor", 3), ("smoke", 1)):  # the doctor: 2 fail, 1 warn
                table = page.locator(f".sd-ext-view[data-sd-view='{view}'] .sd-ext-table")
                rows = table.locator("tr.sd-ext-row")
                total = rows.count()
                assert total >= failing, (view, total)
                expect(table.locator(".sd-ext-verdict")).to_have_class(re.compile(r"sd-ext-verdict-fail"))
                table.locator("select.sd-ext-f-status").select_option("not-ok")
                expect(table.locator("tr.sd-ext-row:visible")).to_have_count(failing)
                assert set(table.locator("tr.sd-ext-row:visible").evaluate_all("rs => rs.map(r => r.dataset.ok)")) == {"false"}
                table.locator("select.sd-ext-f-status").select_option("")
                expect(table.locator("tr.sd-ext-row:visible")).to_have_count(total)
            for theme in ("light", "dark"):
                if theme == "dark":
                    page.locator(".lm-MenuBar-itemLabel").get_by_text("Settings", exact=True).click()
                    page.locator(".lm-Menu-itemLabel").get_by_text("Theme", exact=True).hover()
                    page.locator(".lm-Menu-itemLabel").get_by_text("JupyterLab Dark", exact=True).click()
                    expect(page.locator("body[data-jp-theme-light='false']")).to_have_count(1, timeout=20_000)
                    page.wait_for_timeout(500)
                for name, view in (("explorer", exp), ("inspector", _inspector(page, "x")), ("timeline", timeline),
                                   ("doctor", page.locator(".sd-ext-view[data-sd-view='doctor']"))):
                    view.scroll_into_view_if_needed()
                    view.screenshot(path=str(ARTIFACTS / f"browser_kernelless_{name}_{theme}.png"))

            # the payloads it cannot draw: the static rendering, under one line saying why
            page.goto(f"{url2}/lab/tree/unreadable_payloads.ipynb?token={token2}", wait_until="domcontentloaded")
            static = page.locator(".sd-ext-view[data-sd-drawn-by='static']")
            expect(static).to_have_count(len(BAD_PAYLOADS) + 1, timeout=60_000)
            for k, (_, why) in enumerate(BAD_PAYLOADS.values()):
                expect(static.nth(k).locator(".sd-ext-why")).to_contain_text(why)
                expect(static.nth(k).locator(".sd-static.sd-explorer tr.sd-summary-row").first).to_be_visible()
            # a check of a newer payload version: its static HTML, and the line that says so
            newer = static.nth(len(BAD_PAYLOADS))
            expect(newer.locator(".sd-ext-why")).to_contain_text("the view was saved by a newer sharddbg (data version 2")
            expect(newer.locator(".sd-ext-static .sd-check-verdict")).to_be_visible()
            static_exp = static.first.locator(".sd-static.sd-explorer")
            # the op summary first, each row with its calls on each rank (identical ones as one row), then the calls
            expect(static_exp.locator("tr.sd-summary-row").first).to_have_class(re.compile(r"\bsd-kind-fallback\b"))
            expect(static_exp.locator("tr.sd-summary-row.sd-kind-error")).to_have_count(0)  # the exception was caught
            expect(static_exp.locator("tr.sd-call-group td", has_text=re.compile(r"^ranks 0-3$")).first).to_be_visible()
            expect(static_exp).to_contain_text("broken_add: expected <ShardTensor> & got <b>None</b>")
            expect(static_exp.locator("b", has_text="None")).to_have_count(0)
            static.first.scroll_into_view_if_needed()
            page.screenshot(path=str(ARTIFACTS / "browser_kernelless_unreadable_dark.png"))

            # trace files open from the file browser: the explorer, or the file's TraceFileError
            page.goto(f"{url2}/lab?token={token2}", wait_until="domcontentloaded")
            page.locator(".jp-DirListing-item", has_text="conv4.sdtrace.json").dblclick(timeout=60_000)
            doc = page.locator(".sd-ext-document[data-sd-drawn-by='extension']")
            expect(doc.locator(".sd-explorer .sd-list tr.sd-summary-row").first).to_be_visible(timeout=60_000)
            doc.locator("select.sd-f-rank").select_option("1")
            page.screenshot(path=str(ARTIFACTS / "browser_trace_document_dark.png"))
            page.locator(".jp-DirListing-item", has_text="broken.sdtrace.json").dblclick()
            expect(page.locator(".sd-ext-document .sd-ext-error")).to_contain_text("broken.sdtrace.json", timeout=30_000)
            # a recorded job (what `sharddbg record` wrote): one of its rank files (or its job.json: the same file
            # type, tests/test_labextension.py) opens the whole job with the views, read by the server's load_trace
            page.locator(".jp-DirListing-item", has_text="recorded_job").dblclick()
            shown = page.locator(".lm-DockPanel-widget:not(.lm-mod-hidden) .sd-ext-document[data-sd-drawn-by='extension']")
            page.locator(".jp-DirListing-item", has_text="rank-00000.jsonl").dblclick(timeout=30_000)
            expect(page.locator(".lm-DockPanel-tabBar .lm-TabBar-tab.jp-mod-current")).to_contain_text("rank-00000.jsonl")
            expect(shown.locator(".sd-explorer .sd-list tr.sd-summary-row[data-op='Tensor.matmul']")).to_have_count(
                1, timeout=30_000)
            expect(shown.locator(".sd-ext-section-timeline .js-plotly-plot")).to_have_count(1, timeout=30_000)
            expect(shown.locator(".sd-ext-section-comm .js-plotly-plot")).to_have_count(1)
            page.screenshot(path=str(ARTIFACTS / "browser_job_document_dark.png"))
            # the same job as Arrow streams, and a columnar trace file: binary, opened by a double-click all the same
            page.locator(".jp-BreadCrumbs-home").click()
            page.locator(".jp-DirListing-item", has_text="job_as_arrow_streams").dblclick()
            page.locator(".jp-DirListing-item", has_text="rank-00000.arrows").dblclick(timeout=30_000)
            expect(page.locator(".lm-DockPanel-tabBar .lm-TabBar-tab.jp-mod-current")).to_contain_text("rank-00000.arrows")
            expect(shown.locator(".sd-explorer .sd-list tr.sd-summary-row[data-op='Tensor.matmul']")).to_have_count(
                1, timeout=30_000)
            page.locator(".jp-BreadCrumbs-home").click()
            page.locator(".jp-DirListing-item", has_text="columns.sdtrace.arrow").dblclick(timeout=30_000)
            expect(page.locator(".lm-DockPanel-tabBar .lm-TabBar-tab.jp-mod-current")).to_contain_text("columns.sdtrace.arrow")
            expect(shown.locator(".sd-explorer .sd-list tr.sd-summary-row").first).to_be_visible(timeout=30_000)
            expect(shown.locator(".sd-ext-error")).to_have_count(0)
        assert not console, console
        assert {p: p.read_bytes() for p in saved} == saved
    finally:
        page.remove_listener("console", on_console)


def _drawn_in_its_own_margins(page, box: str) -> None:
    """The figure in ``#box`` was drawn in the margins it carries: plotly did not have to widen them for its legend
    or its axes (it would then have drawn the whole figure a second time), and its legend lies right of the plot,
    within the figure."""
    geometry = page.evaluate("""(id) => { const d = document.getElementById(id), L = d._fullLayout;
        const fig = d.getBoundingClientRect(), legend = d.querySelector('.legend').getBoundingClientRect();
        const asked = {};
        // what each of the legend and the axes asks of the margin at the plot's edge (plotly's auto margin)
        for (const [who, push] of Object.entries(L._pushmargin || {})) {
            if (who === 'base') continue;
            for (const side of ['l', 'b']) if (push[side].val <= 0) asked[who + ' ' + side] = push[side].size;
            for (const side of ['r', 't']) if (push[side].val >= 1) asked[who + ' ' + side] = push[side].size;
        }
        return {margin: d.layout.margin, size: L._size, asked, plotRight: fig.left + L._size.l + L._size.w,
                figRight: fig.right, legendLeft: legend.left, legendRight: legend.right}; }""", box)
    margin, size = geometry["margin"], geometry["size"]
    for side in ("l", "r", "t", "b"):
        assert size[side] == margin[side], (side, geometry)
        wanted = [v for k, v in geometry["asked"].items() if k.endswith(" " + side)]
        assert max(wanted, default=0) <= margin[side], (side, geometry)
    assert geometry["plotRight"] <= geometry["legendLeft"] < geometry["legendRight"] <= geometry["figRight"], geometry


def test_report_light_and_dark(session, tmp_path, monkeypatch):
    """The standalone report (of the golden trace) by the reader's preference: light for a light one, dark for
    a dark one, its figures on the page's background either way. A big trace's report: its timeline, an
    overview, draws a window zoomed into span by span. Last: it opens pages of its own."""
    import sharddbg

    from playwright.sync_api import expect

    report = sharddbg.load_trace(ROOT / "tests" / "data" / "conv4.sdtrace.json").to_html(tmp_path / "report.html")
    browser = session[0].context.browser  # the session's chromium (one Playwright per process)
    page = browser.new_page(viewport={"width": 1200, "height": 900})
    errors: list[str] = []
    page.on("pageerror", lambda e: errors.append(str(e)))
    try:
        page.goto(Path(report).as_uri())
        # the figure in view (the timeline) is drawn; the one far below (imbalance) waits until it is scrolled to,
        # and says so meanwhile, in a box of its height
        page.wait_for_selector("#sd-fig-timeline .main-svg", timeout=60_000)
        expect(page.locator("#sd-fig-timeline")).to_have_attribute("data-state", "drawn")
        _drawn_in_its_own_margins(page, "sd-fig-timeline")
        below = page.locator("#sd-fig-imbalance")
        expect(below).to_have_attribute("data-state", "pending")
        expect(below.locator(".sd-figure-pending")).to_have_text("drawn when it comes into view")
        assert below.locator(".main-svg").count() == 0 and below.bounding_box()["height"] >= 300
        for name in ("comm", "imbalance"):
            page.locator(f"#sd-fig-{name}").scroll_into_view_if_needed()
            page.wait_for_selector(f"#sd-fig-{name} .main-svg", timeout=60_000)
        expect(page.locator(".sd-figure-pending")).to_have_count(0)
        _virtual_explorer_list(page)
        for scheme in ("light", "dark"):
            page.emulate_media(color_scheme=scheme)
            page.screenshot(path=str(ARTIFACTS / f"report_{scheme}.png"), full_page=True)
            body = page.evaluate("getComputedStyle(document.body).backgroundColor")
            # the explorer's dropdowns on the page's background, their open list in the same scheme
            select = page.locator("#sd-explorer select").first
            assert select.evaluate("e => getComputedStyle(e).backgroundColor") == body
            assert "dark" in select.evaluate("e => getComputedStyle(e).colorScheme")
            for name in ("timeline", "comm", "imbalance"):
                png = ARTIFACTS / f"report_{name}_{scheme}.png"
                page.locator(f"#sd-fig-{name}").screenshot(path=str(png))
                shares = _pixel_shares(png)
                if scheme == "light":
                    assert body == "rgb(255, 255, 255)" and shares.bright > 0.5, (name, shares)
                else:
                    assert body == "rgb(17, 17, 17)" and shares.bright < 0.05 and shares.dark > 0.6, (name, shares)
        assert not errors, errors
    finally:
        page.close()
    _big_report_zooms_span_by_span(browser, tmp_path, monkeypatch)


def _big_report_zooms_span_by_span(browser, tmp_path: Path, monkeypatch) -> None:
    """A big trace's report (the golden trace's records over 16 ranks, the overview's thresholds lowered to its
    6,400 events): its timeline, drawn without WebGL, answers a hover; zoomed into one of its shaded windows, each span
    in it is drawn on the page's canvas from the spans the figure carries, and a category hidden from the legend is
    not."""
    import importlib.util

    import pandas as pd

    from sharddbg.trace import Trace
    from sharddbg.views import timeline

    spec = importlib.util.spec_from_file_location("bench_trace_big", ROOT / "bench" / "bench_trace_big.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    doc = bench.big_trace_document(6_400, 16)
    big = Trace(dict(zip(doc["ranks"], doc["payloads"])), {r: 0 for r in doc["ranks"]}, [], doc["meta"])
    # the page draws a window of at most 1,000 spans span by span (not the whole trace: its overview shows)
    for name, value in (("OVERVIEW_ABOVE", 1000), ("OVERVIEW_CELLS", 4000), ("OVERVIEW_MIN_BINS", 50),
                        ("DETAIL_WINDOW_SPANS", 300), ("ZOOM_DRAW_SPANS", 1000)):
        monkeypatch.setattr(timeline, name, value)
    report = big.to_html(tmp_path / "big.html")
    page = browser.new_page(viewport={"width": 1200, "height": 900})
    errors: list[str] = []
    page.on("pageerror", lambda e: errors.append(str(e)))
    # the overview's image is made once per draw of the figure (a canvas turned into a data URL)
    page.add_init_script("""window.__sdImagesMade = 0; const made = HTMLCanvasElement.prototype.toDataURL;
        HTMLCanvasElement.prototype.toDataURL = function (...a) { window.__sdImagesMade++; return made.apply(this, a); };""")
    try:
        page.goto(Path(report).as_uri())
        page.locator("#sd-fig-timeline").scroll_into_view_if_needed()
        page.wait_for_selector("#sd-fig-timeline .main-svg", timeout=60_000)
        page.wait_for_function("() => document.getElementById('sd-fig-timeline').getAttribute('data-state') === 'drawn'",
                               timeout=60_000)
        # drawn once: its legend and axes fit in the margins it carries
        _drawn_in_its_own_margins(page, "sd-fig-timeline")
        assert page.evaluate("() => window.__sdImagesMade") == 1
        # the windows around the slowest spans are shaded, not drawn by plotly (no WebGL on the first screen)
        assert page.evaluate("""() => document.getElementById('sd-fig-timeline')._fullData
            .filter((t) => t.type === 'scattergl').length""") == 0
        assert page.locator("#sd-fig-timeline .gl-canvas").count() == 0
        # the overview answers a hover (rank 0's op lane, at the middle of the time axis)
        page.mouse.move(*page.evaluate("""(y) => { const d = document.getElementById('sd-fig-timeline');
            const L = d._fullLayout, r = d.getBoundingClientRect(), [a, b] = L.xaxis.range;
            return [r.left + L.xaxis._offset + L.xaxis.l2p((a + b) / 2), r.top + L.yaxis._offset + L.yaxis.l2p(y)]; }""",
                                       timeline.OP_LANE0))
        page.wait_for_selector("#sd-fig-timeline .hoverlayer .hovertext", timeout=20_000)
        ops, colls = timeline.timeline_frame(big), timeline.collective_spans(big)
        spans = pd.concat([ops[["start_ms", "end_ms", "category"]], colls[["start_ms", "end_ms", "category"]]])
        # zoomed into the first shaded window: each span in it drawn on the page's canvas; the legend's first category
        # hidden: drawn without it
        zoom_into_window = """async () => { const d = document.getElementById('sd-fig-timeline');
            if (!d._sdZoomPending) return [-1];  // the zoom was never attached to the drawn figure
            await d._sdZoomPending;
            const s = d.layout.shapes.find((s) => s.type === 'rect');
            await Plotly.relayout(d, {'xaxis.range': [s.x0, s.x1]});
            await new Promise(r => requestAnimationFrame(() => setTimeout(r, 0)));
            return [d._sdZoomDrawn, s.x0, s.x1]; }"""
        drawn, a, b = page.evaluate(zoom_into_window)
        inside = spans[(spans["end_ms"] >= a) & (spans["start_ms"] <= b)]
        assert drawn == len(inside) > 0, (drawn, len(inside))
        assert page.locator("#sd-fig-timeline canvas.sd-timeline-zoom").count() == 1
        first = timeline._op_categories(ops)[0]
        page.locator("#sd-fig-timeline .legend .traces", has_text=first.replace("_", " ")).first.click()
        page.wait_for_function("""() => document.getElementById('sd-fig-timeline')._fullData.some(
            (t) => t.visible === 'legendonly')""", timeout=20_000)
        page.evaluate("() => new Promise(r => requestAnimationFrame(() => setTimeout(r, 0)))")
        hidden = int((inside["category"] == first).sum())
        assert 0 < hidden < len(inside)
        assert page.evaluate("() => document.getElementById('sd-fig-timeline')._sdZoomDrawn") == len(inside) - hidden
        assert not errors, errors
    finally:
        page.close()


def _as_arrow_streams(jsonl_job: Path, out: Path) -> None:
    """A recorded job's folder of JSON-line rank files written again, line for line, as Arrow IPC rank streams by
    the writer a recording job uses."""
    from sharddbg import job_files
    from sharddbg.engine.jobs.stream import RankStreamWriter

    out.mkdir()
    shutil.copy(jsonl_job / job_files.JOB_FILE, out / job_files.JOB_FILE)
    for path in sorted(jsonl_job.glob("rank-*.jsonl")):
        rank = int(path.stem.split("-")[1])
        writer = RankStreamWriter(str(out / job_files.rank_file_name(rank)), rank)
        assert writer.write_lines([json.loads(line) for line in path.read_text().splitlines() if line.strip()])
        writer.close()


# the report's explorer drawn again below it with every call of the golden trace repeated 100 times (7,200
# calls), each time as new calls: the seqs moved on, the key that pairs a call with its twins on the other ranks new
MANY_CALLS = """(k) => { const data = JSON.parse(document.getElementById('sd-explorer-data').textContent);
    const at = (f) => data.fields.indexOf(f), base = data.rows, step = 1 + Math.max(...base.map((r) => r[at('seq')]));
    const keys = new Map(), key = (i, c) => { const name = data.strings[i] + '#' + c;
        if (!keys.has(name)) { keys.set(name, data.strings.length); data.strings.push(name); } return keys.get(name); };
    data.rows = [];
    for (let c = 0; c < k; c++) for (const r of base) {
        const x = r.slice();
        for (const f of ['seq', 'parent_seq', 'fwd_seq']) if (x[at(f)] != null) x[at(f)] += c * step;
        x[at('key')] = key(r[at('key')], c);
        data.rows.push(x); }
    data.total = data.rows.length;
    const el = document.createElement('div'); el.id = 'sd-many'; document.body.append(el);
    const state = { data, selected: [] };
    _sdExplorer.render({ model: { get: (n) => state[n], set: (n, v) => { state[n] = v; }, on: () => {},
                                  save_changes: () => {} }, el });
    return data.rows.length; }"""
IN_ITS_BOX = """(r) => { const a = r.getBoundingClientRect(), b = r.closest('.sd-list').getBoundingClientRect();
    return a.top >= b.top - 1 && a.bottom <= b.bottom + 1; }"""


def _virtual_explorer_list(page) -> None:
    """The explorer's list holds only the rows in and near its box, whatever the number of calls: every call is
    reached by scrolling, clicked for its detail, and the arrow keys move between calls."""
    from playwright.sync_api import expect

    n = page.evaluate(MANY_CALLS, 100)
    many = page.locator("#sd-many")
    many.scroll_into_view_if_needed()
    many.locator("select.sd-f-view").select_option("calls")
    expect(many.locator(".sd-status")).to_contain_text(f"{n} matching calls")
    listing = many.locator(".sd-list")
    assert 0 < many.locator("tr.sd-op").count() < 120, many.locator("tr.sd-op").count()
    # scrolled to its end: the last call is drawn, inside the box, and its detail opens on a click
    last = page.evaluate("""() => { const d = JSON.parse(document.getElementById('sd-explorer-data').textContent);
        return d.rows[d.rows.length - 1][d.fields.indexOf('rank')]; }""")
    listing.evaluate("l => { l.scrollTop = l.scrollHeight; }")
    end = many.locator("tr.sd-op").last
    expect(end).to_have_attribute("data-rank", str(last))
    assert end.evaluate(IN_ITS_BOX)
    assert many.locator("tr.sd-op").count() < 120
    end.click()
    detail = many.locator(".sd-detail")
    expect(detail).to_be_visible()
    expect(detail).to_have_attribute("data-seq", end.get_attribute("data-seq"))
    # the keys: ↑ the call above (its detail, its row marked and in the box), Escape closes the detail
    above = many.locator("tr.sd-op").nth(many.locator("tr.sd-op").count() - 2)
    want = (above.get_attribute("data-rank"), above.get_attribute("data-seq"))
    page.keyboard.press("ArrowUp")
    expect(detail).to_have_attribute("data-seq", want[1])
    expect(detail).to_have_attribute("data-rank", want[0])
    assert many.locator("tr.sd-selected").evaluate(IN_ITS_BOX)
    # from the top, 30 calls down: the list scrolled with the selection, the rows drawn there
    listing.evaluate("l => { l.scrollTop = 0; }")
    many.locator("tr.sd-op").first.click()
    for _ in range(30):
        page.keyboard.press("ArrowDown")
    selected = many.locator("tr.sd-selected")
    expect(selected).to_have_count(1)
    assert selected.evaluate(IN_ITS_BOX) and listing.evaluate("l => l.scrollTop") > 0
    page.keyboard.press("Escape")
    expect(detail).to_be_hidden()
    # a filter redraws the list from its start: only conv calls, still a window of them
    convs = page.evaluate("""() => { const d = JSON.parse(document.getElementById('sd-explorer-data').textContent);
        const op = d.fields.indexOf('op'), coded = (d.coded || []).includes('op');
        return d.rows.filter((r) => (coded ? d.strings[r[op]] : r[op]).toLowerCase().includes('conv')).length; }""")
    many.locator("input.sd-f-op").fill("conv")
    expect(many.locator(".sd-status")).to_contain_text(f"{convs * 100} matching calls")
    assert set(many.locator("tr.sd-op").evaluate_all("rs => rs.map(r => r.dataset.op)")) <= {"torch.conv2d"}
    for scheme in ("light", "dark"):
        page.emulate_media(color_scheme=scheme)
        many.screenshot(path=str(ARTIFACTS / f"report_explorer_many_{scheme}.png"))
    page.evaluate("() => document.getElementById('sd-many').remove()")


def _draw_every_figure(browser, report: Path) -> dict:
    """A standalone report opened, each figure scrolled to in turn until it is drawn or failed: the plotly.js the
    page says it carries, the version the evaluated plotly.js says of itself, each figure's state, its traces'
    types in its JSON and as plotly drew them (with whether plotly had a module for each), and the page's errors."""
    page = browser.new_page(viewport={"width": 1200, "height": 900})
    errors: list[str] = []
    page.on("pageerror", lambda e: errors.append(str(e)))
    try:
        page.goto(report.as_uri())
        for box in page.locator("[data-sd-figure]").all():
            box.scroll_into_view_if_needed()
            page.wait_for_function("b => ['drawn', 'failed'].includes(b.getAttribute('data-state'))",
                                   arg=box.element_handle(), timeout=60_000)
        return page.evaluate("""() => {
            const js = document.getElementById('sd-plotly-js');
            return { bundle: js.dataset.plotlyBundle, version: js.dataset.plotlyVersion, evaluated: Plotly.version,
              figures: [...document.querySelectorAll('[data-sd-figure]')].map(b => ({
                name: b.dataset.sdFigure, state: b.getAttribute('data-state'),
                types: JSON.parse(document.getElementById(b.id + '-data').textContent).data.map(t => t.type),
                drawn: (b._fullData || []).map(t => t.type), modules: (b._fullData || []).every(t => !!t._module) })) };
        }""") | {"errors": errors}
    finally:
        page.close()


def test_report_plotly_bundle(chromium, tmp_path, monkeypatch):
    """The report carries plotly's partial bundle when it registers every trace type of the figures, and the full
    one otherwise, and draws every figure either way: the golden trace's report (bars and scatters) with the
    partial bundle; the same report with a WebGL scatter among its figures (the imbalance view replaced by one)
    with the full bundle. The trace types the report's code reads from the partial bundle's text are exactly those
    plotly.js registers once evaluated (``Plotly.PlotSchema``), and its version is the plotly package's."""
    import plotly.graph_objects as go
    from plotly.offline import get_plotlyjs_version

    from sharddbg.exporters import html_report
    from sharddbg.exporters.plotly_bundle import CARTESIAN_BUNDLE, read_partial_bundle

    assert CARTESIAN_BUNDLE.exists(), (f"{CARTESIAN_BUNDLE} is missing: plotly's partial bundle is copied there when "
                                       "the package is built (bash .ci/setup, extension/build_labextension.py)")
    partial = read_partial_bundle(CARTESIAN_BUNDLE)
    version = get_plotlyjs_version()
    page = chromium.new_page()
    try:
        page.set_content("<!DOCTYPE html><html><head></head><body></body></html>")
        page.add_script_tag(content=partial.source)
        registered = page.evaluate("() => ({ types: Object.keys(Plotly.PlotSchema.get().traces), version: Plotly.version })")
    finally:
        page.close()
    assert sorted(registered["types"]) == sorted(partial.trace_types) and {"bar", "heatmap", "scatter"} <= partial.trace_types
    assert registered["version"] == partial.version == version

    trace = sharddbg.load_trace(ROOT / "tests" / "data" / "conv4.sdtrace.json")
    golden = _draw_every_figure(chromium, Path(trace.to_html(tmp_path / "golden.html")))
    assert (golden["bundle"], golden["version"], golden["evaluated"]) == ("cartesian", version, version), golden
    gl = go.Figure([go.Bar(x=[0, 1], y=[2, 3]), go.Scattergl(x=[0, 1, 2], y=[1, 3, 2], mode="lines+markers")])
    monkeypatch.setattr(html_report, "plot_imbalance", lambda _trace: gl)
    webgl = _draw_every_figure(chromium, Path(trace.to_html(tmp_path / "webgl.html")))
    assert (webgl["bundle"], webgl["version"], webgl["evaluated"]) == ("full", version, version), webgl
    assert webgl["figures"][-1]["types"] == ["bar", "scattergl"]
    for report in (golden, webgl):
        assert [f["name"] for f in report["figures"]] == ["timeline", "comm", "imbalance"] and not report["errors"]
        for f in report["figures"]:
            assert f["state"] == "drawn" and f["types"] and f["drawn"] == f["types"] and f["modules"], f
