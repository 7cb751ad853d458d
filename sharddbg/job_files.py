"""The folder ``sharddbg record`` writes for one job, and how it is read back into per-rank payloads.

::

    run/                       one recorded job (``--out``)
      job.json                 the launcher's record: the command, when it ran, how it ended, how each rank ended
      rank-00000.arrows        rank 0's stream: an Arrow IPC stream, a record batch appended at each flush
      rank-00001.arrows        ...

A rank's stream is written by that rank's process while the job runs (``sharddbg.engine.jobs``) and flushed at
least every second, so a process killed at any moment leaves every record batch up to its last flush. Its rows
are the stream's lines, in the order they were written; each line is of one kind (``LINE_KINDS``)::

    header      first line: STREAM_FORMAT, STREAM_VERSION, run_id, rank, world_size, host, pid, ...
    event       one schema record (op, collective, error, meta), complete; the same seq twice: the later
                one replaces the earlier
    amend       an op error's ``handled``, known later than the record (``seq``, ``handled``)
    state       at each flush: what is in flight (records), events dropped so far, the optimizer step
    clock       this rank's clock against rank 0's, measured when its process group came up
    diagnosis   where the rank was (stack, Flight Recorder, groups) when a collective hung, and at the end
    end         last line of a rank whose recording ended normally: the payload's meta, dropped, clock

Stream version 2 (``STREAM_VERSION``, ``rank-NNNNN.arrows``): an Arrow IPC stream whose schema metadata says
``{"format": STREAM_FORMAT, "version": 2}`` under the key ``sharddbg``; its columns are ``line`` (the line's kind),
``body`` (the JSON text of a line that is not an event, null for an event), then the columns of the columnar
trace file (``sharddbg.columnar``: ``rank``, every record field, ``extra``; text dictionary-encoded, a batch's
dictionaries its own), which hold an event line's record and are null on the other lines; buffers compressed with
lz4. A stream cut mid-batch (its process killed while writing)
reads up to its last whole batch, and says where it is cut. A rank's events are read as columns: a job's trace
keeps them as one table, as a trace loaded from a ``.sdtrace.arrow`` file does. Version 1 (``rank-NNNNN.jsonl``,
what sharddbg wrote before) still reads: one JSON object per line with one key, its kind
(``{"event": {...}}``, ...), cut mid-line after its last whole line.

``read_job`` turns the folder into what ``Trace`` is built from: the payloads (``schema.PAYLOAD_FIELDS``; a
rank without its end line is incomplete, its in-flight records those of its last state line), the clock
offsets, why ranks are incomplete (a file cut mid-record, a process killed), and the hang reports. Everything
is checked as strictly as a trace file: ``JobFileProblem`` names the file, the line (row, in an Arrow stream)
and what is wrong.
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass, field
from typing import Any

from . import schema

JOB_FORMAT = "sharddbg.job"
JOB_VERSION = 1
STREAM_FORMAT = "sharddbg.rank-stream"
# 1: JSON lines (rank-NNNNN.jsonl); 2: an Arrow IPC stream, a record batch per flush (rank-NNNNN.arrows)
STREAM_VERSION = 2
STREAM_SUFFIX = ".arrows"
JSON_LINES_SUFFIX = ".jsonl"  # the streams of version 1
JOB_FILE = "job.json"
RANK_FILE_PATTERN = re.compile(r"^rank-(\d{5,})\.(?:jsonl|arrows)$")
LINE_KINDS = ("header", "event", "amend", "state", "clock", "diagnosis", "end")

__all__ = ["JOB_FILE", "JOB_FORMAT", "JOB_VERSION", "STREAM_FORMAT", "STREAM_VERSION", "LINE_KINDS", "JobFileProblem",
           "RecordedJob", "RankStream", "rank_file_name", "is_job_folder", "read_job", "StreamEncoder", "stream_lines",
           "STREAM_SUFFIX", "JSON_LINES_SUFFIX"]


class JobFileProblem(Exception):
    """What is wrong with a recorded job's folder (``load_trace`` raises it as ``TraceFileError``)."""


def rank_file_name(rank: int, suffix: str = STREAM_SUFFIX) -> str:
    """The stream file of ``rank`` in a job folder: ``rank-00003.arrows`` (``rank-00003.jsonl`` with the suffix of
    version 1)."""
    return f"rank-{rank:05d}{suffix}"


