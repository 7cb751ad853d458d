"""Which frames are the user's: one policy for the recorder (each op's source line) and the diagnosis (a
stuck rank's stack, user code first).

A frame is a library frame when its file lies in the installed torch, physicsnemo, sharddbg, IPython,
ipykernel, ipyparallel, tornado, zmq, traitlets, asyncio or concurrent package (directories found
without importing them, compared after resolving links), or is frozen; every other frame is the user's
(a notebook cell, their scripts and modules).
"""

from __future__ import annotations

import os
import sys
from typing import Any

from ..errors import hide_own_frames

# The recorder's wrapper frames are left out of the tracebacks a user reads on a rank (IPython honours a
# true ``__tracebackhide__`` local), unless SHARDDBG_DEBUG=1 was set when the engine started.
HIDE_FRAMES = hide_own_frames()

LIBRARY_PACKAGES = ("torch", "physicsnemo", "sharddbg", "IPython", "ipykernel", "ipyparallel", "tornado", "zmq",
                    "traitlets", "asyncio", "concurrent")


def _pkg_dir(modname: str) -> str | None:
    """The package's directory, found without importing it (physicsnemo may be imported after us)."""
    import importlib.util

    try:
        spec = importlib.util.find_spec(modname)
    except (ImportError, ValueError):
        return None
    locs = list(spec.submodule_search_locations or ()) if spec is not None else []
    return os.path.realpath(locs[0]) + os.sep if locs else None


LIBRARY_DIRS = tuple(d for d in (_pkg_dir(m) for m in LIBRARY_PACKAGES) if d)
# verdict per file name (it depends on nothing else; the recorder asks for every op)
_library_file: dict[str, bool] = {}


def is_library_file(filename: str) -> bool:
    """True for a file of the libraries above (or frozen), False for the user's code."""
    try:
        return _library_file[filename]
    except KeyError:
        # normalised once per file: a path such as bench/../sharddbg/x.py is sharddbg's too
        r = (filename.startswith("<frozen") or filename.startswith(LIBRARY_DIRS)
             or os.path.realpath(filename).startswith(LIBRARY_DIRS))
        _library_file[filename] = r
        return r


def user_frame(skip: int = 2) -> tuple[str, int, str] | None:
    """(file, line, function) of the first frame outside the libraries, ``skip`` frames above the caller."""
    return user_frame_until(skip + 1, None, None)


def user_frame_until(skip: int, stop: Any, stop_answer: Any) -> tuple[str, int, str] | None:
    """user_frame(), except that reaching the frame ``stop`` (on this stack: the wrapper frame of the
    enclosing recorded op, or the ``_call_impl`` frame of the running module) answers ``stop_answer`` (the
    user frame already found for it): a nested op walks only the frames between it and its caller."""
    try:
        f = sys._getframe(skip)
    except ValueError:
        return None
    known = _library_file.get
    while f is not None:
        if f is stop:
            return stop_answer
        code = f.f_code
        r = known(code.co_filename)
        if r is None:
            r = is_library_file(code.co_filename)
        if not r:
            return (code.co_filename, f.f_lineno, code.co_name)
        f = f.f_back
    return None

