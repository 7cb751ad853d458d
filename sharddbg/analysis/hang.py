"""Turn per-rank diagnoses (stack + Flight Recorder + recording so far) into what a user reads when ranks do
not finish: "rank 1 raised IndexError: boom (line 2 of the cell); ranks [0] wait for it in all_reduce on
'domain' (group_seq 1 of this trace), which rank 1 never issued".

Numbering: inside a trace a collective is named by the trace's own number (``group_seq``, the k-th on its
group since the recording started, as ``Trace.get_collectives()`` shows it); outside a trace, by what
torch's Flight Recorder counts, said plainly ("the 33rd collective on process group 'domain'").
"""

from __future__ import annotations

from dataclasses import dataclass, field

import os

from ..errors import RankFailure, hide_own_frames

_OWN_FILE = f"{os.sep}sharddbg{os.sep}"


def ordinal(n: int) -> str:
    """1st, 2nd, 3rd, 4th, 11th, 12th, 13th, 21st, 33rd."""
    if 10 <= n % 100 <= 20:
        suffix = "th"
    else:
        suffix = {1: "st", 2: "nd", 3: "rd"}.get(n % 10, "th")
    return f"{n}{suffix}"


@dataclass
class PendingCollective:
    """A collective a rank issued and that has not completed, with the group's ranks that never issued it."""

    group: str  # process-group name
    group_ranks: list[int]
    seq: int  # the Flight Recorder's count: the seq-th collective on this group since it was created
    name: str  # e.g. "gloo:all_reduce"
    input_sizes: list
    dtypes: list
    missing_ranks: list[int]  # ranks of the group whose last collective on it is older than ``seq``
    last_seq_of: dict[int, int]  # rank -> how many collectives it issued on this group (Flight Recorder)
    mesh_dim: str | None = None  # "ddp" / "domain" when the group is a mesh dim's
    trace_group_seq: int | None = None  # its group_seq in the running trace, when one runs
    # ranks that issued the same collective (same group and count) with other input sizes or another kind
    disagreeing: dict[int, str] = field(default_factory=dict)

    @property
    def kind(self) -> str:
        return self.name.split(":", 1)[-1]

    @property
    def group_label(self) -> str:
        return f"'{self.mesh_dim}'" if self.mesh_dim else f"'{self.group}'"

    def describe(self) -> str:
        sizes = ", ".join("x".join(str(d) for d in s) or "scalar" for s in self.input_sizes) or "?"
        dtype = ",".join(sorted(set(self.dtypes))) or "?"
        if self.trace_group_seq is not None:
            which = (f"{self.kind} on {self.group_label} (group_seq {self.trace_group_seq} of this trace; "
                     f"process group '{self.group}', ranks {self.group_ranks})")
        else:
            where = f"process group {self.group_label}" + (f" ('{self.group}')" if self.mesh_dim else "")
            which = (f"{self.kind}, the {ordinal(self.seq)} collective on {where} since it was created "
                     f"(ranks {self.group_ranks})")
        text = f"{which}, input [{sizes}] {dtype}, not completed"
        if self.missing_ranks:
            details = ", ".join(f"rank {r} (it issued {self.last_seq_of.get(r, 0)} on this group)"
                                for r in self.missing_ranks)
            text += f"\n    never joined by: {details}"
        if self.disagreeing:
            text += "\n    issued differently by: " + "; ".join(f"rank {r}: {what}" for r, what in
                                                            sorted(self.disagreeing.items()))
        if not self.missing_ranks and not self.disagreeing:
            text += "\n    every rank of the group issued it alike (a peer may be slow)"
        return text


