"""Turn per-rank diagnoses (stack + Flight Recorder) into "rank 0 waits in all_reduce #2; rank 1 never joined"."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class PendingCollective:
    """A collective a rank issued and that has not completed, with the group's ranks that never issued it."""

    group: str
    group_ranks: list[int]
    seq: int
    name: str  # e.g. "gloo:all_reduce"
    input_sizes: list
    dtypes: list
    missing_ranks: list[int]  # ranks of the group whose last collective on it is older than ``seq``
    last_seq_of: dict[int, int]  # rank -> last collective seq it issued on this group

    @property
    def kind(self) -> str:
        return self.name.split(":", 1)[-1]

    def describe(self) -> str:
        sizes = ", ".join("x".join(str(d) for d in s) or "scalar" for s in self.input_sizes) or "?"
        dtype = ",".join(sorted(set(self.dtypes))) or "?"
        text = (f"collective #{self.seq} of process group {self.group!r} (ranks {self.group_ranks}): "
                f"{self.kind}, input [{sizes}] {dtype}, not completed")
        if self.missing_ranks:
            details = ", ".join(f"rank {r} (its last on this group: #{self.last_seq_of.get(r, 0)})"
                                for r in self.missing_ranks)
            text += f"\n    never joined by: {details}"
        else:
            text += "\n    every rank of the group issued it (a peer may be slow, or sizes may disagree)"
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

    def format(self) -> str:
        lines = [f"rank {self.rank} (pid {self.pid}):"]
        if not self.answered:
            lines.append(f"  did not answer the diagnosis request: {self.note}")
            return "\n".join(lines)
        user = self.user_frames()
        # Library frames inside the innermost user frame: where the user's call went to wait.
        last_user = max((i for i, f in enumerate(self.stack) if f.get("user")), default=-1)
        library = [f for f in self.stack[last_user + 1:] if not f.get("user")]
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


@dataclass
class HangReport:
    """Which ranks did not finish ``what`` within ``timeout_s``, and where each unfinished one waits."""

    timeout_s: float
    finished: list[int]
    unfinished: list[int]
    ranks: dict[int, RankDiagnosis]  # unfinished rank -> where it waits
    what: str = "the cell"
    # every rank's raw diagnosis as its control thread answered it (None: no answer); a recording
    # running on a rank is in it ("recording"), which is how a trace keeps a hung rank's events
    diagnoses: dict[int, dict | None] = field(default_factory=dict)

    def summary(self) -> str:
        return (f"{len(self.unfinished)} of {len(self.finished) + len(self.unfinished)} ranks did not finish "
                f"{self.what} within {self.timeout_s:g} s: ranks {self.unfinished} still running; "
                f"ranks {self.finished} finished.")

    def format(self) -> str:
        parts = [self.summary()]
        parts += [self.ranks[r].format() for r in self.unfinished if r in self.ranks]
        parts.append(
            "The kernel is free and the engines are kept. To go on:\n"
            "  cl.recover()   # releases the blocked ranks, re-creates the process group on a fresh port\n"
            "                 # (%shard_cluster recover); ShardTensors made before must be made again\n"
            "  cl.restart()   # or: new engines (%shard_cluster restart)"
        )
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


def build_report(timeout_s: float, finished: list[int], unfinished: list[int], diagnoses: dict[int, dict | None],
                 pids: dict[int, int], what: str = "the cell") -> HangReport:
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
                missing_ranks=missing, last_seq_of=last_of,
            ))
        ranks[rank] = result
    return HangReport(timeout_s, sorted(finished), sorted(unfinished), ranks, what, diagnoses=dict(diagnoses))
