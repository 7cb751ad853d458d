"""The JupyterLab extension as a wheel carries it, on a clean clone of this repository: a source install without
Node.js installs the Python package and says the extension was not built. ``pip wheel`` of a clean clone that
``.ci/setup`` set up (``npm ci`` from the committed lockfile, then JupyterLab's builder) carries the extension,
and its install JupyterLab finds enabled (the labextension and the server extension), with no build step of its
own: that check (``wheel_carries_the_extension``) runs in tests/test_setup.py, on the clean clone it sets up
from nothing, so that the suite builds the extension once.

What the extension draws is checked in a real browser by tests/test_browser.py."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import zipfile
from dataclasses import dataclass
from pathlib import Path

import pytest

# a real source install (hatchling in pip's isolated build environment)
pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

REPO = Path(__file__).resolve().parents[1]
LABEXTENSION = "share/jupyter/labextensions/sharddbg-jupyterlab"
SERVER_CONFIG = "etc/jupyter/jupyter_server_config.d/sharddbg.json"
PURELIB = f"lib/python{sys.version_info.major}.{sys.version_info.minor}/site-packages"


def _clean_clone(where: Path) -> Path:
    """A clone of this repository with the working tree's tracked files (committed or not), nothing built."""
    subprocess.run(["git", "clone", "--quiet", str(REPO), str(where)], check=True, timeout=120)
    tracked = subprocess.run(["git", "ls-files", "-z"], cwd=REPO, capture_output=True, check=True).stdout
    for rel in filter(None, tracked.decode().split("\0")):
        if (REPO / rel).is_file():
            (where / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(REPO / rel, where / rel)
    assert not (where / "sharddbg" / "labextension").exists() and not (where / "extension" / "node_modules").exists()
    return where


def _pip(*args: str, env: dict[str, str], cwd: Path) -> subprocess.CompletedProcess:
    # every install here is into a prefix of its own, with --ignore-installed: pip would otherwise uninstall the
    # sharddbg of the environment running the tests (pip's --prefix looks at the running environment)
    return subprocess.run([sys.executable, "-m", "pip", "--disable-pip-version-check", "--no-input", *args],
                          cwd=cwd, env=env, capture_output=True, text=True, timeout=600)


def _env(**extra: str) -> dict[str, str]:
    return {**{k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}, **extra}


@dataclass
class SourceInstall:
    """A source install from a clean clone on a PATH without Node.js."""

    done: subprocess.CompletedProcess
    prefix: Path


@pytest.fixture(scope="module")
def without_node(tmp_path_factory) -> SourceInstall:
    work = tmp_path_factory.mktemp("labextension")
    clone = _clean_clone(work / "sharddbg")
    # no Node.js: a PATH with Python and git only
    bare_bin = work / "bin-without-node"
    bare_bin.mkdir()
    for tool in ("git",):
        (bare_bin / tool).symlink_to(shutil.which(tool))
    (bare_bin / "python").symlink_to(sys.executable)
    prefix = work / "without-node"
    done = _pip("install", "-v", "--no-deps", "--ignore-installed", "--prefix", str(prefix), ".", env=_env(PATH=str(bare_bin)),
                cwd=clone)
    return SourceInstall(done, prefix)


def wheel_carries_the_extension(clone: Path, work: Path) -> None:
    """``pip wheel`` of ``clone`` (whose ``.ci/setup`` built the extension with ``npm ci``: the wheel's build finds
    it up to date) carries the extension; installed, JupyterLab finds it enabled, the server extension too.
    Called by tests/test_setup.py on its clean clone, which has just been set up from nothing."""
    wheels = work / "wheels"
    built = _pip("wheel", "--no-deps", "-w", str(wheels), ".", env=_env(), cwd=clone)
    assert built.returncode == 0, built.stdout[-3000:] + built.stderr[-3000:]
    (wheel,) = wheels.glob("sharddbg-*.whl")
    prefix = work / "from-wheel"
    installed = _pip("install", "--no-deps", "--ignore-installed", "--prefix", str(prefix), str(wheel), env=_env(), cwd=work)
    assert installed.returncode == 0, installed.stdout[-3000:] + installed.stderr[-3000:]
    _wheel_checks(clone, wheel, prefix)
def test_a_source_install_without_node_installs_the_package_and_says_the_extension_was_not_built(without_node):
    done = without_node.done
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    said = done.stdout + done.stderr
    assert "sharddbg: the JupyterLab extension was NOT built: node and npm not found on PATH." in said, said[-3000:]
    assert "Install Node.js 20 (with npm) and install sharddbg again, or install it from a wheel." in said
    assert (without_node.prefix / PURELIB / "sharddbg" / "labserver.py").exists()
    assert not (without_node.prefix / LABEXTENSION).exists()


def _wheel_checks(clone: Path, wheel: Path, prefix: Path) -> None:
    names = zipfile.ZipFile(wheel).namelist()
    data = "sharddbg-0.1.0.data/data/"
    assert data + LABEXTENSION + "/package.json" in names
    assert any(n.startswith(data + LABEXTENSION + "/static/remoteEntry.") for n in names), names
    assert data + SERVER_CONFIG in names
    # the views' own front end, bundled once into the extension, still ships with the package for the widgets
    assert {"sharddbg/views/_static/explorer.js", "sharddbg/views/_static/style.css",
            "sharddbg/views/templates/explorer.html"} <= set(names)
    # plotly's partial bundle for the standalone report, fetched by the same npm ci and copied into the package
    assert "sharddbg/plotlyjs/plotly-cartesian.min.js" in names
    # the lockfile made the build: npm ci left node_modules in the clone
    assert (clone / "extension" / "node_modules" / ".package-lock.json").exists()
    env = _env(JUPYTER_PATH=str(prefix / "share" / "jupyter"), JUPYTER_CONFIG_PATH=str(prefix / "etc" / "jupyter"),
               PYTHONPATH=str(prefix / PURELIB), JUPYTER_CONFIG_DIR=str(prefix / "user-config"))
    jupyter = [sys.executable, "-m", "jupyter"]
    lab = subprocess.run([*jupyter, "labextension", "list"], env=env, capture_output=True, text=True, timeout=120)
    listed = lab.stdout + lab.stderr
    line = next((x for x in listed.splitlines() if "sharddbg-jupyterlab" in x), "")
    assert str(prefix / "share" / "jupyter" / "labextensions") in listed and "enabled" in line and "OK" in line, listed
    # the server extension: enabled by the config file the wheel installs, read as Jupyter Server reads it
    # (`jupyter server extension list` reads only the user's, the prefix's and the system's folders)
    code = ("from jupyter_core.paths import jupyter_config_path; "
            "from jupyter_server.extension.config import ExtensionConfigManager; "
            "import sharddbg.labserver as m; "
            "print(ExtensionConfigManager(read_config_path=jupyter_config_path()).get_jpserver_extensions(), "
            "m.__file__, m._jupyter_server_extension_points())")
    server = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120,
                            cwd=prefix)
    assert server.returncode == 0, server.stderr
    assert "'sharddbg.labserver': True" in server.stdout and str(prefix / PURELIB) in server.stdout, server.stdout