@dataclass
class RankDiagnosis:
    """Where one unfinished rank waits: its stack (user frames tagged) and its pending collectives."""

    rank: int
    pid: int | None
    stack: list[dict] = field(default_factory=list)
    pending: list[PendingCollective] = field(default_factory=list)
    answered: bool = True
    note: str = ""

    def user_frames(self) -> list[dict]:
        return [f for f in self.stack if f.get("user")]

    def innermost_function(self) -> str:
        """The function the rank is stuck in: the innermost frame, library or not."""
        return self.stack[-1]["function"] if self.stack else "?"

    def waits_for(self, ranks) -> bool:
        """It waits in a collective of a group that holds one of ``ranks``."""
        wanted = set(ranks)
        return any(wanted & set(p.group_ranks) for p in self.pending)

    def format(self) -> str:
        lines = [f"rank {self.rank} (pid {self.pid}):"]
        if not self.answered:
            lines.append(f"  did not answer the diagnosis request: {self.note}")
            return "\n".join(lines)
        user = self.user_frames()
        # Library frames inside the innermost user frame: where the user's call went to wait (sharddbg's own
        # hooks are left out unless SHARDDBG_DEBUG=1)
        last_user = max((i for i, f in enumerate(self.stack) if f.get("user")), default=-1)
        library = [f for f in self.stack[last_user + 1:] if not f.get("user")
                   and not (hide_own_frames() and _OWN_FILE in f.get("file", ""))]
        if user:
            lines.append("  in your code (innermost last):")
            lines += [f"    {f['file']}:{f['line']} in {f['function']}: {f['code']}" for f in user[-6:]]
        if library:
            inner = library[-4:]
            lines.append("  inside libraries (innermost last):")
            lines += [f"    {f['file']}:{f['line']} in {f['function']}: {f['code']}" for f in inner]
        for pending in self.pending:
            lines.append("  waiting in " + pending.describe())
        if not self.pending:
            lines.append("  no pending collective in torch's Flight Recorder" + (f" ({self.note})" if self.note else ""))
        return "\n".join(lines)


RECOVERY_HINT = (
    "To go on:\n"
    "  cl.recover()   # releases the blocked ranks, re-creates the process group on a fresh port\n"
    "                 # (%shard_cluster recover); ShardTensors made before must be made again\n"
    "  cl.restart()   # or: new engines (%shard_cluster restart)")


def format_failures(failures: dict[int, RankFailure], tracebacks: int = 1) -> str:
    """Each failed rank's headline (rank, exception, line of the cell), ranks with the same failure
    together, then the traceback of the first ``tracebacks`` distinct failures."""
    groups: dict[tuple, list[int]] = {}
    for rank, f in sorted(failures.items()):
        groups.setdefault((f.type_name, f.message, f.cell_line, f.cell_code), []).append(rank)
    lines = []
    shown = 0
    for (_t, _m, _l, _c), ranks in groups.items():
        f = failures[ranks[0]]
        head = f.headline(ranks[0])
        if len(ranks) > 1:
            head = head.replace(f"rank {ranks[0]} raised", f"ranks {ranks} raised", 1)
        lines.append(head)
        if shown < tracebacks and f.traceback:
            lines.append("  " + f.traceback.strip().replace("\n", "\n  "))
            shown += 1
    return "\n".join(lines)


@dataclass
class HangReport:
    """Which ranks did not finish ``what`` within ``timeout_s``, and where each unfinished one waits.

    ``failures``: ranks that finished by raising, the likely cause of the others' wait: the report leads
    with them."""

    timeout_s: float
    finished: list[int]
    unfinished: list[int]
    ranks: dict[int, RankDiagnosis]  # unfinished rank -> where it waits
    what: str = "the cell"
    # every rank's raw diagnosis as its control thread answered it (None: no answer); a recording
    # running on a rank is in it ("recording"), which is how a trace keeps a hung rank's events
    diagnoses: dict[int, dict | None] = field(default_factory=dict)
    failures: dict[int, RankFailure] = field(default_factory=dict)
    # what comes after the ranks (what the user can do now); "" for the notebook's: the kernel is free, recover
    closing: str = ""
    headline: str = ""  # what comes first instead of ``summary()``; "" for the notebook's

    def summary(self) -> str:
        ok = [r for r in self.finished if r not in self.failures]
        parts = [f"{len(self.unfinished)} of {len(self.finished) + len(self.unfinished)} ranks did not finish "
                 f"{self.what} within {self.timeout_s:g} s: ranks {self.unfinished} still running"]
        if self.failures:
            parts.append(f"ranks {sorted(self.failures)} raised")
        if ok:
            parts.append(f"ranks {ok} finished")
        return "; ".join(parts) + "."

    def format(self) -> str:
        parts = []
        if self.failures:
            parts.append(format_failures(self.failures))
        parts.append(self.headline or self.summary())
        parts += [self.ranks[r].format() for r in self.unfinished if r in self.ranks]
        parts.append(self.closing or "The kernel is free and the engines are kept. " + RECOVERY_HINT)
        return "\n\n".join(parts)

    def __str__(self) -> str:
        return self.format()


