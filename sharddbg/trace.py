"""Trace: the recorded events of all ranks on one clock, as pandas DataFrames.

Built on the client from the per-rank payloads of ``sharddbg.engine.recorder`` (schema.py) and the clock
offsets measured at gather time. Holistic-Trace-Analysis style: every ``get_*()`` returns a DataFrame
and is a one-line delegation to ``sharddbg.analysis``. No torch, no plotting here: ``show()`` / ``plot_*()`` /
``to_html()`` / ``to_perfetto()`` go through ``sharddbg.rendering``, which imports the views and exporters when
called.

File format (``save`` / ``load_trace``), JSON::

    {"format": "sharddbg.trace", "version": 1, "schema_version": 7,
     "meta": {...}, "clock_offsets_ns": {"0": 0, "1": -1234, ...},
     "incomplete_ranks": [2], "payloads": [<payload of rank 0>, ..., null for a rank that sent nothing]}

Every writer (``save``, ``to_perfetto``, ``to_html``) goes through ``write_file_atomically``: the file
appears whole or not at all. ``load_trace`` refuses, naming the field (and payload, rank, event), a file
that contradicts itself (a rank listed twice, a payload whose "rank" is not its "ranks" entry, a negative
count or version, a null or unfinished payload whose rank is not in "incomplete_ranks") or holds what no
sharddbg writes (integers beyond +-MAX_ABS_INT, NaN or infinities, nesting deeper than MAX_NESTING).
"""

from __future__ import annotations

import json
import math
import os
import warnings
from collections.abc import Iterable, Mapping
from types import MappingProxyType
from typing import Any

import pandas as pd

from . import rendering, schema
from .analysis import comm as _comm
from .analysis import consistency as _consistency
from .analysis import findings as _findings
from .analysis import ops as _ops
from .analysis import plan_cache as _plan_cache
from .analysis import summary as _summary
from .analysis.findings import Finding, TraceOverview
from .errors import ShardDbgWarning, TraceFileError
from .files import write_file_atomically

TRACE_FORMAT = "sharddbg.trace"
TRACE_VERSION = 1

__all__ = ["Trace", "load_trace", "TRACE_FORMAT", "TRACE_VERSION", "MAX_ABS_INT",
           "MAX_NESTING"]


