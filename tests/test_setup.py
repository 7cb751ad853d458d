"""The setup (``.ci/setup``) as a newcomer runs it, on a clean clone of this repository: the demo's install first
(``bash .ci/demo``'s): one calm line per step, progress on the long ones, no ``ERROR`` line (pip's note about
physicsnemo's deliberately uninstalled dependency list stays in the log), a last line saying what starts next,
and none of the tests' tools; then the tests' (``bash .ci/run``'s) on that venv: those tools, and only them, in
one step; a second run installs nothing; a real failure stops it with pip's reason. One clean install takes a
few minutes here (torch comes from this machine's disk), so there is one: the tests' install from scratch (all
seven steps in one run) is what CI itself does on its clean clone before every test.

The clean clone and its two installs (the demo's, then the tests') start when the session starts and run beside
the other tests (``setup_in_background``; ``tests/conftest.py`` starts it): the fixtures below wait for their
results. The demo's venv is checked before the tests' install is let go on it."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest

import setup_in_background
from setup_in_background import newcomer_env

# a real install on a clean clone: several minutes (a clean install for the demo took 7.5 minutes on this 2-core
# machine while other tests ran), more than the suite's 600 s a test
pytestmark = [pytest.mark.slow, pytest.mark.timeout(1800)]

REPO = Path(__file__).resolve().parents[1]
# what the setup reads: the working tree's versions are tested, committed or not
SETUP_FILES = (".ci/setup", ".ci/demo", ".ci/requirements.txt", ".ci/requirements-tests.txt", ".ci/constraints.txt",
               "pyproject.toml")
STEP = re.compile(r"^sharddbg setup: \[(\d)/(\d)\] ")
# Debian's packages for the tests (chromium, openssh-server, slurm-wlm and munge), each only where it is missing
CHROMIUM = re.compile(r"^sharddbg setup: (Debian's (chromium|openssh-server|slurm-wlm munge) for the "
                      r"|note: could not install Debian's )")
PROGRESS = re.compile(r"^sharddbg setup:       still at it after \d+ (s|min \d\d s)"
                      r"(: resolving: \d+ packages? so far|: installing \d+ packages?)?$")
READY = r"^sharddbg setup: ready in (\d+ s|\d+ min \d\d s) \(\./\.venv; pip's output in \.venv/sharddbg-setup\.log\)\. "
TESTS_ONLY = ("sharddbg setup: ./.venv has what the demo needs; adding the tests' tools only "
              "(.ci/requirements-tests.txt) ...")
# what requirements-tests.txt brings, by import name; the demo's install has none of them
TEST_TOOLS = ("pytest", "pytest_timeout", "playwright", "mkdocs", "mkdocstrings", "material")


def steps(out: list[str]) -> list[tuple[int, int]]:
    """(step, of how many) of each step line."""
    return [(int(m.group(1)), int(m.group(2))) for m in map(STEP.match, out) if m]


def importable(where: Path, names) -> list[str]:
    """Which of the modules ``names`` the clone's venv finds."""
    code = "import importlib.util, sys; print(*[n for n in sys.argv[1:] if importlib.util.find_spec(n)])"
    return subprocess.run([str(where / ".venv/bin/python"), "-c", code, *names], capture_output=True, text=True,
                          check=True, cwd="/", env=newcomer_env()).stdout.split()


def run_setup(where: Path, *args: str, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", ".ci/setup", *args], cwd=where, capture_output=True, text=True, timeout=1200,
                          env={**newcomer_env(), **env})


@pytest.fixture(scope="module")
def background() -> setup_in_background.BackgroundSetup:
    """The clean clone and its installs that the session started (``tests/conftest.py``); ended (the clone
    removed, by a process of its own) when the module is done."""
    running = setup_in_background.RUNNING
    assert running is not None, "tests/conftest.py starts the clean install when the session collects this module"
    yield running
    running.end()


@pytest.fixture(scope="module")
def clone(background):
    assert not background.had_a_venv
    return background.clone


@pytest.fixture(scope="module")
def demo_installed(background):
    """``bash .ci/demo``'s install on the clean clone, and the length of pip's log after it."""
    return background.result(setup_in_background.DEMO), background.demo_log_length()


@pytest.fixture(scope="module")
def tests_added(background, demo_installed):
    """``bash .ci/run``'s install on the venv the demo set up."""
    background.ask_for_the_tests_install()
    return background.result(setup_in_background.TESTS)


