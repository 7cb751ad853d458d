"""The clean install of tests/test_setup.py, started when the session starts and run beside the other tests.

The install (``bash .ci/setup --for demo`` on a clean clone: torch from disk, physicsnemo, ``npm ci`` and the
extension's build) takes minutes of pip, unzip and npm, and the suite leaves one of the two cores idle most of
the time. So ``tests/conftest.py`` clones the repository and starts this file as a process of its own when the
session has collected a test that needs the install; test_setup.py's fixtures later wait for its results and
assert on them exactly as on a foreground run (``pytest tests/test_setup.py`` alone goes the same way, with
nothing to overlap).

The process, ``python setup_in_background.py CLONE RESULTS``, runs, one after the other, niced:

- ``bash .ci/setup --for demo`` in ``CLONE``, then it records the length of pip's log;
- on the line ``tests`` on its stdin (sent once test_setup.py has checked the demo's venv),
  ``bash .ci/setup --for tests``.

Each run's stdout, stderr and exit status go to ``RESULTS/<name>.out|.err|.rc`` (``.rc`` last: its presence
says the run ended; ``timeout`` when it ran past ``RUN_TIMEOUT_S`` and was killed). Its stdin is the lifeline:
when it closes (the module is done, or the session ended in any way, even by SIGKILL) the running setup's whole
process group is killed and ``CLONE``'s folder (several GB with its venv) is removed, then the process exits.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

RUN_TIMEOUT_S = 1200  # one run of the setup; a clean install takes 3-8 minutes here
TIMED_OUT = "timeout"
DEMO, TESTS = "demo", "tests"
LOG = ".venv/sharddbg-setup.log"


def newcomer_env() -> dict[str, str]:
    """This environment without what would point the clone's Python elsewhere: the venv and the Python the tests
    run in, and a PYTHONPATH (which would import the checkout running the tests instead of the clone)."""
    return {k: v for k, v in os.environ.items() if k not in ("VIRTUAL_ENV", "SHARDDBG_PYTHON", "PYTHONPATH")}


# ---- the test session's side --------------------------------------------------------------------------------
RUNNING: "BackgroundSetup | None" = None  # the install this session started (``start_for``)


def start_for(repo: Path, setup_files: tuple[str, ...]) -> None:
    """Start the clean install (once a session): ``RUNNING``."""
    global RUNNING
    if RUNNING is None:
        RUNNING = BackgroundSetup.start(repo, setup_files)


def end_for_good() -> None:
    """At the session's end: the lifeline closed (the clone removed, a setup still running killed)."""
    if RUNNING is not None:
        RUNNING.end()


