"""The trace explorer: it opens on the op summary (``Trace.get_op_summary()``: one row per op, dispatch
path and phase, errors and fallbacks first); a row expands to its calls on each rank, identical ones (same
shapes, placements, path, source; times may differ) as one row "ranks 0-3". Beside it, every op call of every
rank, filters, and a detail panel for the clicked call (the same call on every rank: inputs/outputs,
placements, time; its collectives; module, handler, user source line; traceback for errors).

``summary_frame(trace)`` is the summary the widget opens on, ``call_groups(trace)`` the rows a summary row
expands to, ``explorer_frame(trace)`` the list of calls (each names its summary row and call group),
``op_detail(trace, rank, seq)`` what the detail panel shows: all pure and tested on golden traces.
``TraceExplorer`` (anywidget) ships them to the browser once; expanding, filtering and the detail panel
then run there without the kernel (so the same front end works inside the standalone HTML report).
Strings are set as text in the browser, never as HTML. Displayed in a notebook, the explorer leaves one
output bundle (``sharddbg.views.bundle``): the widget, ``explorer_html`` (a static rendering),
``explorer_text`` and the trace itself.
"""

from __future__ import annotations

import json
import weakref
from dataclasses import dataclass
from typing import TYPE_CHECKING

import anywidget
import numpy as np
import pandas as pd
import traitlets

from ..analysis.comm import call_chains, call_keys, collective_owners
from ..analysis.formatting import format_shape, is_missing, json_value, ranks_text
from ..analysis.ops import is_fallback
from ..analysis.timeline import time_origin_ns
from .bundle import output_bundle, view_payload
from .common import FINDING_CATEGORY_TITLES, PATH_COLORS, SEVERITY_MARKS, error_entries, fallback_table, path_color, render, static

if TYPE_CHECKING:
    from ..trace import Trace

ROW_FIELDS = ["rank", "seq", "op", "path", "phase", "kind", "key", "depth", "parent_seq", "module", "user_frame",
              "handler", "autograd_node", "fwd_seq", "in_local_shapes", "in_global_shapes", "out_local_shape",
              "out_global_shape", "placements", "in_placements", "dtype", "in_bytes", "out_bytes", "host_ms",
              "device_ms", "t_start_ms", "exc_type", "error", "traceback", "unmasked", "not_implemented", "in_flight",
              "spec_mismatch", "summary_row", "call_group"]
# ``counted_seqs``: the calls a collective counts for (``analysis.comm.collective_calls``, the rule every view
# uses): a call's detail lists the collectives it issued or enclosed, the ones its summary row's time holds.
COLL_FIELDS = ["rank", "seq", "kind", "phase", "op_seq", "outer_op_seq", "group_ranks", "mesh_dim", "bytes_sent",
               "bytes_recv", "duration_ms", "param", "counted_seqs"]
KIND_ORDER = {"error": 0, "fallback": 1, "op": 2}
# Two calls of one summary row with equal values here are identical: one row "ranks 0-3" when the summary row
# expands, whatever their times. ``location`` is where in the user's code ("cell [2], line 4: `...`", the notebook's
# cell), the same on every rank.
CALL_IDENTITY = ("kind", "path", "in_local_shapes", "in_global_shapes", "out_local_shape", "out_global_shape",
                 "placements", "in_placements", "dtype", "module", "location", "error", "in_flight", "spec_mismatch")
GROUP_FIELDS = ["summary_row", "call_group", "ranks", "ranks_text", "calls", "first_rank", "first_seq", *CALL_IDENTITY,
                "host_ms_min", "host_ms_max", "device_ms_min", "device_ms_max"]
# Repeated strings: shipped once in a string table, rows hold their index (a 100k-row trace shrinks ~3x).
TABLE_FIELDS = ("op", "path", "phase", "kind", "key", "module", "user_frame", "handler", "autograd_node",
                "placements", "dtype", "exc_type", "error", "traceback", "spec_mismatch")
# Lists (shapes, placements per argument): their JSON text goes into the same table.
JSON_FIELDS = ("in_local_shapes", "in_global_shapes", "out_local_shape", "out_global_shape", "in_placements")
DEFAULT_MAX_ROWS = 20_000
# A big trace (more op calls than this): the browser gets a bounded sample of its calls (``BigSample``) and only the
# collectives those calls count, so that the page opens in about a second whatever the trace's size; the op summary
# still counts every call, and the page says what is left out and how to see it.
BIG_TRACE_ABOVE = 50_000
BIG_ERRORS = 1_000  # at most this many calls of each kind: errors, fallbacks, slowest, first in time
BIG_FALLBACKS = 1_000
BIG_SLOWEST = 1_000
BIG_FIRST = 1_000
BIG_GROUPS = 50  # call groups under each summary row in a big trace's payload (the rest counted)
STATIC_ROWS = 200  # summary rows, and op calls, in the static rendering (errors and fallbacks first)
STATIC_GROUPS = 8  # call groups under each summary row in the static renderings
TEXT_SUMMARY_ROWS = 30  # summary rows in the text
# The tables' columns: (field, title, width in px or None[, the header's tooltip]). Short columns have fixed widths,
# the others share the rest of the box but never get less than FLEXIBLE_MIN_PX: in a narrow output the list
# scrolls sideways rather than cutting op names short (the flag and the op come first, always in view).
FLEXIBLE_MIN_PX = 100
LIST_COLUMNS = [("kind", "", 84), ("rank", "rank", 44), ("seq", "seq", 50), ("op", "op", None), ("path", "path", None),
                ("phase", "phase", 70), ("module", "module", None), ("out_local_shape", "output (local)", None),
                ("host_ms", "host ms", 66), ("user_frame", "source", None)]