class Trace:
    """Events of every rank of one recording. Build with ``Trace.from_payloads`` or ``load_trace``.

    ``clock_offsets_ns[r]``: how far rank r's clock is ahead of the reference (client) clock;
    every time in the DataFrames is ``rank time - offset``.
    ``incomplete_ranks``: ranks whose recording did not finish (timed out: events up to the snapshot,
    in-flight ops marked ``in_flight``) or that sent nothing at all; a rank whose payload is None or
    says ``complete`` False is always among them.
    """

    def __init__(self, payloads: dict[int, dict | None], clock_offsets_ns: dict[int, int],
                 incomplete_ranks: Iterable[int], meta: dict | None = None) -> None:
        self.payloads = dict(sorted(payloads.items()))
        self.clock_offsets_ns = {int(r): int(clock_offsets_ns.get(r, 0)) for r in self.payloads}
        unfinished = {r for r, p in self.payloads.items() if p is None or not p["complete"]}
        self.incomplete_ranks = sorted({int(r) for r in incomplete_ranks} | unfinished)
        meta = dict(meta or {})
        schema.validate_trace_meta(meta)
        # read-only: what a trace says about itself is set when it is built (schema.TRACE_META_FIELDS)
        self.meta: Mapping[str, Any] = MappingProxyType(meta)
        self._ops: pd.DataFrame | None = None
        self._collectives: pd.DataFrame | None = None
        if self.dropped:
            warnings.warn(
                f"sharddbg: the recorder's buffer overflowed, {self.dropped} events were dropped "
                f"(per rank: {self.dropped_by_rank}); raise max_events (--max-events) to keep them all",
                ShardDbgWarning,
                stacklevel=3,
            )

    # ---- building ---------------------------------------------------------------------------------
    @classmethod
    def from_payloads(cls, payloads: list | dict, clock_offsets_ns: dict | list | None = None,
                      meta: dict | None = None, incomplete_ranks: Iterable[int] = ()) -> "Trace":
        """``payloads``: per rank (list in rank order, or {rank: payload}); ``None`` for a rank that
        returned nothing. Payloads from ``recorder.peek()`` (``complete`` False) mark their rank incomplete.
        ``clock_offsets_ns``: {rank: ns} or a list in rank order (default: all 0).
        """
        items = payloads.items() if isinstance(payloads, dict) else enumerate(payloads)
        by_rank: dict[int, dict | None] = {}
        incomplete = set(int(r) for r in incomplete_ranks)
        for pos, p in items:
            if p is None:
                by_rank[int(pos)] = None
                incomplete.add(int(pos))
                continue
            schema.validate_payload(p)
            r = int(p["rank"])
            if r in by_rank and by_rank[r] is not None:
                raise schema.SchemaError(f"two payloads claim rank {r}")
            by_rank[r] = p
            if not p["complete"]:
                incomplete.add(r)
        if isinstance(clock_offsets_ns, (list, tuple)):
            clock_offsets_ns = dict(enumerate(clock_offsets_ns))
        return cls(by_rank, {int(k): int(v) for k, v in (clock_offsets_ns or {}).items()}, incomplete, meta)

    # ---- facts ------------------------------------------------------------------------------------
    @property
    def ranks(self) -> list[int]:
        return list(self.payloads)

    @property
    def world_size(self) -> int:
        ws = [p["world_size"] for p in self.payloads.values() if p]
        return max(ws + [len(self.payloads)])

    @property
    def dropped_by_rank(self) -> dict[int, int]:
        return {r: p["dropped"] for r, p in self.payloads.items() if p and p["dropped"]}

    @property
    def dropped(self) -> int:
        """Events lost to a full buffer, all ranks together."""
        return sum(self.dropped_by_rank.values())

    @property
    def collectives_recorded(self) -> bool:
        """Collectives were recorded: some rank's payload is of schema version 2 or later (collective
        records exist) and was recorded with collective capture on (its meta ``comm``; the recorder
        always writes it). False: ``get_collectives()`` is empty because nothing was looked for."""
        return any(p["schema_version"] >= 2 and p["meta"].get("comm", True) for p in self.payloads.values() if p)

    @property
    def checks(self) -> dict[str, bool]:
        """Which verifications ran while recording (schema version 5, payload meta): ``spec_check`` (each
        ShardTensor result's spec against its local tensor), ``replicas`` (digests of what claims Replicate),
        ``preflight`` (collectives compared across their group before being issued). All False for older
        files: nothing was looked for, so their empty tables mean "not checked"."""
        metas = [p["meta"] for p in self.payloads.values() if p and p["schema_version"] >= 5]
        return {name: any(bool(m.get(name)) for m in metas) for name in ("spec_check", "replicas", "preflight")}

    def events(self, rank: int) -> list[dict]:
        p = self.payloads.get(rank)
        return list(p["events"]) if p else []

    def __repr__(self) -> str:
        n = sum(len(p["events"]) for p in self.payloads.values() if p)
        return (f"<sharddbg.Trace ranks={self.ranks} events={n} dropped={self.dropped} "
                f"incomplete_ranks={self.incomplete_ranks}>")

    # ---- DataFrames (one-line delegations) ---------------------------------------------------------
    def get_ops(self) -> pd.DataFrame:
        """One row per op call (forward and backward) per rank; times on the reference clock. Beside the
        record's fields: ``location`` (where the user's code made the call: "cell [6], line 5: `y = x + x`"),
        ``message`` / ``exc_type`` / ``traceback`` of an error, ``local_ms`` (CPU: the call's own local
        computation, timed after recording), ``spec_mismatches`` (the records of results whose spec disagrees
        with their local tensor) and ``spec_mismatch`` (the same in one line, None where they agree: the
        mark for a view)."""
        if self._ops is None:
            self._ops = _ops.ops_frame({r: p["events"] if p else [] for r, p in self.payloads.items()},
                                       self.clock_offsets_ns)
        return self._ops.copy()

    def get_op_summary(self, nested: bool = False) -> pd.DataFrame:
        """The table to read first: one row per (op, dispatch path, phase) with calls, ranks, first-call and
        steady-state host time (median, p95), device / local time, what host dispatch adds (and whether it
        dominates), communication exclusive and inclusive, collectives in flight, errors, where in the code.
        Forward rows are the user's own calls (``nested=True``: every call); see analysis/summary.py."""
        return _summary.op_summary(self.get_ops(), self.get_collectives(), nested)

    def get_fallbacks(self, include_metadata: bool = False) -> pd.DataFrame:
        """Ops whose computation took a DTensor fallback: op, path, calls, ranks, host_ms_total, user_frames,
        ..., locations. Metadata reads (``shape``, ``ndim``, ``dtype``, ``detach``, ...) only with
        ``include_metadata=True`` (``category`` "metadata"); ``Tensor.backward`` is never one (its time is the
        whole backward pass)."""
        return _ops.fallbacks(self.get_ops(), include_metadata)

    def get_errors(self, include_propagated: bool = False) -> pd.DataFrame:
        """Real exceptions per rank: one row per origin, the innermost recorded op that raised it, or the cell
        itself for an exception raised outside every recorded op (``op`` is ``<outside recorded ops>``,
        ``user_frame`` the cell's line); ``message`` whole, ``traceback`` from the user's line down;
        ``cell_line`` / ``cell_code``: the cell statement the exception ended; ``location``: where, as
        "cell [6], line 5: `y = x + x`" (analysis/ops.py ``errors``)."""
        return _ops.errors(self.get_ops(), include_propagated, self.get_cell_errors())

    def get_cell_errors(self) -> pd.DataFrame:
        """The exception that ended the cell on each rank that raised (schema "error" records, since
        version 3): rank, seq, t_ns (reference clock), exc_type, message, traceback, origin_seq (the op
        record where it started, or None), cell_line, cell_code, cell (the cell's execution count on the
        ranks, since version 4), location."""
        return _ops.cell_errors_frame({r: p["events"] if p else [] for r, p in self.payloads.items()},
                                      self.clock_offsets_ns)

    @property
    def incomplete_reasons(self) -> dict[int, str]:
        """Why each incomplete rank is incomplete ("did not finish within 60 s", "its process died ..."),
        where the cluster said so."""
        given = self.meta.get("incomplete_reasons") or {}
        return {int(r): str(why) for r, why in given.items()}

    def get_promotions(self) -> pd.DataFrame:
        """Plain tensors promoted to Replicate, per op, with parameter names where known."""
        return _ops.promotions(self.get_ops())

    def get_collectives(self) -> pd.DataFrame:
        """One row per collective call per rank (kind, group, bytes, times on the reference clock,
        duration, bandwidth, the op it belongs to); see analysis/comm.py."""
        if self._collectives is None:
            self._collectives = _comm.collectives_frame({r: p["events"] if p else [] for r, p in self.payloads.items()},
                                                        self.clock_offsets_ns)
        return self._collectives.copy()

    def get_comm_by_op(self, by: str = "op", inclusive: bool = False) -> pd.DataFrame:
        """Communication per op name and rank (``by="op"``) or per op call (``by="call"``); forward
        (``comm_ms`` / ``op_ms`` / ``comm_share``) and backward (``bwd_*``) apart. ``inclusive=True``: a
        collective counts for every recorded op it ran inside, not only the innermost."""
        return _comm.comm_by_op(self.get_collectives(), self.get_ops(), by, inclusive)

    def get_comm_by_kind(self) -> pd.DataFrame:
        """Communication per (op, collective kind), all ranks together: the sum over ranks beside the per-rank
        maximum and mean of the time."""
        return _comm.comm_by_op_kind(self.get_collectives())

    def get_comm_by_rank(self) -> pd.DataFrame:
        """Communication of each rank: collectives, in flight, bytes, time summed and as wall time, and the
        rank's recorded span."""
        return _comm.comm_by_rank(self.get_collectives(), self.get_ops(), self.ranks)

    def get_comm_by_peer(self) -> pd.DataFrame:
        """Bytes each rank sent to / received from each other rank (all_to_all splits, send / recv)."""
        return _comm.comm_by_peer(self.get_collectives())

    def get_imbalance(self) -> pd.DataFrame:
        """Per op and rank: shard volume beside host, comm and wait-for-other-ranks time."""
        return _comm.imbalance(self.get_ops(), self.get_collectives())

    def get_collective_mismatches(self) -> pd.DataFrame:
        """Collectives that do not line up across the ranks of their group at the same group_seq: a
        different kind, dtype, size or split, or a rank that never issued it (``missing``)."""
        return _comm.collective_mismatches(self.get_collectives(), traced_ranks=self.ranks)

    # ---- verification -----------------------------------------------------------------------------
    def get_spec_mismatches(self) -> pd.DataFrame:
        """ShardTensor results whose spec disagreed with the local tensor, at the op that made them, on each rank
        where they held: one row per finding (``check``: which part of the spec, ``detail``: "spec says (313,
        3), the local tensor is (313, 17, 3) ..."), the earliest first (``first``). Empty also when nothing
        was checked (``checks["spec_check"]``)."""
        return _consistency.spec_mismatches(self.get_ops())

    def get_replica_divergence(self) -> pd.DataFrame:
        """Tensors claiming Replicate (op results, plain tensors such as module weights promoted to Replicate)
        whose ranks held different values after an op, recorded with ``replicas=True``: one row per tensor
        and replica group, the first op first (``first``), with the ranks that differ, the ranks they are
        compared with (``reference_ranks``) and, for the first op, the largest difference gathered from the
        ranks (``max_abs_diff``)."""
        return _consistency.replica_divergence(self.get_replica_digests(), self.meta.get("replica_differences"))

    def get_replica_digests(self) -> pd.DataFrame:
        """Every digest taken with ``replicas=True``: one row per tensor claiming Replicate per op call per rank
        (``key`` names the same tensor on every rank)."""
        return _consistency.replicas_frame({r: p["events"] if p else [] for r, p in self.payloads.items()},
                                           self.clock_offsets_ns)

    def get_preflight(self) -> pd.DataFrame:
        """Collectives compared across their group before they were issued (``preflight=True``): one row per
        collective and rank, ``status`` ok / mismatch (with ``detail``) / late / unchecked, ``ms`` its cost."""
        return _consistency.preflight_frame({r: p["events"] if p else [] for r, p in self.payloads.items()},
                                            self.get_ops())

    # ---- performance pitfalls ------------------------------------------------------------------------
    def get_plan_cache(self) -> pd.DataFrame:
        """DTensor's redistribution plan cache while recording: one row per group of calls that missed it per
        rank (op, source and target placements, ``changed``: the spec fields that changed after the call,
        ``stale`` when some did, ``count``), with the cache's size at start and stop on that rank. A stale
        miss is an entry never hit again: the cache grows each step and its lookups slow down
        (``plan_cache_finding``). Empty for payloads written before it was watched."""
        return _plan_cache.plan_cache_frame(self.payloads)

    def get_plan_cache_growth(self) -> pd.DataFrame:
        """Per rank: the plan cache's size at start and stop, the misses while recording, how many stale."""
        return _plan_cache.plan_cache_growth(self.payloads)

    @property
    def plan_cache_finding(self) -> str | None:
        """The plan cache finding's text (cause, cost, fix) when calls missed the plan cache on a spec changed
        after it was cached, else None."""
        found = _findings.plan_cache_finding(self.get_plan_cache(), self.get_plan_cache_growth())
        return found.text() if found is not None else None

    # ---- what is wrong, in the order to read it --------------------------------------------------------
    @property
    def findings(self) -> list[Finding]:
        """What this trace says is wrong, failures first (``analysis.findings.trace_findings``): the one list the
        summary line, the explorer and the report render."""
        return _findings.trace_findings(self)

    def get_findings(self) -> pd.DataFrame:
        """``findings`` as a DataFrame: kind, severity, sentence, fix, ranks, op, location; one row each."""
        return _findings.findings_frame(self.findings)

    @property
    def overview(self) -> TraceOverview:
        """The counts a header shows (``analysis.findings.trace_overview``): op calls, errors, fallbacks,
        collectives, spec mismatches, incomplete ranks, dropped events."""
        return _findings.trace_overview(self)

    # ---- files ------------------------------------------------------------------------------------
    def to_dict(self) -> dict:
        return {
            "format": TRACE_FORMAT,
            "version": TRACE_VERSION,
            "schema_version": schema.SCHEMA_VERSION,
            "meta": dict(self.meta),
            "clock_offsets_ns": {str(r): o for r, o in self.clock_offsets_ns.items()},
            "incomplete_ranks": self.incomplete_ranks,
            "ranks": self.ranks,
            "payloads": [self.payloads[r] for r in self.ranks],
        }

    def save(self, path: str | os.PathLike) -> str:
        """Write the trace as JSON (``load_trace`` reads it back). Returns the path. The file appears
        whole or not at all (``write_file_atomically``)."""
        doc = self.to_dict()
        return write_file_atomically(path, lambda f: json.dump(doc, f, allow_nan=False, separators=(",", ":")))

    def to_perfetto(self, path: str | os.PathLike) -> str:
        """Chrome trace-event JSON (open in ui.perfetto.dev or chrome://tracing): one process per
        rank, one complete ("X") slice per op and per collective; see ``sharddbg.exporters.perfetto``.
        Written like ``save``: whole or not at all."""
        return rendering.perfetto(self, path)

    # ---- views and the HTML report (through sharddbg.rendering: the data layer never needs plotly or widgets)
    def show(self, **kwargs):
        """The trace explorer widget: errors and fallbacks first, filters, per-rank detail of an op."""
        return rendering.explorer(self, **kwargs)

    def plot_timeline(self, **kwargs):
        """plotly Figure: one row per rank, op spans by dispatch path, collective spans by kind."""
        return rendering.timeline(self, **kwargs)

    def plot_comm_by_op(self, **kwargs):
        """plotly Figure: bytes and time per op, split by collective kind."""
        return rendering.comm_by_op(self, **kwargs)

    def plot_imbalance(self, **kwargs):
        """plotly Figure: per-rank shard volume beside per-rank time, per op."""
        return rendering.imbalance(self, **kwargs)

    def to_html(self, path: str | os.PathLike, **kwargs) -> str:
        """One standalone HTML report (explorer, timeline, comm, imbalance), viewable offline; see
        ``sharddbg.exporters.html_report``."""
        return rendering.html_report(self, path, **kwargs)


