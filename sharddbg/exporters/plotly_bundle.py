"""Which plotly.js the standalone report inlines: plotly's partial bundle ``plotly.js-cartesian-dist-min`` (1.5 MB,
evaluated 2-3 times faster than the full 4.8 MB bundle, the most of a report's first screen) when every trace type
of the report's figures is one it registers, else the full bundle of the ``plotly`` package.

The partial bundle is fetched by npm at packaging time (``extension/package.json`` pins it to the plotly.js of the
``plotly`` package) and copied into ``sharddbg/plotlyjs`` by ``extension/build_labextension.py``. What it registers
is read from the file itself: its version from its header, its trace types from the trace modules it defines
(``moduleType:"trace",name:"bar"``), checked in chromium against ``Plotly.PlotSchema.get().traces`` by
tests/test_browser.py. A partial bundle that is missing, of another plotly.js version, or whose trace types cannot
be read is not used: the report then carries the full bundle.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

CARTESIAN_BUNDLE = Path(__file__).resolve().parents[1] / "plotlyjs" / "plotly-cartesian.min.js"
_HEADER_VERSION = re.compile(r"\A/\*\*\s*\*\s*plotly\.js \(cartesian - minified\) v(\S+)")
_TRACE_MODULE = re.compile(r'moduleType:"trace",name:"([a-z0-9]+)"')


@dataclass(frozen=True)
class PartialBundle:
    """A partial plotly.js bundle as read from its file: its version, the trace types it registers, its text."""

    path: Path
    version: str
    trace_types: frozenset[str]
    source: str


@dataclass(frozen=True)
class PlotlyBundle:
    """The plotly.js a report carries: ``name`` ("cartesian" or "full"), its version, its text, and why this one."""

    name: str
    version: str
    source: str
    why: str


class UnreadableBundle(ValueError):
    """A partial bundle's file does not say its version or its trace types where plotly's builds put them."""


def read_partial_bundle(path: Path) -> PartialBundle:
    """The partial bundle at ``path``, its version and trace types read from its text.

    Raises
    ------
    FileNotFoundError
        no file at ``path``.
    UnreadableBundle
        no ``plotly.js (cartesian - minified) vX`` header, or no trace module in it.
    """
    stat = Path(path).stat()
    return _read_partial_bundle(Path(path), stat.st_mtime_ns, stat.st_size)


@functools.lru_cache(maxsize=4)
def _read_partial_bundle(path: Path, mtime_ns: int, size: int) -> PartialBundle:
    # cached by the file's mtime and size: a bundle copied again by a build is read again
    source = path.read_text(encoding="utf-8")
    version = _HEADER_VERSION.match(source)
    if version is None:
        raise UnreadableBundle(f"{path} does not start with plotly's header 'plotly.js (cartesian - minified) vX'")
    types = frozenset(_TRACE_MODULE.findall(source))
    if not types:
        raise UnreadableBundle(f"{path} defines no trace module that can be read (moduleType:\"trace\",name:...)")
    return PartialBundle(path=path, version=version.group(1), trace_types=types, source=source)


def plotly_bundle_for(trace_types: Iterable[str], *, partial: Path | None = None) -> PlotlyBundle:
    """The plotly.js for figures of ``trace_types`` (plotly's trace type names, e.g. ``"bar"``, ``"scattergl"``): the
    partial bundle at ``partial`` (default: ``CARTESIAN_BUNDLE``) when it registers every one and is the ``plotly``
    package's plotly.js version, else the full bundle. ``why`` says which condition chose it."""
    from plotly.offline import get_plotlyjs, get_plotlyjs_version

    partial = CARTESIAN_BUNDLE if partial is None else partial

    full_version = get_plotlyjs_version()
    wanted = sorted(set(trace_types))

    def full(why: str) -> PlotlyBundle:
        return PlotlyBundle(name="full", version=full_version, source=get_plotlyjs(), why=why)

    try:
        bundle = read_partial_bundle(partial)
    except FileNotFoundError:
        return full(f"plotly's partial bundle is not installed ({partial}: it is fetched when the package is built)")
    except UnreadableBundle as e:
        return full(f"plotly's partial bundle could not be read: {e}")
    if bundle.version != full_version:
        return full(f"plotly's partial bundle is plotly.js {bundle.version}, the plotly package's is {full_version}")
    missing = [t for t in wanted if t not in bundle.trace_types]
    if missing:
        return full(f"the figures use {', '.join(missing)}, which plotly's partial bundle does not register")
    return PlotlyBundle(name="cartesian", version=bundle.version, source=bundle.source,
                        why=f"every trace type of the figures ({', '.join(wanted) or 'none'}) is in plotly's partial "
                            "bundle")
