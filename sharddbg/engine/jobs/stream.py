"""One rank's stream file: the recorder's events appended as they complete (``sharddbg.job_files`` says the
format), so that a process killed at any moment leaves everything up to its last flush.

The recorder keeps its events in its buffer as always; a flush formats those that completed since the last
one (a collective completes when its wait returns or it fails) and appends them, then a ``state`` line with
what is still in flight, as one record batch of the rank's Arrow IPC stream (``job_files.StreamEncoder``: each
record's values are put in per-column lists piece by piece, the batch made of them at the end of the flush, or
once ``BATCH_ROWS`` are waiting).
Flushes run on the job's background thread, and once
more, finally, at exit. A write that fails (an unwritable folder, a full disk) stops the recording, never the
job. A path ending in ``.jsonl`` is written as JSON lines, the stream of version 1.
"""

from __future__ import annotations

import json
import os
import threading
import time
import traceback
from typing import Any

from ... import job_files, schema
from .. import clock
from ..recorder import export
from ..recorder.events import CollectiveEvent, OpEvent


# The background thread formats events in pieces and gives the GIL back between two: a piece ends once the
# thread has run PIECE_CPU_NS of CPU time (its own CPU clock: time it waited for the GIL is not counted), so the
# job's thread never waits longer than about that for the GIL. The hand-over sleeps HANDOVER_S, not 0: a
# thread that only releases and retakes the GIL at once usually takes it again before the waiting thread wakes.
PIECE_CPU_NS = 250_000
HANDOVER_S = 50e-6
# A flush of more records than this writes a record batch of them at a piece's end: making a batch of the rows added
# holds the GIL (about 4 ms for this many, 8 ms for 900), which a flush of a few thousand would hold for tens of ms
BATCH_ROWS = 500


def _default(value: Any) -> Any:
    return job_files.as_plain(value)


def encode(line: dict) -> str:
    """One stream line: compact JSON and a newline."""
    return json.dumps(line, separators=(",", ":"), default=_default, allow_nan=False) + "\n"