# The op summary's columns, each with what its header's tooltip says. Communication is shown against what it is
# part of: "comm ms in host" lies within "host ms" (compare them); a backward row's collectives of the op's other
# autograd nodes lie outside that time, in a column of their own.
SUMMARY_LIST_COLUMNS = [
    ("kind", "", 84), ("op", "op", None), ("path", "path", None), ("phase", "phase", 70),
    ("calls", "calls", 48, "your own calls (forward), or the backward events"), ("ranks", "ranks", 56),
    ("first_ms_median", "first ms", 62, "median host time of the first call with given input shapes"),
    ("steady_ms_median", "steady ms", 66, "median host time of every other call"),
    ("host_ms_total", "host ms", 72, "host time of the row's calls, all ranks together (a backward event: the "
                                     "node behind the op's output only; a backward() call: the whole backward pass "
                                     "it runs, every op's backward inside it)"),
    ("comm_ms_within_host", "comm ms in host", 70, "collectives issued while the row's calls ran (those of the "
                                                    "ops they called included): part of host ms"),
    ("comm_ms_outside_host", "bwd comm ms, other nodes", 76,
     "backward: collectives of the op's other autograd nodes, outside host ms; they include waiting for the other "
     "ranks and run beside the rest of the backward pass: compare with the backward pass's time"),
    ("dispatch_bound", "dispatch", 68), ("locations", "source", None)]
GROUP_LIST_COLUMNS = [("kind", "", 84), ("ranks_text", "ranks", 84), ("calls", "calls", 48),
                      ("in_local_shapes", "inputs (local)", None), ("out_local_shape", "output (local)", None),
                      ("placements", "placements", None), ("host_ms", "host ms", 120), ("location", "source", None)]


def path_column_px(paths) -> int:
    """A width in px that holds the widest of ``paths`` as a chip (11 px UI font, about 6.2 px a character, the
    chip's and the cell's padding): the path column never cuts a chip.

    Parameters
    ----------
    paths : iterable of str
        The dispatch paths the table shows.

    Returns
    -------
    int
        The path column's width in px (at least ``FLEXIBLE_MIN_PX``).

    Examples
    --------
    >>> path_column_px(["function_handler"])
    120
    """
    return max([FLEXIBLE_MIN_PX] + [int(6.2 * len(p)) + 21 for p in paths])


def table_min_width(columns: list, path_px: int = FLEXIBLE_MIN_PX) -> int:
    """The least width in px a table of ``columns`` takes: its fixed widths, ``path_px`` for the path column
    and ``FLEXIBLE_MIN_PX`` for each other flexible column.

    Parameters
    ----------
    columns : list
        Column entries (field, title, width in px or None[, tooltip]).
    path_px : int
        The path column's width (``path_column_px``).

    Returns
    -------
    int
        The table's min-width in px.

    Examples
    --------
    >>> table_min_width([("kind", "", 84), ("op", "op", None)])
    204
    """
    return sum(c[2] or (path_px if c[0] == "path" else FLEXIBLE_MIN_PX) for c in columns)


@dataclass(frozen=True)
class _Tables:
    """The explorer's three tables, computed together (each needs the others' numbering)."""
    calls: pd.DataFrame  # explorer_frame's rows (ROW_FIELDS), with each call's occurrence and CALL_IDENTITY
    summary: pd.DataFrame  # summary_frame
    groups: pd.DataFrame  # call_groups


def _min(s: pd.Series) -> float:
    s = s.dropna()
    return float(s.min()) if len(s) else float("nan")


def _max(s: pd.Series) -> float:
    s = s.dropna()
    return float(s.max()) if len(s) else float("nan")


# A trace's tables, computed once per trace (a Trace does not change once built): the widget's data, its text, its
# static rendering and every detail click read the same ones.
_TABLES: "weakref.WeakKeyDictionary[Trace, _Tables]" = weakref.WeakKeyDictionary()


def _tables(trace: Trace) -> _Tables:
    tables = _TABLES.get(trace)
    if tables is None:
        tables = _TABLES[trace] = _build_tables(trace)
    return tables