def is_job_folder(path: str) -> bool:
    """``path`` is a folder holding a job record or at least one rank stream."""
    if not os.path.isdir(path):
        return False
    return os.path.exists(os.path.join(path, JOB_FILE)) or any(RANK_FILE_PATTERN.match(n) for n in os.listdir(path))


@dataclass
class RankStream:
    """One rank's stream as read: its payload and what the reader found on the way."""

    rank: int
    file: str
    header: dict
    payload: dict
    clock_offset_ns: int = 0  # how far this rank's clock is ahead of rank 0's
    clock_uncertainty_ns: int | None = None
    cut: str | None = None  # where the file ends mid-record, in words; None when every line is whole
    last_seq: int | None = None  # the largest seq of its records
    table: Any = None  # its records as columns (an Arrow stream's), ``columnar.table_of_records``' layout
    ended: bool = False  # its end line is there: the rank's recording ended normally
    diagnoses: list[dict] = field(default_factory=list)  # the diagnosis lines, in order
    last_step: int | None = None  # the last optimizer step the rank began
    last_t_ns: int | None = None  # the rank clock of its last line that says when it was written


@dataclass
class RecordedJob:
    """A job folder as read: the launcher's record and every rank's stream."""

    folder: str
    job: dict  # job.json (empty when the launcher did not write one)
    ranks: dict[int, RankStream]
    world_size: int
    missing_ranks: list[int]
    suffix: str = STREAM_SUFFIX  # its streams' (JSON_LINES_SUFFIX: a folder of version 1)
    columns: Any = None  # the records of its Arrow streams, every rank's as one table (``columnar.EventColumns``)

    def incomplete_reasons(self) -> dict[int, str]:
        """Rank -> why its recording is incomplete, in words (the ranks whose recording ended normally are left
        out)."""
        how_ended = {int(k): v for k, v in (self.job.get("rank_exits") or {}).items()}
        reasons = {}
        for rank in self.missing_ranks:
            reasons[rank] = (f"no stream in the folder ({rank_file_name(rank, self.suffix)}): the rank never started "
                             f"recording, or its file was removed")
        for rank, s in self.ranks.items():
            if s.ended:
                continue
            words = []
            exit_words = how_ended.get(rank)
            if exit_words:
                words.append(exit_words)
            else:
                words.append("its process ended without finishing its stream (killed: SIGKILL, the OOM "
                             "killer or a crash)")
            if s.last_step is not None:
                words.append(f"in step {s.last_step}")
            if s.cut:
                words.append(s.cut)
            else:
                last = s.last_seq
                words.append("its file holds every line up to its last flush"
                             + (f" (last event seq {last})" if last is not None else " (no event yet)"))
            reasons[rank] = "; ".join(words)
        return reasons


def _problem(file: str, line: int | None, what: str) -> JobFileProblem:
    where = f"{os.path.basename(file)}" + (f" line {line}" if line is not None else "")
    return JobFileProblem(f"{where}: {what}")


def _read_job_record(folder: str) -> dict:
    path = os.path.join(folder, JOB_FILE)
    if not os.path.exists(path):
        return {}
    try:
        with open(path, "rb") as f:
            job = json.loads(f.read())
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise _problem(path, None, f"not valid JSON ({e})") from None
    if not isinstance(job, dict) or job.get("format") != JOB_FORMAT:
        raise _problem(path, None, f'not a sharddbg job record (no "format": "{JOB_FORMAT}")')
    v = job.get("version")
    if type(v) is not int or v < 1:
        raise _problem(path, None, f'a missing or invalid "version" ({v!r})')
    if v > JOB_VERSION:
        raise _problem(path, None, f"job record version {v} was written by a newer sharddbg; this one reads up to "
                                   f"{JOB_VERSION}: upgrade sharddbg")
    return job


