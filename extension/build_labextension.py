"""Builds the JupyterLab extension while a wheel of sharddbg is built (hatch-jupyter-builder's build function,
named in pyproject.toml): ``npm ci`` from the committed lockfile, then ``npm run build`` (TypeScript, then
JupyterLab's builder) into ``sharddbg/labextension``, which the wheel installs into
``share/jupyter/labextensions/sharddbg-jupyterlab``.

The same ``npm ci`` fetches plotly's partial bundle ``plotly.js-cartesian-dist-min`` (pinned in package.json to the
plotly.js of the ``plotly`` package); the build copies its ``plotly-cartesian.min.js`` into ``sharddbg/plotlyjs``
(git-ignored, shipped in the wheel), where the standalone report takes it for figures of its trace types only
(``sharddbg.exporters.plotly_bundle``): it is evaluated 2-3 times faster than the full bundle.

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
# plotly's partial bundle: where npm puts it, and where the report reads it
PARTIAL_PLOTLY = HERE / "node_modules" / "plotly.js-cartesian-dist-min" / "plotly-cartesian.min.js"
PARTIAL_PLOTLY_COPY = HERE.parent / "sharddbg" / "plotlyjs" / "plotly-cartesian.min.js"
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


def partial_plotly_up_to_date() -> bool:
    """The copy of plotly's partial bundle is there and newer than the lockfile that pins it."""
    return (PARTIAL_PLOTLY_COPY.exists()
            and PARTIAL_PLOTLY_COPY.stat().st_mtime >= (HERE / "package-lock.json").stat().st_mtime)


def copy_partial_plotly() -> None:
    """Copy plotly's partial bundle from node_modules into the package (a missing one is said, not fatal: the
    report then inlines the full bundle)."""
    if not PARTIAL_PLOTLY.exists():
        say(f"sharddbg: plotly's partial bundle is not in {PARTIAL_PLOTLY.parent} (npm ci did not fetch it): "
            "reports carry the full plotly.js")
        return
    PARTIAL_PLOTLY_COPY.parent.mkdir(parents=True, exist_ok=True)
    part = PARTIAL_PLOTLY_COPY.with_name(PARTIAL_PLOTLY_COPY.name + ".part")
    shutil.copyfile(PARTIAL_PLOTLY, part)
    os.replace(part, PARTIAL_PLOTLY_COPY)  # never half a file where the report reads it
    say(f"sharddbg: plotly's partial bundle copied to {PARTIAL_PLOTLY_COPY}")


def build(target_name: str, version: str, **_: object) -> None:
    """Build the extension for a wheel (a standard or an editable one), and copy plotly's partial bundle into
    the package; an sdist carries its sources only."""
    if target_name != "wheel":
        return
    extension_built = up_to_date()
    if extension_built and partial_plotly_up_to_date():
        say(f"sharddbg: the JupyterLab extension in {OUTPUT} and plotly's partial bundle are up to date")
        return
    missing = [tool for tool in ("node", "npm") if shutil.which(tool) is None]
    if missing:
        why = f"{' and '.join(missing)} not found on PATH"
        if (OUTPUT / "package.json").exists():
            say(f"sharddbg: {why}: the JupyterLab extension built before ({OUTPUT}) is used as it is")
            if not partial_plotly_up_to_date():
                copy_partial_plotly()  # from a node_modules fetched before, where there is one
            return
        say(NOT_BUILT.format(why=why))
        warnings.warn(NOT_BUILT.format(why=why), stacklevel=1)
        return
    # the build environment's scripts first: jupyter-builder (JupyterLab's builder) comes from there
    env = dict(os.environ, PATH=os.pathsep.join([sysconfig.get_path("scripts"), os.path.dirname(sys.executable),
                                                  os.environ.get("PATH", "")]))
    steps = [] if extension_built else [["npm", "run", "build"]]
    installed = HERE / "node_modules" / ".package-lock.json"
    if not installed.exists() or installed.stat().st_mtime < (HERE / "package-lock.json").stat().st_mtime:
        steps.insert(0, ["npm", "ci", "--prefer-offline", "--no-audit", "--no-fund"])  # exactly the lockfile's packages
    for step in steps:
        say(f"sharddbg: building the JupyterLab extension: {' '.join(step)}")
        subprocess.run(step, cwd=HERE, env=env, check=True)
    copy_partial_plotly()