def _build_tables(trace: Trace) -> _Tables:
    summary = trace.get_op_summary()
    ops = trace.get_ops()
    if ops.empty:
        return _Tables(pd.DataFrame(columns=ROW_FIELDS),
                       summary.assign(kind=pd.Series(dtype=object), spec_mismatches=pd.Series(dtype="int64")),
                       pd.DataFrame(columns=GROUP_FIELDS))
    # only the columns the explorer reads: every sort and filter below moves each column kept (a big trace's cost)
    used = set(ROW_FIELDS) | set(CALL_IDENTITY) | {"t_start_ns", "error_handled", "fallback"}
    ops = ops[[c for c in ops.columns if c in used]]
    rank, seq = ops["rank"].to_numpy(), ops["seq"].to_numpy()
    if len(ops) > 1 and not ((rank[1:] > rank[:-1]) | ((rank[1:] == rank[:-1]) & (seq[1:] >= seq[:-1]))).all():
        ops = ops.sort_values(["rank", "seq"], kind="stable")  # get_ops() is in this order already: no sort
    ops["occurrence"] = ops.groupby(["rank", "phase", "op"], sort=False).cumcount()
    ops["key"] = ops["phase"] + "|" + ops["op"] + "|" + ops["occurrence"].astype(str)
    fallback = is_fallback(ops).to_numpy(dtype=bool)
    # an exception the user's code caught is no failure: only the others lead (handled: True / False / None), asked
    # of the calls that raised only
    raised = np.flatnonzero(ops["exc_type"].notna().to_numpy(dtype=bool))
    handled = ops["error_handled"].to_numpy(dtype=object)[raised]
    error = np.zeros(len(ops), dtype=bool)
    error[raised[np.array([h is not True for h in handled], dtype=bool)]] = True
    ops["kind"] = "op"
    ops.loc[fallback, "kind"] = "fallback"
    ops.loc[error, "kind"] = "error"
    # the timeline's origin: the trace's first event
    ops["t_start_ms"] = (ops["t_start_ns"] - time_origin_ns(ops, trace.get_collectives())).astype(float) / 1e6
    kind_order = np.full(len(ops), KIND_ORDER["op"], dtype=np.int64)  # each call's kind, as KIND_ORDER numbers it
    kind_order[fallback] = KIND_ORDER["fallback"]
    kind_order[error] = KIND_ORDER["error"]
    ops["kind_order"] = kind_order

    # The summary's calls (get_op_summary: the user's own forward calls, depth 0, and every backward call),
    # its rows in the explorer's order: errors, then fallbacks (as their calls say), each in the summary's order.
    member = (ops["phase"] == "backward") | (ops["depth"] == 0)
    # the columns read, then the rows (a mask moves every column it is given)
    worst = ops[["op", "path", "phase", "kind_order"]][member].groupby(["op", "path", "phase"])["kind_order"].min()
    order = [int(worst.get((o, p, ph), KIND_ORDER["op"])) for o, p, ph in zip(summary["op"], summary["path"], summary["phase"])]
    kind_of = {v: k for k, v in KIND_ORDER.items()}
    # calls whose result's spec disagrees with its local tensor (the recorder's spec check), per summary row
    bad_spec = ops[["op", "path", "phase"]][member & ops["spec_mismatch"].notna()].groupby(["op", "path", "phase"]).size()
    summary = summary.assign(kind=[kind_of[o] for o in order], kind_order=order,
                             spec_mismatches=[int(bad_spec.get(k, 0)) for k in
                                              zip(summary["op"], summary["path"], summary["phase"])])
    summary = summary.sort_values("kind_order", kind="stable").drop(columns="kind_order").reset_index(drop=True)
    # each member call's summary row: (op, path, phase) looked up for all calls at once
    rows_index = pd.MultiIndex.from_arrays([summary["op"].astype(object), summary["path"].astype(object),
                                            summary["phase"].astype(object)])
    if len(rows_index):  # looked up once per distinct (op, path, phase): a million calls hold a few hundred
        combo = ops.groupby(["op", "path", "phase"], sort=False, dropna=False).ngroup().to_numpy()
        first = np.unique(combo, return_index=True)[1]
        distinct = ops[["op", "path", "phase"]].iloc[first]
        at = rows_index.get_indexer(pd.MultiIndex.from_arrays([distinct["op"].astype(object),
                                                               distinct["path"].astype(object),
                                                               distinct["phase"].astype(object)]))[combo]
    else:
        at = np.full(len(ops), -1)
    summary_row = pd.array(at, dtype="Int64")
    summary_row[(at < 0) | ~member.to_numpy(dtype=bool)] = pd.NA
    ops["summary_row"] = summary_row

    # Each summary row's calls, identical ones together; groups numbered in call order (the first call of a
    # group is its earliest occurrence, on its lowest rank).
    calls = ops.loc[ops["summary_row"].notna().to_numpy(), ["summary_row", "occurrence", "rank", "seq", "host_ms", "device_ms",
                                                            *CALL_IDENTITY]] \
        .sort_values(["summary_row", "occurrence", "rank", "seq"], kind="stable")
    codes = pd.Series(_identity_groups(calls), index=calls.index)
    ops["call_group"] = pd.array([None] * len(ops), dtype="Int64")
    ops.loc[calls.index, "call_group"] = codes.astype("int64")
    calls = calls.assign(call_group=codes.astype("int64"))
    groups = []
    for (srow, grp), g in calls.groupby(["summary_row", "call_group"], sort=True):
        first = g.iloc[0]
        ranks = sorted(int(r) for r in g["rank"].unique())
        groups.append({"summary_row": int(srow), "call_group": int(grp), "ranks": ranks, "ranks_text": ranks_text(ranks),
                       "calls": len(g), "first_rank": int(first["rank"]), "first_seq": int(first["seq"]),
                       **{f: first[f] for f in CALL_IDENTITY},
                       "host_ms_min": _min(g["host_ms"]), "host_ms_max": _max(g["host_ms"]),
                       "device_ms_min": _min(g["device_ms"]), "device_ms_max": _max(g["device_ms"])})

    ops["call_start"] = ops.groupby("key")["t_start_ns"].transform("min")  # one call's rows together, rank order
    # the order found on the sort's columns, then taken once: the explorer's columns, and what its call groups were
    # found from (the call's occurrence, every field of CALL_IDENTITY)
    by = ["kind_order", "call_start", "key", "rank", "seq"]
    order = ops[by].reset_index(drop=True).sort_values(by, kind="stable").index.to_numpy()
    kept = ROW_FIELDS + ["occurrence"] + [f for f in CALL_IDENTITY if f not in ROW_FIELDS]
    ops = ops[kept].take(order).reset_index(drop=True)
    return _Tables(ops, summary, pd.DataFrame(groups, columns=GROUP_FIELDS))


def _value_codes(values: pd.Series) -> np.ndarray:
    """One int per row, equal where the values' reprs are equal (lists of ints, strings, bools, None / NaN for
    missing ones): each distinct object's repr made once (a big trace's lists are shared by the rows that hold them)."""
    if values.dtype != object:  # plain values (strings, bools, numbers): equal values, equal reprs
        return pd.factorize(values, use_na_sentinel=False)[0]
    objects = values.to_numpy(dtype=object)
    ids = np.fromiter(map(id, objects), dtype=np.int64, count=len(objects))
    id_codes, unique_ids = pd.factorize(ids)
    first = np.zeros(len(unique_ids), dtype=np.int64)
    first[id_codes[::-1]] = np.arange(len(ids))[::-1]  # a row holding each distinct object
    text_codes = pd.factorize(np.array([repr(objects[k]) for k in first.tolist()], dtype=object))[0]
    return text_codes[id_codes]


def _identity_groups(calls: pd.DataFrame) -> np.ndarray:
    """Each call's group among its summary row's calls (``CALL_IDENTITY`` equal), numbered in the calls' order from
    0 in each summary row."""
    combined = np.zeros(len(calls), dtype=np.int64)
    for field in CALL_IDENTITY:  # (codes so far, this field's code) as one int, numbered again from 0
        codes = _value_codes(calls[field]).astype(np.int64)
        combined = pd.factorize(combined * (int(codes.max(initial=0)) + 1) + codes)[0].astype(np.int64)
    srow = calls["summary_row"].to_numpy(dtype=np.int64)
    pair = pd.factorize(srow * (int(combined.max(initial=0)) + 1) + combined)[0]  # numbered in order of first appearance
    first = np.zeros(pair.max() + 1 if len(pair) else 0, dtype=np.int64)
    first[pair[::-1]] = np.arange(len(pair))[::-1]
    # each distinct (summary row, identity), numbered within its summary row in order of first appearance
    number = pd.Series(srow[first]).groupby(srow[first], sort=False).cumcount().to_numpy()
    return number[pair]


