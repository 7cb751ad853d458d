"""Analyses of the collective records (schema ``collective``): pure functions, no torch, no cluster.

``collectives_frame`` builds ``Trace.get_collectives()``; the others take that frame (and the op table
of ``Trace.get_ops()``) and return DataFrames. Collectives issued outside any recorded op are counted
under ``NO_OP`` everywhere (a DDP gradient bucket's all_reduce under ``schema.DDP_BUCKET_OP``).

Definitions used throughout:
- ``duration_ms``: ``t_done_ns - t_issue_ns`` on the host (issue to the return of its wait, or to its
  completion for work C++ waits on); NaN for a collective that never completed: one still waiting or never
  waited (``in_flight``, counted in ``n_in_flight``) or one that raised (``state`` "failed", its ``error``);
  neither is timed as done.
- ``bandwidth_gbps``: effective bandwidth in GB/s (10^9 bytes per second) =
  ``max(bytes_sent, bytes_recv) / duration`` (``device_ms`` when measured, else ``duration_ms``).
- ``wait_ms`` (imbalance): how long this rank waited for the last rank of the group to arrive at the
  same collective (``max(t_issue of all ranks at that group_seq) - own t_issue``), on the aligned clock.

Which op a collective belongs to is decided once, by ``collective_calls``: the call that issued it (the
innermost recorded op at issue; in backward, the forward call whose autograd node issued it) is its own op (self,
exclusive totals); every enclosing recorded call counts it too (inclusive totals), each op name once, in the
outermost call of that name; and the user's own call, the outermost (depth 0), is its ``owner``: the op the
per-op views (``comm_by_op_kind``, the comm-per-op figure, the explorer's op summary rows) put it under. So
the all_reduce that ``ShardTensor.redistribute`` issues inside the user's ``ShardTensor.backward()`` belongs to
``ShardTensor.backward`` in every view, issued via ``ShardTensor.redistribute``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from operator import itemgetter
from typing import Any

import numpy as np
import pandas as pd

from ..schema import COLLECTIVE_FIELDS
from .formatting import cyclic_gc_paused, format_location, numpy_huge_pages_unadvised
from .ops import (NO_OP, arrow_or_json_column, inferred_column, json_column, locations_of_columns,
                  offsets_per_row)

COLLECTIVE_COLUMNS = [
    "rank", "seq", "group_seq", "kind", "group_ranks", "mesh_dim", "bytes_sent", "bytes_recv", "t_issue_ns",
    "t_done_ns", "duration_ms", "async", "op", "op_seq", "outer_op", "outer_op_seq", "phase", "autograd_node",
    "param", "bandwidth_gbps",
]
COLLECTIVE_EXTRA_COLUMNS = [
    "group_name", "group_size", "peer", "root", "splits_sent", "splits_recv", "dtype", "shape", "api", "aten_op",
    "t_return_ns", "issue_ms", "wait_op_seq", "waited", "device_ms", "in_flight", "state", "error", "thread",
    "params", "bucket", "user_frame", "user_cell", "user_code", "location",
]
COMM_BY_OP_COLUMNS = ["op", "rank", "calls", "own_calls", "nested_calls", "n_collectives", "own_n_collectives",
                      "nested_n_collectives", "kinds", "bytes_sent", "bytes_recv", "comm_ms", "op_ms", "comm_share",
                      "bwd_n_collectives", "bwd_comm_ms", "bwd_op_ms", "n_in_flight"]
COMM_BY_OP_KIND_COLUMNS = ["op", "kind", "calls", "bytes", "comm_ms", "comm_ms_rank_max", "comm_ms_rank_mean",
                           "n_in_flight", "via"]
COMM_BY_CALL_COLUMNS = ["rank", "op_seq", "op", "path", "module", "nested", "n_collectives", "kinds", "bytes_sent",
                        "bytes_recv", "comm_ms", "op_ms", "comm_share", "user_frame", "bwd_n_collectives",
                        "bwd_comm_ms", "bwd_op_ms", "n_in_flight", "location"]
COMM_BY_RANK_COLUMNS = ["rank", "n_collectives", "n_in_flight", "bytes_sent", "bytes_recv", "comm_ms", "comm_wall_ms",
                        "span_ms"]
COMM_BY_PEER_COLUMNS = ["rank", "peer", "kind", "n_collectives", "bytes_sent", "bytes_recv", "local"]
IMBALANCE_COLUMNS = ["op", "rank", "calls", "shard_elems", "host_ms", "comm_ms", "wait_ms", "n_collectives",
                     "shard_imbalance", "host_imbalance", "wait_ms_max"]
# From this many rows (ops + collectives) a table is summed on whole columns (groupby) rather than a group at a time:
# the same table, its float sums added in another order.
BY_COLUMNS_ABOVE = 20_000
MISMATCH_COLUMNS = ["group_name", "group_seq", "mesh_dim", "problem", "ranks", "kinds", "detail"]


# kinds whose buffers must have the same size on every rank of the group
_SAME_SIZE = {"all_reduce", "all_reduce_coalesced", "all_gather_into_tensor", "all_gather",
              "all_gather_into_tensor_coalesced", "all_gather_coalesced", "reduce_scatter_tensor", "reduce_scatter",
              "reduce_scatter_tensor_coalesced", "reduce", "barrier"}
_P2P = {"send", "recv"}

assert {c for c in COLLECTIVE_COLUMNS[1:] + COLLECTIVE_EXTRA_COLUMNS
        if c not in ("kind", "duration_ms", "bandwidth_gbps", "issue_ms", "state", "location")} <= set(COLLECTIVE_FIELDS)


def collectives_frame(rows_by_rank: dict[int, list[dict]], offsets_ns: dict[int, int]) -> pd.DataFrame:
    """One row per collective record per rank; times on the reference clock (t - offset). ``state``: "completed"
    (its wait returned), "failed" (its issuing call or its wait raised: ``error`` says what) or "in_flight"
    (neither: a hang, or never waited while recording; the ``in_flight`` column). Only a completed one has a
    ``duration_ms``. One that the pre-flight stopped before it was issued (``preflight`` status "mismatch")
    moved nothing and is left out (``Trace.get_preflight()`` lists it).

    Read a column at a time, as ``ops.ops_frame``: exactly the table ``collectives_frame_by_record`` builds a
    row at a time."""
    with cyclic_gc_paused(), numpy_huge_pages_unadvised():
        return _collectives_frame(rows_by_rank, offsets_ns)


def _collectives_frame(rows_by_rank: dict[int, list[dict]], offsets_ns: dict[int, int]) -> pd.DataFrame:
    ranks: list[int] = []
    offsets: list[int] = []
    records: list[dict] = []
    for rank in sorted(rows_by_rank):
        own = [ev for ev in rows_by_rank[rank] if ev.get("kind") == "collective"
               and (ev.get("preflight") is None or ev["preflight"].get("status") != "mismatch")]
        records.extend(own)
        ranks.extend([rank] * len(own))
        offsets.extend([int(offsets_ns.get(rank, 0))] * len(own))
    columns = COLLECTIVE_COLUMNS + COLLECTIVE_EXTRA_COLUMNS
    held = [k for k in columns if k in COLLECTIVE_FIELDS] + ["coll"]
    cols: dict = dict(zip(held, map(list, zip(*map(itemgetter(*held), records))))) if records else {
        k: [] for k in held}
    cols["rank"] = ranks
    cols["kind"] = cols.pop("coll")
    places: dict[tuple, str | None] = {}  # (user_frame, user_cell, user_code) -> location: few distinct lines
    cols["location"] = [places[key] if key in places else places.setdefault(key, format_location(*key))
                        for key in zip(cols["user_frame"], cols["user_cell"], cols["user_code"])]
    missing = [math.nan] * len(records)  # what DataFrame(list of dicts) puts in a column no record names
    df = pd.DataFrame({k: inferred_column(cols.get(k, missing)) for k in columns}, columns=columns)
    shift = np.asarray(offsets, dtype=np.int64)
    for c in ("t_issue_ns", "t_return_ns", "t_done_ns"):
        df[c] = df[c].astype("Int64") - shift
    return _collective_states(df)


def collectives_frame_from_columns(table: Any, offsets_ns: dict[int, int]) -> pd.DataFrame:
    """``collectives_frame`` built from the collective rows of a trace held as columns
    (``columnar.EventColumns.of_kind("collective")``, a ``pyarrow.Table``) without making a dict per record:
    exactly the table ``collectives_frame`` builds from the same records.

    Parameters
    ----------
    table : pyarrow.Table
        The collective rows, every rank's, grouped by rank in ascending order.
    offsets_ns : dict of int to int
        Rank -> its clock offset, ns.

    Returns
    -------
    pandas.DataFrame
        ``Trace.get_collectives()``.

    Examples
    --------
    >>> collectives_frame_from_columns(columns.of_kind("collective"), {0: 0}).columns[0]
    'rank'
    """
    import pyarrow as pa

    preflight = table.column("preflight")
    if preflight.null_count != len(preflight):  # the pre-flight stopped some before they were issued: left out
        checked = json_column(preflight)
        stopped = np.array([p is not None and p.get("status") == "mismatch" for p in checked], dtype=bool)
        table = table.filter(pa.array(~stopped))
    if not table.num_rows:
        return collectives_frame({}, offsets_ns)
    with cyclic_gc_paused(), numpy_huge_pages_unadvised():
        columns = COLLECTIVE_COLUMNS + COLLECTIVE_EXTRA_COLUMNS
        n = table.num_rows
        rank = table.column("rank").to_numpy()
        cols: dict[str, Any] = {k: arrow_or_json_column(table, k) for k in columns if k in COLLECTIVE_FIELDS}
        cols["rank"] = rank
        cols["kind"] = arrow_or_json_column(table, "coll")
        cols["location"] = locations_of_columns(table)
        missing = np.full(n, math.nan)  # what DataFrame(list of dicts) puts in a column no record names
        df = pd.DataFrame({k: cols.get(k, missing) for k in columns}, columns=columns)
        shift = offsets_per_row(rank, offsets_ns)
        for c in ("t_issue_ns", "t_return_ns", "t_done_ns"):
            df[c] = df[c].astype("Int64") - shift
        return _collective_states(df)


def collectives_frame_by_record(rows_by_rank: dict[int, list[dict]], offsets_ns: dict[int, int]) -> pd.DataFrame:
    """``collectives_frame`` built a row at a time, as it was before it read columns: kept to check that both
    build the same table."""
    rows = []
    for rank in sorted(rows_by_rank):
        off = int(offsets_ns.get(rank, 0))
        for ev in rows_by_rank[rank]:
            if ev.get("kind") != "collective" or (ev.get("preflight") or {}).get("status") == "mismatch":
                continue
            r = {k: ev.get(k) for k in COLLECTIVE_COLUMNS[1:] + COLLECTIVE_EXTRA_COLUMNS if k in COLLECTIVE_FIELDS}
            r["rank"] = rank
            r["kind"] = ev["coll"]
            for k in ("t_issue_ns", "t_return_ns", "t_done_ns"):
                r[k] = ev[k] - off if ev.get(k) is not None else None
            r["location"] = format_location(ev.get("user_frame"), ev.get("user_cell"), ev.get("user_code"))
            rows.append(r)
    df = pd.DataFrame(rows, columns=COLLECTIVE_COLUMNS + COLLECTIVE_EXTRA_COLUMNS)
    for c in ("t_issue_ns", "t_return_ns", "t_done_ns"):
        df[c] = df[c].astype("Int64")
    return _collective_states(df)


def _collective_states(df: pd.DataFrame) -> pd.DataFrame:
    """The collectives' table typed, with each one's state, duration and bandwidth (``collectives_frame``)."""
    for c in ("t_issue_ns", "t_return_ns", "t_done_ns", "op_seq", "outer_op_seq", "wait_op_seq", "peer", "root",
              "group_size", "bucket", "user_cell"):
        df[c] = df[c].astype("Int64")
    df["in_flight"] = df["in_flight"].fillna(False).astype(bool)
    # failed: it raised and never completed (a record before schema 8 has no error: a failed one reads in flight)
    failed = df["error"].notna() & df["t_done_ns"].isna() if len(df) else pd.Series(dtype=bool)
    df["in_flight"] = df["in_flight"] & ~failed
    df["error"] = df["error"].astype(object).where(df["error"].notna(), None)
    df["state"] = ["failed" if f else "in_flight" if i else "completed" for f, i in zip(failed, df["in_flight"])]
    completed = df["state"] == "completed"
    done = (df["t_done_ns"] - df["t_issue_ns"]).astype("Float64") / 1e6
    df["duration_ms"] = done.astype(float).where(completed)
    df["issue_ms"] = ((df["t_return_ns"] - df["t_issue_ns"]).astype("Float64") / 1e6).astype(float)
    df["device_ms"] = pd.to_numeric(df["device_ms"], errors="coerce").astype(float).where(completed)
    t_ms = df["device_ms"].where(df["device_ms"].notna(), df["duration_ms"])
    vol = df[["bytes_sent", "bytes_recv"]].max(axis=1).astype(float) if len(df) else pd.Series(dtype=float)
    df["bandwidth_gbps"] = (vol / (t_ms / 1e3) / 1e9).where(t_ms > 0)
    return df.sort_values(["rank", "seq"], kind="stable").reset_index(drop=True)


def _kinds(s: pd.Series) -> dict:
    return {str(k): int(v) for k, v in s.value_counts().sort_index().items()}


def _sum_ms(s: pd.Series) -> float:
    return float(s.sum()) if s.notna().any() else 0.0


@dataclass(frozen=True)
class CollectiveCalls:
    """The recorded calls one collective counts for (``collective_calls``): the one rule of attribution.

    Parameters
    ----------
    own : int
        The call that issued it (its ``op_seq``): self (exclusive) totals count it here only.
    counted : tuple of int
        Every call inclusive totals count it for, innermost first: ``own``'s op name and each enclosing op
        name once, each in the outermost call of that name on the chain.
    owner : int
        The user's own call, the outermost recorded call around it (depth 0): the op every per-op view puts it
        under.

    Examples
    --------
    >>> CollectiveCalls(own=5, counted=(5, 4), owner=4).owner
    4
    """

    own: int
    counted: tuple[int, ...]
    owner: int


def collective_calls(rank: int, seq: int, parent: dict, name: dict) -> CollectiveCalls:
    """Which recorded calls a collective issued in call ``seq`` on ``rank`` belongs to: the one function that
    decides it for every table and view (the op summary, ``comm_by_op``, ``comm_by_op_kind`` and its figure).

    Parameters
    ----------
    rank : int
        The collective's rank.
    seq : int
        Its ``op_seq``: the call that issued it.
    parent : dict
        (rank, seq) -> the enclosing recorded call's seq, or None at depth 0 (``parent_seq`` of ``get_ops()``).
    name : dict
        (rank, seq) -> the call's op name. A call without a record is named by nothing: it counts for itself.

    Returns
    -------
    CollectiveCalls
        ``own`` (``seq``), ``counted`` (inclusive: each op name once, in its outermost call) and ``owner`` (the
        outermost call: the user's own).

    Examples
    --------
    >>> collective_calls(0, 5, {(0, 4): None, (0, 5): 4},
    ...                  {(0, 4): "ShardTensor.backward", (0, 5): "ShardTensor.redistribute"})
    CollectiveCalls(own=5, counted=(5, 4), owner=4)
    """
    chain, cur = [], seq
    while cur is not None and len(chain) < 256:  # nesting is shallow; the bound is for a corrupt file
        chain.append(cur)
        cur = parent.get((rank, cur))
    outermost: dict = {}  # op name -> its outermost call on the chain
    for s in chain:
        outermost[name.get((rank, s), s)] = s
    counted = tuple(s for s in chain if outermost[name.get((rank, s), s)] == s)
    return CollectiveCalls(own=seq, counted=counted, owner=chain[-1])


def op_parents_and_names(ops: pd.DataFrame) -> tuple[dict, dict]:
    """The op records' nesting and names, as ``collective_calls`` reads them.

    Parameters
    ----------
    ops : pandas.DataFrame
        ``Trace.get_ops()``.

    Returns
    -------
    tuple of dict
        (rank, seq) -> ``parent_seq`` (None at depth 0), and (rank, seq) -> op name, of every op record.

    Examples
    --------
    >>> parent, name = op_parents_and_names(t.get_ops())
    """
    parent, name = {}, {}
    if ops.empty:
        return parent, name
    for r, s, p, o in zip(ops["rank"].tolist(), ops["seq"].tolist(), ops["parent_seq"].tolist(), ops["op"].tolist()):
        parent[(int(r), int(s))] = None if pd.isna(p) else int(p)
        name[(int(r), int(s))] = o
    return parent, name


def collective_owners(colls: pd.DataFrame, ops: pd.DataFrame) -> pd.DataFrame:
    """Which op each collective belongs to in the per-op views, and which op issued it (``collective_calls``).

    Parameters
    ----------
    colls : pandas.DataFrame
        ``Trace.get_collectives()``.
    ops : pandas.DataFrame
        ``Trace.get_ops()``.

    Returns
    -------
    pandas.DataFrame
        ``colls``'s index; ``owner`` (the user's own call's op name; ``NO_OP`` outside every recorded op, the
        collective's own op where its call has no record), ``owner_seq`` (that call's seq, NA outside ops),
        ``issued_in`` (the op of the call that issued it, the innermost) and ``counted_seqs`` (the calls
        inclusive totals count it for, ``CollectiveCalls.counted``, as a list; empty outside ops).

    Examples
    --------
    >>> collective_owners(t.get_collectives(), t.get_ops())[["owner", "issued_in"]].value_counts()
    """
    if len(colls) + len(ops) >= BY_COLUMNS_ABOVE:  # a big trace: a nesting level at a time for all of them
        chains = call_chains(colls, ops)
        return pd.DataFrame({"owner": chains.owner, "owner_seq": chains.owner_seq, "issued_in": chains.issued_in,
                             "counted_seqs": chains.counted_lists()}, index=colls.index)
    parent, name = op_parents_and_names(ops)
    owner, owner_seq, issued, counted = [], [], [], []
    for r, s, c_op in zip(colls["rank"].tolist(), colls["op_seq"].tolist(), colls["op"].tolist()):
        c_op = NO_OP if pd.isna(c_op) else c_op
        if pd.isna(s):
            owner.append(c_op)
            owner_seq.append(pd.NA)
            issued.append(c_op)
            counted.append([])
            continue
        calls = collective_calls(int(r), int(s), parent, name)
        owner.append(name.get((int(r), calls.owner), c_op))
        owner_seq.append(calls.owner)
        issued.append(name.get((int(r), int(s)), c_op))
        counted.append(list(calls.counted))
    return pd.DataFrame({"owner": owner, "owner_seq": pd.array(owner_seq, dtype="Int64"), "issued_in": issued,
                         "counted_seqs": counted}, index=colls.index)


# (rank, seq) of a call as one int64: ranks stay far below 2**23, seqs below 2**40
_SEQ_BITS = 40


@dataclass(frozen=True)
class CallChains:
    """The calls each collective belongs to (``collective_calls``' rule), worked out for all collectives at once.

    Parameters
    ----------
    seqs : numpy.ndarray
        (collectives, levels) int64: the chain of calls around each collective, innermost (its ``op_seq``) first;
        -1 past a chain's end (a collective without a call has none).
    counted : numpy.ndarray
        (collectives, levels) bool: the calls inclusive totals count it for (``CollectiveCalls.counted``).
    owner, issued_in : numpy.ndarray
        Object arrays: the op name of the user's own call and of the call that issued it (``collective_owners``).
    owner_seq : pandas.arrays.IntegerArray
        The user's own call's seq, NA outside ops.

    Examples
    --------
    >>> chains = call_chains(t.get_collectives(), t.get_ops())
    >>> chains.seqs.shape[0] == len(t.get_collectives())
    True
    """

    seqs: np.ndarray
    counted: np.ndarray
    owner: np.ndarray
    issued_in: np.ndarray
    owner_seq: Any

    def counted_lists(self, rows: np.ndarray | None = None) -> list[list[int]]:
        """``counted`` as one list of seqs per collective (innermost first; empty outside ops).

        Parameters
        ----------
        rows : numpy.ndarray, optional
            Only these collectives (positions or a mask); all by default.

        Returns
        -------
        list of list of int
            ``CollectiveCalls.counted`` of each collective.

        Examples
        --------
        >>> call_chains(t.get_collectives(), t.get_ops()).counted_lists()[0]
        """
        seqs, counted = (self.seqs, self.counted) if rows is None else (self.seqs[rows], self.counted[rows])
        kept = np.where(counted, seqs, -1).tolist()
        return [[x for x in row if x >= 0] for row in kept]

    def counted_pairs(self, rank: np.ndarray) -> pd.DataFrame:
        """Every (collective, call) that ``counted`` holds, one row each: ``at`` (the collective's position),
        ``key`` (its rank and the call's seq as one int64, ``call_keys``).

        Parameters
        ----------
        rank : numpy.ndarray
            Each collective's rank.

        Returns
        -------
        pandas.DataFrame
            Columns ``at`` and ``key``.

        Examples
        --------
        >>> c = t.get_collectives()
        >>> pairs = call_chains(c, t.get_ops()).counted_pairs(c["rank"].to_numpy())
        """
        at, level = np.nonzero(self.counted)
        return pd.DataFrame({"at": at, "key": (np.asarray(rank, dtype=np.int64)[at] << _SEQ_BITS) + self.seqs[at, level]})


def call_keys(rank, seq) -> np.ndarray:
    """(rank, seq) pairs as one int64 each (-1 where seq is missing): how ``CallChains`` names a call.

    Parameters
    ----------
    rank, seq : array-like
        Ranks and seqs (seq may hold missing values).

    Returns
    -------
    numpy.ndarray
        int64 keys.

    Examples
    --------
    >>> call_keys([0, 1], [5, None]).tolist()
    [5, -1]
    """
    s = pd.to_numeric(pd.Series(seq, dtype=object) if not isinstance(seq, pd.Series) else seq)
    s = s.to_numpy(dtype=np.float64, na_value=np.nan)
    key = (np.asarray(rank, dtype=np.int64) << _SEQ_BITS) + np.nan_to_num(s, nan=0).astype(np.int64)
    return np.where(np.isnan(s), -1, key)


def call_chains(colls: pd.DataFrame, ops: pd.DataFrame) -> CallChains:
    """``collective_calls`` for every collective of ``colls`` at once, a nesting level at a time on whole columns.

    Parameters
    ----------
    colls : pandas.DataFrame
        ``Trace.get_collectives()`` (or some of its rows).
    ops : pandas.DataFrame
        ``Trace.get_ops()``.

    Returns
    -------
    CallChains
        The chains, what they count for and the owners' names.

    Examples
    --------
    >>> call_chains(t.get_collectives(), t.get_ops()).owner[:3]
    """
    n = len(colls)
    c_op = colls["op"].to_numpy(dtype=object, na_value=None)
    c_op = np.where(pd.isna(c_op), NO_OP, c_op) if n else np.array([], dtype=object)
    rank = colls["rank"].to_numpy(dtype=np.int64)
    cur = call_keys(rank, colls["op_seq"])
    if len(ops):
        # the op records keyed by (rank, seq); a key held twice: its last record, as a dict would keep
        o_key = call_keys(ops["rank"], ops["seq"])
        last = ~pd.Series(o_key).duplicated(keep="last").to_numpy()
        o_key = o_key[last]
        o_parent = call_keys(ops["rank"], ops["parent_seq"])[last]
        # the names factorized on the whole column (no Python object per row), every missing one as one name: None
        all_codes, distinct = pd.factorize(ops["op"])
        o_code = np.where(all_codes < 0, len(distinct), all_codes)[last]
        o_names = [*np.asarray(distinct, dtype=object), None]
        index = pd.Index(o_key)
    else:
        o_parent, o_code, o_names, index = np.array([], dtype=np.int64), np.array([], dtype=np.int64), [], pd.Index([])
    o_names = np.asarray(o_names, dtype=object)
    seqs, codes, found = [], [], []
    live = cur >= 0
    first_pos = None
    for _ in range(256):  # nesting is shallow; the bound is for a corrupt file
        if not live.any():
            break
        pos = index.get_indexer(np.where(live, cur, -1)) if len(index) else np.full(n, -1)
        pos = np.where(live, pos, -1)
        rec = pos >= 0
        seqs.append(np.where(live, cur & ((1 << _SEQ_BITS) - 1), -1))
        # a call without a record is named by nothing (its own seq): it matches no other name on its chain
        codes.append(np.where(rec, o_code[np.maximum(pos, 0)] if len(index) else -1, -1 - len(codes)))
        found.append(pos)
        if first_pos is None:
            first_pos = pos
        nxt = np.where(rec, o_parent[np.maximum(pos, 0)] if len(index) else -1, -1)
        live = live & rec & (nxt >= 0)
        cur = nxt
    levels = len(seqs)
    S = np.stack(seqs, axis=1) if levels else np.full((n, 0), -1, dtype=np.int64)
    N = np.stack(codes, axis=1) if levels else np.full((n, 0), -1, dtype=np.int64)
    P = np.stack(found, axis=1) if levels else np.full((n, 0), -1, dtype=np.int64)
    valid = S >= 0
    # counted: each name once, in its outermost call: no later (outer) call on the chain has the same name
    counted = valid.copy()
    for j in range(levels):
        for k in range(j + 1, levels):
            counted[:, j] &= ~(valid[:, k] & (N[:, k] == N[:, j]))
    depth = valid.sum(axis=1)
    has = depth > 0
    last = np.maximum(depth - 1, 0)
    rows = np.arange(n)
    owner_seq = pd.array(np.where(has, S[rows, last] if levels else 0, 0), dtype="Int64")
    owner_seq[~has] = pd.NA
    owner_pos = P[rows, last] if levels else np.full(n, -1)
    row_names = o_names[o_code] if len(o_names) else o_names  # each op record's name
    owner = np.where(has & (owner_pos >= 0), row_names[np.maximum(owner_pos, 0)] if len(row_names) else None, c_op)
    first = P[:, 0] if levels else np.full(n, -1)
    issued = np.where(has & (first >= 0), row_names[np.maximum(first, 0)] if len(row_names) else None, c_op)
    return CallChains(S, counted, owner.astype(object), issued.astype(object), owner_seq)


def attributed(colls: pd.DataFrame, ops: pd.DataFrame, inclusive: bool) -> pd.DataFrame:
    """One row per (collective, op call it counts for), as ``collective_calls`` decides: the collective's own
    op (``op``/``op_seq``; NO_OP for none), and with ``inclusive`` every enclosing recorded call too (each op
    name once per collective). Columns: the collective's, with ``op``/``op_seq`` replaced."""
    c = colls.copy()
    c["op"] = c["op"].where(c["op"].notna(), NO_OP)
    if c.empty or ops.empty:
        return c
    parent, names = op_parents_and_names(ops)
    # the name of the op record a collective names (the record is the one source of an op's name)
    c["op"] = [c_op if pd.isna(s) else names.get((int(r), int(s)), c_op)
               for r, s, c_op in zip(c["rank"].tolist(), c["op_seq"].tolist(), c["op"].tolist())]
    if not inclusive:
        return c
    rows, idx = [], []
    for i, (r, seq) in enumerate(zip(c["rank"].tolist(), c["op_seq"].tolist())):
        if pd.isna(seq):
            idx.append(i)
            rows.append((c["op"].iat[i], pd.NA))
            continue
        for s in collective_calls(int(r), int(seq), parent, names).counted:
            idx.append(i)
            rows.append((names.get((int(r), s), c["op"].iat[i]), s))
    out = c.iloc[idx].reset_index(drop=True)
    out["op"] = [n for n, _ in rows]
    out["op_seq"] = pd.array([s for _, s in rows], dtype="Int64")
    return out


@dataclass
class _OpComm:
    """One row of ``comm_by_op(by="op")`` while it is summed up: an op on a rank."""

    calls: int = 0
    own_calls: int = 0
    nested_calls: int = 0
    n_collectives: int = 0
    own_n_collectives: int = 0
    nested_n_collectives: int = 0
    kinds: dict = field(default_factory=dict)
    bytes_sent: int = 0
    bytes_recv: int = 0
    comm_ms: float = 0.0
    op_ms: float = 0.0
    bwd_n_collectives: int = 0
    bwd_comm_ms: float = 0.0
    bwd_op_ms: float = 0.0
    n_in_flight: int = 0


def comm_by_op(colls: pd.DataFrame, ops: pd.DataFrame, by: str = "op", inclusive: bool = False) -> pd.DataFrame:
    """Communication per op name and rank (``by="op"``) or per op call (``by="call"``), forward and backward
    apart.

    A collective counts for the op it is attributed to (``op``: innermost recorded op at issue; in backward
    the forward op whose autograd node issued it); with ``inclusive=True`` also for every recorded op it ran
    inside (``ShardTensor.full_tensor`` then owns the all_gather of the ``redistribute`` it calls; inclusive
    rows overlap, so they do not add up to the trace's total). ``calls``: every forward call of the op on that
    rank, nested ones included: ``own_calls`` (the user's own, depth 0: what ``get_op_summary()`` counts) plus
    ``nested_calls`` (made from inside another recorded op, e.g. the ``redistribute`` of a ``full_tensor``).
    ``n_collectives`` / ``kinds`` / ``bytes_*``: both phases, of every call; ``own_n_collectives`` /
    ``nested_n_collectives``: those of the own / nested calls (a row of collectives outside every recorded op
    has neither); ``by="call"``: ``nested`` says the same of each call. Like with like: ``comm_ms`` (sum of
    the forward collectives' ``duration_ms``) against ``op_ms`` (host time of the forward calls),
    ``comm_share`` = comm_ms / op_ms, so a share above 1 can only come from async collectives overlapping each
    other or outlasting the call; ``bwd_comm_ms`` / ``bwd_op_ms``: the same for the backward collectives and
    events (a backward event times the op's output node only, while ``bwd_comm_ms`` holds the collectives of
    all the op's autograd nodes, waits for the other ranks included: the two are not a share). ``n_in_flight``:
    collectives that never completed (counted, never timed). Collectives outside every recorded op appear
    under ``NO_OP`` (a DDP bucket under ``schema.DDP_BUCKET_OP``).
    """
    if by not in ("op", "call"):
        raise ValueError(f"by must be 'op' or 'call', got {by!r}")
    if not isinstance(inclusive, bool):
        raise ValueError(f"inclusive must be True or False, got {inclusive!r}")
    if by == "call":
        return _comm_by_call(attributed(colls, ops, inclusive), ops)
    if not inclusive and len(ops) + len(colls) >= _ROWS_BY_COLUMNS:
        return comm_by_op_by_columns(colls, ops)
    c = attributed(colls[["rank", "op", "op_seq", "kind", "bytes_sent", "bytes_recv", "duration_ms", "phase",
                          "in_flight"]], ops[["rank", "seq", "op", "parent_seq"]], inclusive)
    # one pass over the collectives and one over the ops: pandas per (op, rank) costs far more than the sums
    depth = {(int(r), int(s)): int(d) for r, s, d in zip(*(ops[k].tolist() for k in ("rank", "seq", "depth")))} \
        if len(ops) else {}
    acc: dict[tuple, _OpComm] = {}
    # plain lists: iterating a Series (Arrow-backed text above all) costs a Python call per value
    for op, r, s, kind, sent, recv, ms, ph, fl in zip(*(c[k].tolist() for k in (
            "op", "rank", "op_seq", "kind", "bytes_sent", "bytes_recv", "duration_ms", "phase", "in_flight"))):
        a = acc.setdefault((op, int(r)), _OpComm())
        a.n_collectives += 1
        call_depth = None if pd.isna(s) else depth.get((int(r), int(s)))
        if call_depth is not None:
            a.own_n_collectives += call_depth == 0
            a.nested_n_collectives += call_depth > 0
        a.kinds[str(kind)] = a.kinds.get(str(kind), 0) + 1
        a.bytes_sent += 0 if pd.isna(sent) else int(sent)
        a.bytes_recv += 0 if pd.isna(recv) else int(recv)
        done = 0.0 if pd.isna(ms) else float(ms)
        if ph == "backward":
            a.bwd_n_collectives += 1
            a.bwd_comm_ms += done
        else:
            a.comm_ms += done
        a.n_in_flight += bool(fl)
    if len(ops):
        calls = list(zip(*(ops[k].tolist() for k in ("op", "rank", "phase", "depth", "host_ms"))))
        for op, r, ph, d, ms in calls:
            if ph == "forward":
                a = acc.setdefault((op, int(r)), _OpComm())
                a.calls += 1
                a.own_calls += d == 0
                a.nested_calls += d > 0
                a.op_ms += 0.0 if pd.isna(ms) else float(ms)
        for op, r, ph, _d, ms in calls:
            a = acc.get((op, int(r))) if ph == "backward" else None
            if a is not None:
                a.bwd_op_ms += 0.0 if pd.isna(ms) else float(ms)
    rows = []
    for (op, rank), a in sorted(acc.items(), key=lambda kv: (str(kv[0][0]), kv[0][1])):
        op_ms = a.op_ms if a.calls else math.nan
        rows.append({
            "op": op, "rank": rank, "calls": a.calls, "own_calls": int(a.own_calls),
            "nested_calls": int(a.nested_calls),
            "n_collectives": a.n_collectives, "own_n_collectives": int(a.own_n_collectives),
            "nested_n_collectives": int(a.nested_n_collectives), "kinds": dict(sorted(a.kinds.items())),
            "bytes_sent": a.bytes_sent, "bytes_recv": a.bytes_recv, "comm_ms": a.comm_ms, "op_ms": op_ms,
            "comm_share": a.comm_ms / op_ms if a.calls and op_ms > 0 else math.nan,
            "bwd_n_collectives": a.bwd_n_collectives, "bwd_comm_ms": a.bwd_comm_ms, "bwd_op_ms": a.bwd_op_ms,
            "n_in_flight": int(a.n_in_flight),
        })
    df = pd.DataFrame(rows, columns=COMM_BY_OP_COLUMNS)
    df["total_ms"] = df["comm_ms"] + df["bwd_comm_ms"]
    df = df.sort_values(["total_ms", "op", "rank"], ascending=[False, True, True], kind="stable")
    return df.drop(columns="total_ms").reset_index(drop=True)


# below this many rows (ops and collectives) comm_by_op adds up a row at a time: on a small trace that is quicker
# than the fixed cost of the groupbys
_ROWS_BY_COLUMNS = 20_000


def comm_by_op_by_columns(colls: pd.DataFrame, ops: pd.DataFrame) -> pd.DataFrame:
    """``comm_by_op(colls, ops)`` (by op name and rank, exclusive) worked out on whole columns, without Python per
    collective or per call: for big traces.

    Parameters
    ----------
    colls : pandas.DataFrame
        ``Trace.get_collectives()``.
    ops : pandas.DataFrame
        ``Trace.get_ops()``.

    Returns
    -------
    pandas.DataFrame
        ``Trace.get_comm_by_op()``: the table ``comm_by_op`` adds up a row at a time, its sums added in another
        order.

    Examples
    --------
    >>> comm_by_op_by_columns(t.get_collectives(), t.get_ops()).columns[0]
    'op'
    """
    c = colls[["rank", "op", "op_seq", "kind", "bytes_sent", "bytes_recv", "duration_ms", "phase", "in_flight"]]
    rank = c["rank"].to_numpy(dtype=np.int64)
    op = c["op"].to_numpy(dtype=object, na_value=None)
    op = np.where(pd.isna(op), NO_OP, op) if len(op) else op
    depth = np.full(len(c), -1, dtype=np.int64)  # -1: no op record (or no call at all)
    if len(ops) and len(c):
        keyed = ops[["rank", "seq", "op", "depth"]].drop_duplicates(["rank", "seq"], keep="last")
        index = pd.MultiIndex.from_arrays([keyed["rank"].to_numpy(dtype=np.int64),
                                           keyed["seq"].to_numpy(dtype=np.int64)])
        has_call = c["op_seq"].notna().to_numpy()
        at = index.get_indexer(pd.MultiIndex.from_arrays([rank, c["op_seq"].to_numpy(dtype=np.int64, na_value=-1)]))
        at = np.where(has_call, at, -1)
        found = at >= 0
        # the name of the op record a collective names (the record is the one source of an op's name)
        op = np.where(found, keyed["op"].to_numpy(dtype=object)[np.maximum(at, 0)], op)
        depth = np.where(found, keyed["depth"].to_numpy(dtype=np.int64)[np.maximum(at, 0)], -1)
    backward = (c["phase"] == "backward").fillna(False).to_numpy(dtype=bool)
    done = c["duration_ms"].to_numpy(dtype=np.float64, na_value=np.nan)
    done = np.where(np.isnan(done), 0.0, done)
    per = pd.DataFrame({
        "op": op, "rank": rank, "n_collectives": 1, "own_n_collectives": depth == 0,
        "nested_n_collectives": depth > 0,
        "bytes_sent": c["bytes_sent"].fillna(0).to_numpy(dtype=np.int64),
        "bytes_recv": c["bytes_recv"].fillna(0).to_numpy(dtype=np.int64),
        "comm_ms": np.where(backward, 0.0, done), "bwd_n_collectives": backward,
        "bwd_comm_ms": np.where(backward, done, 0.0),
        "n_in_flight": c["in_flight"].fillna(False).to_numpy(dtype=bool)})
    comm = per.groupby(["op", "rank"], sort=False).sum()
    kinds = pd.DataFrame({"op": op, "rank": rank, "kind": c["kind"].astype(str).to_numpy(dtype=object)}) \
        .groupby(["op", "rank", "kind"], sort=True).size()
    kind_counts: dict[tuple, dict] = {}
    for (o, r, k), n in kinds.items():
        kind_counts.setdefault((o, r), {})[k] = int(n)
    phase = ops["phase"].to_numpy(dtype=object, na_value=None) if len(ops) else np.array([], dtype=object)
    host = ops["host_ms"].to_numpy(dtype=np.float64, na_value=np.nan) if len(ops) else np.array([])
    host = np.where(np.isnan(host), 0.0, host)
    o_depth = ops["depth"].to_numpy(dtype=np.int64) if len(ops) else np.array([], dtype=np.int64)
    o_names = ops["op"].to_numpy(dtype=object) if len(ops) else np.array([], dtype=object)
    o_rank = ops["rank"].to_numpy(dtype=np.int64) if len(ops) else np.array([], dtype=np.int64)
    forward = phase == "forward"
    calls = pd.DataFrame({"op": o_names[forward], "rank": o_rank[forward], "calls": 1,
                          "own_calls": o_depth[forward] == 0, "nested_calls": o_depth[forward] > 0,
                          "op_ms": host[forward]}).groupby(["op", "rank"], sort=False).sum()
    bwd = phase == "backward"
    bwd_ms = pd.DataFrame({"op": o_names[bwd], "rank": o_rank[bwd], "bwd_op_ms": host[bwd]}) \
        .groupby(["op", "rank"], sort=False).sum()
    keys = comm.index.union(calls.index, sort=False) if len(calls) else comm.index
    df = pd.DataFrame(index=keys)
    for name in ("calls", "own_calls", "nested_calls", "op_ms"):
        df[name] = calls[name].reindex(keys).fillna(0).to_numpy() if len(calls) else 0
    for name in ("n_collectives", "own_n_collectives", "nested_n_collectives", "bytes_sent", "bytes_recv", "comm_ms",
                 "bwd_n_collectives", "bwd_comm_ms", "n_in_flight"):
        df[name] = comm[name].reindex(keys).fillna(0).to_numpy() if len(comm) else 0
    df["bwd_op_ms"] = bwd_ms["bwd_op_ms"].reindex(keys).fillna(0.0).to_numpy() if len(bwd_ms) else 0.0
    df = df.reset_index().rename(columns={"level_0": "op", "level_1": "rank"})
    df["kinds"] = [kind_counts.get((o, r), {}) for o, r in zip(df["op"].tolist(), df["rank"].tolist())]
    for name in ("calls", "own_calls", "nested_calls", "n_collectives", "own_n_collectives", "nested_n_collectives",
                 "bytes_sent", "bytes_recv", "bwd_n_collectives", "n_in_flight", "rank"):
        df[name] = df[name].astype(np.int64)
    for name in ("op_ms", "comm_ms", "bwd_comm_ms", "bwd_op_ms"):
        df[name] = df[name].astype(np.float64)
    df["op_ms"] = df["op_ms"].where(df["calls"] > 0)
    df["comm_share"] = (df["comm_ms"] / df["op_ms"]).where((df["calls"] > 0) & (df["op_ms"] > 0))
    df["op"] = df["op"].astype(object)
    df = df.assign(_op=df["op"].astype(str)).sort_values(["_op", "rank"], kind="stable").drop(columns="_op")
    df = pd.DataFrame({name: df[name].to_numpy() if name != "op" else df["op"].tolist() for name in COMM_BY_OP_COLUMNS},
                      columns=COMM_BY_OP_COLUMNS)
    df["total_ms"] = df["comm_ms"] + df["bwd_comm_ms"]
    df = df.sort_values(["total_ms", "op", "rank"], ascending=[False, True, True], kind="stable")
    return df.drop(columns="total_ms").reset_index(drop=True)


def _comm_by_call(c: pd.DataFrame, ops: pd.DataFrame) -> pd.DataFrame:
    rows = []
    fwd = ops[ops["phase"] == "forward"] if len(ops) else ops
    bwd = ops[ops["phase"] == "backward"] if len(ops) else ops
    with_coll = c[c["op_seq"].notna()]
    keys = set(zip(with_coll["rank"], with_coll["op_seq"].astype(int)))
    keys |= set(zip(fwd["rank"], fwd["seq"].astype(int))) if len(fwd) else set()
    fwd_idx = {(int(r), int(s)): row for r, s, row in zip(fwd["rank"], fwd["seq"], fwd.itertuples(index=False))} \
        if len(fwd) else {}
    bwd_ms: dict[tuple[int, int], float] = {}
    if len(bwd):
        for r, fs, ms in zip(bwd["rank"], bwd["fwd_seq"], bwd["host_ms"]):
            if not pd.isna(fs) and not pd.isna(ms):
                bwd_ms[(int(r), int(fs))] = bwd_ms.get((int(r), int(fs)), 0.0) + float(ms)
    groups = {k: g for k, g in with_coll.groupby(["rank", with_coll["op_seq"].astype(int)])} if len(with_coll) else {}
    empty = c.iloc[0:0]
    for rank, seq in sorted(keys):
        g = groups.get((rank, seq), empty)
        gf, gb = g[g["phase"] != "backward"], g[g["phase"] == "backward"]
        o = fwd_idx.get((rank, seq))
        op_ms = float(o.host_ms) if o is not None and not pd.isna(o.host_ms) else 0.0
        comm = _sum_ms(gf["duration_ms"])
        rows.append({
            "rank": int(rank), "op_seq": int(seq),
            "op": o.op if o is not None else (g["op"].iloc[0] if len(g) else None),
            "path": o.path if o is not None else None, "module": o.module if o is not None else None,
            "nested": bool(o.depth > 0) if o is not None else None, "n_collectives": int(len(g)),
            "kinds": _kinds(g["kind"]),
            "bytes_sent": int(g["bytes_sent"].sum()), "bytes_recv": int(g["bytes_recv"].sum()),
            "comm_ms": comm, "op_ms": op_ms, "comm_share": comm / op_ms if op_ms > 0 else math.nan,
            "user_frame": o.user_frame if o is not None else None,
            "bwd_n_collectives": int(len(gb)), "bwd_comm_ms": _sum_ms(gb["duration_ms"]),
            "bwd_op_ms": bwd_ms.get((rank, seq), 0.0), "n_in_flight": int(g["in_flight"].sum()),
            "location": o.location if o is not None else None,
        })
    nc = c[c["op_seq"].isna()]
    for (rank, op), g in nc.groupby(["rank", "op"]):
        gf, gb = g[g["phase"] != "backward"], g[g["phase"] == "backward"]
        locs = [x for x in g["location"] if isinstance(x, str)]
        rows.append({"rank": int(rank), "op_seq": None, "op": op, "path": None, "module": None, "nested": None,
                     "n_collectives": int(len(g)), "kinds": _kinds(g["kind"]),
                     "bytes_sent": int(g["bytes_sent"].sum()), "bytes_recv": int(g["bytes_recv"].sum()),
                     "comm_ms": _sum_ms(gf["duration_ms"]), "op_ms": math.nan, "comm_share": math.nan,
                     "user_frame": None, "bwd_n_collectives": int(len(gb)), "bwd_comm_ms": _sum_ms(gb["duration_ms"]),
                     "bwd_op_ms": math.nan, "n_in_flight": int(g["in_flight"].sum()),
                     "location": locs[0] if len(set(locs)) == 1 else None})
    df = pd.DataFrame(rows, columns=COMM_BY_CALL_COLUMNS)
    df["op_seq"] = df["op_seq"].astype("Int64")
    return df.sort_values(["rank", "op_seq"], kind="stable").reset_index(drop=True)


def comm_by_op_kind(colls: pd.DataFrame, ops: pd.DataFrame | None = None) -> pd.DataFrame:
    """Communication per (op, collective kind), all ranks together.

    Parameters
    ----------
    colls : pandas.DataFrame
        ``Trace.get_collectives()``.
    ops : pandas.DataFrame, optional
        ``Trace.get_ops()``: with it, a collective counts for the op it belongs to (``collective_owners``: the
        user's own call it was issued in, as in the op summary); without it, for the op that issued it.

    Returns
    -------
    pandas.DataFrame
        ``op``, ``kind``, ``calls`` (collectives), ``bytes`` (sent + received, summed over ranks), ``comm_ms``
        (``duration_ms`` summed over ranks: on 4 ranks waiting together it is about 4x the wall time),
        ``comm_ms_rank_max`` / ``comm_ms_rank_mean`` (per-rank totals: the slowest rank's, and their mean over
        the ranks of the table), ``n_in_flight`` (never completed; not timed), ``via`` (the ops inside ``op``
        that issued them, comma-separated; "" when ``op`` issued them itself). Largest ``bytes`` first, then
        largest ``comm_ms``.

    Examples
    --------
    >>> comm_by_op_kind(t.get_collectives(), t.get_ops())[["op", "kind", "comm_ms", "via"]]
    """
    if colls.empty:
        return pd.DataFrame(columns=COMM_BY_OP_KIND_COLUMNS)
    own = colls["op"].where(colls["op"].notna(), NO_OP)
    if ops is not None:
        chains = call_chains(colls, ops)
        op = pd.Series(chains.owner, index=colls.index, dtype=object)
        issued = pd.Series(chains.issued_in, index=colls.index, dtype=object)
    else:
        op, issued = own, own
    c = colls.assign(op=op, issued=issued, bytes=colls["bytes_sent"].fillna(0) + colls["bytes_recv"].fillna(0),
                     done_ms=colls["duration_ms"].fillna(0.0))
    n_ranks = max(int(c["rank"].nunique()), 1)
    g = c.groupby(["op", "kind"], sort=False).agg(calls=("kind", "size"), bytes=("bytes", "sum"),
                                                  comm_ms=("done_ms", "sum"), n_in_flight=("in_flight", "sum"))
    per_rank = c.groupby(["op", "kind", "rank"], sort=False)["done_ms"].sum()
    g["comm_ms_rank_max"] = per_rank.groupby(level=[0, 1]).max()
    g["comm_ms_rank_mean"] = per_rank.groupby(level=[0, 1]).sum() / n_ranks
    g["n_in_flight"] = g["n_in_flight"].astype(int)
    via = c[c["issued"] != c["op"]].groupby(["op", "kind"], sort=False)["issued"].agg(
        lambda s: ", ".join(dict.fromkeys(s)))
    g["via"] = via.reindex(g.index).fillna("")
    return g.reset_index().sort_values(["bytes", "comm_ms"], ascending=False, kind="stable").reset_index(drop=True)[
        COMM_BY_OP_KIND_COLUMNS]


def _union_ms(starts, ends) -> float:
    """Length (ms) of the union of [start, end) intervals in ns: wall time with at least one collective open."""
    a, b = pd.Series(starts, dtype="Int64"), pd.Series(ends, dtype="Int64")
    ok = (a.notna() & b.notna()).to_numpy(dtype=bool)
    a, b = a.to_numpy(dtype=np.int64, na_value=0)[ok], b.to_numpy(dtype=np.int64, na_value=0)[ok]
    keep = b >= a
    a, b = a[keep], b[keep]
    if not len(a):
        return 0.0
    order = np.lexsort((b, a))
    a, b = a[order], b[order]
    reach = np.maximum.accumulate(b)  # the furthest end so far: a span starting after it opens a new stretch
    first = np.flatnonzero(np.concatenate([[True], a[1:] > reach[:-1]]))
    last = np.concatenate([first[1:] - 1, [len(a) - 1]])
    return int((reach[last] - a[first]).sum()) / 1e6


def comm_by_rank(colls: pd.DataFrame, ops: pd.DataFrame, ranks=None) -> pd.DataFrame:
    """Communication of each rank: ``n_collectives``, ``n_in_flight`` (never completed), ``bytes_sent`` /
    ``bytes_recv``, ``comm_ms`` (sum of ``duration_ms``; overlapping async collectives count each),
    ``comm_wall_ms`` (wall time with at least one of them open: never more than the span), ``span_ms`` (from
    the rank's first recorded event to its last). ``ranks``: every rank to list (a rank without collectives
    has zeros)."""
    keys = set(int(r) for r in colls["rank"].unique()) | set(int(r) for r in ops["rank"].unique()) | \
        set(int(r) for r in (ranks or ()))
    rows = []
    # the columns read, then each rank's rows: a mask moves every column it is given (a big trace's cost)
    colls = colls[["rank", "in_flight", "t_issue_ns", "t_done_ns", "bytes_sent", "bytes_recv", "duration_ms"]]
    ops = ops[["rank", "t_start_ns", "t_end_ns"]]
    c_rank, o_rank = colls["rank"].to_numpy(), ops["rank"].to_numpy()
    for rank in sorted(keys):
        g = colls[c_rank == rank]
        o = ops[o_rank == rank]
        done = g[~g["in_flight"].to_numpy(dtype=bool)]
        # the first and last recorded times (exact integers: ns since the epoch do not fit a float)
        t0 = [x for x in (g["t_issue_ns"].min(), o["t_start_ns"].min()) if not pd.isna(x)]
        t1 = [x for x in (g["t_done_ns"].max(), g["t_issue_ns"].max(), o["t_end_ns"].max()) if not pd.isna(x)]
        rows.append({
            "rank": rank, "n_collectives": int(len(g)), "n_in_flight": int(g["in_flight"].sum()),
            "bytes_sent": int(g["bytes_sent"].sum()), "bytes_recv": int(g["bytes_recv"].sum()),
            "comm_ms": _sum_ms(g["duration_ms"]), "comm_wall_ms": _union_ms(done["t_issue_ns"], done["t_done_ns"]),
            "span_ms": (int(max(t1)) - int(min(t0))) / 1e6 if t0 and t1 else math.nan,
        })
    return pd.DataFrame(rows, columns=COMM_BY_RANK_COLUMNS)


def comm_by_peer(colls: pd.DataFrame) -> pd.DataFrame:
    """Bytes each rank sent to and received from each other rank, where the records say so exactly:
    all_to_all (its per-rank splits) and point-to-point send / recv (its peer). ``local``: the part of an
    all_to_all a rank keeps for itself (peer == rank: no transfer). Collectives whose per-peer traffic depends
    on the backend's algorithm (all_reduce, all_gather, broadcast, ...) are not split here."""
    acc: dict[tuple[int, int, str], list[int]] = {}

    def add(rank, peer, kind, sent, recv):
        a = acc.setdefault((int(rank), int(peer), str(kind)), [0, 0, 0])
        a[0] += 1
        a[1] += int(sent)
        a[2] += int(recv)

    for r in colls.itertuples(index=False):
        if r.kind in ("all_to_all_single", "all_to_all") and isinstance(r.group_ranks, (list, tuple)):
            ss = r.splits_sent if isinstance(r.splits_sent, (list, tuple)) else None
            sr = r.splits_recv if isinstance(r.splits_recv, (list, tuple)) else None
            if ss is None and sr is None:
                continue
            for i, peer in enumerate(r.group_ranks):
                add(r.rank, peer, r.kind, ss[i] if ss is not None and i < len(ss) else 0,
                    sr[i] if sr is not None and i < len(sr) else 0)
        elif r.kind in _P2P and not pd.isna(r.peer):
            add(r.rank, r.peer, r.kind, r.bytes_sent, r.bytes_recv)
    rows = [{"rank": k[0], "peer": k[1], "kind": k[2], "n_collectives": v[0], "bytes_sent": v[1], "bytes_recv": v[2],
             "local": k[0] == k[1]} for k, v in sorted(acc.items())]
    return pd.DataFrame(rows, columns=COMM_BY_PEER_COLUMNS)


# What names one collective across ranks: its process group (by name: two groups of the same ranks, such as the
# world and a domain sub-mesh of every rank, count their collectives apart) and its number on that group.
MATCH_KEY = ["group_name", "group_seq"]


def matched_collectives(colls: pd.DataFrame) -> pd.Series:
    """Which rows of ``get_collectives()`` are the same collective on different ranks: one id per row (an int,
    in order of first appearance), equal for the rows of one collective (``MATCH_KEY``: the same process group
    and the same ``group_seq``, the k-th collective each rank issued on it). Every analysis and view that lines
    a collective up across ranks uses this."""
    if colls.empty:
        return pd.Series(dtype="int64", index=colls.index)
    return colls.groupby(MATCH_KEY, sort=False).ngroup()


def arrival_wait_ms(colls: pd.DataFrame) -> pd.Series:
    """Per collective row: ms this rank waited for the last rank of its group to issue the same collective
    (``matched_collectives``), from the aligned ``t_issue_ns``. NaN when only one rank recorded it."""
    if colls.empty:
        return pd.Series(dtype=float)
    t = colls["t_issue_ns"].astype("Float64")
    same = matched_collectives(colls)
    last = t.groupby(same).transform("max")
    n = t.groupby(same).transform("count")
    w = ((last - t) / 1e6).astype(float)
    return w.where(n.astype(int) > 1)


def imbalance(ops: pd.DataFrame, colls: pd.DataFrame) -> pd.DataFrame:
    """Per op name and rank: shard volume (``shard_elems``: elements of the local data of every
    distributed argument, ShardTensor or DTensor, of its forward calls; plain tensors, such as weights
    promoted to Replicate during the call, are left out) beside host time (forward and backward events),
    comm time of its collectives and the time spent waiting for other ranks to arrive (``wait_ms``).
    ``shard_imbalance`` / ``host_imbalance``: max over ranks / mean over ranks of that op (1.0 =
    balanced); ``wait_ms_max``: the largest per-rank wait of that op."""
    if len(ops) + len(colls) >= BY_COLUMNS_ABOVE:
        return _imbalance_table(_imbalance_by_columns(ops, colls))
    c = colls.copy()
    c["wait_ms"] = arrival_wait_ms(c) if len(c) else pd.Series(dtype=float)
    c["op"] = c["op"].where(c["op"].notna(), NO_OP)
    rows = []
    keys = set(zip(ops["op"], ops["rank"])) if len(ops) else set()
    keys |= set(zip(c["op"], c["rank"]))
    for op, rank in sorted(keys, key=lambda k: (str(k[0]), int(k[1]))):
        o = ops[(ops["op"] == op) & (ops["rank"] == rank)] if len(ops) else ops
        f = o[o["phase"] == "forward"] if len(o) else o
        g = c[(c["op"] == op) & (c["rank"] == rank)]
        rows.append({
            "op": op, "rank": int(rank), "calls": int(len(f)),
            "shard_elems": _shard_elems(f),
            "host_ms": _sum_ms(o["host_ms"]) if len(o) else 0.0,
            "comm_ms": _sum_ms(g["duration_ms"]), "wait_ms": _sum_ms(g["wait_ms"]), "n_collectives": int(len(g)),
        })
    return _imbalance_table(pd.DataFrame(rows, columns=IMBALANCE_COLUMNS))


def _imbalance_by_columns(ops: pd.DataFrame, colls: pd.DataFrame) -> pd.DataFrame:
    """``imbalance``'s rows before its ratios, summed by groupby on whole columns (a big trace): the same
    table, float sums added in another order."""
    o_op = ops["op"].to_numpy(dtype=object, na_value=None) if len(ops) else np.array([], dtype=object)
    forward = (ops["phase"] == "forward").fillna(False).to_numpy(dtype=bool) if len(ops) else np.array([], dtype=bool)
    elems = np.zeros(len(ops), dtype=np.int64)
    if forward.any():
        # shapes and placements decoded once per distinct value are one object each: counted once per pair of them
        seen: dict[tuple[int, int], int] = {}
        at = np.flatnonzero(forward)
        for k, shapes, pls in zip(at.tolist(), ops["in_local_shapes"].to_numpy(dtype=object)[at].tolist(),
                                  ops["in_placements"].to_numpy(dtype=object)[at].tolist()):
            key = (id(shapes), id(pls))
            n = seen.get(key)
            if n is None:
                n = seen[key] = _shard_elems_of(shapes, pls)
            elems[k] = n
    per_op = pd.DataFrame({"op": o_op, "rank": ops["rank"].to_numpy(dtype=np.int64) if len(ops) else [],
                           "calls": forward.astype(np.int64), "shard_elems": elems,
                           "host_ms": ops["host_ms"].to_numpy(dtype=np.float64, na_value=np.nan) if len(ops) else []})
    per_op = per_op.groupby(["op", "rank"], sort=False, dropna=False).sum()
    c_op = colls["op"].to_numpy(dtype=object, na_value=None)
    c_op = np.where(pd.isna(c_op), NO_OP, c_op) if len(colls) else c_op
    per_coll = pd.DataFrame({"op": c_op, "rank": colls["rank"].to_numpy(dtype=np.int64),
                             "comm_ms": colls["duration_ms"].to_numpy(dtype=np.float64, na_value=np.nan),
                             "wait_ms": arrival_wait_ms(colls).to_numpy(dtype=np.float64) if len(colls) else [],
                             "n_collectives": np.ones(len(colls), dtype=np.int64)})
    per_coll = per_coll.groupby(["op", "rank"], sort=False, dropna=False).sum()
    keys = per_op.index.union(per_coll.index, sort=False)
    df = pd.DataFrame(index=keys)
    for name, part, dtype in (("calls", per_op, np.int64), ("shard_elems", per_op, np.int64),
                              ("host_ms", per_op, np.float64), ("comm_ms", per_coll, np.float64),
                              ("wait_ms", per_coll, np.float64), ("n_collectives", per_coll, np.int64)):
        df[name] = part[name].reindex(keys).fillna(0).to_numpy(dtype=dtype) if len(part) else np.zeros(len(keys), dtype)
    df = df.reset_index()
    df.columns = ["op", "rank", *df.columns[2:]]
    df["op"] = df["op"].astype(str).astype("str")  # the dtype a table of records gets
    df["rank"] = df["rank"].astype(np.int64)
    return df.reindex(columns=IMBALANCE_COLUMNS).reset_index(drop=True)


def _imbalance_table(df: pd.DataFrame) -> pd.DataFrame:
    """``imbalance``'s ratios over its per (op, rank) rows, sorted."""
    if len(df):
        grp = df.groupby("op")
        for src, dst in (("shard_elems", "shard_imbalance"), ("host_ms", "host_imbalance")):
            mean = grp[src].transform("mean").astype(float)
            df[dst] = (grp[src].transform("max").astype(float) / mean).where(mean > 0)
        df["wait_ms_max"] = grp["wait_ms"].transform("max")
    return df.sort_values(["op", "rank"], kind="stable").reset_index(drop=True)


def _shard_elems(f: pd.DataFrame) -> int:
    return int(sum(_shard_elems_of(shapes, pls) for shapes, pls in zip(f["in_local_shapes"], f["in_placements"])))


def _shard_elems_of(shapes, pls) -> int:
    """Elements of the local data of one call's distributed arguments."""
    total = 0
    for shp, pl in zip(shapes or (), pls or ()):
        if pl is not None and shp is not None:
            total += math.prod(int(d) for d in shp)
    return int(total)


# The columns of get_collectives() that collective_mismatches, _may_mismatch and _mismatch_rows read.
MISMATCH_COLUMNS_READ = [*MATCH_KEY, "rank", "kind", "mesh_dim", "group_ranks", "dtype", "bytes_sent", "bytes_recv", "root",
                         "splits_sent", "splits_recv"]


def collective_mismatches(colls: pd.DataFrame, traced_ranks=None) -> pd.DataFrame:
    """Collectives that do not line up across the ranks of their group.

    For each collective (``matched_collectives``) every rank of the group must have issued the same one:
    ``problem`` is ``"kind"`` (different kinds; send/recv count as one point-to-point kind),
    ``"dtype"``, ``"size"`` (different buffer sizes for a kind whose sizes must agree, or a broadcast
    with different sizes or roots), ``"splits"`` (all_to_all: what rank i sends to j differs from what j
    expects from i), or ``"missing"`` (a rank of the group never issued a collective with this group_seq:
    it recorded fewer on the group, or none at all). ``traced_ranks``: the ranks the trace holds (a rank of
    the group outside them is not counted missing); None: every rank of the group. Point-to-point calls
    are not counted: a send and its recv are one pair of ranks, not the whole group.
    """
    rows: list[dict] = []
    if colls.empty:
        return pd.DataFrame(columns=MISMATCH_COLUMNS)
    traced = None if traced_ranks is None else {int(r) for r in traced_ranks}
    # the columns read here and in _mismatch_rows, then the sort: it moves every column it is given
    colls = colls[[c for c in MISMATCH_COLUMNS_READ if c in colls.columns]]
    colls = colls.assign(_match=matched_collectives(colls)).sort_values(MATCH_KEY, kind="stable")
    # groups in order of first appearance (as groupby(sort=False)), each group's rows in the sorted order
    codes = pd.factorize(colls["_match"].to_numpy())[0]
    order = np.argsort(codes, kind="stable")
    bounds = np.flatnonzero(np.diff(codes[order])) + 1
    cols = {k: colls[k].to_numpy(dtype=object, na_value=None).tolist() if k in colls else [None] * len(colls)
            for k in ("rank", "kind", "group_ranks", "dtype", "bytes_sent", "bytes_recv", "root", "splits_sent",
                      "splits_recv")}
    # most collectives line up: a quick look on plain lists, the full one (_mismatch_rows) only where they may not
    flagged = [at for at in np.split(order, bounds) if _may_mismatch(cols, at.tolist(), traced)]
    if flagged:
        for _, d in colls.iloc[np.concatenate(flagged)].groupby("_match", sort=False):
            rows += _mismatch_rows(d, traced)
    return pd.DataFrame(rows, columns=MISMATCH_COLUMNS)


def _may_mismatch(cols: dict[str, list], at: list[int], traced: set | None) -> bool:
    """False where the collective of rows ``at`` (plain column lists) surely lines up: ``_mismatch_rows`` would
    find nothing."""
    kinds = {cols["kind"][i] for i in at}
    if len(kinds) > 1:
        return not kinds <= _P2P
    kind = next(iter(kinds))
    if kind in _P2P:
        return False
    ranks = {int(cols["rank"][i]) for i in at}
    if len(ranks) < len(at):
        return True  # a rank issued it twice: the full look
    gr = cols["group_ranks"][at[0]]
    members = {int(x) for x in gr} if isinstance(gr, (list, tuple)) else ranks
    if members - ranks - (set() if traced is None else members - traced):
        return True
    if len({x for x in (cols["dtype"][i] for i in at) if isinstance(x, str)}) > 1:
        return True
    if kind in _SAME_SIZE:
        return len({cols["bytes_sent"][i] for i in at}) > 1
    if kind == "broadcast":
        return True  # rare: the full look
    if kind in ("all_to_all_single", "all_to_all"):
        pos = {g: k for k, g in enumerate(int(x) for x in gr)} if isinstance(gr, (list, tuple)) else \
            {g: k for k, g in enumerate(sorted(ranks))}
        sent = {int(cols["rank"][i]): cols["splits_sent"][i] for i in at if isinstance(cols["splits_sent"][i], (list, tuple))}
        recv = {int(cols["rank"][i]): cols["splits_recv"][i] for i in at if isinstance(cols["splits_recv"][i], (list, tuple))}
        for i in sent:
            for j in recv:
                if i in pos and j in pos and pos[j] < len(sent[i]) and pos[i] < len(recv[j]):
                    if int(sent[i][pos[j]]) != int(recv[j][pos[i]]):
                        return True
    return False


def _mismatch_rows(d: pd.DataFrame, traced: set | None) -> list[dict]:
    """``collective_mismatches``' rows of one collective (``d``: its rows on every rank)."""
    rows: list[dict] = []
    gname, gseq = d["group_name"].iloc[0], d["group_seq"].iloc[0]
    d = d.sort_values("rank")
    ranks = [int(r) for r in d["rank"]]
    kinds = [str(k) for k in d["kind"]]
    mesh_dim = d["mesh_dim"].iloc[0]
    base = {"group_name": gname, "group_seq": int(gseq), "mesh_dim": mesh_dim, "ranks": ranks, "kinds": kinds}
    gr = d["group_ranks"].iloc[0]
    members = [int(x) for x in gr] if isinstance(gr, (list, tuple)) else ranks
    missing = sorted(set(members) - set(ranks) - (set() if traced is None else set(members) - traced))
    if missing and not all(k in _P2P for k in kinds):
        where = mesh_dim if isinstance(mesh_dim, str) else f"process group {gname}"
        rows.append({**base, "problem": "missing", "detail": "; ".join(
            f"rank {r} never issued group_seq {int(gseq)}: {kinds[0]} on {where}" for r in missing)})
    classes = {("p2p" if k in _P2P else k) for k in kinds}
    if len(classes) > 1:
        rows.append({**base, "problem": "kind", "detail": ", ".join(f"rank {r}: {k}" for r, k in zip(ranks, kinds))})
        return rows
    kind = kinds[0]
    if kind in _P2P:
        return rows
    dts = {str(x) for x in d["dtype"] if isinstance(x, str)}
    if len(dts) > 1:
        rows.append({**base, "problem": "dtype", "detail": ", ".join(f"rank {r}: {x}" for r, x in zip(ranks, d["dtype"]))})
    if kind in _SAME_SIZE:
        sizes = [int(x) for x in d["bytes_sent"]]
        if len(set(sizes)) > 1:
            rows.append({**base, "problem": "size",
                         "detail": ", ".join(f"rank {r}: {s} B sent" for r, s in zip(ranks, sizes))})
    elif kind == "broadcast":
        sizes = [max(int(a), int(b)) for a, b in zip(d["bytes_sent"], d["bytes_recv"])]
        roots = {int(x) for x in d["root"] if not pd.isna(x)}
        if len(set(sizes)) > 1 or len(roots) > 1:
            rows.append({**base, "problem": "size", "detail": ", ".join(
                f"rank {r}: {s} B root {ro}" for r, s, ro in zip(ranks, sizes, d["root"]))})
    elif kind in ("all_to_all_single", "all_to_all"):
        pos = {g: i for i, g in enumerate(members)}
        sent = {int(r): s for r, s in zip(d["rank"], d["splits_sent"]) if isinstance(s, (list, tuple))}
        recv = {int(r): s for r, s in zip(d["rank"], d["splits_recv"]) if isinstance(s, (list, tuple))}
        bad = []
        for i in sent:
            for j in recv:
                if i in pos and j in pos and pos[j] < len(sent[i]) and pos[i] < len(recv[j]):
                    if int(sent[i][pos[j]]) != int(recv[j][pos[i]]):
                        bad.append(f"{i}->{j}: sends {sent[i][pos[j]]} B, {j} expects {recv[j][pos[i]]} B")
        if bad:
            rows.append({**base, "problem": "splits", "detail": "; ".join(bad)})
    return rows
