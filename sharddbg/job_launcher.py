"""``sharddbg record -- COMMAND``: run a job unchanged with every process recording (``sharddbg.engine.jobs``),
into one folder (``sharddbg.job_files``); ``sharddbg summary`` / ``sharddbg report`` read it back.

The launcher checks everything it is given before the job starts, writes ``job.json``, starts the command with
sharddbg's start-up file first on ``PYTHONPATH`` and the settings in the environment, passes its output
through, waits, then records how the job and each rank ended. Its exit status is the command's.
"""

from __future__ import annotations

import json
import os
import platform
import shutil
import signal
import subprocess
import sys
import time
import uuid
from dataclasses import dataclass

from . import job_files
from .engine.jobs.settings import ENV_CLAIMED, ENV_SETTINGS, JobSettings
from .errors import ShardDbgError
from .files import write_file_atomically
from .options import RecordingOptions

# the default --hang-after: below gloo's and NCCL's default process-group timeouts (30 and 10 minutes)
DEFAULT_HANG_AFTER_S = 60.0
SITE_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "engine", "jobs", "site")
AGENT_EXITS_FILE = "agent-exits.json"


class RecordArgumentError(ShardDbgError):
    """``sharddbg record`` was given something it cannot run; nothing was started."""


@dataclass(frozen=True)
class RecordRequest:
    """What ``sharddbg record`` was asked, checked."""

    command: list[str]
    out: str
    steps: tuple[int, int] | None
    hang_after_s: float
    options: RecordingOptions
    force: bool


def parse_steps(text: str) -> tuple[int, int]:
    """``"A:B"`` -> (A, B): optimizer steps A to B, 1-based, inclusive; RecordArgumentError otherwise."""
    parts = text.split(":")
    if len(parts) != 2 or not all(p.strip().isdigit() for p in parts):
        raise RecordArgumentError(f"--steps {text}: give a window of optimizer steps as A:B, whole numbers from 1 "
                                  f"(e.g. --steps 2:3 records the 2nd and 3rd steps)")
    first, last = int(parts[0]), int(parts[1])
    if first < 1:
        raise RecordArgumentError(f"--steps {text}: steps count from 1 (the first optimizer step is step 1)")
    if first > last:
        raise RecordArgumentError(f"--steps {text}: the window ends before it begins; did you mean "
                                  f"--steps {last}:{first}?")
    return first, last


def check_out_folder(out: str, force: bool) -> None:
    """Refuse a folder that cannot take a new run before anything starts (RecordArgumentError)."""
    if os.path.exists(out) and not os.path.isdir(out):
        raise RecordArgumentError(f"--out {out} is a file, not a folder: name a new folder for the run")
    if os.path.isdir(out) and os.listdir(out) and not force:
        raise RecordArgumentError(f"--out {out} exists and is not empty: name a new folder, or pass --force to record "
                                  f"into it (a previous run's files there are moved aside, never overwritten)")
    parent = out if os.path.isdir(out) else os.path.dirname(os.path.abspath(out))
    while not os.path.exists(parent):
        parent = os.path.dirname(parent)
    if not os.access(parent, os.W_OK | os.X_OK):
        raise RecordArgumentError(f"--out {out}: {parent} is not writable by you: name a folder you can write to")
    # the real test (os.access says yes to root everywhere): make a probe where the run would go, then remove it
    try:
        probe = os.path.join(parent, f".sharddbg-probe-{os.getpid()}")
        os.mkdir(probe)
        os.rmdir(probe)
    except OSError as e:
        raise RecordArgumentError(f"--out {out}: cannot write into {parent} ({e.strerror or e}): name a folder you can "
                                  f"write to") from None


def _move_previous_run(out: str) -> str | None:
    """With --force: a previous run's files in ``out`` go into ``out/replaced-<its run id>/``; the folder used."""
    previous = [n for n in os.listdir(out) if job_files.RANK_FILE_PATTERN.match(n)
                or n in (job_files.JOB_FILE, AGENT_EXITS_FILE) or n.startswith(".hang-")]
    if not previous:
        return None
    run_id = "unknown"
    try:
        with open(os.path.join(out, job_files.JOB_FILE)) as f:
            run_id = str(json.load(f).get("run_id") or run_id)
    except (OSError, ValueError):
        pass
    aside = os.path.join(out, f"replaced-{run_id}")
    n = 1
    while os.path.exists(aside):
        n += 1
        aside = os.path.join(out, f"replaced-{run_id}-{n}")
    os.makedirs(aside)
    for name in previous:
        shutil.move(os.path.join(out, name), os.path.join(aside, name))
    return aside