# What a trace file may hold, checked before anything is built from it.
# Every integer lies within +-2**61: times are int64 ns, and the analyses subtract a clock offset and the
# trace's first time from each; within this bound the result stays inside +-(2**62 + 2**61), which int64
# holds (2**61 ns is 73 years; byte counts fit as well).
MAX_ABS_INT = 2**61
_INT_BOUND_TEXT = "integers in a trace lie within +-2**61: times are int64 ns, and offsets are subtracted from them"
# Containers nest at most this deep in the whole file. A recorded op's shard shapes sit 8 levels down
# (file > payloads > payload > events > event > sharding_shapes > per-rank list > shape); the bound
# leaves room for free-form meta and keeps every reader that walks values recursively far from Python's
# recursion limit.
MAX_NESTING = 64


def load_trace(path: str | os.PathLike) -> Trace:
    """Read a file written by ``Trace.save``. Wrong or corrupt files raise TraceFileError, naming the field
    (and the payload, rank and event index) that is wrong, before anything is built from the file."""
    path = os.fspath(path)
    with open(path, "rb") as f:
        raw = f.read()
    try:
        d = json.loads(raw)
    except RecursionError:
        raise TraceFileError(f"{path}: corrupt sharddbg trace: its JSON nests deeper than Python's parser can "
                             f"follow (a trace nests at most {MAX_NESTING} levels)") from None
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise TraceFileError(f"{path}: not a sharddbg trace: not valid JSON ({e}); the file is corrupt or truncated") from None
    except ValueError:  # Python's limit on the digits of an integer it converts (4300 by default)
        raise TraceFileError(f"{path}: corrupt sharddbg trace: it holds an integer too long to read "
                             f"({_INT_BOUND_TEXT})") from None
    if not isinstance(d, dict) or d.get("format") != TRACE_FORMAT:
        raise TraceFileError(f"{path}: not a sharddbg trace (no \"format\": \"{TRACE_FORMAT}\" field)")
    v = d.get("version")
    if not _is_int(v) or v < 1:
        raise TraceFileError(f"{path}: sharddbg trace with a missing or invalid version field ({v!r})")
    if v > TRACE_VERSION:
        raise TraceFileError(f"{path}: trace file version {v} was written by a newer sharddbg; "
                             f"this one reads versions up to {TRACE_VERSION}: upgrade sharddbg")
    sv = d.get("schema_version")
    if _is_int(sv) and sv > schema.SCHEMA_VERSION:
        raise TraceFileError(f"{path}: its events use schema version {sv!r}; this sharddbg reads up to "
                             f"{schema.SCHEMA_VERSION}: upgrade sharddbg")
    try:
        return _trace_of_file(d)
    except _FileProblem as e:
        raise TraceFileError(f"{path}: corrupt sharddbg trace: {e}") from None