class _Lines:
    """What a stream's lines say, read in order (``take``); its events kept by the reader of the format."""

    def __init__(self, path: str, rank_in_name: int, where: str) -> None:
        self.path = path
        self.rank_in_name = rank_in_name
        self.where = where  # "line" or "row": how the format counts its lines, in messages
        self.header: dict | None = None
        self.events: dict[int, dict] = {}  # seq -> the last record of that seq (JSON lines)
        self.amends: dict[int, bool | None] = {}
        self.state: dict | None = None
        self.end: dict | None = None
        self.s = RankStream(rank_in_name, path, {}, {})

    def problem(self, number: int | None, what: str) -> JobFileProblem:
        where = os.path.basename(self.path) + (f" {self.where} {number}" if number is not None else "")
        return JobFileProblem(f"{where}: {what}")

    def take(self, number: int, kind: str, body: Any) -> None:
        """Line ``number`` (1-based) of kind ``kind`` holding ``body``."""
        s = self.s
        if not isinstance(body, dict):
            raise self.problem(number, f'"{kind}" must hold an object')
        if number == 1:
            if kind != "header" or body.get("format") != STREAM_FORMAT:
                raise self.problem(number, f'not a sharddbg rank stream (its first line is not a "{STREAM_FORMAT}" '
                                           f"header)")
            v = body.get("version")
            if type(v) is not int or v < 1 or v > STREAM_VERSION:
                raise self.problem(number, f"stream version {v!r}: this sharddbg reads 1..{STREAM_VERSION}"
                                           + (" (upgrade sharddbg)" if type(v) is int and v > STREAM_VERSION else ""))
            sv = body.get("schema_version")
            if type(sv) is not int or sv < 1 or sv > schema.SCHEMA_VERSION:
                raise self.problem(number, f"schema_version {sv!r}: this sharddbg reads 1..{schema.SCHEMA_VERSION}")
            for key, want in (("rank", int), ("world_size", int), ("run_id", str), ("meta", dict)):
                if type(body.get(key)) is not want:
                    raise self.problem(number, f'header field "{key}" must be {want.__name__}, got {body.get(key)!r}')
            if body["rank"] != self.rank_in_name:
                raise self.problem(number, f'the header says rank {body["rank"]} but the file is named for rank '
                                           f"{self.rank_in_name}")
            self.header = body
            return
        if kind == "header":
            raise self.problem(number, "a second header: two streams were written into one file")
        if kind == "event":
            if type(body.get("seq")) is not int:
                raise self.problem(number, 'an event without an integer "seq"')
            self.events[body["seq"]] = body
        elif kind == "amend":
            if type(body.get("seq")) is not int or body.get("handled") not in (True, False, None):
                raise self.problem(number, 'an amend line needs an integer "seq" and "handled" true/false/null')
            self.amends[body["seq"]] = body["handled"]
        elif kind == "state":
            self.state = body
            if type(body.get("step")) is int:
                s.last_step = body["step"]
            if type(body.get("t_ns")) is int:
                s.last_t_ns = body["t_ns"]
        elif kind == "clock":
            if type(body.get("offset_ns")) is not int:
                raise self.problem(number, 'a clock line without an integer "offset_ns"')
            s.clock_offset_ns = body["offset_ns"]
            u = body.get("uncertainty_ns")
            s.clock_uncertainty_ns = u if type(u) is int else None
        elif kind == "diagnosis":
            s.diagnoses.append(body)
        elif kind == "end":
            self.end = body

    def in_flight(self, held) -> list[dict]:
        """The records of the last state line whose seq no event holds (``held``: a seq -> bool test)."""
        return [ev for ev in (self.state or {}).get("in_flight", []) if isinstance(ev, dict) and not held(ev.get("seq"))]

    def finish(self, records, step_records: list[dict]) -> RankStream:
        """The stream, its payload holding ``records`` (a list, or the rank's records as columns); ``step_records``:
        its meta records."""
        s = self.s
        header, end, state = self.header, self.end, self.state
        for ev in step_records:
            if ev.get("kind") == schema.KIND_META and ev.get("name") == "step" and isinstance(ev.get("data"), dict):
                step = ev["data"].get("step")
                if type(step) is int and (s.last_step is None or step > s.last_step):
                    s.last_step = step
        meta = dict(header["meta"])
        if end is not None and isinstance(end.get("meta"), dict):
            meta.update(end["meta"])
        clock = dict(header.get("clock") or {})
        if end is not None and isinstance(end.get("clock"), dict):
            clock.update(end["clock"])
        dropped = (end or state or {}).get("dropped", 0)
        s.header = header
        s.ended = end is not None
        s.payload = {
            "format": schema.PAYLOAD_FORMAT,
            "schema_version": header["schema_version"],
            "rank": header["rank"],
            "world_size": header["world_size"],
            "complete": end is not None,
            "events": records,
            "dropped": dropped if type(dropped) is int else 0,
            "clock": clock,
            "meta": meta,
        }
        return s


def _read_stream(path: str, rank_in_name: int) -> RankStream:
    with open(path, "rb") as f:
        raw = f.read()
    if not raw:
        raise _problem(path, None, "the file is empty: the rank's process ended before it wrote its first line")
    if path.endswith(STREAM_SUFFIX):
        return _read_arrow_stream(path, rank_in_name, raw)
    return _read_json_lines(path, rank_in_name, raw)