def _job_record(request: RecordRequest, run_id: str, **more) -> dict:
    from . import __version__

    return {"format": job_files.JOB_FORMAT, "version": job_files.JOB_VERSION, "run_id": run_id,
            "command": request.command, "cwd": os.getcwd(), "host": platform.node(),
            "sharddbg": __version__, "steps": list(request.steps) if request.steps else None,
            "hang_after_s": request.hang_after_s, "options": request.options.as_dict(), **more}


def record(request: RecordRequest) -> int:
    """Run the job of ``request`` recorded; its exit status (negative: the signal that ended it).

    Parameters
    ----------
    request : RecordRequest
        The command and the recording's settings, checked (``check_out_folder`` first).

    Returns
    -------
    int
        The command's exit status, as ``subprocess`` gives it.

    Raises
    ------
    RecordArgumentError
        The folder cannot take the run.
    FileNotFoundError
        The command's program does not exist (nothing ran).

    Examples
    --------
    >>> record(RecordRequest(["torchrun", "--nproc-per-node", "4", "train.py"], "run", None, 60.0,
    ...                      RecordingOptions(), force=False))
    0
    """
    if shutil.which(request.command[0]) is None:
        raise FileNotFoundError(f"{request.command[0]}: no such program (not on PATH, not a file); nothing was started")
    check_out_folder(request.out, request.force)
    os.makedirs(request.out, exist_ok=True)
    aside = _move_previous_run(request.out) if request.force else None
    run_id = f"{time.strftime('%Y%m%d-%H%M%S')}-{uuid.uuid4().hex[:8]}"
    out = os.path.abspath(request.out)
    job_path = os.path.join(out, job_files.JOB_FILE)
    started = time.time()
    write_file_atomically(job_path, lambda f: json.dump(_job_record(request, run_id, started=started,
                                                                     replaced_into=aside), f, indent=1))
    env = dict(os.environ)
    env.pop(ENV_CLAIMED, None)
    # torch's Flight Recorder (what each rank's collectives were, for the hang report): a ring buffer of records,
    # nothing the job computes changes; a size the user set is kept
    env.setdefault("TORCH_FR_BUFFER_SIZE", "2000")
    env["PYTHONPATH"] = SITE_DIR + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    env[ENV_SETTINGS] = JobSettings(out, run_id, request.options.as_dict(), request.steps,
                                    request.hang_after_s).to_env()
    # Ctrl-C reaches the job itself (same process group); the launcher waits for it to end
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        proc = subprocess.Popen(request.command, env=env)
        returncode = proc.wait()
    finally:
        signal.signal(signal.SIGINT, previous)
    rank_exits = {}
    exits_path = os.path.join(out, AGENT_EXITS_FILE)
    if os.path.exists(exits_path):
        try:
            with open(exits_path) as f:
                rank_exits = json.load(f)
        except (OSError, ValueError):
            pass
    elif returncode < 0 and _one_process(out):  # no torchrun agent: the signal ended the one recording process
        rank_exits = {"0": f"its process (pid {proc.pid}) was killed by {signal.Signals(-returncode).name}"}
    for name in os.listdir(out):
        if name.startswith(".hang-"):
            try:
                os.remove(os.path.join(out, name))
            except OSError:
                pass
    write_file_atomically(job_path, lambda f: json.dump(_job_record(
        request, run_id, started=started, replaced_into=aside, ended=time.time(),
        wall_s=round(time.time() - started, 3), returncode=returncode, rank_exits=rank_exits), f, indent=1))
    return returncode


def _one_process(out: str) -> bool:
    """The folder holds rank 0's stream only: the job was one recording process."""
    return sorted(n for n in os.listdir(out) if job_files.RANK_FILE_PATTERN.match(n)) == [job_files.rank_file_name(0)]


