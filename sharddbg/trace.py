"""Trace: the recorded events of all ranks on one clock, as pandas DataFrames.

Built on the client from the per-rank payloads of ``sharddbg.engine.recorder`` (schema.py) and the clock
offsets measured at gather time. Holistic-Trace-Analysis style: every ``get_*()`` returns a DataFrame
and is a one-line delegation to ``sharddbg.analysis``; the files it writes come from
``sharddbg.exporters``. No torch, no plotting here: ``show()`` / ``plot_*()`` / ``to_html()`` import the
views when called.

File format (``save`` / ``load_trace``), JSON::

    {"format": "sharddbg.trace", "version": 1, "schema_version": 2,
     "meta": {...}, "clock_offsets_ns": {"0": 0, "1": -1234, ...},
     "incomplete_ranks": [2], "payloads": [<payload of rank 0>, ..., null for a rank that sent nothing]}
"""

from __future__ import annotations

import json
import os
import warnings
from typing import Iterable

import pandas as pd

from . import schema
from .analysis import comm as _comm
from .analysis import ops as _ops
from .errors import ShardDbgWarning, TraceFileError
from .exporters.perfetto import perfetto_dict, write_perfetto  # noqa: F401 - also sharddbg.trace.perfetto_dict

TRACE_FORMAT = "sharddbg.trace"
TRACE_VERSION = 1

__all__ = ["Trace", "load_trace", "TRACE_FORMAT", "TRACE_VERSION"]


class Trace:
    """Events of every rank of one recording. Build with ``Trace.from_payloads`` or ``load_trace``.

    ``clock_offsets_ns[r]``: how far rank r's clock is ahead of the reference (client) clock;
    every time in the DataFrames is ``rank time - offset``.
    ``incomplete_ranks``: ranks whose recording did not finish (timed out: events up to the snapshot,
    in-flight ops marked ``in_flight``) or that sent nothing at all.
    """

    def __init__(self, payloads: dict[int, dict | None], clock_offsets_ns: dict[int, int],
                 incomplete_ranks: Iterable[int], meta: dict | None = None) -> None:
        self.payloads = dict(sorted(payloads.items()))
        self.clock_offsets_ns = {int(r): int(clock_offsets_ns.get(r, 0)) for r in self.payloads}
        self.incomplete_ranks = sorted(set(int(r) for r in incomplete_ranks))
        self.meta = dict(meta or {})
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

    def events(self, rank: int) -> list[dict]:
        p = self.payloads.get(rank)
        return list(p["events"]) if p else []

    def __repr__(self) -> str:
        n = sum(len(p["events"]) for p in self.payloads.values() if p)
        return (f"<sharddbg.Trace ranks={self.ranks} events={n} dropped={self.dropped} "
                f"incomplete_ranks={self.incomplete_ranks}>")

    # ---- DataFrames (one-line delegations) ---------------------------------------------------------
    def get_ops(self) -> pd.DataFrame:
        """One row per op call (forward and backward) per rank; times on the reference clock."""
        if self._ops is None:
            self._ops = _ops.ops_frame({r: p["events"] if p else [] for r, p in self.payloads.items()},
                                       self.clock_offsets_ns)
        return self._ops.copy()

    def get_fallbacks(self) -> pd.DataFrame:
        """Ops that took a DTensor fallback: op, path, calls, ranks, host_ms_total, user_frames."""
        return _ops.fallbacks(self.get_ops())

    def get_errors(self, include_propagated: bool = False) -> pd.DataFrame:
        """Real exceptions per rank (origin op), with tracebacks."""
        return _ops.errors(self.get_ops(), include_propagated)

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

    def get_comm_by_op(self, by: str = "op") -> pd.DataFrame:
        """Communication per op name and rank (``by="op"``) or per op call (``by="call"``)."""
        return _comm.comm_by_op(self.get_collectives(), self.get_ops(), by)

    def get_imbalance(self) -> pd.DataFrame:
        """Per op and rank: shard volume beside host, comm and wait-for-other-ranks time."""
        return _comm.imbalance(self.get_ops(), self.get_collectives())

    def get_collective_mismatches(self) -> pd.DataFrame:
        """Collectives whose kind, dtype or sizes differ across the ranks at the same group_seq."""
        return _comm.collective_mismatches(self.get_collectives())

    # ---- files ------------------------------------------------------------------------------------
    def to_dict(self) -> dict:
        return {
            "format": TRACE_FORMAT,
            "version": TRACE_VERSION,
            "schema_version": schema.SCHEMA_VERSION,
            "meta": self.meta,
            "clock_offsets_ns": {str(r): o for r, o in self.clock_offsets_ns.items()},
            "incomplete_ranks": self.incomplete_ranks,
            "ranks": self.ranks,
            "payloads": [self.payloads[r] for r in self.ranks],
        }

    def save(self, path: str | os.PathLike) -> str:
        """Write the trace as JSON (``load_trace`` reads it back). Returns the path."""
        path = os.fspath(path)
        tmp = path + ".tmp"
        with open(tmp, "w") as f:
            json.dump(self.to_dict(), f, allow_nan=False, separators=(",", ":"))
        os.replace(tmp, path)  # never leave a half-written trace under the real name
        return path

    def to_perfetto(self, path: str | os.PathLike) -> str:
        """Chrome trace-event JSON (open in ui.perfetto.dev or chrome://tracing): one process per
        rank, one complete ("X") slice per op and per collective; see ``sharddbg.exporters.perfetto``."""
        return write_perfetto(self, path)

    # ---- views and the HTML report (imported lazily: the data layer never needs plotly or widgets) ----
    def show(self, **kwargs):
        """The trace explorer widget: errors and fallbacks first, filters, per-rank detail of an op."""
        from .views.explorer import TraceExplorer

        return TraceExplorer(self, **kwargs)

    def plot_timeline(self, **kwargs):
        """plotly Figure: one row per rank, op spans by dispatch path, collective spans by kind."""
        from .views.timeline import plot_timeline

        return plot_timeline(self, **kwargs)

    def plot_comm_by_op(self, **kwargs):
        """plotly Figure: bytes and time per op, split by collective kind."""
        from .views.comm import plot_comm_by_op

        return plot_comm_by_op(self, **kwargs)

    def plot_imbalance(self, **kwargs):
        """plotly Figure: per-rank shard volume beside per-rank time, per op."""
        from .views.imbalance import plot_imbalance

        return plot_imbalance(self, **kwargs)

    def to_html(self, path: str | os.PathLike, **kwargs) -> str:
        """One standalone HTML report (explorer, timeline, comm, imbalance), viewable offline; see
        ``sharddbg.exporters.html_report``."""
        from .exporters.html_report import to_html

        return to_html(self, path, **kwargs)