def test_the_demo_install_says_what_it_does_without_error_lines(background, clone, demo_installed):
    demo, _ = demo_installed
    out = demo.stdout.splitlines()
    assert demo.returncode == 0 and demo.stderr == "", demo.stdout + demo.stderr
    assert "ERROR" not in demo.stdout and "error" not in demo.stdout.lower()
    assert steps(out) == [(n, 6) for n in range(1, 7)], out
    assert not any(CHROMIUM.match(line) for line in out), "the demo needs no browser"
    assert all(STEP.match(line) or PROGRESS.match(line) for line in out[:-1]), out
    assert any(PROGRESS.match(line) for line in out), "the long steps show progress"
    assert re.match(READY + r"Starting the demo\.$", out[-1]), out[-1]
    # pip's own output, the expected note about physicsnemo's dependency list included, is in the log
    log = (clone / ".venv/sharddbg-setup.log").read_text()
    assert "nvidia-physicsnemo 2.2.2 requires" in log and "Successfully installed" in log
    # the editable install: the clone's own package, imported from anywhere
    where = subprocess.run([str(clone / ".venv/bin/python"), "-c", "import sharddbg; print(sharddbg.__file__)"],
                           capture_output=True, text=True, check=True, cwd="/", env=newcomer_env()).stdout.strip()
    assert where == str(clone / "sharddbg/__init__.py")
    assert importable(clone, ("torch", "physicsnemo", "sharddbg", "jinja2", "jupyterlab")) == [
        "torch", "physicsnemo", "sharddbg", "jinja2", "jupyterlab"]
    assert importable(clone, TEST_TOOLS) == []
    # the demo's venv is checked: the tests' install may go on with it (beside the wheel's test)
    background.ask_for_the_tests_install()


def test_the_wheel_of_the_set_up_clone_carries_the_jupyterlab_extension(clone, demo_installed, tmp_path):
    """``pip wheel`` of the clone its setup built the extension in: the wheel carries it, JupyterLab finds it."""
    from test_labextension import wheel_carries_the_extension

    assert demo_installed[0].returncode == 0
    wheel_carries_the_extension(clone, tmp_path)


def test_the_tests_then_add_their_tools_and_only_them(clone, demo_installed, tests_added):
    _, logged = demo_installed
    out = [line for line in tests_added.stdout.splitlines() if not CHROMIUM.match(line)]
    assert tests_added.returncode == 0 and tests_added.stderr == "", tests_added.stdout + tests_added.stderr
    assert out[0] == TESTS_ONLY and steps(out) == [], out  # one line says what happens; no step runs again
    assert all(PROGRESS.match(line) for line in out[1:-1]), out
    assert re.match(READY + r"Starting the tests\.$", out[-1]), out[-1]
    assert importable(clone, TEST_TOOLS) == list(TEST_TOOLS)
    assert (clone / ".venv/bin/mpiexec").is_file()  # the mpich wheel's, for Cluster(launcher="mpi")
    # pip installed the tools and nothing of the demo's again
    added = (clone / ".venv/sharddbg-setup.log").read_text()[logged:]
    installed_now = re.search(r"^Successfully installed (.*)$", added, re.MULTILINE).group(1).split()
    assert any(name.startswith("pytest-") for name in installed_now), installed_now
    assert any(name.startswith("mkdocs-") for name in installed_now), installed_now
    assert not [name for name in installed_now if name.startswith(("torch-", "nvidia-physicsnemo-", "pandas-"))]


def test_second_run_installs_nothing(clone, tests_added):
    again = run_setup(clone)
    assert again.returncode == 0 and again.stderr == ""
    assert again.stdout.splitlines() == ["sharddbg setup: everything is installed already (the requirement files did "
                                         "not change). Next: bash .ci/demo (the demo on 4 CPU ranks), or bash .ci/run "
                                         "(the tests)."]
    for caller, then in (("demo", "Starting the demo."), ("tests", "Starting the tests.")):
        assert run_setup(clone, "--for", caller).stdout.splitlines() == [
            f"sharddbg setup: everything is installed already (the requirement files did not change). {then}"]


def test_a_real_failure_stops_with_its_reason(clone, tests_added):
    requirements = clone / ".ci/requirements.txt"
    before = requirements.read_text()
    requirements.write_text(before + "sharddbg-no-such-package\n")
    try:
        failed = run_setup(clone)
    finally:
        requirements.write_text(before)
    assert failed.returncode == 1
    assert steps(failed.stdout.splitlines()) == [(n, 7) for n in (1, 2, 3, 4)], failed.stdout  # nothing after it
    err = failed.stderr.splitlines()
    assert err[0] == ("sharddbg setup: [4/7] what physicsnemo's imports, sharddbg, the demo and the notebooks need "
                      "(.ci/requirements.txt): failed (exit status 1). The reason:"), err
    assert "No matching distribution found for sharddbg-no-such-package" in failed.stderr
    assert "dependency resolver" not in failed.stderr  # the expected note is not offered as the reason
    assert err[-1] == ("sharddbg setup: the whole output: .venv/sharddbg-setup.log. Nothing after this step was "
                       "installed.")
    # the failed run did not mark the venv as set up: with the requirements back, it is complete as before
    assert run_setup(clone).stdout.startswith("sharddbg setup: everything is installed already")


def test_no_python_and_bad_arguments_are_refused_at_once(tmp_path):
    for name in SETUP_FILES:
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(REPO / name, tmp_path / name)
    no_python = run_setup(tmp_path, SHARDDBG_PYTHON="/no/such/python")
    assert no_python.returncode == 1 and no_python.stdout == ""
    assert no_python.stderr == ("sharddbg setup: no Python found at '/no/such/python': install Python 3.10 or newer, "
                                "or set SHARDDBG_PYTHON to one\n")
    bad = run_setup(tmp_path, "--for", "x")
    assert bad.returncode == 2 and bad.stderr == "sharddbg setup: --for takes demo or tests, got 'x'\n"
    assert not (tmp_path / ".venv").exists()
