"""Test modules that run in a pytest process of their own, beside the rest of the session.

The engine launchers' tests (tests/test_launchers.py) start clusters whose engines are not forks of a preloaded
fork server: every engine imports torch and physicsnemo itself. The recorded jobs' tests (tests/test_record_job.py)
run torchrun jobs whose every rank does the same. Minutes of CPU in all, while the session's other tests leave one
of the two cores idle much of the time (they wait on kernels, browsers and collectives). So when a session
selects them together with other tests, ``tests/conftest.py`` runs them in a second pytest
process (``BackgroundRun``: niced, its own ``SHARDDBG_HOME``, its report in JUnit XML; started once the browser
and notebook tests are done, which a busy machine slows most) and puts in their place
items of the same names (``ResultOfBackgroundRun``) that, late in the session, wait for that process and pass,
skip or fail exactly as the test did there, with its failure text. Run alone (``pytest tests/test_launchers.py``)
they run in the foreground as usual. A session that ends in any way ends the second process with it.
"""

from __future__ import annotations

import ctypes
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from dataclasses import dataclass
from pathlib import Path

import pytest

BACKGROUND_MODULES = ("test_record_job.py", "test_launchers.py")
# the modules the second process waits for: their browsers, kernels and pages are the most sensitive to a busy
# machine (a run beside them made them 115 s slower), and the clean install shares their minutes already
NOT_BESIDE = ("test_browser.py", "test_notebooks.py")
INSIDE_ENV = "SHARDDBG_TESTS_IN_BACKGROUND"  # set in the second process: it runs its tests itself
WAIT_S = 1800.0  # the second process's whole run; its tests' own limits are far below
NICENESS = 10  # below the session's tests (like the clean install); its engines still answer their heartbeats
PR_SET_PDEATHSIG = 1


def inside_background_run() -> bool:
    return os.environ.get(INSIDE_ENV) == "1"


@dataclass(frozen=True)
class BackgroundResult:
    """One test's outcome in the second process, from its JUnit report."""

    outcome: str  # passed | failed | skipped
    message: str
    text: str


def _in_child() -> None:
    os.nice(NICENESS)
    # the session's death (even SIGKILL) ends this process too: its clusters then end with their owner
    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)


class BackgroundRun:
    """The second pytest process and its results."""

    def __init__(self, repo: Path, nodeids: list[str]):
        self.folder = Path(tempfile.mkdtemp(prefix="sharddbg-tests-in-background-"))
        self.junit = self.folder / "junit.xml"
        self.output = self.folder / "output.txt"
        home = self.folder / "home"
        env = dict(os.environ, **{INSIDE_ENV: "1", "SHARDDBG_HOME": str(home)})
        with open(self.output, "wb") as out:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-q", "-rA", f"--junitxml={self.junit}",
                 *nodeids], cwd=repo, env=env, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
                start_new_session=True, preexec_fn=_in_child)
        self._results: dict[str, BackgroundResult] | None = None

    def result_of(self, nodeid: str) -> BackgroundResult:
        """The test's outcome, once the second process ended (waited for, at most ``WAIT_S`` from now)."""
        if self._results is None:
            try:
                self.proc.wait(timeout=WAIT_S)
            except subprocess.TimeoutExpired:
                self.end()
                raise AssertionError(f"the tests run beside the session did not end within {WAIT_S:.0f} s; "
                                     f"their output so far: {self.output}") from None
            self._results = self._read_results()
        found = self._results.get(nodeid)
        if found is None:
            return BackgroundResult("failed", "no result", f"the run beside the session has no result for {nodeid} "
                                    f"(it exited with status {self.proc.returncode}):\n{self.tail()}")
        return found

    def _read_results(self) -> dict[str, BackgroundResult]:
        if not self.junit.exists():
            return {}
        results = {}
        for case in ET.parse(self.junit).getroot().iter("testcase"):
            module = case.get("classname", "").replace(".", "/") + ".py"
            nodeid = f"{module}::{case.get('name')}"
            outcome, message, text = "passed", "", ""
            for tag in ("failure", "error", "skipped"):
                element = case.find(tag)
                if element is not None:
                    outcome = "skipped" if tag == "skipped" else "failed"
                    message = element.get("message", "")
                    text = (element.text or "").strip()
                    break
            if outcome == "failed" and results.get(nodeid, BackgroundResult("passed", "", "")).outcome == "failed":
                previous = results[nodeid]  # a failure in the test and another in its teardown: both told
                text = f"{previous.text}\n\n{text}"
            if nodeid not in results or outcome == "failed":
                results[nodeid] = BackgroundResult(outcome, message, text)
        return results

    def tail(self, lines: int = 40) -> str:
        try:
            return "\n".join(self.output.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""

    def end(self) -> None:
        if self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGTERM)
                self.proc.wait(timeout=30)
            except (ProcessLookupError, subprocess.TimeoutExpired):
                try:
                    os.killpg(self.proc.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass


RUNNING: BackgroundRun | None = None
_WAITING: tuple[Path, list[str]] | None = None  # what starts once the session has passed NOT_BESIDE


def start_when_due(item) -> None:
    """Before each test: start the second process once the session runs a test outside ``NOT_BESIDE``."""
    global RUNNING, _WAITING
    if _WAITING is not None and item.path.name not in NOT_BESIDE:
        repo, nodeids = _WAITING
        _WAITING = None
        RUNNING = BackgroundRun(repo, nodeids)


class FailedInBackground(Exception):
    """A test that failed in the run beside the session: its own failure text."""


class ResultOfBackgroundRun(pytest.Item):
    """Stands for a test run beside the session: waits for that run, then passes, skips or fails as it did."""

    def runtest(self) -> None:
        t0 = time.monotonic()
        result = RUNNING.result_of(self.nodeid)
        self.user_properties.append(("waited_for_background_s", round(time.monotonic() - t0, 1)))
        if result.outcome == "skipped":
            pytest.skip(result.message or "skipped in the run beside the session")
        if result.outcome == "failed":
            raise FailedInBackground(result.text or result.message)

    def repr_failure(self, excinfo):
        if isinstance(excinfo.value, FailedInBackground):
            return (f"{excinfo.value}\n\n(run in a pytest process of its own beside the session; its whole output: "
                    f"{RUNNING.output})")
        return super().repr_failure(excinfo)

    def reportinfo(self):
        return self.path, None, self.name


def hand_over(session_items: list, repo: Path) -> None:
    """Where the session runs other tests too: the background modules' selected tests go to the second process
    (started by ``start_when_due``), and their stand-ins take their places (``session_items`` is changed in
    place)."""
    global _WAITING
    if inside_background_run():
        return
    chosen = [item for item in session_items if item.path.name in BACKGROUND_MODULES]
    if not chosen or len(chosen) == len(session_items):
        return
    _WAITING = (repo, [item.nodeid for item in chosen])
    for index, item in enumerate(session_items):
        if item.path.name in BACKGROUND_MODULES:
            session_items[index] = ResultOfBackgroundRun.from_parent(item.parent, name=item.name)


def end_for_good() -> None:
    """At the session's end: the second process ended (killed if it still runs); its folder removed when every
    test there passed or skipped (kept, with its output and its clusters' logs, when one failed)."""
    if RUNNING is not None:
        RUNNING.end()
        if RUNNING.proc.returncode == 0:
            shutil.rmtree(RUNNING.folder, ignore_errors=True)