def _read_json_lines(path: str, rank_in_name: int, raw: bytes) -> RankStream:
    """A stream of version 1: JSON lines."""
    lines = raw.split(b"\n")
    tail = lines.pop()  # what follows the last newline: empty when the file ends on a whole line
    read = _Lines(path, rank_in_name, "line")
    offset = 0
    for number, line in enumerate(lines, start=1):
        offset += len(line) + 1
        try:
            obj = json.loads(line)
        except (UnicodeDecodeError, json.JSONDecodeError):
            # a line cut by a crash is always the last one; an unreadable line before others is corruption
            raise _problem(path, number, "not a JSON object: the file is corrupt") from None
        if not isinstance(obj, dict) or len(obj) != 1 or next(iter(obj)) not in LINE_KINDS:
            raise _problem(path, number, f"not a sharddbg stream line (an object with one key of {LINE_KINDS})")
        kind, body = next(iter(obj.items()))
        read.take(number, kind, body)
    if read.header is None:
        raise _problem(path, None, "no header line")
    events = read.events
    if tail:
        last_seq = max(events, default=None)
        read.s.cut = (f"its file ends mid-record at byte {offset + len(tail)} (line {len(lines) + 1} is cut after "
                      f"{len(tail)} bytes" + (f"; the last whole event is seq {last_seq})" if last_seq is not None else ")"))
    in_flight = read.in_flight(events.__contains__)
    for seq, handled in read.amends.items():
        ev = events.get(seq)
        if ev is not None and isinstance(ev.get("error"), dict):
            events[seq] = dict(ev, error=dict(ev["error"], handled=handled))
    records = sorted(list(events.values()) + in_flight, key=lambda e: e.get("seq", -1))
    read.s.last_seq = max((ev["seq"] for ev in records if type(ev.get("seq")) is int), default=None)
    s = read.finish(records, records)
    try:
        schema.validate_payload(s.payload)
    except schema.SchemaError as e:
        raise _problem(path, None, str(e)) from None
    return s


def _read_arrow_stream(path: str, rank_in_name: int, raw: bytes) -> RankStream:
    """A stream of version 2: an Arrow IPC stream, a record batch per flush; its events kept as columns."""
    import numpy as np
    import pyarrow as pa
    import pyarrow.compute as pc

    from . import columnar

    source = pa.BufferReader(raw)
    try:
        reader = pa.ipc.open_stream(source)
    except (pa.ArrowInvalid, pa.ArrowException, OSError):
        raise _problem(path, None, f"not a sharddbg rank stream (not an Arrow IPC stream, or cut before its first "
                                   f"record batch: the rank's process ended before it wrote its first line)") from None
    label = json.loads((reader.schema.metadata or {}).get(columnar.METADATA_KEY, b"null") or b"null")
    if not isinstance(label, dict) or label.get("format") != STREAM_FORMAT:
        raise _problem(path, None, f'not a sharddbg rank stream (an Arrow stream without the "{STREAM_FORMAT}" '
                                   f"label in its schema)")
    want = _stream_schema()
    if not reader.schema.remove_metadata().equals(want):
        raise _problem(path, None, "its columns are not those of a sharddbg rank stream: the file is corrupt")
    batches = []
    whole = source.tell()  # where the last whole batch ends
    cut_batch = None
    while True:
        try:
            batches.append(reader.read_next_batch())
        except StopIteration:
            break
        except (pa.ArrowInvalid, pa.ArrowException, OSError):
            cut_batch = len(batches) + 1
            break
        whole = source.tell()
    table = pa.Table.from_batches(batches, want)
    read = _Lines(path, rank_in_name, "row")
    line = table.column("line")
    is_event = pc.fill_null(pc.equal(line, "event"), False).to_numpy(zero_copy_only=False)
    others = np.flatnonzero(~is_event)
    kinds = line.take(others).to_pylist()
    bodies = table.column("body").take(others).to_pylist()
    for row, kind, body_text in zip(others.tolist(), kinds, bodies):
        if kind not in LINE_KINDS:
            raise _problem(path, row + 1, f"not a sharddbg stream line (its kind {kind!r} is none of {LINE_KINDS})")
        try:
            body = json.loads(body_text) if body_text is not None else None
        except (UnicodeDecodeError, ValueError):
            raise _problem(path, row + 1, "its body is not JSON: the file is corrupt") from None
        read.take(row + 1, kind, body)
    if len(is_event) and is_event[0]:  # the first line must be the header: JSON lines' words
        raise read.problem(1, f'not a sharddbg rank stream (its first line is not a "{STREAM_FORMAT}" header)')
    if read.header is None:
        raise _problem(path, None, "no header line")
    event_rows = np.flatnonzero(is_event)
    seqs = table.column("seq").take(event_rows)
    if seqs.null_count:
        first = event_rows[np.flatnonzero(seqs.is_null().to_numpy(zero_copy_only=False))[0]]
        raise _problem(path, int(first) + 1, 'an event without an integer "seq"')
    seq_values = seqs.to_numpy()
    # the later record of a seq replaces the earlier: the last row of each seq, by seq
    _distinct, last_from_end = np.unique(seq_values[::-1], return_index=True)
    keep = event_rows[len(seq_values) - 1 - last_from_end]
    if cut_batch is not None:
        last_seq = int(_distinct[-1]) if len(keep) else None
        read.s.cut = (f"its file ends mid-record at byte {len(raw)} (record batch {cut_batch} is cut after "
                      f"{len(raw) - whole} bytes" + (f"; the last whole event is seq {last_seq})" if last_seq is not None
                                                     else ")"))
    # the text dictionary-encoded first: the rows kept are then taken as indices, not copied as text
    events = columnar.file_table(table.select(["rank", *columnar.COLUMNS, "extra"])).take(keep)
    held = set(seq_values.tolist())
    in_flight = read.in_flight(held.__contains__)
    if in_flight:
        events = pa.concat_tables([events, columnar.table_of_records(rank_in_name, in_flight)])
        events = events.take(pc.sort_indices(events, [("seq", "ascending")]))
    events = events.set_column(0, "rank", pa.array(np.full(events.num_rows, read.header["rank"], dtype=np.int64)))
    if read.amends:
        events = _amended(events, read.amends)
    events = columnar.file_table(events)
    read.s.last_seq = pc.max(events.column("seq")).as_py() if events.num_rows else None
    meta_rows = events.filter(pc.equal(events.column("kind"), schema.KIND_META))
    s = read.finish([], columnar.records_of(meta_rows))
    try:  # the payload without its records; these are checked on columns, every rank's at once (read_job)
        schema.validate_payload(s.payload)
    except schema.SchemaError as e:
        raise _problem(path, None, str(e)) from None
    s.table = events
    return s


