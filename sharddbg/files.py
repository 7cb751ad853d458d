"""Writing files safely: every file sharddbg writes for the user (traces, reports, exports) appears whole
or not at all, and a name planted beside it (a symlink at a predictable temp name) is never followed."""

from __future__ import annotations

import errno
import os
import tempfile
from typing import IO, Callable

__all__ = ["write_file_atomically", "refuse_folder"]


def write_file_atomically(path: str | os.PathLike, write: Callable[[IO[str]], object], *,
                          example_name: str = "out.txt") -> str:
    """Write a text file (UTF-8) through ``write(file)``: into a fresh temp file beside ``path``, then
    renamed over it.

    The temp file has a name nobody can guess (``tempfile.mkstemp``: created exclusively, so a symlink
    planted there is never followed) and gets the mode a plain ``open(path, "w")`` would give: an existing
    file's permissions, else 0666 less the umask. Readers see the old file or the whole new one, never a
    half-written one; when ``write`` (or anything after it) fails, the temp file is removed, ``path`` is
    left as it was and the error is re-raised. An ``OSError`` names ``path``, never the temp file.

    Parameters
    ----------
    path : str or os.PathLike
        The file to write (replaced if it exists).
    write : callable
        ``write(file)`` writes the content to the open text file.
    example_name : str
        A file name the refusal of a folder suggests (``trace.sdtrace.json``, ...).

    Returns
    -------
    str
        ``path``.

    Raises
    ------
    IsADirectoryError
        ``path`` is a folder: the message suggests a file name inside it.
    OSError
        The file cannot be written (no such folder, no permission, disk full), naming ``path``.
    Exception
        Whatever ``write`` raises.

    Examples
    --------
    >>> write_file_atomically("notes.txt", lambda f: f.write("hello"))
    'notes.txt'
    """
    path = refuse_folder(path, example_name)
    folder, name = os.path.split(os.path.abspath(path))
    try:
        mode = os.stat(path).st_mode & 0o777
    except FileNotFoundError:
        mode = 0o666 & ~_umask()
    except OSError as e:  # e.g. a component of path is a file (ENOTDIR): the error opening it would give
        raise _naming(path, e) from None
    try:
        fd, tmp = tempfile.mkstemp(dir=folder, prefix=f".{name}.", suffix=".tmp")
    except OSError as e:  # the error a plain open(path, "w") would give, naming path, not the temp file
        raise _naming(path, e) from None
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            os.fchmod(f.fileno(), mode)
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException as exc:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        if isinstance(exc, OSError):
            if os.path.isdir(path):  # made a folder while the file was written
                raise _folder_refused(path, example_name) from None
            raise _naming(path, exc) from exc
        raise
    return path


def refuse_folder(path: str | os.PathLike, example_name: str) -> str:
    """``path`` as a str, refused when it is a folder (a writer calls it before the work of making the content).

    Parameters
    ----------
    path : str or os.PathLike
        The file about to be written.
    example_name : str
        A file name to suggest inside the folder.

    Returns
    -------
    str
        ``path``, as a str.

    Raises
    ------
    IsADirectoryError
        ``path`` is a folder; the message suggests ``path/example_name``.

    Examples
    --------
    >>> refuse_folder("run.sdtrace.json", "trace.sdtrace.json")
    'run.sdtrace.json'
    """
    path = os.fspath(path)
    if os.path.isdir(path):
        raise _folder_refused(path, example_name)
    return path


def _naming(path: str, error: OSError) -> OSError:
    """``error`` as it would read had it happened on ``path`` itself (the user's name for the file)."""
    if error.errno is None or error.filename == path:
        return error
    return type(error)(error.errno, error.strerror or os.strerror(error.errno), path)


def _folder_refused(path: str, example_name: str) -> IsADirectoryError:
    error = IsADirectoryError(f"{path!r} is a folder, not a file: give the path of the file to write, e.g. "
                              f"{os.path.join(path, example_name)!r}")
    error.errno = errno.EISDIR  # what `except OSError as e: e.errno` code expects; the message stays the sentence
    return error


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
