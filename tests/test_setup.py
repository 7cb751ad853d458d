"""The setup (``.ci/setup``) as a newcomer runs it, on a clean clone of this repository: one calm line per step,
progress on the long ones, no ``ERROR`` line (pip's note about physicsnemo's deliberately uninstalled
dependency list stays in the log), a last line saying what to run next; a second run installs nothing; a real
failure stops it with pip's reason. The clean install takes about two minutes here (torch comes from this
machine's disk)."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow  # a real install on a clean clone: about 2 minutes

REPO = Path(__file__).resolve().parents[1]
# what the setup reads: the working tree's versions are tested, committed or not
SETUP_FILES = (".ci/setup", ".ci/demo", ".ci/requirements.txt", ".ci/constraints.txt", "pyproject.toml")
STEP = re.compile(r"^sharddbg setup: \[(\d)/6\] ")
# chromium for the browser tests, only where it is missing
CHROMIUM = re.compile(r"^sharddbg setup: (Debian's chromium for the browser tests"
                      r"|note: could not install Debian's chromium)")
PROGRESS = re.compile(r"^sharddbg setup:       still at it after \d+ (s|min \d\d s)"
                      r"(: resolving: \d+ packages? so far|: installing \d+ packages?)?$")


def run_setup(where: Path, *args: str, **env: str) -> subprocess.CompletedProcess:
    environ = {k: v for k, v in os.environ.items() if k not in ("VIRTUAL_ENV", "SHARDDBG_PYTHON")}
    return subprocess.run(["bash", ".ci/setup", *args], cwd=where, capture_output=True, text=True, timeout=1200,
                          env={**environ, **env})


@pytest.fixture(scope="module")
def clone(tmp_path_factory):
    where = tmp_path_factory.mktemp("setup") / "sharddbg"
    subprocess.run(["git", "clone", "--quiet", str(REPO), str(where)], check=True, timeout=120)
    for name in SETUP_FILES:
        shutil.copy2(REPO / name, where / name)
    assert not (where / ".venv").exists()
    yield where
    shutil.rmtree(where, ignore_errors=True)  # its venv is several GB


@pytest.fixture(scope="module")
def installed(clone):
    return run_setup(clone)


def test_clean_install_says_what_it_does_without_error_lines(clone, installed):
    out = installed.stdout.splitlines()
    assert installed.returncode == 0, installed.stdout + installed.stderr
    assert installed.stderr == ""
    assert "ERROR" not in installed.stdout and "error" not in installed.stdout.lower()
    steps = [int(STEP.match(line).group(1)) for line in out if STEP.match(line)]
    assert steps == [1, 2, 3, 4, 5, 6], out
    assert all(STEP.match(line) or PROGRESS.match(line) or CHROMIUM.match(line) for line in out[:-1]), out
    assert any(PROGRESS.match(line) for line in out), "the long steps show progress"
    assert re.match(r"^sharddbg setup: ready in (\d+ s|\d+ min \d\d s) \(\./\.venv; pip's output in "
                    r"\.venv/sharddbg-setup\.log\)\. Next: bash \.ci/demo \(the demo on 4 CPU ranks\), or bash "
                    r"\.ci/run \(the tests\)\.$", out[-1]), out[-1]
    # pip's own output, the expected note about physicsnemo's dependency list included, is in the log
    log = (clone / ".venv/sharddbg-setup.log").read_text()
    assert "nvidia-physicsnemo 2.2.2 requires" in log and "Successfully installed" in log
    # the editable install: the clone's own package, imported from anywhere
    where = subprocess.run([str(clone / ".venv/bin/python"), "-c", "import sharddbg; print(sharddbg.__file__)"],
                           capture_output=True, text=True, check=True, cwd="/").stdout.strip()
    assert where == str(clone / "sharddbg/__init__.py")


def test_second_run_installs_nothing(clone, installed):
    again = run_setup(clone)
    assert again.returncode == 0 and again.stderr == ""
    assert again.stdout.splitlines() == ["sharddbg setup: everything is installed already (the requirement files did "
                                         "not change). Next: bash .ci/demo (the demo on 4 CPU ranks), or bash .ci/run "
                                         "(the tests)."]
    for caller, then in (("demo", "Starting the demo."), ("tests", "Starting the tests.")):
        assert run_setup(clone, "--for", caller).stdout.strip().endswith(then)


def test_a_real_failure_stops_with_its_reason(clone, installed):
    requirements = clone / ".ci/requirements.txt"
    before = requirements.read_text()
    requirements.write_text(before + "sharddbg-no-such-package\n")
    try:
        failed = run_setup(clone)
    finally:
        requirements.write_text(before)
    assert failed.returncode == 1
    steps = [int(STEP.match(line).group(1)) for line in failed.stdout.splitlines() if STEP.match(line)]
    assert steps == [1, 2, 3, 4], failed.stdout  # nothing after the failed step
    err = failed.stderr.splitlines()
    assert err[0] == ("sharddbg setup: [4/6] what physicsnemo's imports, sharddbg and its tests need "
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