def explorer_frame(trace: Trace) -> pd.DataFrame:
    """The explorer's list of calls: one row per op call per rank, ``kind`` = error / fallback / op, errors
    first, then fallbacks, then everything else in time order. ``key`` names the same call on every rank
    (phase, op, and its occurrence number on that rank); ``summary_row`` (a row of ``summary_frame``) and
    ``call_group`` (its group there, ``call_groups``) are empty for a forward call nested in another
    recorded op (the summary counts the user's own calls)."""
    return _tables(trace).calls[ROW_FIELDS]


def summary_frame(trace: Trace) -> pd.DataFrame:
    """The summary the explorer opens on: the rows of ``Trace.get_op_summary()``, errors first, then
    fallbacks, then the rest, each in the summary's own order (most host time first); ``kind`` error /
    fallback / op as the row's calls are in ``explorer_frame`` (a row is an error when one of its calls
    raised); ``spec_mismatches``: how many of its calls made a result whose spec disagrees with its local
    tensor (``Trace.get_spec_mismatches()``)."""
    return _tables(trace).summary.copy()


def call_groups(trace: Trace) -> pd.DataFrame:
    """What a summary row expands to: its calls on each rank, identical ones (equal ``CALL_IDENTITY``:
    shapes, placements, path, source, error; times may differ) as one row. Columns ``GROUP_FIELDS``:
    ``summary_row`` / ``call_group`` (the numbering ``explorer_frame`` uses), ``ranks`` and ``ranks_text``
    ("ranks 0-3"), ``calls``, the first call (``first_rank``, ``first_seq``: its detail), the identical
    fields, and the range of host and device times."""
    return _tables(trace).groups.copy()


def _collectives(trace: Trace) -> pd.DataFrame:
    colls = trace.get_collectives()
    return colls.assign(counted_seqs=collective_owners(colls, trace.get_ops())["counted_seqs"] if len(colls)
                        else pd.Series(dtype=object))[COLL_FIELDS]


def _counted_for(coll: pd.DataFrame, per_rank: pd.DataFrame) -> pd.Series:
    """Which collectives count for the calls of ``per_rank`` (one call on every rank): a forward call's
    collectives of both phases, a backward event's those its forward call's autograd nodes issued."""
    backward = bool(len(per_rank)) and per_rank["phase"].iloc[0] == "backward"
    key = "fwd_seq" if backward else "seq"
    pairs = {(int(r), int(s)) for r, s in zip(per_rank["rank"], per_rank[key]) if not pd.isna(s)}
    return pd.Series([(not backward or ph == "backward") and any((int(r), int(s)) in pairs for s in seqs)
                      for r, ph, seqs in zip(coll["rank"], coll["phase"], coll["counted_seqs"])],
                     index=coll.index, dtype=bool)


def _collectives_counted_by(trace: Trace, calls: pd.DataFrame) -> pd.DataFrame:
    """``_collectives(trace)`` of those that count for any of ``calls`` (rows of ``explorer_frame``: issued or enclosed by one
    of them, or by the forward call of a backward one: what their details list), on whole columns: the chains of calls of all
    collectives looked up at once, the lists of counted calls made only for the collectives kept."""
    colls = trace.get_collectives()
    if colls.empty:
        return colls.assign(counted_seqs=pd.Series(dtype=object))[COLL_FIELDS]
    chains = call_chains(colls, trace.get_ops())
    fwd = calls[calls["fwd_seq"].notna()]
    wanted = np.concatenate([call_keys(calls["rank"], calls["seq"]), call_keys(fwd["rank"], fwd["fwd_seq"])])
    pairs = chains.counted_pairs(colls["rank"].to_numpy())
    keep = np.zeros(len(colls), dtype=bool)
    keep[pairs["at"].to_numpy()[np.isin(pairs["key"].to_numpy(), wanted)]] = True
    return colls[keep].assign(counted_seqs=chains.counted_lists(keep))[COLL_FIELDS]


def op_detail(trace: Trace, rank: int, seq: int) -> dict:
    """What the detail panel shows for op ``seq`` of ``rank``: ``row`` (that call), ``per_rank`` (the same
    call on every rank, a DataFrame in rank order), ``collectives`` (those it caused, every rank),
    ``patch_family`` (a fallback call: its op's entry of ``patch_families``; else None)."""
    rows = explorer_frame(trace)
    hit = rows[(rows["rank"] == rank) & (rows["seq"] == seq)]
    if hit.empty:
        raise KeyError(f"no op with seq {seq} on rank {rank} in this trace")
    row = hit.iloc[0]
    per_rank = rows[rows["key"] == row["key"]].sort_values("rank").reset_index(drop=True)
    coll = _collectives(trace)
    mine = coll[_counted_for(coll, per_rank)] if len(coll) else coll
    family = patch_families(trace).get(row["op"]) if row["kind"] == "fallback" else None
    return {"row": row.to_dict(), "per_rank": per_rank, "collectives": mine.reset_index(drop=True),
            "patch_family": family}