class _FileProblem(Exception):
    """What is wrong in a trace file's content (load_trace adds the file's name)."""


def _is_int(v) -> bool:
    return type(v) is int  # not bool, which is an int in Python


def _trace_of_file(d: dict) -> Trace:
    """The Trace a parsed trace file describes; _FileProblem naming the field when the file contradicts
    itself or holds what no sharddbg writes."""
    payloads = d.get("payloads")
    if "ranks" in d:
        ranks = d["ranks"]
    else:  # "ranks" may be left out: the payloads are then those of ranks 0, 1, ...
        ranks = list(range(len(payloads))) if isinstance(payloads, list) else []
    _check_values(d, ranks)
    sv = d.get("schema_version")
    if not _is_int(sv) or sv < 1:
        raise _FileProblem(f'field "schema_version" = {sv!r} is not a schema version (1..{schema.SCHEMA_VERSION})')
    if not isinstance(payloads, list):
        raise _FileProblem(f'field "payloads" must be a list (one payload or null per rank), '
                           f"got {type(payloads).__name__}")
    if not isinstance(ranks, list) or not all(_is_int(r) and r >= 0 for r in ranks):
        raise _FileProblem(f'field "ranks" = {ranks!r} must be a list of ranks (integers >= 0)')
    if len(ranks) != len(payloads):
        raise _FileProblem(f'"ranks" lists {len(ranks)} ranks but "payloads" holds {len(payloads)}')
    first_entry: dict[int, int] = {}
    for i, r in enumerate(ranks):
        if r in first_entry:
            raise _FileProblem(f'"ranks" lists rank {r} twice ("ranks"[{first_entry[r]}] and "ranks"[{i}])')
        first_entry[r] = i
    world_sizes: dict[int, int] = {}  # world size -> first payload index that says it
    for i, (r, p) in enumerate(zip(ranks, payloads)):
        if p is None:
            continue
        try:
            schema.validate_payload(p)
        except schema.SchemaError as e:
            raise _FileProblem(f"payload {i}: {e}") from None
        where = f"payload {i} (rank {r})"
        if p["rank"] != r:
            raise _FileProblem(f'payload {i} says rank {p["rank"]} but "ranks"[{i}] is {r}')
        if p["schema_version"] > sv:
            raise _FileProblem(f'{where} has schema_version {p["schema_version"]}, newer than the file\'s '
                               f'"schema_version" {sv}')
        if p["dropped"] < 0:
            raise _FileProblem(f'{where} field "dropped" = {p["dropped"]} is negative (it counts records the '
                               f"recorder could not keep)")
        if p["world_size"] < 1 or r >= p["world_size"]:
            raise _FileProblem(f'{where} field "world_size" = {p["world_size"]} does not hold rank {r}')
        world_sizes.setdefault(p["world_size"], i)
        if len(world_sizes) > 1:
            (ws0, i0), (ws1, i1) = world_sizes.items()
            raise _FileProblem(f'payload {i1} says "world_size" {ws1} but payload {i0} says {ws0}')
    offsets_field = d.get("clock_offsets_ns", {})
    if not isinstance(offsets_field, dict):
        raise _FileProblem(f'field "clock_offsets_ns" must map each rank to an integer, '
                           f"got {type(offsets_field).__name__}")
    offsets: dict[int, int] = {}
    for key, off in offsets_field.items():
        if not (key.isascii() and key.isdigit() and str(int(key)) == key and int(key) in first_entry):
            raise _FileProblem(f'field "clock_offsets_ns" has an entry {key!r} that is not a rank of "ranks" {ranks}')
        if not _is_int(off):
            raise _FileProblem(f'field "clock_offsets_ns"[{json.dumps(key)}] = {off!r} is not an integer (ns)')
        offsets[int(key)] = off
    if "clock_offsets_ns" in d and set(offsets) != set(ranks):
        missing = sorted(set(ranks) - set(offsets))
        raise _FileProblem(f'field "clock_offsets_ns" has no offset for rank{"s" if len(missing) > 1 else ""} '
                           f'{", ".join(map(str, missing))}')
    incomplete = d.get("incomplete_ranks", [])
    if not isinstance(incomplete, list) or not all(_is_int(r) and r in first_entry for r in incomplete):
        raise _FileProblem(f'field "incomplete_ranks" = {incomplete!r} must list ranks of "ranks" {ranks}')
    for i, (r, p) in enumerate(zip(ranks, payloads)):
        if (p is None or not p["complete"]) and r not in incomplete:
            what = "is null (the rank sent nothing)" if p is None else 'says "complete": false'
            raise _FileProblem(f'payload {i} (rank {r}) {what} but "incomplete_ranks" {incomplete} '
                               f"does not list rank {r}")
    meta = d.get("meta", {})
    if not isinstance(meta, dict):
        raise _FileProblem(f'field "meta" must be an object, got {type(meta).__name__}')
    try:
        schema.validate_trace_meta(meta)
    except schema.SchemaError as e:
        raise _FileProblem(f'field "meta": {e}') from None
    return Trace(dict(zip(ranks, payloads)), offsets, incomplete, meta)