# ---- the server side's pieces, without a server (fast) ------------------------------------------------------------
def _diagnosis(rank: int, entries: list[dict]) -> dict:
    """A rank's diagnosis as its control thread answers a brief request (``engine.control.diagnosis``)."""
    return {"rank": rank, "pid": 100 + rank, "stack": [], "groups": {"0": [0, 1]}, "mesh_dims": {"0": "domain"},
            "flight_recorder": {"available": True, "entries": entries}}


def _entry(seq: int, completed: bool, created_s: float) -> dict:
    return {"group": "0", "group_desc": "", "seq": seq, "p2p_seq": 0, "is_p2p": False, "name": "gloo:all_reduce",
            "input_sizes": [[4]], "dtypes": ["Float"], "completed": completed, "state": "", "timeout_ms": 60_000,
            "time_created_ns": int(created_s * 1e9)}


def test_the_state_file_names_the_collective_a_stuck_rank_waits_in_and_the_last_trace(tmp_path, monkeypatch):
    import json
    import time
    from dataclasses import asdict

    from sharddbg.cluster import state_file

    now = time.time()
    # rank 0 waits in its 2nd all_reduce on 'domain', which rank 1 never issued; rank 1 waits in nothing
    stuck = state_file.stuck_collectives({0: _diagnosis(0, [_entry(1, True, now - 9), _entry(2, False, now - 5)]),
                                          1: _diagnosis(1, [_entry(1, True, now - 9)])}, {0: 100, 1: 101})
    assert list(stuck) == [0]
    assert (stuck[0].collective, stuck[0].group, stuck[0].group_ranks, stuck[0].missing_ranks) == ("all_reduce", "domain", [0, 1], [1])
    assert stuck[0].since == pytest.approx(now - 5, abs=1e-3)
    assert "never joined by: rank 1" in stuck[0].description
    # what the panel's endpoint reads back: the stuck rank with its collective, the last trace
    monkeypatch.setenv("SHARDDBG_HOME", str(tmp_path))
    state = state_file.ClusterState(
        cluster_id="c0ffee", ranks=2, mesh="domain=2", backend="gloo", patch_mode="none", owner_pid=os.getpid(),
        owner_kernel=None, started=now, updated=now,
        rank_states=[state_file.RankState(0, 100, "stuck", stuck_in=stuck[0]), state_file.RankState(1, 101, "busy")],
        last_trace=state_file.LastTrace(path=str(state_file.last_trace_path("c0ffee")), label="2 ranks, 4 events", saved=now))
    state_file.state_path("c0ffee").write_text(json.dumps(asdict(state)))
    (read,) = state_file.read_states()
    assert read == state
    assert (tmp_path / "cluster-state" / "last-trace").stat().st_mode & 0o777 == 0o700  # private
    state_file.forget("c0ffee")
    assert state_file.read_states() == []


def test_a_recorded_jobs_files_open_the_whole_job_with_the_views():
    from sharddbg import load_trace
    from sharddbg.labserver import trace_answer, trace_source

    job = REPO / "tests" / "data" / "recorded_job"
    assert trace_source(job / "job.json") == job and trace_source(job / "rank-00000.jsonl") == job
    assert trace_source(job.parent / "conv4.sdtrace.json") == job.parent / "conv4.sdtrace.json"
    answer = trace_answer(load_trace(trace_source(job / "rank-00000.jsonl")))
    assert [v["view"] for v in answer["views"]] == ["explorer", "timeline", "comm"]
    explorer, timeline, comm = (v["drawn"] for v in answer["views"])
    assert "Tensor.matmul" in json.dumps(explorer)
    assert timeline["figure"]["data"] and comm["figure"]["layout"]