@dataclass(frozen=True)
class CallSample:
    """Which op calls the explorer's payload holds when it cannot hold them all (a big trace, or a rank or time
    window asked for): counts of rows (one call on one rank), each kind with the number of its kind in the rows
    asked for. A call is taken on every rank it ran on, so that its detail shows it on every rank."""

    asked: int  # rows in the trace, or on the rank / in the window asked for
    trace_total: int  # rows in the whole trace
    errors: int
    errors_total: int
    fallbacks: int
    fallbacks_total: int
    slowest: int  # ordinary calls taken for their host time (the slowest first)
    first: int  # ordinary calls taken from the start, in time order
    where: str  # "" or " on rank 2", " starting in 10–20 ms", ...

    @property
    def shown(self) -> int:
        """The rows the payload holds.

        Returns
        -------
        int
            errors + fallbacks + slowest + first.

        Examples
        --------
        >>> CallSample(10, 10, 1, 1, 0, 0, 2, 3, "").shown
        6
        """
        return self.errors + self.fallbacks + self.slowest + self.first

    def sentence(self) -> str:
        """What the page shows and what it leaves out, and how to see the rest, in one sentence.

        Returns
        -------
        str
            The sentence the explorer shows above its list.

        Examples
        --------
        >>> CallSample(100, 100, 1, 1, 0, 0, 2, 3, "").sentence().split(":")[0]
        'this view holds 6 of the 100 op calls (one call on one rank)'
        """
        parts = [f"{self.errors} of the {self.errors_total} that raised" if self.errors < self.errors_total
                 else f"all {self.errors} that raised",
                 f"{self.fallbacks} of the {self.fallbacks_total} DTensor fallbacks"
                 if self.fallbacks < self.fallbacks_total else f"all {self.fallbacks} DTensor fallbacks",
                 f"the {self.slowest} slowest of the others (each call on every rank)",
                 f"the first {self.first} in time"]
        return (f"this view holds {self.shown} of the {self.asked} op calls{self.where} (one call on one rank): "
                + ", ".join(parts) + f"; {self.asked - self.shown} are left out of the list, none of the trace: the op "
                "summary counts every call. To list others: t.show(rank=2, window=(start_ms, end_ms)) (calls starting "
                "in that window, ms since the first event, as the timeline's axis), or t.get_ops() for all of them")


# at most this many rows of a sample in all: a payload of a few MB that a browser parses in well under a second
SAMPLE_ROWS = BIG_ERRORS + BIG_FALLBACKS + BIG_SLOWEST + BIG_FIRST


def _whole_calls(part: pd.DataFrame, order: pd.Index, budget: int) -> pd.Index:
    """The row labels of ``part``'s calls (``key``: one call on every rank) in the order of ``order`` (keys),
    whole calls only, while their rows fit in ``budget``."""
    if budget <= 0 or part.empty:
        return part.index[:0]
    sizes = part.groupby("key", sort=False).size().reindex(order)
    keep = order[(sizes.cumsum() <= budget).to_numpy()]
    if not len(keep):  # one call holds more rows than the budget: its first rows
        return part.index[:budget]
    return part.index[part["key"].isin(keep).to_numpy()]


def sample_calls(calls: pd.DataFrame, trace_total: int, where: str = "") -> tuple[pd.DataFrame, CallSample]:
    """A bounded sample of ``calls`` (rows of ``explorer_frame``, in its order): the first ``BIG_ERRORS``
    rows that raised, the first ``BIG_FALLBACKS`` fallbacks, the ``BIG_SLOWEST`` rows of the slowest
    other calls (by their largest host time on any rank), and the ``BIG_FIRST`` rows of the first other calls
    in time; whole calls (every rank's row) where they fit.

    Parameters
    ----------
    calls : pandas.DataFrame
        Rows of ``explorer_frame`` (errors first, then fallbacks, then time order).
    trace_total : int
        How many rows the whole trace holds (said in the sentence when ``calls`` is a part of them).
    where : str
        Which part of the trace ``calls`` are (" on rank 2"), said in the sentence.

    Returns
    -------
    tuple of (pandas.DataFrame, CallSample)
        The rows kept, in ``calls``' order, and what they are.

    Examples
    --------
    >>> rows, sample = sample_calls(explorer_frame(t), len(explorer_frame(t)))
    >>> sample.shown == len(rows)
    True
    """
    # the choice reads three columns: each mask and drop below moves only those (the wide rows are taken once, at the end)
    chosen_from = calls[["kind", "key", "host_ms"]]
    kind = chosen_from["kind"]
    errors = chosen_from[(kind == "error").to_numpy()]
    fallbacks = chosen_from[(kind == "fallback").to_numpy()]
    others = chosen_from[(kind == "op").to_numpy()]
    keep_errors = errors.index[:BIG_ERRORS]
    keep_fallbacks = fallbacks.index[:BIG_FALLBACKS]
    slowest_keys = others.groupby("key", sort=False)["host_ms"].max().sort_values(ascending=False, kind="stable").index
    keep_slowest = _whole_calls(others, slowest_keys, BIG_SLOWEST)
    rest = others.drop(index=keep_slowest)
    keep_first = _whole_calls(rest, pd.Index(rest["key"].unique()), BIG_FIRST)
    keep = keep_errors.append([keep_fallbacks, keep_slowest, keep_first])
    shown = calls.loc[sorted(keep)] if len(keep) else calls.iloc[:0]
    return shown, CallSample(asked=len(calls), trace_total=trace_total, errors=len(keep_errors),
                             errors_total=len(errors), fallbacks=len(keep_fallbacks), fallbacks_total=len(fallbacks),
                             slowest=len(keep_slowest), first=len(keep_first), where=where)


def _asked_calls(calls: pd.DataFrame, rank: int | None, window: tuple[float, float] | None) -> tuple[pd.DataFrame, str]:
    """The calls on ``rank`` starting in ``window`` (ms since the first event), each with its rows on the other
    ranks when a rank is asked for, and those words (" on rank 2 ...")."""
    where, asked = [], calls
    if rank is not None:
        asked = asked[(asked["rank"] == rank).to_numpy()]
        where.append(f" on rank {rank}")
    if window is not None:
        a, b = window
        asked = asked[((asked["t_start_ms"] >= a) & (asked["t_start_ms"] <= b)).to_numpy()]
        where.append(f" starting in {a:g}–{b:g} ms")
    if rank is not None:  # each call on the other ranks too: its detail shows it on every rank
        asked = calls[calls["key"].isin(set(asked["key"])).to_numpy()]
        where.append(" (with the same calls on the other ranks)")
    return asked, "".join(where)


def _check_part(trace: Trace, rank, window) -> None:
    """Refuse a rank the trace does not hold or a window that is not (start_ms, end_ms), before any work."""
    if rank is not None and rank not in set(int(r) for r in trace.ranks):
        raise ValueError(f"rank {rank!r} is not in this trace (its ranks: {list(trace.ranks)})")
    if window is not None:
        ok = isinstance(window, (tuple, list)) and len(window) == 2 and all(
            isinstance(v, (int, float)) and not isinstance(v, bool) for v in window) and window[0] <= window[1]
        if not ok:
            raise ValueError(f"window must be (start_ms, end_ms) with start_ms <= end_ms (ms since the first event, "
                             f"as the timeline's axis), not {window!r}")