def last_seq_by_group(fr: dict) -> dict[str, int]:
    last: dict[str, int] = {}
    for entry in fr.get("entries", []) if fr.get("available") else []:
        if entry.get("is_p2p"):
            continue
        last[entry["group"]] = max(last.get(entry["group"], 0), entry["seq"])
    return last


def _trace_group_seq(recording: dict | None, group: str) -> int | None:
    """The group_seq, in a running recording, of the last collective on ``group`` that never completed."""
    if not recording:
        return None
    found = None
    for ev in recording.get("events", []):
        if ev.get("kind") == "collective" and ev.get("group_name") == group and (
                ev.get("t_done_ns") is None or ev.get("in_flight")):
            found = ev.get("group_seq")
    return found


def _entry_text(entry: dict) -> str:
    sizes = ", ".join("x".join(str(d) for d in s) or "scalar" for s in entry.get("input_sizes", [])) or "?"
    return f"{entry['name'].split(':', 1)[-1]}, input [{sizes}]"


def _same_collective_elsewhere(diagnoses: dict, rank: int, entry: dict) -> dict[int, str]:
    """Ranks whose Flight Recorder holds the same collective (group and count) with another kind or other
    input sizes: rank -> what they issued."""
    mine = _entry_text(entry)
    out = {}
    for other, diag in diagnoses.items():
        if other == rank or not diag:
            continue
        for e in diag.get("flight_recorder", {}).get("entries", []):
            if e["group"] == entry["group"] and e["seq"] == entry["seq"] and not e.get("is_p2p"):
                if _entry_text(e) != mine:
                    out[other] = _entry_text(e)
    return out


@dataclass
class UnissuedCollective:
    """A collective that ranks waited in until it failed (gloo's own collective timeout, say), and that other
    ranks of its group never issued: the cause of that failure."""

    waiting_ranks: list[int]  # the ranks that issued it (and failed in it)
    missing_ranks: list[int]  # ranks of its group whose Flight Recorder holds fewer collectives on the group
    name: str  # e.g. "gloo:all_gather"
    group: str  # process-group name
    seq: int  # the Flight Recorder's count: the seq-th collective on this group since it was created
    mesh_dim: str | None = None  # "ddp" / "domain" when the group is a mesh dim's
    trace_group_seq: int | None = None  # its group_seq in the running trace, when one runs

    @property
    def kind(self) -> str:
        return self.name.split(":", 1)[-1]

    def describe(self) -> str:
        """ "rank 1 never issued the all_gather rank 0 waited in (group_seq 3 of this trace on 'domain')" """
        where = f"'{self.mesh_dim}'" if self.mesh_dim else f"'{self.group}'"
        if self.trace_group_seq is not None:
            which = f"group_seq {self.trace_group_seq} of this trace on {where}"
        else:
            which = f"the {ordinal(self.seq)} collective on process group {where} since it was created"
        return (f"{ranks_words(self.missing_ranks)} never issued the {self.kind} {ranks_words(self.waiting_ranks)} "
                f"waited in ({which})")


def ranks_words(ranks) -> str:
    """ "rank 1", "ranks 1, 2, 3" """
    ranks = sorted(ranks)
    return f"rank {ranks[0]}" if len(ranks) == 1 else "ranks " + ", ".join(str(r) for r in ranks)


