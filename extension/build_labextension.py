"""Builds the JupyterLab extension while a wheel of sharddbg is built (hatch-jupyter-builder's build function,
named in pyproject.toml): ``npm ci`` from the committed lockfile, then ``npm run build`` (TypeScript, then
JupyterLab's builder) into ``sharddbg/labextension``, which the wheel installs into
``share/jupyter/labextensions/sharddbg-jupyterlab``.

Without Node.js and npm the Python package still builds and installs; the build then says, on its output and
as a warning, that the extension was not built (the notebook's views fall back to their static copies in a
notebook reopened without its kernel). A build that is up to date is not run again.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import sysconfig
import warnings
from pathlib import Path

HERE = Path(__file__).resolve().parent
OUTPUT = HERE.parent / "sharddbg" / "labextension"
# what the built extension is made from: a change to any of them builds it again
SOURCES = [HERE / "package.json", HERE / "package-lock.json", HERE / "tsconfig.json", *sorted((HERE / "src").glob("*")),
           *sorted((HERE / "style").glob("*")), *sorted((HERE.parent / "sharddbg" / "views" / "_static").glob("*"))]
NOT_BUILT = ("sharddbg: the JupyterLab extension was NOT built: {why}. The Python package is installed without "
             "it: a notebook reopened without its kernel shows the views' static copies, and trace files do not open "
             "as documents. Install Node.js 20 (with npm) and install sharddbg again, or install it from a wheel.")


def say(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def up_to_date() -> bool:
    """The built extension is newer than everything it is built from."""
    built = OUTPUT / "package.json"
    if not built.exists():
        return False
    return built.stat().st_mtime >= max(p.stat().st_mtime for p in SOURCES if p.exists())


def build(target_name: str, version: str, **_: object) -> None:
    """Build the extension for a wheel (a standard or an editable one); an sdist carries its sources only."""
    if target_name != "wheel":
        return
    if up_to_date():
        say(f"sharddbg: the JupyterLab extension in {OUTPUT} is up to date")
        return
    missing = [tool for tool in ("node", "npm") if shutil.which(tool) is None]
    if missing:
        why = f"{' and '.join(missing)} not found on PATH"
        if (OUTPUT / "package.json").exists():
            say(f"sharddbg: {why}: the JupyterLab extension built before ({OUTPUT}) is used as it is")
            return
        say(NOT_BUILT.format(why=why))
        warnings.warn(NOT_BUILT.format(why=why), stacklevel=1)
        return
    # the build environment's scripts first: jupyter-builder (JupyterLab's builder) comes from there
    env = dict(os.environ, PATH=os.pathsep.join([sysconfig.get_path("scripts"), os.path.dirname(sys.executable),
                                                  os.environ.get("PATH", "")]))
    steps = [["npm", "run", "build"]]
    installed = HERE / "node_modules" / ".package-lock.json"
    if not installed.exists() or installed.stat().st_mtime < (HERE / "package-lock.json").stat().st_mtime:
        steps.insert(0, ["npm", "ci", "--prefer-offline", "--no-audit", "--no-fund"])  # exactly the lockfile's packages
    for step in steps:
        say(f"sharddbg: building the JupyterLab extension: {' '.join(step)}")
        subprocess.run(step, cwd=HERE, env=env, check=True)