def explorer_data(trace: Trace, max_rows: int | None = None, *, rank: int | None = None,
                  window: tuple[float, float] | None = None) -> dict:
    """Everything the explorer front end needs, JSON-able: the op summary it opens on (``summary``, see
    ``op_summary``), rows (column-wise fields + row arrays), collectives, the filter choices, and how many
    rows were left out. ``max_rows`` (an int): the first rows in the explorer's order (errors and fallbacks first,
    the rest in time order). By default (None): every row up to ``DEFAULT_MAX_ROWS`` for a trace of up to
    ``BIG_TRACE_ABOVE`` op calls; above, or with ``rank`` / ``window`` (ms since the first event: calls starting
    in it), a bounded sample (``sample_calls``) unless the calls asked for fit in ``SAMPLE_ROWS``, with only the
    collectives the rows shipped count, and ``sample`` (its counts) and ``left_out_text`` (what is left out and
    how to see it). The summary always covers every call."""
    _check_part(trace, rank, window)
    return _data(trace, _tables(trace), max_rows, rank=rank, window=window)


def _data(trace: Trace, tables: _Tables, max_rows: int | None, rank: int | None = None,
          window: tuple[float, float] | None = None) -> dict:
    rows = tables.calls
    total = len(rows)
    sample, where = None, ""
    if max_rows is not None:
        shown = rows.iloc[:max_rows]
    elif rank is None and window is None and total <= BIG_TRACE_ABOVE:
        shown = rows.iloc[:DEFAULT_MAX_ROWS]
    else:
        asked, where = _asked_calls(rows, rank, window)
        shown = asked
        if len(asked) > SAMPLE_ROWS:
            shown, sample = sample_calls(asked, total, where)
    bounded = max_rows is None and (sample is not None or rank is not None or window is not None or total > BIG_TRACE_ABOVE)
    if bounded:  # only the collectives the shipped calls count (what their details list)
        coll = _collectives_counted_by(trace, shown)
    else:
        coll = _collectives(trace)
    shown = shown[ROW_FIELDS]
    strings: list[str] = []
    index: dict[str, int] = {}
    coded = set(ROW_FIELDS.index(f) for f in TABLE_FIELDS)
    as_json = set(ROW_FIELDS.index(f) for f in JSON_FIELDS)

    def code(v):
        if not isinstance(v, str):
            return None
        i = index.get(v)
        if i is None:
            i = index[v] = len(strings)
            strings.append(v)
        return i

    out_rows = []
    for r in shown.itertuples(index=False, name=None):
        out_rows.append([code(v) if i in coded else
                         code(json.dumps(json_value(v), separators=(",", ":"))) if i in as_json and v is not None else
                         json_value(v) for i, v in enumerate(r)])
    return {
        "fields": ROW_FIELDS, "coded": sorted(TABLE_FIELDS), "json_coded": sorted(JSON_FIELDS), "strings": strings, "rows": out_rows,
        "total": total, "left_out": total - len(shown),
        # a bounded payload: what it holds and how to see the rest (None: the list holds every call, or the first
        # max_rows as asked)
        "sample": None if sample is None else {**sample.__dict__, "shown": sample.shown},
        "initial_rank": rank,  # the rank asked for: the list opens filtered to it
        "left_out_text": sample.sentence() if sample is not None else
        (f"this view lists the {len(shown)} op calls{where}" + (
            f"; the other {total - len(shown)} of the trace are left out of the list (the op summary counts every "
            "call)" if len(shown) < total else "") + ": t.show() for the whole trace"
         if rank is not None or window is not None else None),
        "coll_fields": COLL_FIELDS,
        "collectives": [[json_value(v) for v in r] for r in coll.itertuples(index=False, name=None)],
        "has_collectives": trace.collectives_recorded,
        "ranks": [int(r) for r in trace.ranks],
        "paths": sorted(set(rows["path"].unique())), "phases": sorted(set(rows["phase"].unique())),
        "path_colors": PATH_COLORS,
        "counts": {k: int((rows["kind"] == k).sum()) for k in ("error", "fallback", "op")},
        "incomplete_ranks": [int(r) for r in trace.incomplete_ranks],
        "dropped": int(trace.dropped),
        "headline": trace.overview.headline(),
        "findings": [f.as_dict() for f in trace.findings],
        "severity_marks": SEVERITY_MARKS,
        "category_titles": FINDING_CATEGORY_TITLES,
        "summary": _summary_rows(tables, BIG_GROUPS if bounded else None),
        "list_columns": [list(c) for c in LIST_COLUMNS],
        "summary_columns": [list(c) for c in SUMMARY_LIST_COLUMNS],
        "group_columns": [list(c) for c in GROUP_LIST_COLUMNS],
        "flexible_min_px": FLEXIBLE_MIN_PX,
        "patch_families": patch_families(trace),
    }


def patch_families(trace: Trace) -> dict[str, dict]:
    """Per op that fell back, the patch family ``get_fallbacks()`` reads for it: ``family``, ``halo_width``
    (None unless known), ``closest_patch``, ``evidence`` and ``fallback_collectives``; what a fallback call's
    detail shows."""
    fb = trace.get_fallbacks()
    keys = ("family", "halo_width", "closest_patch", "evidence", "fallback_collectives")
    return {r["op"]: {k: json_value(r[k]) for k in keys} for r in fb.to_dict("records")}


def _summary_rows(tables: _Tables, max_groups: int | None = None) -> list[dict]:
    """The summary rows, each with its call groups (the first ``max_groups``; ``more_groups``: how many more)."""
    groups = tables.groups
    more = groups.groupby("summary_row").size() if len(groups) else pd.Series(dtype="int64")
    if max_groups is not None and len(groups):
        groups = groups[(groups.groupby("summary_row").cumcount() < max_groups).to_numpy()]
    by_row: dict[int, list[dict]] = {}
    for g in groups.to_dict("records"):
        by_row.setdefault(g["summary_row"], []).append({k: json_value(v) for k, v in g.items() if k != "summary_row"})
    return [{**{k: json_value(v) for k, v in r.items()}, "ranks_text": ranks_text(r["ranks"]), "groups": by_row.get(i, []),
             **({"more_groups": int(more.get(i, 0)) - len(by_row.get(i, []))} if max_groups is not None else {})}
            for i, r in enumerate(tables.summary.to_dict("records"))]