def unissued_collectives(diagnoses: dict[int, dict | None], failed) -> list[UnissuedCollective]:
    """For each rank of ``failed`` (they raised in a collective that failed for want of a peer), the last
    collective it issued on each of its groups that other ranks of the group never issued, from every rank's
    Flight Recorder in ``diagnoses`` (rank -> the engine's diagnosis; a rank without one is not counted
    missing). Ranks that waited in the same collective are together."""
    last_by_rank = {r: last_seq_by_group(d.get("flight_recorder", {})) for r, d in diagnoses.items() if d}
    found: dict[tuple, UnissuedCollective] = {}
    for rank in sorted(failed):
        diag = diagnoses.get(rank)
        fr = (diag or {}).get("flight_recorder", {})
        if not fr.get("available"):
            continue
        last: dict[str, dict] = {}  # group -> the last collective this rank issued on it
        for entry in fr.get("entries", []):
            if not entry.get("is_p2p") and entry["seq"] >= last.get(entry["group"], {"seq": -1})["seq"]:
                last[entry["group"]] = entry
        for group, entry in last.items():
            members = diag.get("groups", {}).get(group, [])
            missing = sorted(r for r in members if r in last_by_rank and last_by_rank[r].get(group, 0) < entry["seq"])
            if not missing:
                continue
            key = (group, entry["seq"], entry["name"])
            if key not in found:
                found[key] = UnissuedCollective(
                    waiting_ranks=[], missing_ranks=missing, name=entry["name"], group=group, seq=entry["seq"],
                    mesh_dim=diag.get("mesh_dims", {}).get(group),
                    trace_group_seq=_last_trace_group_seq(diag.get("recording"), group))
            found[key].waiting_ranks.append(rank)
    return list(found.values())


def _last_trace_group_seq(recording: dict | None, group: str) -> int | None:
    """The group_seq, in a running recording, of the last collective on ``group`` (completed or not)."""
    seqs = [ev.get("group_seq") for ev in (recording or {}).get("events", [])
            if ev.get("kind") == "collective" and ev.get("group_name") == group]
    return seqs[-1] if seqs else None


def build_report(timeout_s: float, finished: list[int], unfinished: list[int], diagnoses: dict[int, dict | None],
                 pids: dict[int, int], what: str = "the cell",
                 failures: dict[int, RankFailure] | None = None, closing: str = "") -> HangReport:
    """``diagnoses``: rank -> the engine's :func:`sharddbg.engine.control.diagnosis` dict, or None if silent."""
    last_by_rank = {r: last_seq_by_group(d.get("flight_recorder", {})) for r, d in diagnoses.items() if d}
    ranks: dict[int, RankDiagnosis] = {}
    for rank in unfinished:
        diag = diagnoses.get(rank)
        if not diag:
            ranks[rank] = RankDiagnosis(rank, pids.get(rank), answered=False,
                                        note="its control thread is stuck too (see the engine's stack dump file)")
            continue
        fr = diag.get("flight_recorder", {})
        groups = diag.get("groups", {})
        mesh_dims = diag.get("mesh_dims", {})
        result = RankDiagnosis(rank, diag.get("pid"), stack=diag.get("stack", []))
        if not fr.get("available"):
            result.note = fr.get("reason", "flight recorder unavailable")
        for entry in fr.get("entries", []) if fr.get("available") else []:
            if entry["completed"] or entry.get("is_p2p"):
                continue
            members = groups.get(entry["group"], [])
            last_of = {r: last_by_rank[r].get(entry["group"], 0) for r in members if r in last_by_rank}
            missing = sorted(r for r, seq in last_of.items() if seq < entry["seq"])
            result.pending.append(PendingCollective(
                group=entry["group"], group_ranks=members, seq=entry["seq"], name=entry["name"],
                input_sizes=entry.get("input_sizes", []), dtypes=entry.get("dtypes", []),
                missing_ranks=missing, last_seq_of=last_of, mesh_dim=mesh_dims.get(entry["group"]),
                trace_group_seq=_trace_group_seq(diag.get("recording"), entry["group"]),
                disagreeing=_same_collective_elsewhere(diagnoses, rank, entry),
            ))
        ranks[rank] = result
    return HangReport(timeout_s, sorted(finished), sorted(unfinished), ranks, what, diagnoses=dict(diagnoses),
                      failures=dict(failures or {}), closing=closing)