def _check_columns(streams: list[RankStream]):
    """The records of ``streams`` (Arrow streams, read as columns) checked on whole columns, every rank's at once:
    their table (``columnar.EventColumns``) when nothing is doubted, and each payload's ``events`` its rank's rows;
    else their records are made as dicts and checked one by one (JobFileProblem naming the file), and None."""
    from . import columnar

    streams = sorted(streams, key=lambda s: s.rank)
    try:
        table = columnar.concat_tables([s.table for s in streams])
        plain = columnar.plainly_valid(table, [s.rank for s in streams], [s.payload for s in streams], 2**63, 10**6)
    except (ValueError, TypeError, OverflowError):
        plain = False
    if plain:
        columns = columnar.EventColumns(table)
        for s in streams:
            s.payload["events"] = columnar.LazyRecords(columns, s.rank)
        return columns
    for s in streams:  # a closer look: the records as dicts, which names what is wrong
        s.payload["events"] = columnar.records_of(s.table)
        try:
            schema.validate_payload(s.payload)
        except schema.SchemaError as e:
            raise _problem(s.file, None, str(e)) from None
    return None


def _amended(events, amends: dict[int, bool | None]):
    """``events`` with the ``handled`` of the errors of the seqs ``amends`` names set as it says."""
    import pyarrow as pa

    seqs = events.column("seq").to_pylist()
    errors = events.column("error").to_pylist()
    changed = False
    for i, seq in enumerate(seqs):
        if seq in amends and errors[i] is not None:
            error = json.loads(errors[i])
            if isinstance(error, dict):
                errors[i] = json.dumps(dict(error, handled=amends[seq]), separators=(",", ":"))
                changed = True
    if not changed:
        return events
    index = events.column_names.index("error")
    return events.set_column(index, events.schema.field(index), pa.array(errors, events.schema.field(index).type))