class RankStreamWriter:
    """Appends one rank's lines to ``path``; every method is safe from the job's two threads (one lock)."""

    def __init__(self, path: str, rank: int = 0) -> None:
        self.path = path
        # the Arrow stream's encoder; None: JSON lines (a .jsonl path, version 1)
        self.encoder = None if path.endswith(job_files.JSON_LINES_SUFFIX) else job_files.StreamEncoder(rank)
        # O_EXCL: never write into another run's file; O_APPEND: every line lands whole at the end
        self.fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_APPEND | getattr(os, "O_CLOEXEC", 0),
                          0o644)
        self.lock = threading.RLock()
        self.failed: str | None = None  # why writing stopped, once it did
        self.largest_flush_ms = 0.0  # the longest flush so far (formatting and writing), for the bench
        # the most CPU time the flush ran between two hand-overs of the GIL (what the job's thread may wait), for
        # the bench
        self.largest_piece_ms = 0.0
        self.bytes_written = 0
        # the recorder's buffer: how far it was scanned, and the kept events not complete yet
        self._scanned = 0
        self._pending: list[Any] = []
        self._unsettled_errors: list[OpEvent] = []  # op errors written while their ``handled`` was unknown
        self._extra: list[dict] = []  # lines queued by the main thread (step markers), written at the next flush

    # ---- writing ---------------------------------------------------------------------------------------
    def write_lines(self, lines: list[dict]) -> bool:
        """Append ``lines`` (each a {kind: body} object) in one write; False once writing failed."""
        if self.failed is not None or not lines:
            return self.failed is None
        if self.encoder is None:
            return self.write_encoded("".join(encode(line) for line in lines).encode())
        with self.lock:  # the encoder keeps the stream's state: one batch at a time
            return self.write_encoded(self.encoder.encode(lines))

    def write_encoded(self, data: bytes) -> bool:
        """Append lines already encoded, in one write; False once writing failed."""
        if self.failed is not None or not data:
            return self.failed is None
        with self.lock:
            try:
                view = memoryview(data)
                while view:
                    n = os.write(self.fd, view)
                    view = view[n:]
                self.bytes_written += len(data)
                return True
            except (OSError, ValueError) as e:
                self.failed = f"{type(e).__name__}: {e}"
                return False

    def queue(self, line: dict) -> None:
        """A line for the next flush (cheap: called from the user's thread)."""
        self._extra.append(line)

    def close(self) -> None:
        """Close the file (after the final flush)."""
        with self.lock:
            try:
                os.close(self.fd)
            except OSError:
                pass
            self.fd = -1

    # ---- the recorder's events -------------------------------------------------------------------------
    def flush(self, rec, step: int | None, final: bool = False) -> bool:
        """Append what completed since the last flush, then a ``state`` line (``final``: every kept event, the
        settled ``handled`` of op errors, no state line). False once writing failed.

        On the background thread (not ``final``) the events are formatted and written in pieces of at most
        ``PIECE_CPU_NS`` of this thread's CPU time, and the GIL is handed to the job's thread between pieces:
        the job's thread waits at most about one piece for it (``largest_piece_ms``), not the whole flush."""
        t0 = time.perf_counter()
        with self.lock:
            buf = rec.buffer
            n = len(buf)
            if n > self._scanned:
                self._pending.extend(buf[self._scanned:n])
                self._scanned = n
            meshes = {} if rec.spec_check else None
            extra, self._extra = self._extra, []
            still = []
            encoded: list = []  # JSON lines not written yet (a stream of version 1)
            for line in extra:
                self._add(encoded, line)
            piece_start = time.thread_time_ns()
            for ev in self._pending:
                if not final and time.thread_time_ns() - piece_start >= PIECE_CPU_NS:
                    if self.encoder is None or self.encoder.pending >= BATCH_ROWS:
                        data = "".join(encoded).encode() if self.encoder is None else self.encoder.batch()
                        if not self.write_encoded(data):  # the write gives the GIL up too
                            return False
                        encoded = []
                    self._piece_done(piece_start)
                    time.sleep(HANDOVER_S)
                    piece_start = time.thread_time_ns()
                if not final and type(ev) is CollectiveEvent and ev.t_done_ns is None and ev.error is None:
                    still.append(ev)
                    continue
                try:
                    record = export.record_of(ev, rec, meshes)
                except Exception:  # noqa: BLE001 - e.g. its mesh is gone (the group destroyed): kept unchecked
                    rec.internal_errors.append(traceback.format_exc())
                    record = export.record_of(ev, rec, None)
                self._add(encoded, {"event": record})
                if type(ev) is OpEvent and ev.error is not None and record["error"]["handled"] is None:
                    self._unsettled_errors.append(ev)
            self._piece_done(piece_start)
            self._pending = still
            lines: list[dict] = []
            if final:
                for ev in self._unsettled_errors:
                    lines.append({"amend": {"seq": ev.seq, "handled": export.error_handled(rec, ev)}})
                self._unsettled_errors = []
                lines += [{"event": r} for r in export.in_flight_ops(rec, meshes)]  # ops a signal ended
            else:
                in_flight = [export.collective_record(ev, True, rec) for ev in still]
                in_flight += export.in_flight_ops(rec, None)
                lines.append({"state": {"t_ns": clock.now_ns(), "dropped": rec.dropped, "step": step,
                                        "in_flight": in_flight, "recording": rec.running}})
            for line in lines:
                self._add(encoded, line)
            ok = self.write_encoded("".join(encoded).encode() if self.encoder is None else self.encoder.batch())
        self.largest_flush_ms = max(self.largest_flush_ms, (time.perf_counter() - t0) * 1e3)
        return ok

    def _add(self, encoded: list[str], line: dict) -> None:
        """``line`` added to what the flush writes: to the Arrow batch being made, or as a JSON line."""
        if self.encoder is None:
            encoded.append(encode(line))
        else:
            self.encoder.add(line)

    def _piece_done(self, started_cpu_ns: int) -> None:
        self.largest_piece_ms = max(self.largest_piece_ms, (time.thread_time_ns() - started_cpu_ns) / 1e6)

    def pending_collectives(self) -> list[CollectiveEvent]:
        """The kept collectives not completed at the last flush (the hang watch reads them)."""
        return list(self._pending)


def header(settings, rank: int, world_size: int, local_rank: int | None, meta: dict, t_start_ns: int | None) -> dict:
    """The stream's first line."""
    import platform
    import sys

    return {"header": {
        "format": job_files.STREAM_FORMAT,
        "version": job_files.STREAM_VERSION,
        "schema_version": schema.SCHEMA_VERSION,
        "run_id": settings.run_id,
        "rank": rank,
        "world_size": world_size,
        "local_rank": local_rank,
        "host": platform.node(),
        "pid": os.getpid(),
        "argv": list(sys.argv),
        "steps": list(settings.steps) if settings.steps else None,
        "hang_after_s": settings.hang_after_s,
        "clock": dict(clock.describe(), t_start_ns=t_start_ns),
        "meta": meta,
    }}
