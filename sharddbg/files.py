"""Writing files safely: every file sharddbg writes for the user (traces, reports, exports) appears whole
or not at all, and a name planted beside it (a symlink at a predictable temp name) is never followed."""

from __future__ import annotations

import os
import tempfile
from typing import IO, Callable

__all__ = ["write_file_atomically"]


def write_file_atomically(path: str | os.PathLike, write: Callable[[IO[str]], object]) -> str:
    """Write a text file (UTF-8) through ``write(file)``: into a fresh temp file beside ``path``, then
    renamed over it. Returns ``path``.

    The temp file has a name nobody can guess (``tempfile.mkstemp``: created exclusively, so a symlink
    planted there is never followed) and gets the mode a plain ``open(path, "w")`` would give: an existing
    file's permissions, else 0666 less the umask. Readers see the old file or the whole new one, never a
    half-written one; when ``write`` (or anything after it) fails, the temp file is removed, ``path`` is
    left as it was and the error is re-raised.
    """
    path = os.fspath(path)
    folder, name = os.path.split(os.path.abspath(path))
    try:
        mode = os.stat(path).st_mode & 0o777
    except FileNotFoundError:
        mode = 0o666 & ~_umask()
    try:
        fd, tmp = tempfile.mkstemp(dir=folder, prefix=f".{name}.", suffix=".tmp")
    except OSError as e:  # the error a plain open(path, "w") would give, naming path, not the temp file
        raise type(e)(e.errno, e.strerror, path) from None
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            os.fchmod(f.fileno(), mode)
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        raise
    return path


def _umask() -> int:
    """This process's umask, read without changing it where Linux tells it (os.umask can only be read by
    setting it, which for a moment changes it for every thread)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except OSError:
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask
