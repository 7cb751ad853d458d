"""Lines from a child process's stdout pipe, each read with a deadline: the warm Pythons sharddbg forks from
(the checks' reference, the plain re-runs) answer one line per request, and a stuck one must not hang us."""

from __future__ import annotations

import os
import select
import time


class PipeLines:
    """Reads whole lines from a pipe's file descriptor, keeping what came after the last one for the next call."""

    def __init__(self, fd: int) -> None:
        self.fd = fd
        self._buffer = b""

    def next_line(self, deadline: float) -> str | None:
        """The next line (without its newline); None when the pipe ended or no whole line came before
        ``deadline`` (a ``time.monotonic()`` value).

        Returns
        -------
        str or None
            The line, decoded as UTF-8; None at the pipe's end or at the deadline.

        Examples
        --------
        >>> PipeLines(proc.stdout.fileno()).next_line(time.monotonic() + 5.0)
        '{"ready": true}'
        """
        while b"\n" not in self._buffer:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([self.fd], [], [], left)[0]:
                return None
            chunk = os.read(self.fd, 65536)
            if not chunk:
                return None
            self._buffer += chunk
        line, _, self._buffer = self._buffer.partition(b"\n")
        return line.decode()
