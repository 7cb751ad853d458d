"""Trace: the recorded events of all ranks on one clock, as pandas DataFrames.

Built on the client from the per-rank payloads of ``sharddbg.engine.recorder`` (schema.py) and the clock
offsets measured at gather time. Holistic-Trace-Analysis style: every ``get_*()`` returns a DataFrame
and is a one-line delegation to ``sharddbg.analysis``. No torch, no plotting here: ``show()`` / ``plot_*()`` /
``to_html()`` / ``to_perfetto()`` go through ``sharddbg.rendering``, which imports the views and exporters when
called.

File format (``save`` / ``load_trace``), JSON::

    {"format": "sharddbg.trace", "version": 1, "schema_version": 8,
     "meta": {...}, "clock_offsets_ns": {"0": 0, "1": -1234, ...},
     "incomplete_ranks": [2], "ranks": [0, 1, 2, ...],
     "payloads": [<payload of rank 0>, ..., null for a rank that sent nothing]}

``save("run.sdtrace.arrow")`` writes the same document as columns instead (``sharddbg.columnar``: an Arrow IPC
file, for big traces); ``load_trace`` tells the two apart by their first bytes and checks both alike. A trace
loaded from columns keeps them: its tables are built from the columns, its records made as dicts only when asked
for (``events(rank)``, ``to_dict()``). So does a big trace given as dicts (a JSON file, ``Trace.from_payloads``: a
rank of ``RECORDS_AS_COLUMNS_FROM`` records or more), where the columns give every record back as it is.

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
import stat
import warnings
from collections.abc import Iterable, Mapping
from types import MappingProxyType
from typing import TYPE_CHECKING, Any

import pandas as pd

from . import columnar, job_files, rendering, schema
from .analysis import comm as _comm
from .analysis import consistency as _consistency
from .analysis import findings as _findings
from .analysis import formatting as _analysis_formatting
from .analysis import ops as _ops
from .analysis import patch_families as _patch_families
from .analysis import plan_cache as _plan_cache
from .analysis import summary as _summary
from .analysis.findings import Finding, TraceOverview
from .errors import ShardDbgWarning, TraceFileError
from .files import refuse_folder, write_file_atomically

if TYPE_CHECKING:  # the return types of the views, for type checkers only (never imported when sharddbg runs)
    import anywidget
    import plotly.graph_objects as go

TRACE_FORMAT = "sharddbg.trace"
TRACE_VERSION = 1

__all__ = ["Trace", "load_trace", "TRACE_FORMAT", "TRACE_VERSION", "MAX_ABS_INT",
           "MAX_NESTING", "RECORDS_AS_COLUMNS_FROM"]


class Trace:
    """Events of every rank of one recording, on one clock, as pandas DataFrames.

    ``Cluster.trace`` and ``%%shard_trace`` hand one back; build one with ``Trace.from_payloads`` (from the
    recorders' payloads) or ``load_trace`` (from a file ``save`` wrote). Every ``get_*()`` returns a new
    DataFrame; ``show()``, ``plot_*()``, ``to_html()`` and ``to_perfetto()`` render the trace. The
    arguments are kept as attributes of the same names: ``payloads`` sorted by rank, ``clock_offsets_ns``
    for those ranks, ``incomplete_ranks`` sorted, ``meta`` read-only. A trace loaded from a columnar file
    (``.sdtrace.arrow``) keeps its columns: each payload's ``events`` is then a sequence
    (``columnar.LazyRecords``) whose dicts are made on first use; ``events(rank)`` gives a list either way.

    Parameters
    ----------
    payloads : dict of int to dict or None
        Rank -> its payload (``schema.py``), or None for a rank that sent nothing. Not checked here:
        ``from_payloads`` and ``load_trace`` check them first.
    clock_offsets_ns : dict of int to int
        Rank -> how far its clock is ahead of the reference (client) clock, in ns; a rank left out has 0.
        Every time in the DataFrames is ``rank time - offset``.
    incomplete_ranks : iterable of int
        Ranks whose recording did not finish (timed out: events up to the snapshot, in-flight ops marked
        ``in_flight``) or that sent nothing at all. A rank whose payload is None or says ``complete``
        False is always among them, listed here or not.
    meta : dict or None
        What the trace says about itself (the keys ``schema.TRACE_META_FIELDS`` names: the code, the
        cluster, the clock, why ranks are incomplete, ...; other keys are kept and read by nothing). Set
        when the trace is built, read-only afterwards.

    Raises
    ------
    SchemaError
        A key of ``meta`` that ``schema.TRACE_META_FIELDS`` names holds what it does not allow.

    Notes
    -----
    When a recorder's buffer overflowed, building the trace issues a ``ShardDbgWarning`` saying how many
    events were dropped, per rank, and that a larger ``max_events`` (``--max-events``) keeps them all.

    Examples
    --------
    >>> t = cl.trace("y = torch.nn.functional.conv2d(x, w, padding=1)")
    >>> t.incomplete_ranks  # every rank finished the cell
    []
    >>> t.get_ops()[["rank", "op", "path", "host_ms"]]
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
        self._current: dict[int, list[dict]] | None = None  # the records as this schema reads them
        # every rank's records as one Arrow table, where the trace was read or gathered as columns: the tables
        # are built from it and the records made as dicts only when asked for (columnar.LazyRecords)
        self._columns: columnar.EventColumns | None = None
        self._ops: pd.DataFrame | None = None
        self._collectives: pd.DataFrame | None = None
        self._fallbacks: dict[bool, pd.DataFrame] = {}  # get_fallbacks(include_metadata), built once each
        self._errors: dict[bool, pd.DataFrame] = {}  # get_errors(include_propagated), built once each
        self._findings: list[Finding] | None = None  # worked out once: a trace does not change once built
        self._overview: TraceOverview | None = None
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
        """Build a trace from the payloads the ranks' recorders returned.

        Each payload is checked (``schema.validate_payload``) before anything is built. A payload's rank is
        its own ``"rank"`` field; the list position or dict key places only a None. A None, and a payload
        from ``recorder.peek()`` (``complete`` False), mark their rank incomplete. Payloads whose records came
        as columns (``api.recording_stop(columns_from=...)``: ``columnar.EVENTS_AS_COLUMNS``) make a trace that
        keeps them as one table (as one loaded from a ``.sdtrace.arrow`` file does), checked on whole columns;
        where those checks find anything, the records are made as dicts and checked one by one, so that the
        error is the one the same records as dicts give. Payloads of dicts of which some rank holds
        ``RECORDS_AS_COLUMNS_FROM`` records or more are made into such a table too (the payloads and records given
        are left as they are; the trace's records are equal to them, made from the columns when asked for), unless
        the columns would not give every record back as it is (``columnar.table_holding_records``) or their
        checks find anything: the trace then holds the records given, checked one by one.

        Parameters
        ----------
        payloads : list or dict
            Per rank: a list in rank order, or {rank: payload}; None for a rank that returned nothing.
        clock_offsets_ns : dict or list or None
            {rank: ns} or a list in rank order: how far each rank's clock is ahead of the reference clock.
            Default: all 0.
        meta : dict or None
            The trace's meta (``schema.TRACE_META_FIELDS``), as the class takes it.
        incomplete_ranks : iterable of int
            More ranks to mark incomplete (a rank that timed out or whose process died).

        Returns
        -------
        Trace
            The trace of these payloads, ranks in ascending order.

        Raises
        ------
        SchemaError
            A payload that is not a valid payload of this schema, two payloads that claim the same rank, or
            a ``meta`` that ``schema.TRACE_META_FIELDS`` refuses.

        Examples
        --------
        On one process, without a cluster:

        >>> with sharddbg.record() as rec:
        ...     y = model(x)
        >>> t = sharddbg.Trace.from_payloads([rec.payload()])
        >>> t.ranks
        [0]
        """
        by_position = dict(payloads.items() if isinstance(payloads, dict) else enumerate(payloads))
        if any(isinstance(p, dict) and columnar.EVENTS_AS_COLUMNS in p for p in by_position.values()):
            return _trace_of_payloads_as_columns(cls, by_position, clock_offsets_ns, meta, incomplete_ranks)
        as_columns = _trace_of_big_dict_payloads(cls, by_position, clock_offsets_ns, meta, incomplete_ranks)
        if as_columns is not None:
            return as_columns
        items = by_position.items()
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
        """The ranks this trace holds, ascending, those that sent nothing included."""
        return list(self.payloads)

    @property
    def world_size(self) -> int:
        """The number of ranks of the recording: the largest ``world_size`` a payload states, and never less
        than the number of ranks this trace holds."""
        ws = [p["world_size"] for p in self.payloads.values() if p]
        return max(ws + [len(self.payloads)])

    @property
    def dropped_by_rank(self) -> dict[int, int]:
        """Events lost to a full buffer, per rank ({rank: count}); only the ranks that lost some."""
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
        ``preflight`` (collectives compared across their group before being issued). True where any rank ran
        it. All False for older files: nothing was looked for, so their empty tables mean "not checked"."""
        metas = [p["meta"] for p in self.payloads.values() if p and p["schema_version"] >= 5]
        return {name: any(bool(m.get(name)) for m in metas) for name in ("spec_check", "replicas", "preflight")}

    def events(self, rank: int) -> list[dict]:
        """The records of one rank, as its recorder wrote them.

        Op, collective and error records (``schema.py``) in the payload's order, times on that rank's own
        clock (the DataFrames move them onto the reference clock). The list is new, the records in it are
        the trace's own: change a copy, not them.

        Parameters
        ----------
        rank : int
            The rank whose records to give.

        Returns
        -------
        list of dict
            Its records; empty for a rank that sent nothing or that the trace does not hold.

        Examples
        --------
        >>> op_records = [e for e in t.events(0) if e["kind"] == "op"]
        >>> len(op_records) == len(t.get_ops().query("rank == 0"))
        True
        """
        p = self.payloads.get(rank)
        return list(p["events"]) if p else []

    def _events_by_rank(self) -> dict[int, list[dict]]:
        """Rank -> its records as this schema version reads them (``schema.current_events``: an older payload's
        records gain the fields added since), made once; what the analyses read."""
        if self._current is None:
            self._current = {r: schema.current_events(dict(p, events=list(p["events"]))) if p else []
                             for r, p in self.payloads.items()}
        return self._current

    def _records_where(self, kind: str, field: str | None = None) -> dict[int, list[dict]]:
        """Rank -> its records of ``kind`` (those where ``field`` is not null, when given), as this schema reads
        them: of a trace held as columns, only those rows are made into dicts."""
        if self._columns is None or any(isinstance(p["events"], columnar.LazyRecords) and p["events"].made
                                        for p in self.payloads.values() if p):
            return {r: [ev for ev in events if ev.get("kind") == kind and (field is None or ev.get(field))]
                    for r, events in self._events_by_rank().items()}
        import pyarrow.compute as pc

        rows = self._columns.of_kind(kind)
        if field is not None:
            rows = rows.filter(pc.is_valid(rows.column(field)))
        by_rank: dict[int, list[dict]] = {r: [] for r in self.payloads}
        for rank, record in zip(rows.column("rank").to_pylist(), columnar.records_of(rows)):
            by_rank[rank].append(record)
        return by_rank

    def __repr__(self) -> str:
        n = sum(len(p["events"]) for p in self.payloads.values() if p)
        return (f"<sharddbg.Trace ranks={self.ranks} events={n} dropped={self.dropped} "
                f"incomplete_ranks={self.incomplete_ranks}>")

    # ---- DataFrames (one-line delegations) ---------------------------------------------------------
    def _ops_table(self) -> pd.DataFrame:
        """The op table, built once and not copied: for the analyses here, which only read it."""
        if self._ops is None and self._columns is not None:
            self._ops = _ops.ops_frame_from_columns(self._columns.of_kind(schema.KIND_OP), self.clock_offsets_ns)
        if self._ops is None:
            self._ops = _ops.ops_frame(self._events_by_rank(), self.clock_offsets_ns)
        return self._ops

    def _collectives_table(self) -> pd.DataFrame:
        """The collectives' table, built once and not copied (as ``_ops_table``)."""
        if self._collectives is None and self._columns is not None:
            self._collectives = _comm.collectives_frame_from_columns(self._columns.of_kind(schema.KIND_COLLECTIVE),
                                                                     self.clock_offsets_ns)
        if self._collectives is None:
            self._collectives = _comm.collectives_frame(self._events_by_rank(), self.clock_offsets_ns)
        return self._collectives

    def get_ops(self) -> pd.DataFrame:
        """Every op call of every rank, one row each: the table the others are built from.

        One row per op call (forward and backward) per rank; times on the reference clock. Beside the
        record's fields: ``location`` (where the user's code made the call: "cell [6], line 5: `y = x + x`"),
        ``message`` / ``exc_type`` / ``traceback`` of an error, ``local_ms`` (CPU: the call's own local
        computation, timed after recording), ``spec_mismatches`` (the records of results whose spec disagrees
        with their local tensor) and ``spec_mismatch`` (the same in one line, missing where they agree: the
        mark for a view). Built once (``analysis.ops.ops_frame``); each call returns a copy.

        Returns
        -------
        pandas.DataFrame
            Sorted by ``rank``, then ``seq``. Columns: ``rank``; the op record's fields
            (``schema.OP_FIELDS``) ``seq``, ``parent_seq``, ``depth``, ``op``, ``path``, ``handler``,
            ``phase``, ``autograd_node``, ``module``, ``user_frame``, ``in_local_shapes``,
            ``in_global_shapes``, ``out_local_shape``, ``out_global_shape``, ``placements``, ``dtype``,
            ``sharding_shapes``, ``in_bytes``, ``out_bytes``, ``t_start_ns``, ``t_end_ns``, ``host_ms``,
            ``device_ms``, ``mem_delta_bytes``, ``error`` ("exc_type: message", missing when the call did
            not raise), ``fwd_seq``, ``in_placements``, ``fallback``, ``not_implemented``, ``in_flight``,
            ``thread``; then ``exc_type``, ``traceback``, ``error_origin_seq`` (the seq of the op where the
            exception was first seen), ``unmasked``, ``promotions``, ``user_cell``, ``user_code``,
            ``location``, ``local_ms``, ``message``, ``spec_mismatches``, ``spec_mismatch``.
            ``host_ms``, ``device_ms``, ``local_ms`` and ``mem_delta_bytes`` are floats, NaN where not
            measured; ``t_start_ns``, ``t_end_ns`` (missing for a call still running at snapshot time),
            ``parent_seq``, ``fwd_seq``, ``error_origin_seq`` and ``user_cell`` are nullable integers.

        Examples
        --------
        >>> ops = t.get_ops()
        >>> ops[ops["exc_type"].notna()][["rank", "op", "exc_type", "location"]]
        >>> ops.groupby(["path", "phase"])["host_ms"].sum()
        """
        # copy-on-write (pandas 3): changing the copy copies what it changes; the table itself is not copied per call
        return self._ops_table().copy(deep=False)

    def get_op_summary(self, nested: bool = False) -> pd.DataFrame:
        """The table to read first: one row per (op, dispatch path, phase), all ranks together.

        Calls, ranks, first-call and steady-state host time (median, p95), device / local time, what host
        dispatch adds (and whether it dominates), communication self and total (exclusive and inclusive) and
        split by what it stands against, collectives in flight, errors, where in the code
        (``analysis.summary.op_summary``; its module docstring defines every column). Forward rows are the
        user's own calls (depth 0) unless ``nested``; backward rows are the backward events (and forward-path
        ops the autograd engine called). ``get_comm_by_op()`` counts every call of an op instead, its own and
        nested calls apart.

        Parameters
        ----------
        nested : bool
            Also count the calls made from inside another recorded op, as rows of their own (every call).

        Returns
        -------
        pandas.DataFrame
            Largest ``host_ms_total`` first (then most ``calls``; NaN last). Columns: ``op``, ``path``,
            ``phase``, ``calls``, ``nested_calls`` (of ``calls``, those made from inside another recorded
            op: 0 on forward rows unless ``nested``), ``ranks`` (list), ``first_calls`` /
            ``first_ms_median`` (the first call on a rank with given local input shapes), ``steady_calls`` /
            ``steady_ms_median`` / ``steady_ms_p95`` (every other call), ``host_ms_total``,
            ``device_ms_median``, ``local_ms_median`` (``device_ms`` on CUDA, ``local_ms`` on CPU),
            ``dispatch_ms_median`` (host time minus the communication within it minus local time),
            ``dispatch_bound`` (even the least dispatch time exceeds the local computation),
            ``n_collectives`` / ``comm_ms`` / ``bytes`` (self: the collectives of the calls themselves; with
            ``nested`` every collective issued inside a recorded op is in exactly one row) and
            ``n_collectives_inclusive`` / ``comm_ms_inclusive`` / ``bytes_inclusive`` (total: with those of
            the recorded ops they ran), ``comm_ms_within_host`` (of ``comm_ms_inclusive``, the collectives
            issued while one of the row's timed calls ran: part of ``host_ms_total``, compare the two) and
            ``comm_ms_outside_host`` (the rest: on a backward row the collectives of the op's other autograd
            nodes, waits for the other ranks included, which run beside the rest of the backward pass and
            stand against its time, not against ``host_ms_total``), ``n_in_flight``, ``errors`` (calls
            that raised), ``fallback`` (bool), ``category`` ("compute", "metadata" or "autograd"),
            ``locations`` (list). Empty, with these columns, when no op was recorded.

        Examples
        --------
        >>> t.get_op_summary().query("dispatch_bound")[["op", "path", "steady_ms_median", "local_ms_median"]]
        >>> t.get_op_summary().query("phase == 'backward'")[["op", "host_ms_total", "comm_ms_within_host",
        ...                                                  "comm_ms_outside_host"]]
        >>> int(t.get_op_summary(nested=True)["calls"].sum()) == len(t.get_ops())
        True
        """
        # the trace's own tables, not copies: the summary only reads them (a copy of a million rows costs a second)
        return _summary.op_summary(self._ops_table(), self._collectives_table(), nested)

    def get_fallbacks(self, include_metadata: bool = False) -> pd.DataFrame:
        """Ops whose computation took a DTensor fallback, one row per (op, path).

        Metadata reads (``shape``, ``ndim``, ``dtype``, ``detach``, ...) are left out unless asked for;
        ``Tensor.backward`` is never one (its time is the whole backward pass, whose nodes are recorded on
        their own). ``analysis.ops.fallbacks``.

        Parameters
        ----------
        include_metadata : bool
            Also list the metadata reads (``category`` "metadata").

        Returns
        -------
        pandas.DataFrame
            Largest ``host_ms_total`` first, then most ``calls``. Columns: ``op``, ``path`` (the handler's
            path when ``via_handler``), ``calls`` (forward calls), ``ranks`` (list), ``host_ms_total``
            (their host time, NaN where not measured), ``user_frames`` (list), ``via_handler`` (the op had a
            handler that itself called the fallback), ``bwd_host_ms_total`` (time of their backward events,
            the output node only), ``category`` ("compute" or "metadata"), ``locations`` (where the user's
            code made the calls, list); then which family of ShardTensor patch would fit the op, read from the
            trace (``analysis.patch_families``): ``family`` ("pointwise", "halo", "reduction", "view", "global"
            or "none"), ``sharded_dim``, ``halo_width`` (rows a shard needs from a neighbour; missing unless
            "halo" and the shapes tell), ``closest_patch`` (the physicsnemo handler to follow), ``evidence``
            (one sentence), ``fallback_collectives`` (what the fallback moved per call) and ``fallback_bytes``
            (bytes received per call and rank). Empty, with these columns, when there are none.

        Examples
        --------
        >>> t.get_fallbacks()[["op", "calls", "host_ms_total", "locations"]]
        >>> t.get_fallbacks()[["op", "family", "halo_width", "closest_patch"]]
        >>> fb = t.get_fallbacks(include_metadata=True)
        >>> fb[fb["category"] == "metadata"]["op"].tolist()
        """
        key = bool(include_metadata)
        if key not in self._fallbacks:  # the report and its views ask several times: the trace does not change
            self._fallbacks[key] = _patch_families.classified_fallbacks(self._ops_table(), self._collectives_table(),
                                                                        key)
        return self._fallbacks[key].copy()

    def get_errors(self, include_propagated: bool = False) -> pd.DataFrame:
        """Real exceptions per rank: one row per origin (``analysis.ops.errors``), those that ended the cell and
        those the user's code caught (``handled``).

        The origin is the innermost recorded op that raised it, or the cell itself for an exception raised
        outside every recorded op (``op`` is ``<outside recorded ops>``, ``user_frame`` the cell's line).
        ``handled`` is True for an exception the user's code caught (``pytest.raises``, ``try``/``except``)
        and the cell went on; False for one that ended the cell, itself or chained into the one that did;
        missing where it is not known (a rank's snapshot taken while the cell still ran, a trace of schema
        version 7 or older without an error record for it). Only the ones not handled are failures in
        ``findings``.
        ``message`` whole, ``traceback`` from the user's line down; ``cell_line`` / ``cell_code``: the cell
        statement the exception ended; ``location``: where, as "cell [6], line 5: `y = x + x`".

        Parameters
        ----------
        include_propagated : bool
            Also give a row for every enclosing recorded op the same exception went through.

        Returns
        -------
        pandas.DataFrame
            Sorted by ``rank``, then ``seq``. Columns: ``rank``, ``seq``, ``op``, ``path``, ``exc_type``,
            ``message``, ``traceback``, ``user_frame``, ``phase`` ("cell" for an exception outside every
            recorded op), ``unmasked`` (re-raised as ``UnmaskedOpError``), ``handled`` (nullable boolean, see
            above), ``propagated_to`` (seqs of the enclosing ops it went through), ``cell_line``,
            ``cell_code``, ``location``. Empty, with these columns, when nothing raised.

        Examples
        --------
        >>> t.get_errors()[["rank", "op", "exc_type", "handled", "location"]]
        >>> print(t.get_errors()["traceback"].iloc[0])
        """
        key = bool(include_propagated)
        if key not in self._errors:  # the findings and the report's error list ask both: the trace does not change
            self._errors[key] = _ops.errors(self.get_ops(), key, self.get_cell_errors())
        return self._errors[key].copy()

    def get_cell_errors(self) -> pd.DataFrame:
        """The exception that ended the cell on each rank that raised (schema "error" records, since
        version 3; ``analysis.ops.cell_errors_frame``).

        Returns
        -------
        pandas.DataFrame
            One row per such record. Columns: ``rank``, ``seq``, ``t_ns`` (reference clock), ``exc_type``,
            ``message``, ``traceback``, ``origin_seq`` (the op record where it started, or missing when it
            was raised outside every recorded op), ``cell_line``, ``cell_code``, ``cell`` (the cell's
            execution count in the notebook, since version 4), ``location``. ``seq``, ``t_ns``,
            ``origin_seq``, ``cell_line`` and ``cell`` are nullable integers. Empty when no cell raised.

        Examples
        --------
        >>> t.get_cell_errors()[["rank", "exc_type", "message", "location"]]
        """
        return _ops.cell_errors_frame(self._records_where(schema.KIND_ERROR),
                                      self.clock_offsets_ns)

    @property
    def incomplete_reasons(self) -> dict[int, str]:
        """Why each incomplete rank is incomplete ("did not finish within 60 s", "its process died ..."),
        where the cluster said so ({rank: reason}, from ``meta["incomplete_reasons"]``)."""
        given = self.meta.get("incomplete_reasons") or {}
        return {int(r): str(why) for r, why in given.items()}

    def get_promotions(self) -> pd.DataFrame:
        """Plain tensors promoted to Replicate, per op, with parameter names where known.

        Returns
        -------
        pandas.DataFrame
            One row per promotion. Columns: ``rank``, ``seq`` and ``op`` (the call that promoted it),
            ``param`` (the parameter or buffer name, missing when not known), ``shape`` (tuple), ``dtype``,
            ``module``, ``user_frame``.

        Examples
        --------
        >>> t.get_promotions().groupby("op")["param"].unique()
        """
        return _ops.promotions(self.get_ops())

    def get_collectives(self) -> pd.DataFrame:
        """One row per collective call per rank, times on the reference clock (``analysis.comm``).

        Each has a ``state``: "completed" (its wait returned), "failed" (its issuing call or its wait raised,
        e.g. gloo refusing split sizes at once or gloo's own timeout; ``error`` says what) or "in_flight"
        (neither: still blocked when a hung rank's snapshot was taken, or never waited; the ``in_flight``
        column). Only a completed one is timed. One the pre-flight stopped before it was issued moved nothing
        and is left out (``get_preflight()`` lists it). Built once; each call returns a copy. Empty when
        nothing was recorded (see ``collectives_recorded``).

        Returns
        -------
        pandas.DataFrame
            Sorted by ``rank``, then ``seq``. Columns: ``rank``, ``seq``, ``group_seq``, ``kind``,
            ``group_ranks``, ``mesh_dim``, ``bytes_sent``, ``bytes_recv``, ``t_issue_ns``, ``t_done_ns``,
            ``duration_ms`` (issue to the return of its wait; NaN unless completed), ``async``, ``op``,
            ``op_seq`` (the op it belongs to), ``outer_op``, ``outer_op_seq``, ``phase``,
            ``autograd_node``, ``param``, ``bandwidth_gbps`` (``max(bytes_sent, bytes_recv)`` over
            ``device_ms``, else ``duration_ms``, in GB/s), ``group_name``, ``group_size``, ``peer``,
            ``root``, ``splits_sent``, ``splits_recv``, ``dtype``, ``shape``, ``api``, ``aten_op``,
            ``t_return_ns``, ``issue_ms`` (issue to the return of the issuing call), ``wait_op_seq``,
            ``waited``, ``device_ms``, ``in_flight``, ``state``, ``error`` ("exc_type: message" of a failed
            one, else None; a trace of schema 7 or older has none, its failed ones read in flight), ``thread``,
            ``params``, ``bucket``, ``user_frame``,
            ``user_cell``, ``user_code``, ``location``. The record fields mean what
            ``schema.COLLECTIVE_FIELDS`` says.

        Examples
        --------
        >>> c = t.get_collectives()
        >>> c.groupby("kind")[["bytes_sent", "duration_ms"]].sum()
        >>> c[c["state"] != "completed"][["rank", "kind", "state", "error", "location"]]
        """
        return self._collectives_table().copy(deep=False)  # copy-on-write, as get_ops

    def get_comm_by_op(self, by: str = "op", inclusive: bool = False) -> pd.DataFrame:
        """Communication per op name and rank, or per op call; forward and backward apart.

        A collective counts for the op it is attributed to (the innermost recorded op at issue; in backward,
        the forward op whose autograd node issued it). Every call of an op counts, nested ones included
        (``get_op_summary()`` counts the user's own): ``own_calls`` / ``nested_calls`` and
        ``own_n_collectives`` / ``nested_n_collectives`` say which is which. ``comm_ms`` (the forward collectives' time) stands
        against ``op_ms`` (the host time of the forward calls), ``comm_share`` = comm_ms / op_ms; the
        backward's ``bwd_*`` are not a share (a backward event times the op's output node only).
        Collectives outside every recorded op appear under ``<outside recorded ops>``
        (``analysis.comm.comm_by_op``).

        Parameters
        ----------
        by : str
            ``"op"``: one row per op name and rank; ``"call"``: one row per op call.
        inclusive : bool
            A collective counts for every recorded op it ran inside, not only the innermost (the rows then
            overlap and do not add up to the trace's total).

        Returns
        -------
        pandas.DataFrame
            ``by="op"``, largest communication (forward and backward) first: ``op``, ``rank``, ``calls``
            (forward calls, nested ones included), ``own_calls`` (the user's own, depth 0), ``nested_calls``
            (made from inside another recorded op), ``n_collectives`` (of every call, both phases),
            ``own_n_collectives`` / ``nested_n_collectives`` (those of the own / nested calls; neither for
            ``<outside recorded ops>``), ``kinds`` ({kind: count}), ``bytes_sent``, ``bytes_recv`` (both
            phases), ``comm_ms`` (forward collectives), ``op_ms`` (host time of the forward calls),
            ``comm_share``, ``bwd_n_collectives``, ``bwd_comm_ms`` (the collectives of all the op's
            autograd nodes, waits included), ``bwd_op_ms`` (the backward events: the output node only),
            ``n_in_flight`` (never completed, not timed). ``by="call"``, sorted by ``rank`` and ``op_seq``:
            ``rank``, ``op_seq``, ``op``, ``path``, ``module``, ``nested`` (made from inside another recorded
            op; missing for collectives of no call), ``n_collectives``, ``kinds``, ``bytes_sent``, ``bytes_recv``, ``comm_ms``,
            ``op_ms``, ``comm_share``, ``user_frame``, ``bwd_n_collectives``, ``bwd_comm_ms``,
            ``bwd_op_ms``, ``n_in_flight``, ``location``.

        Raises
        ------
        ValueError
            ``by`` is neither "op" nor "call", or ``inclusive`` is not a bool.

        Examples
        --------
        >>> t.get_comm_by_op()[["op", "rank", "comm_ms", "op_ms", "comm_share"]]
        >>> t.get_comm_by_op(by="call", inclusive=True).nlargest(5, "comm_ms")
        """
        # built once; comm_by_op only reads them: no copies
        return _comm.comm_by_op(self._collectives_table(), self._ops_table(), by, inclusive)

    def get_comm_by_kind(self) -> pd.DataFrame:
        """Communication per (op, collective kind), all ranks together: the sum over ranks beside the per-rank
        maximum and mean of the time (``analysis.comm.comm_by_op_kind``). A collective counts for the op it
        belongs to, as in the op summary: the user's own call it was issued in (``via`` names the op inside it
        that issued it).

        Returns
        -------
        pandas.DataFrame
            Largest ``bytes`` first, then largest ``comm_ms``. Columns: ``op``, ``kind``, ``calls``
            (collectives), ``bytes`` (sent + received, summed over ranks), ``comm_ms`` (``duration_ms``
            summed over ranks: about 4x the wall time on 4 ranks waiting together), ``comm_ms_rank_max``
            and ``comm_ms_rank_mean`` (per-rank totals: the slowest rank's, and their mean over the ranks
            of the table), ``n_in_flight`` (never completed, not timed), ``via`` (the ops inside ``op`` that
            issued them; "" when ``op`` did).

        Examples
        --------
        >>> t.get_comm_by_kind().head()
        """
        return _comm.comm_by_op_kind(self.get_collectives(), self.get_ops())

    def get_comm_by_rank(self) -> pd.DataFrame:
        """Communication of each rank: collectives, in flight, bytes, time summed and as wall time, and the
        rank's recorded span (``analysis.comm.comm_by_rank``).

        Returns
        -------
        pandas.DataFrame
            One row per rank of the trace, ascending (zeros for a rank without collectives). Columns:
            ``rank``, ``n_collectives``, ``n_in_flight`` (never completed), ``bytes_sent``, ``bytes_recv``,
            ``comm_ms`` (sum of ``duration_ms``: overlapping async collectives count each),
            ``comm_wall_ms`` (wall time with at least one of them open, never more than the span),
            ``span_ms`` (from the rank's first recorded event to its last).

        Examples
        --------
        >>> by_rank = t.get_comm_by_rank()
        >>> by_rank.assign(share=by_rank["comm_wall_ms"] / by_rank["span_ms"])
        """
        return _comm.comm_by_rank(self.get_collectives(), self.get_ops(), self.ranks)

    def get_comm_by_peer(self) -> pd.DataFrame:
        """Bytes each rank sent to / received from each other rank, where the records say so exactly: the
        splits of an all_to_all, the peer of a send / recv. Collectives whose traffic per peer depends on the
        backend's algorithm (all_reduce, all_gather, broadcast, ...) are not split here.

        Returns
        -------
        pandas.DataFrame
            Sorted by ``rank``, ``peer``, ``kind``. Columns: ``rank``, ``peer``, ``kind``,
            ``n_collectives``, ``bytes_sent``, ``bytes_recv``, ``local`` (peer == rank: the part of an
            all_to_all a rank keeps, no transfer).

        Examples
        --------
        >>> p = t.get_comm_by_peer()
        >>> p[~p["local"]].pivot_table(index="rank", columns="peer", values="bytes_sent", aggfunc="sum")
        """
        return _comm.comm_by_peer(self.get_collectives())

    def get_imbalance(self) -> pd.DataFrame:
        """Per op and rank: shard volume beside host, comm and wait-for-other-ranks time
        (``analysis.comm.imbalance``).

        Returns
        -------
        pandas.DataFrame
            Sorted by ``op``, then ``rank``. Columns: ``op``, ``rank``, ``calls`` (forward calls),
            ``shard_elems`` (elements of the local data of every distributed argument of those calls),
            ``host_ms`` (forward and backward events), ``comm_ms``, ``wait_ms`` (waiting for the last rank
            of the group to issue the same collective), ``n_collectives``, ``shard_imbalance`` and
            ``host_imbalance`` (max over the op's ranks / mean over them: 1.0 is balanced), ``wait_ms_max``
            (the op's largest per-rank wait).

        Examples
        --------
        >>> imb = t.get_imbalance()
        >>> imb[imb["shard_imbalance"] > 1.1][["op", "rank", "shard_elems", "host_ms"]]
        """
        return _comm.imbalance(self.get_ops(), self.get_collectives())

    def get_collective_mismatches(self) -> pd.DataFrame:
        """Collectives that do not line up across the ranks of their group at the same group_seq: a
        different kind, dtype, size or split, or a rank that never issued it (``missing``).

        A rank of the group that this trace does not hold is not counted missing; point-to-point calls are
        not compared (``analysis.comm.collective_mismatches``).

        Returns
        -------
        pandas.DataFrame
            One row per problem. Columns: ``group_name``, ``group_seq``, ``mesh_dim``, ``problem`` ("kind",
            "dtype", "size", "splits" or "missing"), ``ranks`` (those that issued it), ``kinds`` (what
            each of them issued), ``detail``. Empty when every collective lines up.

        Examples
        --------
        >>> t.get_collective_mismatches()[["group_seq", "problem", "detail"]]
        """
        return _comm.collective_mismatches(self.get_collectives(), traced_ranks=self.ranks)

    # ---- verification -----------------------------------------------------------------------------
    def get_spec_mismatches(self) -> pd.DataFrame:
        """ShardTensor results whose spec disagreed with the local tensor, at the op that made them, on each
        rank where they held (``analysis.consistency.spec_mismatches``).

        ``detail`` reads "spec says (313, 3), the local tensor is (313, 17, 3) ...". Empty also when nothing
        was checked (``checks["spec_check"]``).

        Returns
        -------
        pandas.DataFrame
            One row per finding, the earliest first (``first`` True on it). Columns: ``rank``, ``seq``,
            ``op``, ``path``, ``phase``, ``depth``, ``output`` (which result), ``check`` (which part of the
            spec: "sharding_shapes", "mesh_size", "ndim" or "global_shape"), ``mesh_dim``, ``spec_shape``,
            ``local_shape``, ``global_shape``, ``placements``, ``detail``, ``t_start_ns``, ``first``,
            ``module``, ``location``.

        Examples
        --------
        >>> t.get_spec_mismatches().head(1)[["op", "rank", "detail", "location"]]  # the first
        """
        return _consistency.spec_mismatches(self.get_ops())

    def get_replica_divergence(self) -> pd.DataFrame:
        """Tensors claiming Replicate whose ranks held different values after an op, recorded with
        ``replicas=True`` (``analysis.consistency.replica_divergence``).

        Op results, and plain tensors such as module weights promoted to Replicate. For the first op that
        diverged, the cluster gathers the largest difference from the ranks. Empty also when nothing was
        digested (``checks["replicas"]``).

        Returns
        -------
        pandas.DataFrame
            One row per tensor and replica group, the first op first (``first`` True on it). Columns:
            ``key``, ``op``, ``what``, ``group_ranks``, ``ranks_differing``, ``reference_ranks`` (the ranks
            of the most common version they are compared with), ``n_versions``, ``missing_ranks``,
            ``shape``, ``dtype``, ``t_start_ns``, ``first``, ``max_abs_diff`` (the largest over the differing
            ranks, NaN where not gathered), ``max_abs_diff_by_rank``, ``note`` (why values were not
            gathered), ``location``.

        Examples
        --------
        >>> t = cl.trace("loss = model(x).sum(); loss.backward(); opt.step()", replicas=True)
        >>> t.get_replica_divergence()[["op", "what", "ranks_differing", "max_abs_diff"]]
        """
        return _consistency.replica_divergence(self.get_replica_digests(), self.meta.get("replica_differences"))

    def get_replica_digests(self) -> pd.DataFrame:
        """Every digest taken with ``replicas=True`` (``analysis.consistency.replicas_frame``).

        Returns
        -------
        pandas.DataFrame
            One row per tensor claiming Replicate per op call per rank. Columns: ``rank``, ``seq``, ``op``,
            ``key`` (names the same tensor on every rank), ``what``, ``digest``, ``shape``, ``dtype``,
            ``group_ranks``, ``kept`` (a copy is kept on the rank), ``t_start_ns`` (the op's start),
            ``location``.

        Examples
        --------
        >>> d = t.get_replica_digests()
        >>> per_tensor = d.groupby(["key", "group_ranks"])["digest"].nunique()
        >>> per_tensor[per_tensor > 1]  # tensors whose replicas disagree
        """
        return _consistency.replicas_frame(self._records_where(schema.KIND_OP, "replicas"),
                                           self.clock_offsets_ns)

    def get_preflight(self) -> pd.DataFrame:
        """Collectives compared across their group before they were issued (``preflight=True``;
        ``analysis.consistency.preflight_frame``).

        Returns
        -------
        pandas.DataFrame
            One row per collective and rank. Columns: ``rank``, ``seq``, ``group_seq``, ``kind``,
            ``group_name``, ``mesh_dim``, ``group_ranks``, ``op``, ``phase``, ``status`` ("ok",
            "mismatch" (never issued, ``detail`` says what disagreed), "late" (issued unchecked) or
            "unchecked"), ``ms`` (the check's cost), ``detail``, ``late_ranks``, ``location``. Empty when
            nothing was compared.

        Examples
        --------
        >>> pf = t.get_preflight()
        >>> pf[pf["status"] != "ok"][["rank", "kind", "op", "status", "detail"]]
        """
        return _consistency.preflight_frame(self._records_where(schema.KIND_COLLECTIVE, "preflight"),
                                            self.get_ops())

    # ---- performance pitfalls ------------------------------------------------------------------------
    def get_plan_cache(self) -> pd.DataFrame:
        """DTensor's redistribution plan cache while recording (``analysis.plan_cache.plan_cache_frame``).

        A stale miss is an entry never hit again: the cache grows each step and its lookups slow down
        (``plan_cache_finding``). Empty for payloads written before it was watched.

        Returns
        -------
        pandas.DataFrame
            One row per group of calls that missed it per rank. Columns: ``rank``, ``op``, ``outer_op``,
            ``source`` and ``target`` (placements), ``shape``, ``spec_type``, ``changed`` (the spec fields
            that changed after the call, joined by ", "; "" for a first call), ``stale`` (some did),
            ``count``, ``kept`` (of them, still cached at stop), ``first_op_seq``, ``entries_start`` and
            ``entries_end`` (the cache's size at start and stop on that rank).

        Examples
        --------
        >>> pc = t.get_plan_cache()
        >>> pc[pc["changed"] != ""][["rank", "op", "source", "target", "changed", "kept"]]  # the stale ones
        """
        return _plan_cache.plan_cache_frame(self.payloads)

    def get_plan_cache_growth(self) -> pd.DataFrame:
        """Per rank: the plan cache's size at start and stop, the misses while recording, how many stale
        (``analysis.plan_cache.plan_cache_growth``).

        Returns
        -------
        pandas.DataFrame
            One row per rank whose payload watched the cache. Columns: ``rank``, ``entries_start``,
            ``entries_end``, ``misses``, ``stale_misses``, ``clears`` (times the cache was seen emptied).

        Examples
        --------
        >>> list(t.get_plan_cache_growth().columns)
        ['rank', 'entries_start', 'entries_end', 'misses', 'stale_misses', 'clears']
        """
        return _plan_cache.plan_cache_growth(self.payloads)

    @property
    def plan_cache_finding(self) -> str | None:
        """The plan cache finding's text (cause, cost, fix) when calls missed the plan cache on a spec changed
        after it was cached and left such entries in it, else None."""
        found = _findings.plan_cache_finding(self.get_plan_cache(), self.get_plan_cache_growth())
        return found.text() if found is not None else None

    # ---- what is wrong, in the order to read it --------------------------------------------------------
    @property
    def findings(self) -> list[Finding]:
        """What this trace says is wrong, by what it means (errors, wrong results, hangs, performance, facts;
        ``Finding.category``), then severity (``analysis.findings.trace_findings``): the one list the summary
        line, the explorer and the report render."""
        if self._findings is None:
            self._findings = _findings.trace_findings(self)
        return list(self._findings)

    def get_findings(self) -> pd.DataFrame:
        """``findings`` as a DataFrame, one row each (``analysis.findings.findings_frame``).

        Returns
        -------
        pandas.DataFrame
            In ``findings`` order (by category, then severity). Columns: ``kind``, ``severity``, ``category``,
            ``sentence``, ``fix``, ``ranks`` (list), ``op``, ``location``, ``text``, ``summary``, ``details``
            (``Finding.as_dict``).

        Examples
        --------
        >>> f = t.get_findings()
        >>> f[f["severity"] == "fail"][["kind", "sentence"]]
        """
        return _findings.findings_frame(self.findings)

    @property
    def overview(self) -> TraceOverview:
        """The counts a header shows (``analysis.findings.trace_overview``): op calls, errors, fallbacks,
        collectives, spec mismatches, incomplete ranks, dropped events."""
        if self._overview is None:
            self._overview = _findings.trace_overview(self)
        return self._overview

    # ---- files ------------------------------------------------------------------------------------
    def to_dict(self) -> dict:
        """The trace as the JSON document ``save`` writes (the module's file format).

        Returns
        -------
        dict
            ``format`` ("sharddbg.trace"), ``version``, ``schema_version``, ``meta``, ``clock_offsets_ns``
            ({rank as a string: ns}), ``incomplete_ranks``, ``ranks``, ``payloads`` (in ``ranks`` order,
            None for a rank that sent nothing). The payloads are the trace's own, not copies, except that of a
            trace held as columns (loaded from a ``.sdtrace.arrow`` file), whose records are made as dicts here.

        Examples
        --------
        >>> d = t.to_dict()
        >>> d["format"], d["ranks"] == t.ranks
        ('sharddbg.trace', True)
        """
        return self._document([self._payload_with_records(r) for r in self.ranks])

    def _payload_with_records(self, rank: int) -> dict | None:
        """The payload of ``rank`` with its records as a list (made from the columns where held as columns)."""
        p = self.payloads[rank]
        if p is not None and isinstance(p["events"], columnar.LazyRecords):
            return dict(p, events=p["events"].as_list())
        return p

    def _document(self, payloads: list) -> dict:
        """The trace document of ``to_dict`` holding ``payloads``."""
        return {
            "format": TRACE_FORMAT,
            "version": TRACE_VERSION,
            "schema_version": schema.SCHEMA_VERSION,
            "meta": dict(self.meta),
            "clock_offsets_ns": {str(r): o for r, o in self.clock_offsets_ns.items()},
            "incomplete_ranks": self.incomplete_ranks,
            "ranks": self.ranks,
            "payloads": payloads,
        }

    def save(self, path: str | os.PathLike) -> str:
        """Write the trace as JSON (``.json``) or as the columnar Arrow IPC file (``.arrow``); ``load_trace``
        reads either back.

        The file appears whole or not at all (``write_file_atomically``): on any error ``path`` is left as
        it was. JSON is the readable form, for small traces; the columnar file (``sharddbg.columnar``,
        docs/trace-files.md) is for big ones.

        Parameters
        ----------
        path : str or os.PathLike
            The file to write (replaced if it exists): ``run.sdtrace.json`` or ``run.sdtrace.arrow``; any
            other suffix is refused before anything is written.

        Returns
        -------
        str
            ``path``.

        Raises
        ------
        IsADirectoryError
            ``path`` is a folder (the message suggests a file name inside it).
        OSError
            The file cannot be written (no such folder, no permission, disk full); the error names ``path``.
        ValueError
            The suffix is neither ``.json`` nor ``.arrow`` (``.parquet``, ``.csv``, none, ...; nothing is
            written), or the trace holds a NaN or an infinite number, which strict JSON cannot hold (the
            columnar file refuses them too).
        TypeError
            ``meta`` holds a value JSON cannot write (a key that ``schema.TRACE_META_FIELDS`` does not name
            may hold anything).

        Examples
        --------
        >>> t.save("conv.sdtrace.json")
        'conv.sdtrace.json'
        >>> sharddbg.load_trace("conv.sdtrace.json").ranks == t.ranks
        True
        >>> t.save("big.sdtrace.arrow")  # columns: a million records in seconds
        'big.sdtrace.arrow'
        """
        path = refuse_folder(path, "trace.sdtrace.json")
        columnar_file = _trace_file_layout(path) == "columnar"  # refuses a suffix neither layout has first
        with _analysis_formatting.cyclic_gc_paused():  # the columns of a million records: no cycles among them
            if columnar_file:
                return write_file_atomically(path, lambda f: columnar.write_table(*self._header_and_table(), f.buffer),
                                             example_name="trace.sdtrace.arrow")
            doc = self.to_dict()
            return write_file_atomically(
                path, lambda f: f.write(json.dumps(doc, allow_nan=False, separators=(",", ":"))),
                example_name="trace.sdtrace.json")

    def _header_and_table(self) -> tuple[dict, Any]:
        """The trace document (its records need not be in it) and the columns of its records: those the trace
        holds, else built from its records in one pass per kind."""
        doc = self._document([self.payloads[r] for r in self.ranks])
        if self._columns is not None:
            return doc, self._columns.table
        return doc, columnar.table_of_payloads(doc["ranks"], doc["payloads"])

    def to_perfetto(self, path: str | os.PathLike) -> str:
        """Write Chrome trace-event JSON, to open in ui.perfetto.dev or chrome://tracing.

        One process per rank, one complete ("X") slice per op and per collective; see
        ``sharddbg.exporters.perfetto``. Written like ``save``: whole or not at all.

        Parameters
        ----------
        path : str or os.PathLike
            The file to write (replaced if it exists).

        Returns
        -------
        str
            ``path``.

        Raises
        ------
        OSError
            The file cannot be written.

        Examples
        --------
        >>> t.to_perfetto("conv.perfetto.json")
        'conv.perfetto.json'
        """
        return rendering.perfetto(self, path)

    # ---- views and the HTML report (through sharddbg.rendering: the data layer never needs plotly or widgets)
    def show(self, **kwargs) -> anywidget.AnyWidget:
        """The trace explorer widget: errors and fallbacks first, filters, per-rank detail of an op.

        Parameters
        ----------
        **kwargs : Any
            Passed to ``views.explorer.TraceExplorer``: ``rank`` and ``window`` ((start_ms, end_ms) since
            the first event: the calls starting in it) to list a part of the trace, ``max_rows`` (calls sent
            to the browser: by default up to 20,000 of a small trace, errors first, then fallbacks, then the
            rest in time order; a bounded sample of a big one, which the page describes) and the widget's
            own keywords.

        Returns
        -------
        anywidget.AnyWidget
            The widget, a ``views.explorer.TraceExplorer``; displayed when it is a cell's last value.

        Examples
        --------
        >>> t.show()
        >>> t.show(max_rows=2_000)
        >>> t.show(rank=2, window=(120.0, 130.0))
        """
        return rendering.explorer(self, **kwargs)

    def plot_timeline(self, **kwargs) -> go.Figure:
        """plotly Figure: one row per rank, op spans by dispatch path, collective spans by kind.

        Parameters
        ----------
        **kwargs : Any
            Passed to ``views.timeline.plot_timeline``: ``time_range`` ((start, end) in ms since the first
            event: only that window), ``aggregate`` (merge nested ops into their top-level op), ``overview``
            (bin the spans into time bins per rank) and ``height``.

        Returns
        -------
        plotly.graph_objects.Figure
            The timeline.

        Examples
        --------
        >>> t.plot_timeline()
        >>> t.plot_timeline(time_range=(120.0, 180.0))
        """
        return rendering.timeline(self, **kwargs)

    def plot_comm_by_op(self, **kwargs) -> go.Figure:
        """plotly Figure: bytes and time per op, split by collective kind.

        Parameters
        ----------
        **kwargs : Any
            Passed to ``views.comm.plot_comm_by_op``, which takes none: any keyword raises a TypeError.

        Returns
        -------
        plotly.graph_objects.Figure
            Bytes sent + received (left) and time in collectives (right) per op, stacked by kind; a figure
            that says so when no collective was recorded.

        Examples
        --------
        >>> t.plot_comm_by_op()
        """
        return rendering.comm_by_op(self, **kwargs)

    def plot_imbalance(self, **kwargs) -> go.Figure:
        """plotly Figure: per-rank shard volume beside per-rank time, per op.

        Parameters
        ----------
        **kwargs : Any
            Passed to ``views.imbalance.plot_imbalance``: ``op`` (the op shown first; the menu holds the
            others and all ops together).

        Returns
        -------
        plotly.graph_objects.Figure
            Shard volume (left) and times (right) per rank.

        Examples
        --------
        >>> t.plot_imbalance(op="torch.conv2d")
        """
        return rendering.imbalance(self, **kwargs)

    def to_html(self, path: str | os.PathLike, **kwargs) -> str:
        """Write one standalone HTML report (explorer, timeline, comm, imbalance), viewable offline; see
        ``sharddbg.exporters.html_report``.

        The findings, errors and fallbacks come first, then the figures and the explorer. Written like
        ``save``: whole or not at all.

        Parameters
        ----------
        path : str or os.PathLike
            The file to write (replaced if it exists).
        **kwargs : Any
            Passed to ``exporters.html_report.to_html``: ``title`` (default "sharddbg trace report") and
            ``max_rows`` (calls kept in the explorer, 20,000 by default).

        Returns
        -------
        str
            ``path``.

        Raises
        ------
        OSError
            The file cannot be written.

        Examples
        --------
        >>> t.to_html("conv-report.html", title="conv, 4 ranks")
        'conv-report.html'
        """
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


# A trace of which some rank holds this many records or more, given as dicts (a ``.sdtrace.json`` file,
# ``Trace.from_payloads`` of dict payloads), keeps every rank's records as columns, as one gathered live or loaded
# from a ``.sdtrace.arrow`` file does: its records are checked on whole columns, its tables built from them and its
# save as ``.sdtrace.arrow`` is the table's write. The rank's threshold of the gather (``cluster.recording``).
RECORDS_AS_COLUMNS_FROM = 2000


def _columns_of_big_payloads(ranks: list, payloads: list, values_from_json: bool = False) -> Any:
    """The columns (one table, ranks ascending) of the records of ``payloads`` (one per entry of ``ranks``, distinct
    integers; None for a rank that sent nothing) where some rank holds ``RECORDS_AS_COLUMNS_FROM`` records or more,
    each payload is of this schema version (its records are as this schema reads them), the columns give every
    record back as it is (``columnar.table_holding_records``) and pass the checks of every record
    (``columnar.plainly_valid``); else None: the records are then checked as dicts, which name what is wrong."""
    if not any(type(p) is dict and type(p.get("events")) is list and len(p["events"]) >= RECORDS_AS_COLUMNS_FROM
               for p in payloads):
        return None
    records_by_rank = []
    for rank, p in sorted(zip(ranks, payloads), key=lambda entry: entry[0]):
        if p is None:
            continue
        if (type(p) is not dict or type(p.get("events")) is not list
                or p.get("schema_version") != schema.SCHEMA_VERSION):
            return None
        records_by_rank.append((rank, p["events"]))
    table = columnar.table_holding_records(records_by_rank, values_from_json)
    if table is None:
        return None
    try:
        plain = columnar.plainly_valid(table, ranks, payloads, MAX_ABS_INT, MAX_NESTING)
    except (ValueError, TypeError, OverflowError):
        plain = False
    return table if plain else None


def _trace_of_big_dict_payloads(cls, payloads: dict, clock_offsets_ns, meta, incomplete_ranks) -> Trace | None:
    """``Trace.from_payloads`` of dict payloads (position -> payload or None) whose records it keeps as columns
    (``_columns_of_big_payloads``), their headers checked as the dict path checks them; None where it keeps them as
    dicts. The caller's payloads are left as they are: the trace holds copies whose records are the columns."""
    given = [p for p in payloads.values() if p is not None]
    if not all(type(p) is dict for p in given):
        return None
    ranks = [p.get("rank") for p in given]
    if not all(_is_int(r) for r in ranks) or len(set(ranks)) != len(ranks):
        return None
    with _analysis_formatting.cyclic_gc_paused():
        table = _columns_of_big_payloads(ranks, given)
        if table is None:
            return None
        heads = {pos: None if p is None else dict(p, events=[]) for pos, p in payloads.items()}
        return _hold_columns(cls.from_payloads(heads, clock_offsets_ns, meta, incomplete_ranks), table)


def _trace_of_payloads_as_columns(cls, payloads: dict, clock_offsets_ns, meta, incomplete_ranks) -> Trace:
    """``Trace.from_payloads`` of payloads some of which hold their records as columns: the trace keeps every rank's
    rows as one table, its records checked on whole columns (``columnar.plainly_valid``); where those checks find
    anything (or a stream is unreadable), the records are made as dicts and the payloads built as such, whose
    checks say what is wrong exactly as they say it of dicts."""
    import pyarrow.compute as pc

    with _analysis_formatting.cyclic_gc_paused():
        tables: dict[int, Any] = {}
        heads: dict[Any, dict | None] = {}
        plain = True
        for pos, p in payloads.items():
            if not (isinstance(p, dict) and columnar.EVENTS_AS_COLUMNS in p):
                heads[pos] = dict(p) if isinstance(p, dict) else p  # its records go into the table: not the caller's
                continue
            head = {k: v for k, v in p.items() if k != columnar.EVENTS_AS_COLUMNS}
            head["events"] = []
            heads[pos] = head
            try:
                table = columnar.table_of_stream(p[columnar.EVENTS_AS_COLUMNS])
            except columnar.ColumnarProblem:
                plain = False
                continue
            rank = p.get("rank")
            rank_column = table.column("rank")
            if not _is_int(rank) or rank in tables or (table.num_rows and (
                    rank_column.null_count or pc.min(rank_column).as_py() != rank
                    or pc.max(rank_column).as_py() != rank)):
                plain = False
                continue
            tables[rank] = table
        if plain:
            # the header of every payload checked as the dict path checks it (a payload with no records yet)
            trace = cls.from_payloads(heads, clock_offsets_ns, meta, incomplete_ranks)
            for rank, p in trace.payloads.items():
                if p is not None and rank not in tables and p["events"]:
                    tables[rank] = columnar.table_of_records(rank, schema.current_events(p))
            ranks = trace.ranks
            table = columnar.concat_tables([tables[r] for r in ranks if r in tables]) if tables else None
            try:
                plain = table is None or columnar.plainly_valid(table, ranks, [trace.payloads[r] for r in ranks],
                                                                MAX_ABS_INT, MAX_NESTING)
            except (ValueError, TypeError, OverflowError):
                plain = False
            if plain:
                if table is not None:
                    _hold_columns(trace, table)
                return trace
    # a closer look: the records as dicts, checked one by one
    as_dicts = {pos: (p if not (isinstance(p, dict) and columnar.EVENTS_AS_COLUMNS in p)
                      else dict(heads[pos], events=_records_of_stream(p[columnar.EVENTS_AS_COLUMNS])))
                for pos, p in payloads.items()}
    return cls.from_payloads(as_dicts, clock_offsets_ns, meta, incomplete_ranks)


def _records_of_stream(raw: bytes) -> list[dict]:
    """The records a payload's column stream holds, as dicts; SchemaError when it is not readable."""
    try:
        return columnar.records_of(columnar.table_of_stream(raw))
    except columnar.ColumnarProblem as e:
        raise schema.SchemaError(f"its records as columns ({columnar.EVENTS_AS_COLUMNS}) cannot be read: {e}") from None


def load_trace(path: str | os.PathLike, *, allow_missing_ranks: bool = False) -> Trace:
    """Read a trace file written by ``Trace.save`` (JSON or the columnar ``.sdtrace.arrow``, told apart by its
    first bytes), or the folder of a job ``sharddbg record`` recorded.

    Everything is checked before anything is built from the file: a wrong or corrupt file raises
    TraceFileError naming the field (and the payload, rank and event index) that is wrong. A file without
    ``"ranks"`` holds the payloads of ranks 0, 1, ... in order.

    Parameters
    ----------
    path : str or os.PathLike
        The file to read, or a recorded job's folder (``sharddbg.job_files``: ``job.json`` and one
        ``rank-NNNNN.arrows`` stream per rank, or ``rank-NNNNN.jsonl`` as sharddbg wrote them before). A rank
        whose stream has no end (its process was killed, or ended in a hang) loads up to its last flush,
        incomplete, with the reason; a stream cut mid-batch (mid-line) loads up to its last whole batch (line) and
        the reason says where it is cut. The events of Arrow streams are kept as columns, and so are those of a
        big JSON file (a rank of ``RECORDS_AS_COLUMNS_FROM`` records or more; its records are made as dicts when
        asked for, equal to the file's).
    allow_missing_ranks : bool, default False
        For a job folder: load the ranks whose streams are there when some are missing (marked incomplete)
        instead of refusing it.

    Returns
    -------
    Trace
        The trace the file holds.

    Raises
    ------
    TraceFileError
        The file is not a sharddbg trace (neither JSON nor a readable Arrow IPC file, no
        ``"format": "sharddbg.trace"``; a columnar file without its header, a column missing or of another
        type), was written by a
        newer sharddbg (a file version or schema version above what this one reads), or is corrupt: it
        contradicts itself (a rank listed twice, a payload whose ``"rank"`` is not its ``"ranks"`` entry, a
        negative count or version, a null or unfinished payload whose rank is not in ``"incomplete_ranks"``,
        ...) or holds what no sharddbg writes (integers beyond +-``MAX_ABS_INT``, NaN or infinities, nesting
        deeper than ``MAX_NESTING``); or ``path`` is not a regular file (a folder, a FIFO, a device such as
        ``/dev/zero``, ...), refused before it is read.
    OSError
        The file cannot be opened (``FileNotFoundError``, ``PermissionError``, ...).

    Notes
    -----
    A trace whose recorders dropped events loads, with a ``ShardDbgWarning`` saying how many.

    Examples
    --------
    >>> t = sharddbg.load_trace("conv.sdtrace.json")
    >>> t.get_errors()[["rank", "op", "exc_type", "location"]]
    >>> sharddbg.load_trace("run").ranks  # a folder `sharddbg record --out run` wrote
    [0, 1, 2, 3]
    """
    path = os.fspath(path)
    if os.path.isdir(path):
        return _trace_of_job(path, allow_missing_ranks)
    with _analysis_formatting.cyclic_gc_paused():  # millions of records made and checked: no cycles among them
        return _trace_of_regular_file(path)


def _trace_of_regular_file(path: str) -> Trace:
    """The Trace of a trace file (JSON or columnar), checked."""
    raw = _read_regular_file(path)
    if raw.startswith(_ARROW_MAGIC):
        return _trace_of_columnar_file(path, raw)
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
    return _trace_of_document(path, d)


def _trace_of_columnar_file(path: str, raw: bytes) -> Trace:
    """The Trace of a columnar file's bytes, checked as its JSON document would be; it keeps the columns and
    makes a rank's records as dicts only when asked for.

    The records' checks run on whole columns (``columnar.plainly_valid``); where they find anything, the file is
    read again as its JSON document, one dict per record, whose checks name what is wrong."""
    try:
        header, table = columnar.read_table(raw)
    except columnar.ColumnarProblem as e:
        raise TraceFileError(f"{path}: corrupt sharddbg trace (columnar file): {e}") from None
    ranks, payloads = header.get("ranks"), header.get("payloads")
    try:
        plain = (isinstance(ranks, list) and isinstance(payloads, list) and len(ranks) == len(payloads)
                 and columnar.plainly_valid(table, ranks, payloads, MAX_ABS_INT, MAX_NESTING))
    except (ValueError, TypeError, OverflowError):  # a text that is not JSON, a value of no known kind
        plain = False
    if not plain:
        return _trace_of_document(path, _document_of_columnar_file(path, raw), records_as_columns=False)
    d = {k: v for k, v in header.items() if k not in ("layout", "columns")}
    # the header checked as a document whose payloads have no records yet: the columns were checked above
    d["payloads"] = [dict(p, events=[]) if isinstance(p, dict) else p for p in payloads]
    return _hold_columns(_trace_of_document(path, d), table)


def _hold_columns(trace: Trace, table) -> Trace:
    """``trace`` made to hold ``table`` (every rank's records, checked): each payload's events are the rank's rows,
    made as dicts only when asked (``columnar.LazyRecords``)."""
    columns = columnar.EventColumns(table)
    for p in trace.payloads.values():
        if p is not None:
            p["events"] = columnar.LazyRecords(columns, p["rank"])
    trace._columns = columns
    return trace


def _document_of_columnar_file(path: str, raw: bytes) -> dict:
    """A columnar file's JSON document, one dict per record; TraceFileError naming what is wrong in it."""
    try:
        return columnar.read_document(raw)
    except columnar.ColumnarProblem as e:
        raise TraceFileError(f"{path}: corrupt sharddbg trace (columnar file): {e}") from None


def _trace_of_document(path: str, d: Any, records_as_columns: bool = True) -> Trace:
    """The Trace of a trace document (a JSON file's, or a columnar file's turned back into it), checked. With
    ``records_as_columns``, a big one keeps its records as columns (``_columns_of_big_payloads``), its header checked
    as the whole document's would be: its records passed the same checks on columns."""
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
    table = _columns_of_document(d) if records_as_columns else None
    try:
        if table is None:
            return _trace_of_file(d)
        header = dict(d, payloads=[dict(p, events=[]) if isinstance(p, dict) else p for p in d["payloads"]])
        return _hold_columns(_trace_of_file(header), table)
    except _FileProblem as e:
        raise TraceFileError(f"{path}: corrupt sharddbg trace: {e}") from None


def _columns_of_document(d: dict) -> Any:
    """The columns of a trace document's records (``_columns_of_big_payloads``; its values are what json.loads or a
    columnar file's reading made: JSON's types) where its ``ranks`` and ``payloads`` are what a file holds (distinct
    ranks, one payload each); else None."""
    payloads = d.get("payloads")
    if not isinstance(payloads, list):
        return None
    ranks = d["ranks"] if "ranks" in d else list(range(len(payloads)))
    if (not isinstance(ranks, list) or len(ranks) != len(payloads) or not all(_is_int(r) and r >= 0 for r in ranks)
            or len(set(ranks)) != len(ranks)):
        return None
    return _columns_of_big_payloads(ranks, payloads, values_from_json=True)


# An Arrow IPC file starts with these bytes; load_trace reads such a file as the columnar layout, any other as JSON.
_ARROW_MAGIC = b"ARROW1"
# What each layout's file is named; save refuses any other suffix before writing anything.
TRACE_SUFFIXES = {".json": "json", ".arrow": "columnar"}


def _trace_file_layout(path: str) -> str:
    """'json' or 'columnar', from the suffix of ``path``; ValueError for any other suffix."""
    suffix = os.path.splitext(os.fspath(path))[1].lower()
    if suffix not in TRACE_SUFFIXES:
        raise ValueError(f"{os.fspath(path)!r}: Trace.save writes JSON (.sdtrace.json, readable, for small traces) or "
                         f"the columnar Arrow IPC file (.sdtrace.arrow, for big ones), not {suffix or 'a file without a suffix'!r}: "
                         f"nothing was written; name the file run.sdtrace.json or run.sdtrace.arrow")
    return TRACE_SUFFIXES[suffix]


def _trace_of_job(folder: str, allow_missing_ranks: bool) -> Trace:
    """The Trace of a recorded job's folder (``job_files.read_job``), its hang report in the meta."""
    if not job_files.is_job_folder(folder):
        raise TraceFileError(f"{folder} is a folder, not a trace file or a recorded job (no job.json or "
                             f"rank-NNNNN.arrows in it): give a file written by Trace.save() (e.g. run.sdtrace.json) "
                             f"or a folder written by `sharddbg record --out`")
    try:
        job = job_files.read_job(folder, allow_missing_ranks)
    except job_files.JobFileProblem as e:
        raise TraceFileError(f"{folder}: {e}") from None
    except OSError as e:
        raise TraceFileError(f"{folder}: cannot read it ({e})") from None
    payloads: dict[int, dict | None] = {r: s.payload for r, s in job.ranks.items()}
    payloads.update(dict.fromkeys(job.missing_ranks))
    reasons = job.incomplete_reasons()
    meta = {"code": " ".join(job.job.get("command") or []) or None,
            "wall_s": job.job.get("wall_s"),
            "incomplete_reasons": {str(r): why for r, why in reasons.items()},
            "clock_uncertainty_ns": {str(r): s.clock_uncertainty_ns for r, s in job.ranks.items()
                                     if s.clock_uncertainty_ns is not None},
            "job": {"folder": os.path.abspath(folder), "run_id": job.job.get("run_id"),
                    "returncode": job.job.get("returncode"), "steps": job.job.get("steps")}}
    report = job_files.hang_report(job)
    if report is not None:
        meta["hang_report"] = report
    offsets = {r: s.clock_offset_ns for r, s in job.ranks.items()}
    incomplete = [r for r, p in payloads.items() if p is None or not p["complete"]]
    trace = Trace(payloads, offsets, incomplete, meta)
    held = {r: p["events"] for r, p in trace.payloads.items() if p is not None}
    if job.columns is not None:
        # streams of Arrow batches: every rank's rows as one table, as a trace loaded from a columnar file keeps them
        columns = job.columns
        if any(not isinstance(events, columnar.LazyRecords) for events in held.values()):  # JSON lines beside them
            with _analysis_formatting.cyclic_gc_paused():
                tables = [events.columns.rows(r) if isinstance(events, columnar.LazyRecords) else
                          columnar.table_of_records(r, schema.current_events(trace.payloads[r]))
                          for r, events in held.items() if len(events)]
                columns = columnar.EventColumns(columnar.concat_tables(tables))
        for r in held:
            trace.payloads[r]["events"] = columnar.LazyRecords(columns, r)
        trace._columns = columns
    return trace


def _read_regular_file(path: str) -> bytes:
    """The bytes of the regular file ``path``; TraceFileError for anything else, before reading it: a FIFO or
    a terminal would block the read (or the open) until someone writes, a character device such as /dev/zero
    never ends."""
    what = _not_a_file(os.stat(path).st_mode)
    if what:
        raise TraceFileError(f"{path} is {what}, not a trace file: give the path of a file written by Trace.save() "
                             f"(e.g. run.sdtrace.json)")
    # O_NONBLOCK: should the path have been swapped for a FIFO since the stat, the open does not wait for a writer
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    with os.fdopen(fd, "rb") as f:
        info = os.fstat(f.fileno())
        what = _not_a_file(info.st_mode)
        if what:
            raise TraceFileError(f"{path} is {what}, not a trace file: give the path of a file written by "
                                 f"Trace.save() (e.g. run.sdtrace.json)")
        os.set_blocking(fd, True)
        return f.read(info.st_size)  # no more than the file held when opened: a growing file cannot run on


def _not_a_file(mode: int) -> str | None:
    """What a file of ``mode`` is, in words, when it is not a regular file; None for a regular file."""
    kinds = [(stat.S_ISDIR, "a folder"), (stat.S_ISFIFO, "a FIFO (named pipe)"), (stat.S_ISCHR, "a character device"),
             (stat.S_ISBLK, "a block device"), (stat.S_ISSOCK, "a socket")]
    if stat.S_ISREG(mode):
        return None
    return next((words for test, words in kinds if test(mode)), "something other than a regular file")


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