def _stream_schema():
    """The columns of a rank stream of version 2 (without its label): ``line``, ``body``, then the columnar file's,
    text dictionary-encoded (each batch carries the dictionaries of its own text: a reader unifies them, where
    plain text would have to be encoded again, a million times)."""
    import pyarrow as pa

    from . import columnar

    global _SCHEMA
    if _SCHEMA is None:
        empty = columnar.table_of_records(0, [])
        _SCHEMA = pa.schema([pa.field("line", pa.large_string()), pa.field("body", pa.large_string()),
                             *empty.schema])
    return _SCHEMA


_SCHEMA = None


class StreamEncoder:
    """Encodes one rank's stream lines (``{kind: body}`` objects, ``LINE_KINDS``) as the record batches of an Arrow
    IPC stream (version 2): lines are added one at a time (``add``: their values put in per-column lists, cheap
    enough to spread over pieces of time), then made into one record batch (``batch``: the bytes to append to the
    file, the stream's schema before the first batch).

    Parameters
    ----------
    rank : int
        Whose stream.

    Examples
    --------
    >>> encoder = StreamEncoder(0)
    >>> data = encoder.encode([{"header": {...}}, {"event": {"kind": "meta", "seq": 0}}])
    >>> os.write(fd, data)
    """

    def __init__(self, rank: int) -> None:
        from . import columnar

        self.rank = rank
        self._writer = None
        self._sink: list[bytes] = []
        self._rows = columnar.RecordRows(rank)
        self._kinds: list[str] = []
        self._bodies: list[str | None] = []

    @property
    def pending(self) -> int:
        """The lines added since the last batch."""
        return len(self._kinds)

    def add(self, line: dict) -> None:
        """Add one line to the next batch.

        Parameters
        ----------
        line : dict
            An object with one key, its kind, holding its body; an event's body is a schema record.

        Raises
        ------
        ValueError
            A NaN or an infinite number, which JSON does not hold.
        TypeError
            A value of a kind JSON cannot write, in a record's list or dict.

        Examples
        --------
        >>> encoder.add({"event": {"kind": "meta", "seq": 0}})
        """
        kind = next(iter(line))
        if kind == "event":
            self._rows.add(line[kind])
            self._bodies.append(None)
        else:
            self._rows.add(None)
            self._bodies.append(json.dumps(line[kind], separators=(",", ":"), default=as_plain, allow_nan=False))
        self._kinds.append(kind)

    def batch(self) -> bytes:
        """The bytes of one record batch holding the lines added since the last one (the stream's schema first, the
        first time); empty when none were.

        Returns
        -------
        bytes
            What to append to the file.

        Raises
        ------
        ValueError
            A NaN or an infinite number in a float field.

        Examples
        --------
        >>> encoder.add({"event": {"kind": "meta", "seq": 0}})
        >>> len(encoder.batch()) > 0
        True
        """
        import pyarrow as pa

        from . import columnar

        if not self._kinds:
            return b""
        rows = self._rows.table()
        table = pa.Table.from_arrays([pa.array(self._kinds, pa.large_string()),
                                      pa.array(self._bodies, pa.large_string()), *rows.columns],
                                     schema=_stream_schema())
        self._kinds, self._bodies = [], []
        if self._writer is None:
            label = json.dumps({"format": STREAM_FORMAT, "version": STREAM_VERSION}).encode()
            # lz4: a sixth of the bytes for a tenth more of the encoding's CPU (zstd: a tenth, for half more)
            self._writer = pa.ipc.new_stream(_Collect(self._sink),
                                             table.schema.with_metadata({columnar.METADATA_KEY: label}),
                                             options=pa.ipc.IpcWriteOptions(compression="lz4"))
        self._writer.write_table(table)
        data = b"".join(self._sink)
        self._sink.clear()
        return data

    def encode(self, lines: list[dict]) -> bytes:
        """The bytes of one record batch holding ``lines`` (``add`` each, then ``batch``).

        Parameters
        ----------
        lines : list of dict
            Each an object with one key, its kind, holding its body.

        Returns
        -------
        bytes
            What to append to the file (empty for no lines).

        Raises
        ------
        ValueError
            A NaN or an infinite number, which JSON does not hold.
        TypeError
            A value of a kind JSON cannot write.

        Examples
        --------
        >>> len(StreamEncoder(0).encode([{"event": {"kind": "meta", "seq": 0}}])) > 0
        True
        """
        for line in lines:
            self.add(line)
        return self.batch()


class _Collect:
    """A file-like sink that keeps what is written, for the caller to take."""

    def __init__(self, parts: list[bytes]) -> None:
        self.parts = parts
        self.closed = False

    def write(self, data) -> int:
        self.parts.append(bytes(data))
        return len(data)

    def flush(self) -> None:
        pass

    def close(self) -> None:
        self.closed = True