@dataclass
class BackgroundSetup:
    """The running install: the clone, where its results go, and the helper process (its stdin the lifeline)."""

    clone: Path
    results: Path
    process: subprocess.Popen
    had_a_venv: bool  # whether the fresh clone had a .venv before the install (it must not)
    tests_asked: bool = False

    @classmethod
    def start(cls, repo: Path, setup_files: tuple[str, ...]) -> "BackgroundSetup":
        """Clone ``repo`` (with the working tree's ``setup_files``, committed or not) into a new temporary folder
        and start the helper on it."""
        import tempfile

        root = Path(tempfile.mkdtemp(prefix="sharddbg-setup-"))
        clone, results = root / "sharddbg", root / "results"
        results.mkdir()
        try:
            subprocess.run(["git", "clone", "--quiet", str(repo), str(clone)], check=True, timeout=120)
            for setup_file in setup_files:
                shutil.copy2(repo / setup_file, clone / setup_file)
            had_a_venv = (clone / ".venv").exists()
            process = subprocess.Popen([sys.executable, __file__, str(clone), str(results)], stdin=subprocess.PIPE,
                                       stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                       start_new_session=True, env=newcomer_env())
        except BaseException:
            shutil.rmtree(root, ignore_errors=True)
            raise
        return cls(clone, results, process, had_a_venv)

    def ask_for_the_tests_install(self) -> None:
        """Start ``bash .ci/setup --for tests`` after the demo's (once; later calls do nothing)."""
        if not self.tests_asked:
            self.tests_asked = True
            self.process.stdin.write(b"tests\n")
            self.process.stdin.flush()

    def result(self, name: str) -> subprocess.CompletedProcess:
        """The run ``name`` (``demo`` or ``tests``) as ``subprocess.run`` would have returned it; waits for it.
        Raises ``subprocess.TimeoutExpired`` where it ran past ``RUN_TIMEOUT_S``, and RuntimeError where the
        helper died without a result."""
        rc_file = self.results / f"{name}.rc"
        while not rc_file.exists():
            if self.process.poll() is not None:
                raise RuntimeError(f"the background setup process ended (exit status {self.process.returncode}) "
                                   f"without a result of `bash .ci/setup --for {name}`")
            time.sleep(0.5)
        argv = ["bash", ".ci/setup", "--for", name]
        out, err = ((self.results / f"{name}.{kind}").read_text() for kind in ("out", "err"))
        rc = rc_file.read_text().strip()
        if rc == TIMED_OUT:
            raise subprocess.TimeoutExpired(argv, RUN_TIMEOUT_S, out, err)
        return subprocess.CompletedProcess(argv, int(rc), out, err)

    def demo_log_length(self) -> int:
        """The length of pip's log right after the demo's install."""
        self.result(DEMO)
        return int((self.results / "demo.logged").read_text())

    def end(self) -> None:
        """Close the lifeline: the helper kills a setup still running and removes the clone, by itself (nothing
        waits for the several GB of disk work)."""
        if self.process.stdin and not self.process.stdin.closed:
            try:
                self.process.stdin.close()
            except OSError:
                pass


# ---- the helper process -------------------------------------------------------------------------------------
class _Helper:
    def __init__(self, clone: Path, results: Path):
        self.clone, self.results = clone, results
        self.running: subprocess.Popen | None = None
        self.lock = threading.Lock()
        self.ending = False

    def run(self, name: str) -> None:
        with self.lock:
            if self.ending:
                return
            with open(self.results / f"{name}.out", "wb") as out, open(self.results / f"{name}.err", "wb") as err:
                self.running = subprocess.Popen(["bash", ".ci/setup", "--for", name], cwd=self.clone, stdout=out,
                                                stderr=err, stdin=subprocess.DEVNULL, start_new_session=True)
        try:
            rc = str(self.running.wait(timeout=RUN_TIMEOUT_S))
        except subprocess.TimeoutExpired:
            self.kill_running()
            rc = TIMED_OUT
        if name == DEMO:
            log = self.clone / LOG
            (self.results / "demo.logged").write_text(str(len(log.read_text()) if log.exists() else 0))
        done = self.results / f"{name}.rc.part"
        done.write_text(rc)
        done.rename(self.results / f"{name}.rc")

    def kill_running(self) -> None:
        proc = self.running
        if proc is not None and proc.poll() is None:
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            proc.wait()

    def end(self) -> None:
        """The lifeline closed: nothing of the install is left running or on disk."""
        with self.lock:
            self.ending = True
        self.kill_running()
        subprocess.run(["rm", "-rf", str(self.clone.parent)], check=False)  # faster than shutil.rmtree here
        os._exit(0)


def main(argv: list[str]) -> None:
    clone, results = Path(argv[0]), Path(argv[1])
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a Ctrl-C of the session ends it through the lifeline
    os.nice(10)  # the foreground tests first: the install takes the time the suite leaves idle
    helper = _Helper(clone, results)

    def install() -> None:
        helper.run(DEMO)
        asked.wait()
        helper.run(TESTS)

    asked = threading.Event()
    threading.Thread(target=install, daemon=True).start()
    for line in sys.stdin.buffer:
        if line.strip() == b"tests":
            asked.set()
    helper.end()


if __name__ == "__main__":
    main(sys.argv[1:])