def _check_values(d: dict, ranks) -> None:
    """Every container of the file nests at most MAX_NESTING deep, every integer lies within MAX_ABS_INT,
    every float is finite; else _FileProblem naming the first value found that does not."""
    if _values_in_bounds(d):
        return
    stack: list[tuple[dict | list, tuple]] = [(d, ())]  # (container, its path from the file's top)
    while stack:
        node, path = stack.pop()
        if len(path) >= MAX_NESTING:
            raise _FileProblem(f"{_where(path, ranks)} nests deeper than {MAX_NESTING} levels")
        for key, v in (node.items() if type(node) is dict else enumerate(node)):
            t = type(v)
            if t is int:
                if not -MAX_ABS_INT <= v <= MAX_ABS_INT:
                    raise _FileProblem(f"{_where(path + (key,), ranks)} = {v} is out of range ({_INT_BOUND_TEXT})")
            elif t is float:
                if not math.isfinite(v):
                    raise _FileProblem(f"{_where(path + (key,), ranks)} = {v} is not a finite number")
            elif t is dict or t is list:
                stack.append((v, path + (key,)))


def _values_in_bounds(d: dict) -> bool:
    """_check_values' test without keeping paths: it runs on every value of every file, so it is kept lean
    (a fraction of what json.loads takes); the slower walk that names the culprit runs only when this fails."""
    stack = [(d, 1)]
    while stack:
        node, depth = stack.pop()
        if depth > MAX_NESTING:
            return False
        for v in (node.values() if type(node) is dict else node):
            t = type(v)
            if t is int:
                if v > MAX_ABS_INT or v < -MAX_ABS_INT:
                    return False
            elif t is float:
                if v - v != 0.0:  # inf and nan: inf - inf is nan, and nan != 0
                    return False
            elif t is dict or t is list:
                stack.append((v, depth + 1))
    return True


def _where(path: tuple, ranks) -> str:
    """A value's place in a trace file, in the file's terms: 'payload 2 (rank 2) event #5 field "t_start_ns"'."""
    rest = path
    text = ""
    if len(path) >= 2 and path[0] == "payloads":
        i = path[1]
        rank = ranks[i] if isinstance(ranks, list) and i < len(ranks) and _is_int(ranks[i]) else None
        text = f"payload {i}" + (f" (rank {rank})" if rank is not None else "")
        rest = path[2:]
        if len(rest) >= 2 and rest[0] == "events":
            text += f" event #{rest[1]}"
            rest = rest[2:]
    if rest:
        shown = rest[:8]  # a path down a deeply nested value is cut, with how deep it goes
        field = json.dumps(shown[0]) + "".join(f"[{json.dumps(k)}]" for k in shown[1:])
        if len(rest) > len(shown):
            field += f"... ({len(rest) - len(shown)} levels more)"
        text = f"{text} field {field}" if text else f"field {field}"
    return text
