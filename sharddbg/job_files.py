"""The folder ``sharddbg record`` writes for one job, and how it is read back into per-rank payloads.

::

    run/                       one recorded job (``--out``)
      job.json                 the launcher's record: the command, when it ran, how it ended, how each rank ended
      rank-00000.jsonl         rank 0's stream: one JSON object per line, appended as the job runs
      rank-00001.jsonl         ...

A rank's stream is written by that rank's process while the job runs (``sharddbg.engine.jobs``) and flushed at
least every second, so a process killed at any moment leaves every line up to its last flush. Each line is an
object with one key, its kind (``LINE_KINDS``)::

    {"header": {...}}     first line: STREAM_FORMAT, STREAM_VERSION, run_id, rank, world_size, host, pid, ...
    {"event": {...}}      one schema record (op, collective, error, meta), complete; the same seq twice: the later
                          one replaces the earlier
    {"amend": {...}}      an op error's ``handled``, known later than the record (``seq``, ``handled``)
    {"state": {...}}      at each flush: what is in flight (records), events dropped so far, the optimizer step
    {"clock": {...}}      this rank's clock against rank 0's, measured when its process group came up
    {"diagnosis": {...}}  where the rank was (stack, Flight Recorder, groups) when a collective hung, and at the end
    {"end": {...}}        last line of a rank whose recording ended normally: the payload's meta, dropped, clock

``read_job`` turns the folder into what ``Trace`` is built from: the payloads (``schema.PAYLOAD_FIELDS``; a
rank without its end line is incomplete, its in-flight records those of its last state line), the clock
offsets, why ranks are incomplete (a file cut mid-record, a process killed), and the hang reports. Everything
is checked as strictly as a trace file: ``JobFileProblem`` names the file, the line and what is wrong.
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
STREAM_VERSION = 1
JOB_FILE = "job.json"
RANK_FILE_PATTERN = re.compile(r"^rank-(\d{5,})\.jsonl$")
LINE_KINDS = ("header", "event", "amend", "state", "clock", "diagnosis", "end")

__all__ = ["JOB_FILE", "JOB_FORMAT", "JOB_VERSION", "STREAM_FORMAT", "STREAM_VERSION", "LINE_KINDS", "JobFileProblem",
           "RecordedJob", "RankStream", "rank_file_name", "is_job_folder", "read_job"]


class JobFileProblem(Exception):
    """What is wrong with a recorded job's folder (``load_trace`` raises it as ``TraceFileError``)."""