def op_summary(trace: Trace) -> list[dict]:
    """The op summary the explorer opens on, JSON-able (``explorer_data`` passes it to the front end as
    ``summary``): one dict per row of ``summary_frame`` (every column of ``Trace.get_op_summary()``,
    ``kind``, ``ranks_text``), each with ``groups``: the rows it expands to (``call_groups``, identical
    calls on several ranks as one "ranks 0-3"), in order."""
    return _summary_rows(_tables(trace))


def explorer_summary(trace: Trace) -> dict:
    """What the explorer's header says, as data: the trace's overview (``Trace.overview``: ranks, op calls,
    errors, fallbacks, collectives, ..., and its ``headline``) and its findings (``Trace.findings``, each as
    ``Finding.as_dict()``, in their order)."""
    return {**trace.overview.as_dict(), "findings": [f.as_dict() for f in trace.findings]}


def _ms(v) -> str:
    return "—" if is_missing(v) else f"{float(v):.3f}"


def _ms_range(lo, hi) -> str:
    """One time, or the range of a group's times ("9.599–10.157")."""
    return _ms(lo) if is_missing(lo) or _ms(lo) == _ms(hi) else f"{_ms(lo)}–{_ms(hi)}"


def _shapes(shapes) -> str:
    return "—" if is_missing(shapes) or not shapes else ", ".join(format_shape(s) for s in shapes)


def _source(user_frame) -> str:
    """A user frame's file name and line ("model.py:12 in forward"), without its folders."""
    return user_frame.split("/")[-1] if isinstance(user_frame, str) else ""


def _group_text(g) -> str:
    """One call group in words: ranks, calls, inputs -> output, placements, host time, error, where."""
    parts = [g["ranks_text"], f"{g['calls']} call{'s' if g['calls'] != 1 else ''}",
             f"in {_shapes(g['in_local_shapes'])} -> out {format_shape(g['out_local_shape'])}"]
    if isinstance(g["placements"], str):
        parts.append(g["placements"])
    parts.append(f"host {_ms_range(g['host_ms_min'], g['host_ms_max'])} ms")
    if isinstance(g["error"], str):  # an error that is not the group's kind: the cell caught it
        parts.append(f"raised {g['error'].splitlines()[0]}" + ("" if g["kind"] == "error" else " (handled)"))
    if g["in_flight"] is True:
        parts.append("still running")
    if isinstance(g["spec_mismatch"], str):
        parts.append(f"spec mismatch: {g['spec_mismatch']}")
    if isinstance(g["location"], str):
        parts.append(g["location"])
    return " · ".join(parts)


def _summary_text(tables: _Tables, max_rows: int = TEXT_SUMMARY_ROWS, max_groups: int = STATIC_GROUPS) -> list[str]:
    summary = tables.summary
    if summary.empty:
        return ["  op summary: no op calls"]
    lines = [f"  op summary ({len(summary)} rows, one per op, path and phase; errors and fallbacks first; "
             "under each its calls, identical ones on several ranks as one line):",
             "    (host ms: the calls' host time, all ranks; comm in host: collectives within it; bwd comm other "
             "nodes: a backward row's collectives of the op's other autograd nodes, outside host ms, waits for the "
             "other ranks included)",
             f"    {'':10} {'op':28} {'path':26} {'phase':8} {'calls':>5} {'ranks':8} {'first ms':>9} "
             f"{'steady ms':>9} {'host ms':>9} {'comm in host':>12} {'bwd comm other nodes':>20}"]
    groups = {k: g for k, g in tables.groups.groupby("summary_row", sort=False)} if len(tables.groups) else {}
    for i, r in enumerate(summary.head(max_rows).itertuples(index=False)):
        lines.append(f"    {_flag(r.kind, None):10} {r.op:28} {r.path:26} {r.phase:8} {r.calls:>5} "
                     f"{ranks_text(r.ranks).split(' ', 1)[1]:8} {_ms(r.first_ms_median):>9} {_ms(r.steady_ms_median):>9} "
                     f"{_ms(r.host_ms_total):>9} {_ms(r.comm_ms_within_host):>12} {_ms(r.comm_ms_outside_host):>20}"
                     + (f"  {r.errors} raised" if r.errors else "") + ("  dispatch-bound" if r.dispatch_bound else "")
                     + (f"  {r.spec_mismatches} spec mismatch(es)" if r.spec_mismatches else ""))
        g = groups.get(i)
        for gr in ([] if g is None else g.head(max_groups).to_dict("records")):
            lines.append(f"{'':15}{_group_text(gr)}")
        if g is not None and len(g) > max_groups:
            lines.append(f"{'':15}… {len(g) - max_groups} more")
    if len(summary) > max_rows:
        lines.append(f"    … {len(summary) - max_rows} more rows (t.get_op_summary() has them all)")
    return lines


def explorer_text(trace: Trace) -> str:
    """The explorer in words: what was recorded (``Trace.overview``'s headline), what is wrong (``Trace.findings``,
    in their order, each with its mark and its category), and the op summary, each row with its calls (identical ones on several
    ranks as one line)."""
    return _text(trace, _tables(trace))


def _text(trace: Trace, tables: _Tables) -> str:
    lines = [f"Trace explorer: {trace.overview.headline()}"]
    lines += [f"  {SEVERITY_MARKS[f.severity]} {FINDING_CATEGORY_TITLES[f.category]}: {f.text()}"
              for f in trace.findings]
    lines += _summary_text(tables)
    lines.append("  (live: filters and each call on every rank, in the widget or t.to_html(path))")
    return "\n".join(lines)


def _flag(kind: str, in_flight) -> str:
    return "✖ error" if kind == "error" else "⚠ fallback" if kind == "fallback" else "⏳ running" if in_flight is True else ""


def _spec_count(n) -> str | None:
    return f"{int(n)} call(s) made a result whose spec disagrees with its local tensor" if n else None


def _text_or_none(v) -> str | None:
    return v if isinstance(v, str) else None