def stream_lines(path: str) -> list[dict]:
    """The lines of a rank's stream file (either version) as ``{kind: body}`` objects, in order; an event's body is
    its record as a dict. A cut last line or batch is left out.

    Parameters
    ----------
    path : str
        A ``rank-NNNNN.arrows`` or ``rank-NNNNN.jsonl`` file.

    Returns
    -------
    list of dict
        Its lines.

    Raises
    ------
    JobFileProblem
        Not a readable stream.

    Examples
    --------
    >>> stream_lines("run/rank-00000.arrows")[0]["header"]["format"]
    'sharddbg.rank-stream'
    """
    import pyarrow as pa

    from . import columnar

    with open(path, "rb") as f:
        raw = f.read()
    if not path.endswith(STREAM_SUFFIX):
        return [json.loads(line) for line in raw.split(b"\n")[:-1]]
    source = pa.BufferReader(raw)
    try:
        reader = pa.ipc.open_stream(source)
    except (pa.ArrowInvalid, pa.ArrowException, OSError):
        raise _problem(path, None, "not a sharddbg rank stream (not an Arrow IPC stream)") from None
    batches = []
    while True:
        try:
            batches.append(reader.read_next_batch())
        except (StopIteration, pa.ArrowInvalid, pa.ArrowException, OSError):
            break
    table = pa.Table.from_batches(batches, _stream_schema())
    records = iter(columnar.records_of(columnar.file_table(table.filter(pa.compute.equal(table.column("line"),
                                                                                          "event"))
                                                           .select(["rank", *columnar.COLUMNS, "extra"]))))
    return [{"event": next(records)} if kind == "event" else {kind: json.loads(body)}
            for kind, body in zip(table.column("line").to_pylist(), table.column("body").to_pylist())]


def read_job(folder: str, allow_missing_ranks: bool = False) -> RecordedJob:
    """Read a job folder (see the module docstring).

    Parameters
    ----------
    folder : str
        The folder ``sharddbg record --out`` wrote.
    allow_missing_ranks : bool, default False
        Read the ranks whose streams are there when others are missing (they are marked incomplete) instead
        of refusing the folder.

    Returns
    -------
    RecordedJob
        The launcher's record and every rank's stream, read and checked.

    Raises
    ------
    JobFileProblem
        No rank stream in the folder, a stream that is not one, streams of two runs or two world sizes mixed,
        a missing rank (unless allowed), a corrupt line: the file and line named.

    Examples
    --------
    >>> job = read_job("run")
    >>> sorted(job.ranks), job.missing_ranks
    ([0, 1, 2, 3], [])
    """
    job = _read_job_record(folder)
    names = sorted(n for n in os.listdir(folder) if RANK_FILE_PATTERN.match(n))
    if not names:
        raise JobFileProblem(f"no rank stream (rank-NNNNN.arrows or .jsonl) in the folder: nothing was recorded there "
                             f"(did the job start under `sharddbg record --out {folder}`?)")
    streams: dict[int, RankStream] = {}
    for name in names:
        rank = int(RANK_FILE_PATTERN.match(name).group(1))
        if rank in streams:
            raise JobFileProblem(f"two streams of rank {rank} in the folder ({os.path.basename(streams[rank].file)} and "
                                 f"{name}): record each job into its own folder (--out)")
        streams[rank] = _read_stream(os.path.join(folder, name), rank)
    as_columns = [s for s in streams.values() if s.table is not None]
    columns = _check_columns(as_columns) if as_columns else None
    # the names of the files a rank would have: those of the folder's streams (JSON lines in a folder of version 1)
    suffix = JSON_LINES_SUFFIX if all(n.endswith(JSON_LINES_SUFFIX) for n in names) else STREAM_SUFFIX
    run_ids = {s.header["run_id"]: r for r, s in streams.items()}
    if job.get("run_id") is not None:
        run_ids.setdefault(job["run_id"], None)
    if len(run_ids) > 1:
        (a, ra), (b, rb) = list(run_ids.items())[:2]
        def who(r):
            return JOB_FILE if r is None else rank_file_name(r, suffix)
        raise JobFileProblem(f"two recorded runs are mixed in this folder: {who(ra)} belongs to run {a}, "
                             f"{who(rb)} to run {b}; record each job into its own folder (--out)")
    sizes = {s.header["world_size"]: r for r, s in streams.items()}
    if len(sizes) > 1:
        (a, ra), (b, rb) = list(sizes.items())[:2]
        raise JobFileProblem(f"{rank_file_name(ra, suffix)} says world size {a} but {rank_file_name(rb, suffix)} says {b}")
    world_size = next(iter(sizes))
    beyond = sorted(r for r in streams if r >= world_size)
    if beyond:
        raise JobFileProblem(f"{rank_file_name(beyond[0], suffix)} is rank {beyond[0]} of a world of {world_size}")
    missing = [r for r in range(world_size) if r not in streams]
    if missing and not allow_missing_ranks:
        files = ", ".join(rank_file_name(r, suffix) for r in missing)
        raise JobFileProblem(f"rank{'s' if len(missing) > 1 else ''} {', '.join(map(str, missing))} of {world_size} "
                             f"{'are' if len(missing) > 1 else 'is'} missing (no {files}): copy every rank's file "
                             f"into the folder, or load the ranks that are there with "
                             f"load_trace(folder, allow_missing_ranks=True)")
    return RecordedJob(folder, job, streams, world_size, missing, suffix, columns)