def summary_text(trace, width: int = 100) -> str:
    """The findings of a recorded job, in order, as plain text lines of at most ``width`` characters.

    Parameters
    ----------
    trace : Trace
        The job's trace (``load_trace(folder)``).
    width : int, default 100
        The longest line.

    Returns
    -------
    str
        A header (ranks, events, how the job ended), then each finding's severity and text wrapped, then the
        hang report when there was one.

    Examples
    --------
    >>> print(summary_text(sharddbg.load_trace("run")))  # doctest: +SKIP
    """
    import textwrap

    ov = trace.overview
    job = trace.meta.get("job") or {}
    rc = job.get("returncode")
    ended = ("still running or not ended" if rc is None else "exit status 0" if rc == 0
             else f"killed by {signal.Signals(-rc).name}" if rc < 0 else f"exit status {rc}")
    lines = [f"sharddbg: {job.get('folder', '')}", f"  {len(trace.ranks)} ranks; {ov.op_calls} op calls, "
             f"{ov.collectives} collectives recorded; the job ended with {ended}"]
    if trace.meta.get("code"):
        lines += textwrap.wrap(f"command: {trace.meta['code']}", width, initial_indent="  ", subsequent_indent="    ")
    lines.append("")
    findings = trace.findings
    if not findings:
        lines.append("no findings: nothing failed, hung or fell back")
    for f in findings:
        lines += textwrap.wrap(f"{f.severity.upper():<5} {f.text()}", width, subsequent_indent="      ",
                               break_long_words=True, break_on_hyphens=False)
    report = trace.meta.get("hang_report")
    if report:
        lines += ["", "hang report:"]
        for line in str(report).splitlines():
            indent = " " * (len(line) - len(line.lstrip()))
            lines += textwrap.wrap(line, width, subsequent_indent=indent + "    ", break_long_words=True,
                                   break_on_hyphens=False) or [""]
    return "\n".join(lines)


def main_record(argv: list[str]) -> int:
    """``sharddbg record [options] -- COMMAND ...``: the command line front end (its exit status)."""
    import argparse

    if "--" not in argv:
        print("sharddbg record: put the command after --, e.g. "
              "sharddbg record --out run -- torchrun --nproc-per-node 4 train.py", file=sys.stderr)
        return 2
    cut = argv.index("--")
    ours, command = argv[:cut], argv[cut + 1:]
    if not command:
        print("sharddbg record: nothing after --: give the command to run, e.g. -- torchrun --nproc-per-node 4 "
              "train.py", file=sys.stderr)
        return 2
    parser = argparse.ArgumentParser(prog="sharddbg record", description="record a job, unchanged, on every rank")
    parser.add_argument("--out", default=None, help="the run's folder (default: ./sharddbg-run-DATE-TIME)")
    parser.add_argument("--steps", default=None, help="record optimizer steps A to B only (A:B, from 1)")
    parser.add_argument("--max-events", type=int, default=None, help="events kept per rank")
    parser.add_argument("--hang-after", type=float, default=DEFAULT_HANG_AFTER_S,
                        help="seconds a collective may take before every rank writes where it is")
    parser.add_argument("--no-comm", action="store_true", help="record ops only, not collectives")
    parser.add_argument("--force", action="store_true", help="record into a folder that is not empty")
    args = parser.parse_args(ours)
    try:
        steps = parse_steps(args.steps) if args.steps is not None else None
        if not args.hang_after > 0:
            raise RecordArgumentError(f"--hang-after {args.hang_after:g}: give a number of seconds above 0")
        options = RecordingOptions.build(None, max_events=args.max_events, comm=False if args.no_comm else None)
        out = args.out or f"sharddbg-run-{time.strftime('%Y%m%d-%H%M%S')}"
        request = RecordRequest(command, out, steps, float(args.hang_after), options, args.force)
        if shutil.which(command[0]) is None:
            raise FileNotFoundError(f"{command[0]}: no such program (not on PATH, not a file); nothing was started")
        check_out_folder(out, args.force)
        returncode = record(request)
    except (RecordArgumentError, ShardDbgError, FileNotFoundError) as e:
        print(f"sharddbg record: {e}", file=sys.stderr)
        return 2
    print(f"sharddbg: recorded into {out} (exit status {returncode}); read it with: sharddbg summary {out}",
          file=sys.stderr)
    return returncode if returncode >= 0 else 128 - returncode