def load_trace(path: str | os.PathLike) -> Trace:
    """Read a file written by ``Trace.save``. Wrong or corrupt files raise TraceFileError."""
    path = os.fspath(path)
    with open(path, "rb") as f:
        raw = f.read()
    try:
        d = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise TraceFileError(f"{path}: not a sharddbg trace: not valid JSON ({e}); the file is corrupt or truncated") from None
    if not isinstance(d, dict) or d.get("format") != TRACE_FORMAT:
        raise TraceFileError(f"{path}: not a sharddbg trace (no \"format\": \"{TRACE_FORMAT}\" field)")
    v = d.get("version")
    if not isinstance(v, int) or v < 1:
        raise TraceFileError(f"{path}: sharddbg trace with a missing or invalid version field ({v!r})")
    if v > TRACE_VERSION:
        raise TraceFileError(f"{path}: trace file version {v} was written by a newer sharddbg; "
                             f"this one reads versions up to {TRACE_VERSION}: upgrade sharddbg")
    sv = d.get("schema_version")
    if not isinstance(sv, int) or sv > schema.SCHEMA_VERSION:
        raise TraceFileError(f"{path}: its events use schema version {sv!r}; this sharddbg reads up to "
                             f"{schema.SCHEMA_VERSION}: upgrade sharddbg")
    try:
        payloads = d["payloads"]
        ranks = d.get("ranks") or list(range(len(payloads)))
        if not isinstance(payloads, list) or len(ranks) != len(payloads):
            raise TraceFileError(f"{path}: corrupt sharddbg trace: 'payloads' and 'ranks' disagree")
        by_rank = {}
        for r, p in zip(ranks, payloads):
            if p is not None:
                schema.validate_payload(p)
            by_rank[int(r)] = p
        offsets = {int(k): int(v) for k, v in (d.get("clock_offsets_ns") or {}).items()}
        return Trace(by_rank, offsets, d.get("incomplete_ranks") or [], d.get("meta") or {})
    except schema.SchemaError as e:
        raise TraceFileError(f"{path}: corrupt sharddbg trace: {e}") from None
    except (KeyError, TypeError, ValueError, AttributeError) as e:
        if isinstance(e, TraceFileError):
            raise
        raise TraceFileError(f"{path}: corrupt sharddbg trace: {type(e).__name__}: {e}") from None