def hang_diagnoses(job: RecordedJob) -> dict[int, dict]:
    """Rank -> the diagnosis it wrote when a collective hung (its own, or another rank's: where it was then);
    a rank that wrote none of those contributes its end-of-run one, so that the ranks that never joined a
    collective are known from their Flight Recorder counts."""
    out: dict[int, dict] = {}
    for rank, s in job.ranks.items():
        at_hang = [d for d in s.diagnoses if d.get("why") in ("hang", "hang_elsewhere")]
        own = [d for d in at_hang if d.get("why") == "hang"]
        if own or at_hang:
            out[rank] = (own or at_hang)[0]
        elif s.diagnoses:
            out[rank] = s.diagnoses[-1]
    return out


JOB_HANG_CLOSING = ("sharddbg changed nothing in the job: it went on as it would have without sharddbg (the "
                    "collective completes late, or fails at the process group's timeout).")


def hang_report(job: RecordedJob) -> str | None:
    """The hang report of a job whose ranks wrote hang diagnoses (``analysis.hang``, as the notebook's): the
    collective, the ranks that never joined it and where each rank's Python was; None when nothing hung."""
    from .analysis.hang import build_report

    diagnoses = hang_diagnoses(job)
    stuck = sorted(r for r, d in diagnoses.items() if d.get("why") == "hang")
    if not stuck:
        return None
    elsewhere = sorted(r for r, d in diagnoses.items() if d.get("why") == "hang_elsewhere")
    after = diagnoses[stuck[0]].get("hang_after_s")
    after = float(after) if isinstance(after, (int, float)) else 0.0
    report = build_report(after, sorted(set(job.ranks) - set(stuck) - set(elsewhere)), stuck + elsewhere,
                          diagnoses, {r: s.header.get("pid") for r, s in job.ranks.items()},
                          closing=JOB_HANG_CLOSING)
    steps = {r: d.get("step") for r, d in diagnoses.items() if type(d.get("step")) is int}

    def done(r: int) -> str:
        return f" after {steps[r] - 1} optimizer step{'s' if steps[r] - 1 != 1 else ''}" if r in steps else ""

    def never_joined(r: int) -> list[int]:
        return sorted({m for p in report.ranks[r].pending for m in p.missing_ranks})

    # a stuck rank whose collective waits only for stuck ranks waits in turn; the others name the cause
    causes = [r for r in stuck if not set(never_joined(r)) <= set(stuck) or not never_joined(r)]
    in_turn = [r for r in stuck if r not in causes]
    parts = []
    for r in causes:
        missing = never_joined(r)
        parts.append(f"rank {r}{done(r)} waited more than {after:g} s in a collective"
                     + (f" that rank{'s' if len(missing) > 1 else ''} {', '.join(map(str, missing))} never joined"
                        if missing else ""))
    for r in in_turn:
        parts.append(f"rank {r}{done(r)} waits in turn for rank{'s' if len(never_joined(r)) > 1 else ''} "
                     f"{', '.join(map(str, never_joined(r)))}")
    if elsewhere:
        parts.append(f"where the other ranks were then: {', '.join(f'rank {r}{done(r)}' for r in elsewhere)}")
    report.headline = "; ".join(parts) + "."
    return report.format()


def as_plain(value: Any) -> Any:
    """``value`` as JSON writes it (the writer's ``default``): sets and tuples as lists, anything else as str."""
    if isinstance(value, (set, tuple)):
        return list(value)
    return str(value)