def _summary_cells(tables: _Tables, max_rows: int, max_groups: int = STATIC_GROUPS) -> list[dict]:
    """The op summary's first ``max_rows`` rows as the static rendering writes them, each with its first
    ``max_groups`` call groups and how many more there are."""
    groups = {k: g for k, g in tables.groups.groupby("summary_row", sort=False)} if len(tables.groups) else {}
    rows = []
    for i, r in enumerate(tables.summary.head(max_rows).itertuples(index=False)):
        g = groups.get(i)
        shown = [] if g is None else g.head(max_groups).to_dict("records")
        rows.append({
            "kind": r.kind, "flag": _flag(r.kind, None), "op": r.op, "path": r.path, "path_color": path_color(r.path),
            "spec": _spec_count(r.spec_mismatches), "phase": r.phase, "calls": int(r.calls),
            "ranks": ranks_text(r.ranks).split(" ", 1)[1], "first_ms": _ms(r.first_ms_median),
            "steady_ms": _ms(r.steady_ms_median), "host_ms": _ms(r.host_ms_total), "comm_ms_in_host": _ms(r.comm_ms_within_host),
            "comm_ms_other_nodes": _ms(r.comm_ms_outside_host),
            "dispatch": "bound" if r.dispatch_bound else "", "locations": "\n".join(r.locations),
            "where": r.locations[0] if r.locations else "",
            "groups": [{"kind": gr["kind"], "flag": _flag(gr["kind"], gr["in_flight"]), "ranks_text": gr["ranks_text"],
                        "calls": int(gr["calls"]), "inputs": _shapes(gr["in_local_shapes"]),
                        "output": format_shape(gr["out_local_shape"]),
                        "placements": gr["placements"] if isinstance(gr["placements"], str) else "",
                        "host_ms": _ms_range(gr["host_ms_min"], gr["host_ms_max"]), "location": gr["location"]}
                       for gr in shown],
            "more_groups": 0 if g is None else max(len(g) - max_groups, 0)})
    return rows


def _call_cells(calls: pd.DataFrame, max_rows: int) -> list[dict]:
    """The first ``max_rows`` op calls (the explorer's order) as the static rendering writes them."""
    return [{"kind": r.kind, "flag": _flag(r.kind, r.in_flight), "rank": int(r.rank), "seq": int(r.seq), "op": r.op,
             "path": r.path, "path_color": path_color(r.path), "spec": _text_or_none(r.spec_mismatch),
             "phase": r.phase, "module": r.module if isinstance(r.module, str) else "",
             "output": format_shape(r.out_local_shape), "host_ms": _ms(r.host_ms), "source": _source(r.user_frame)}
            for r in calls.iloc[:max_rows].itertuples(index=False)]


def explorer_html(trace: Trace, max_rows: int = STATIC_ROWS) -> str:
    """The explorer as static HTML (no script): the header, the op summary (each row with its calls on each
    rank, identical ones as one row "ranks 0-3"), the errors, the fallbacks, and the first ``max_rows`` op
    calls in the explorer's order (errors, fallbacks, then time)."""
    return _html(trace, _tables(trace), max_rows)


def _html(trace: Trace, tables: _Tables, max_rows: int) -> str:
    fallback_columns, fallback_rows = fallback_table(trace)
    return render("explorer.html", facts=explorer_summary(trace), marks=SEVERITY_MARKS,
                  categories=FINDING_CATEGORY_TITLES, max_rows=max_rows,
                  summary_total=len(tables.summary), summary_rows=_summary_cells(tables, max_rows),
                  calls_total=len(tables.calls), calls=_call_cells(tables.calls, max_rows),
                  errors=error_entries(trace), fallback_columns=fallback_columns, fallback_rows=fallback_rows,
                  summary_columns=SUMMARY_LIST_COLUMNS, group_columns=GROUP_LIST_COLUMNS, list_columns=LIST_COLUMNS,
                  path_px=(path_px := path_column_px(set(tables.calls["path"]))),
                  summary_min_px=table_min_width(SUMMARY_LIST_COLUMNS, path_px),
                  list_min_px=table_min_width(LIST_COLUMNS, path_px))


def decode_rows(data: dict) -> list[dict]:
    """``explorer_data``'s rows back as dicts (what the front end reconstructs)."""
    coded, as_json, s = set(data["coded"]), set(data["json_coded"]), data["strings"]

    def one(f, v):
        if v is None:
            return None
        return s[v] if f in coded else json.loads(s[v]) if f in as_json else v

    return [{f: one(f, v) for f, v in zip(data["fields"], r)} for r in data["rows"]]


class TraceExplorer(anywidget.AnyWidget):
    """The trace explorer widget. ``selected`` (synced): [rank, seq] of the op whose detail is open."""

    _esm = static("explorer.js")
    _css = static("style.css")
    data = traitlets.Dict().tag(sync=True)
    selected = traitlets.List([]).tag(sync=True)

    def __init__(self, trace: Trace, max_rows: int | None = None, *, rank: int | None = None,
                 window: tuple[float, float] | None = None, **kwargs):
        _check_part(trace, rank, window)
        tables = _tables(trace)  # the widget's data, its text, its static rendering and its details read these
        super().__init__(data=_data(trace, tables, max_rows, rank=rank, window=window), **kwargs)
        self.trace = trace
        self._tables = tables

    def detail(self) -> dict | None:
        """``op_detail`` of the op selected in the browser (None before a click)."""
        return op_detail(self.trace, *self.selected) if self.selected else None

    def text(self) -> str:
        """The explorer in words (``explorer_text``): what ``str(widget)`` and a terminal show."""
        return _text(self.trace, self._tables)

    def __repr__(self) -> str:
        return self.text()

    def _repr_mimebundle_(self, **kwargs):
        """The live widget, a static rendering, the text and the trace (see ``sharddbg.views.bundle``)."""
        payload = view_payload("explorer", self.trace.to_dict(), explorer_summary(self.trace),
                               "t.save('run.sdtrace.json')", drawn=self.data)
        return output_bundle(super()._repr_mimebundle_(**kwargs), html=_html(self.trace, self._tables, STATIC_ROWS),
                             text=self.text(), payload=payload)