def rank_file_name(rank: int) -> str:
    """The stream file of ``rank`` in a job folder: ``rank-00003.jsonl``."""
    return f"rank-{rank:05d}.jsonl"


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

    def incomplete_reasons(self) -> dict[int, str]:
        """Rank -> why its recording is incomplete, in words (the ranks whose recording ended normally are left
        out)."""
        how_ended = {int(k): v for k, v in (self.job.get("rank_exits") or {}).items()}
        reasons = {}
        for rank in self.missing_ranks:
            reasons[rank] = (f"no stream in the folder ({rank_file_name(rank)}): the rank never started "
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
                last = max((ev["seq"] for ev in s.payload["events"]), default=None)
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


def _read_stream(path: str, rank_in_name: int) -> RankStream:
    with open(path, "rb") as f:
        raw = f.read()
    lines = raw.split(b"\n")
    tail = lines.pop()  # what follows the last newline: empty when the file ends on a whole line
    if not lines and not tail:
        raise _problem(path, None, "the file is empty: the rank's process ended before it wrote its first line")
    header = None
    events: dict[int, dict] = {}
    amends: dict[int, bool | None] = {}
    state: dict | None = None
    end: dict | None = None
    s = RankStream(rank_in_name, path, {}, {})
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
        if not isinstance(body, dict):
            raise _problem(path, number, f'"{kind}" must hold an object')
        if number == 1:
            if kind != "header" or body.get("format") != STREAM_FORMAT:
                raise _problem(path, number, f'not a sharddbg rank stream (its first line is not a "{STREAM_FORMAT}" '
                                             f"header)")
            v = body.get("version")
            if type(v) is not int or v < 1 or v > STREAM_VERSION:
                raise _problem(path, number, f"stream version {v!r}: this sharddbg reads 1..{STREAM_VERSION}"
                                             + (" (upgrade sharddbg)" if type(v) is int and v > STREAM_VERSION else ""))
            sv = body.get("schema_version")
            if type(sv) is not int or sv < 1 or sv > schema.SCHEMA_VERSION:
                raise _problem(path, number, f"schema_version {sv!r}: this sharddbg reads 1..{schema.SCHEMA_VERSION}")
            for key, want in (("rank", int), ("world_size", int), ("run_id", str), ("meta", dict)):
                if type(body.get(key)) is not want:
                    raise _problem(path, number, f'header field "{key}" must be {want.__name__}, got '
                                                 f"{body.get(key)!r}")
            if body["rank"] != rank_in_name:
                raise _problem(path, number, f'the header says rank {body["rank"]} but the file is named for rank '
                                             f"{rank_in_name}")
            header = body
            continue
        if kind == "header":
            raise _problem(path, number, "a second header: two streams were written into one file")
        if kind == "event":
            if type(body.get("seq")) is not int:
                raise _problem(path, number, 'an event without an integer "seq"')
            events[body["seq"]] = body
        elif kind == "amend":
            if type(body.get("seq")) is not int or body.get("handled") not in (True, False, None):
                raise _problem(path, number, 'an amend line needs an integer "seq" and "handled" true/false/null')
            amends[body["seq"]] = body["handled"]
        elif kind == "state":
            state = body
            if type(body.get("step")) is int:
                s.last_step = body["step"]
            if type(body.get("t_ns")) is int:
                s.last_t_ns = body["t_ns"]
        elif kind == "clock":
            if type(body.get("offset_ns")) is not int:
                raise _problem(path, number, 'a clock line without an integer "offset_ns"')
            s.clock_offset_ns = body["offset_ns"]
            u = body.get("uncertainty_ns")
            s.clock_uncertainty_ns = u if type(u) is int else None
        elif kind == "diagnosis":
            s.diagnoses.append(body)
        elif kind == "end":
            end = body
    if header is None:
        raise _problem(path, None, "no header line")
    if tail:
        last_seq = max(events, default=None)
        s.cut = (f"its file ends mid-record at byte {offset + len(tail)} (line {len(lines) + 1} is cut after "
                 f"{len(tail)} bytes" + (f"; the last whole event is seq {last_seq})" if last_seq is not None else ")"))
    in_flight = [ev for ev in (state or {}).get("in_flight", []) if isinstance(ev, dict) and ev.get("seq") not in events]
    for seq, handled in amends.items():
        ev = events.get(seq)
        if ev is not None and isinstance(ev.get("error"), dict):
            events[seq] = dict(ev, error=dict(ev["error"], handled=handled))
    records = sorted(list(events.values()) + in_flight, key=lambda e: e.get("seq", -1))
    for ev in records:
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
    try:
        schema.validate_payload(s.payload)
    except schema.SchemaError as e:
        raise _problem(path, None, str(e)) from None
    return s


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
        raise JobFileProblem(f"no rank stream (rank-NNNNN.jsonl) in the folder: nothing was recorded there "
                             f"(did the job start under `sharddbg record --out {folder}`?)")
    streams: dict[int, RankStream] = {}
    for name in names:
        rank = int(RANK_FILE_PATTERN.match(name).group(1))
        streams[rank] = _read_stream(os.path.join(folder, name), rank)
    run_ids = {s.header["run_id"]: r for r, s in streams.items()}
    if job.get("run_id") is not None:
        run_ids.setdefault(job["run_id"], None)
    if len(run_ids) > 1:
        (a, ra), (b, rb) = list(run_ids.items())[:2]
        def who(r):
            return JOB_FILE if r is None else rank_file_name(r)
        raise JobFileProblem(f"two recorded runs are mixed in this folder: {who(ra)} belongs to run {a}, "
                             f"{who(rb)} to run {b}; record each job into its own folder (--out)")
    sizes = {s.header["world_size"]: r for r, s in streams.items()}
    if len(sizes) > 1:
        (a, ra), (b, rb) = list(sizes.items())[:2]
        raise JobFileProblem(f"{rank_file_name(ra)} says world size {a} but {rank_file_name(rb)} says {b}")
    world_size = next(iter(sizes))
    beyond = sorted(r for r in streams if r >= world_size)
    if beyond:
        raise JobFileProblem(f"{rank_file_name(beyond[0])} is rank {beyond[0]} of a world of {world_size}")
    missing = [r for r in range(world_size) if r not in streams]
    if missing and not allow_missing_ranks:
        files = ", ".join(rank_file_name(r) for r in missing)
        raise JobFileProblem(f"rank{'s' if len(missing) > 1 else ''} {', '.join(map(str, missing))} of {world_size} "
                             f"{'are' if len(missing) > 1 else 'is'} missing (no {files}): copy every rank's file "
                             f"into the folder, or load the ranks that are there with "
                             f"load_trace(folder, allow_missing_ranks=True)")
    return RecordedJob(folder, job, streams, world_size, missing)


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
