"""The notebook front end in a real browser: JupyterLab on loopback, Debian's chromium driven by Playwright,
the quickstart notebook run for real on a 4-rank CPU cluster.

Checks what a user sees: the inspector's blocks (one per rank, the right local shapes), the timeline's
rows (one per rank), the explorer's detail after clicking a fallback op, and an error message that
contains HTML shown as text. Screenshots go to test-artifacts/ (gitignored).
"""

from __future__ import annotations

import json
import os
import re
import secrets
import shutil
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
ARTIFACTS = ROOT / "test-artifacts"
CHROMIUM = "/usr/bin/chromium"
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync", "--no-first-run"]
N = 4
ROWS = [66 // N + (1 if r < 66 % N else 0) for r in range(N)]  # 17, 17, 16, 16

pytestmark = [pytest.mark.browser, pytest.mark.cluster]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _settings(directory: Path) -> None:
    """JupyterLab user settings for the test: render every cell (no windowing), no news or update checks."""
    files = {
        "@jupyterlab/notebook-extension/tracker.jupyterlab-settings": {"windowingMode": "none"},
        "@jupyterlab/apputils-extension/notification.jupyterlab-settings": {"fetchNews": "false", "checkForUpdates": False},
    }
    for rel, content in files.items():
        p = directory / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(json.dumps(content))


@pytest.fixture(scope="module")
def lab(tmp_path_factory):
    """A JupyterLab server on 127.0.0.1 serving a scratch copy of the notebooks; yields (url, token, root)."""
    # A missing browser is a broken set-up, not a reason to check nothing: fail loudly.
    assert os.path.exists(CHROMIUM), f"{CHROMIUM} is missing: install Debian's chromium (bash .ci/setup does)"
    import playwright.sync_api  # noqa: F401
    work = tmp_path_factory.mktemp("lab")
    root = work / "root"
    root.mkdir()
    shutil.copy(ROOT / "notebooks" / "01_quickstart.ipynb", root)
    _settings(work / "settings")
    token, port = secrets.token_hex(16), _free_port()
    env = dict(os.environ, OMP_NUM_THREADS="1", JUPYTERLAB_SETTINGS_DIR=str(work / "settings"),
               JUPYTERLAB_WORKSPACES_DIR=str(work / "workspaces"), JUPYTER_CONFIG_DIR=str(work / "config"),
               JUPYTER_RUNTIME_DIR=str(work / "runtime"))
    log = open(work / "lab.log", "w")
    proc = subprocess.Popen(
        [sys.executable, "-m", "jupyterlab", "--allow-root", "--no-browser", "--ip=127.0.0.1", f"--port={port}",
         f"--ServerApp.token={token}", f"--ServerApp.root_dir={root}", "--ServerApp.open_browser=False",
         "--LabApp.news_url=", "--ServerApp.disable_check_xsrf=False"],
        cwd=root, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                urllib.request.urlopen(f"{url}/api/status?token={token}", timeout=2).read()
                break
            except OSError:
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"JupyterLab did not start; log:\n{(work / 'lab.log').read_text()[-3000:]}")
                time.sleep(0.3)
        yield url, token, root
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        log.close()


def _wait_kernel_idle(url: str, token: str, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    state = None
    while time.monotonic() < deadline:
        sessions = json.loads(urllib.request.urlopen(f"{url}/api/sessions?token={token}", timeout=5).read())
        states = [s["kernel"]["execution_state"] for s in sessions if s.get("kernel")]
        state = states
        if states == ["idle"]:
            return
        time.sleep(0.3)
    raise AssertionError(f"the notebook's kernel did not become idle within {timeout} s: {state}")


def test_quickstart_in_jupyterlab(lab):
    from playwright.sync_api import expect, sync_playwright

    url, token, root = lab
    ARTIFACTS.mkdir(exist_ok=True)
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        page = browser.new_page(viewport={"width": 1500, "height": 1100})
        page_errors: list[str] = []
        page.on("pageerror", lambda e: page_errors.append(str(e)))
        try:
            page.goto(f"{url}/lab/tree/01_quickstart.ipynb?token={token}", wait_until="domcontentloaded")
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
            expect(page.locator(".jp-OutputArea-output", has_text="sharddbg: stopped 4 ranks")).to_have_count(
                1, timeout=150_000)
            expect(page.locator(".jp-Notebook-ExecutionIndicator[data-status='idle']")).to_have_count(1, timeout=30_000)

            # inspector: one block per rank with the real local shapes and offsets
            insp = page.locator(".sd-inspector")
            expect(insp).to_have_count(1)
            blocks = insp.locator(".sd-block")
            expect(blocks).to_have_count(N)
            for r in range(N):
                b = insp.locator(f".sd-block[data-ranks='{r}']")
                expect(b).to_have_attribute("data-local-shape", f"1,3,{ROWS[r]},64")
                off = sum(ROWS[:r])
                expect(b).to_have_attribute("data-rows", f"{off}-{off + ROWS[r]}")
                expect(b).to_contain_text(f"rank {r}")
                expect(insp.locator(f"tr[data-rank='{r}'] td.sd-col-local_shape")).to_have_text(f"(1, 3, {ROWS[r]}, 64)")
            # uneven shards are marked, and drawn smaller
            expect(insp.locator(".sd-block.sd-uneven")).to_have_count(2)
            h = [insp.locator(f".sd-block[data-ranks='{r}'] rect").first.bounding_box()["height"] for r in range(N)]
            assert h[0] == pytest.approx(h[1]) and h[2] == pytest.approx(h[3]) and h[0] > h[2]
            insp.screenshot(path=str(ARTIFACTS / "browser_inspector.png"))
            # another pair of dims: channels x H; W is not sharded, so still one block per rank
            insp.locator("select.sd-dims").select_option(label="rows: dim 1 (3) × cols: dim 2 (66)")
            for r in range(N):
                off = sum(ROWS[:r])
                expect(insp.locator(f".sd-block[data-ranks='{r}']")).to_have_attribute("data-cols", f"{off}-{off + ROWS[r]}")

            # timeline: one row per rank
            plot = page.locator(".js-plotly-plot")
            expect(plot).to_have_count(1)
            expect(plot.locator(".ytick text")).to_have_text([f"rank {r}" for r in range(N)])
            plot.scroll_into_view_if_needed()
            plot.screenshot(path=str(ARTIFACTS / "browser_timeline.png"))
            # hover over the middle of the first conv2d span of rank 2: its shapes and bytes
            pos = plot.evaluate("""(d) => {
                const L = d._fullLayout, r = d.getBoundingClientRect();
                for (const t of d._fullData) {
                  if (t.mode !== 'markers' || !t.hovertext) continue;
                  for (let i = 0; i < t.hovertext.length; i++) {
                    const h = t.hovertext[i];
                    if (h.includes('torch.conv2d') && h.includes('rank 2 ') && h.includes('forward'))
                      return [r.left + L.xaxis._offset + L.xaxis.l2p(t.x[i]), r.top + L.yaxis._offset + L.yaxis.l2p(t.y[i])];
                  }
                }
                return null; }""")
            assert pos is not None
            page.mouse.move(pos[0], pos[1])
            hover = plot.locator(".hoverlayer .hovertext")
            expect(hover).to_contain_text("torch.conv2d")
            expect(hover).to_contain_text(f"(1, 3, {ROWS[2]}, 64)")
            expect(hover).to_contain_text("bytes in")
            page.mouse.move(5, 5)

            # explorer: click a fallback op -> its detail, the same call on every rank
            exp = page.locator(".sd-explorer")
            expect(exp).to_have_count(1)
            fb = exp.locator("tr.sd-kind-fallback[data-op='Tensor.abs']").first
            fb.scroll_into_view_if_needed()
            fb.click()
            detail = exp.locator(".sd-detail")
            expect(detail).to_be_visible()
            expect(detail.locator(".sd-detail-op")).to_have_text("Tensor.abs")
            expect(detail).to_contain_text("ran through the DTensor fallback")
            rows = detail.locator("table.sd-per-rank tbody tr")
            expect(rows).to_have_count(N)
            for r in range(N):
                expect(rows.nth(r).locator("td.sd-col-in_local_shapes")).to_have_text(f"(1, 2, {ROWS[r]}, 64)")
            exp.screenshot(path=str(ARTIFACTS / "browser_explorer_fallback.png"))
            # filters: rank 2 and the DTensor fallbacks only
            exp.locator("select.sd-f-rank").select_option("2")
            exp.locator("select.sd-f-path").select_option("@fallback")
            listed = exp.locator(".sd-list tr.sd-op")
            assert listed.count() > 0
            assert set(listed.evaluate_all("rs => rs.map(r => r.dataset.rank + ':' + r.dataset.kind)")) == {"2:fallback"}
            exp.locator("select.sd-f-rank").select_option("")
            exp.locator("select.sd-f-path").select_option("")

            # an error whose message contains HTML is shown as text, not rendered
            err = exp.locator("tr.sd-kind-error").first
            err.click()
            msg = detail.locator(".sd-error-msg")
            expect(msg).to_have_text("TypeError: broken_add: expected <ShardTensor> & got <b>None</b>")
            expect(detail.locator("b")).to_have_count(0)
            expect(detail.locator("pre.sd-tb")).to_contain_text("broken_add")
            exp.screenshot(path=str(ARTIFACTS / "browser_explorer_error.png"))
            page.screenshot(path=str(ARTIFACTS / "browser_quickstart.png"))
            assert not page_errors, page_errors
        except Exception:
            page.screenshot(path=str(ARTIFACTS / "browser_failure.png"))
            raise
        finally:
            browser.close()
