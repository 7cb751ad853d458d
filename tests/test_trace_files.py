"""Trace files that contradict themselves are refused with the field named; every writer goes through a
fresh temp file. No cluster: each bad file is the golden trace (a real 4-rank recording, tests/data) with
one thing corrupted.
"""

from __future__ import annotations

import errno
import json
import os
import threading
import re
import stat
from pathlib import Path

import pandas as pd
import pyarrow as pa
import pytest

from sharddbg import columnar, schema

from sharddbg.errors import ShardDbgWarning, TraceFileError
from sharddbg.trace import MAX_ABS_INT, MAX_NESTING, Trace, load_trace, write_file_atomically

GOLDEN = Path(__file__).parent / "data" / "conv4.sdtrace.json"
NAME = "run.sdtrace.json"
COLUMNAR_NAME = "run.sdtrace.arrow"


def golden() -> dict:
    return json.loads(GOLDEN.read_text())


def content(d: dict) -> dict:
    """A trace file's content, without the header's schema_version (a file is written with the writer's)."""
    return {k: v for k, v in d.items() if k != "schema_version"}


def first_op(d: dict, payload: int) -> tuple[int, dict]:
    """(index, event) of the first op record of a payload."""
    return next((i, e) for i, e in enumerate(d["payloads"][payload]["events"]) if e["kind"] == "op")


def nested(depth: int, leaf=1):
    for _ in range(depth):
        leaf = [leaf]
    return leaf


# ---- one corruption per case: (change to the parsed file, what the message must say) -------------------
def _duplicate_rank(d):
    d["ranks"][1] = 0
    d["payloads"][1]["rank"] = 0


def _payload_says_other_rank(d):
    d["payloads"][2]["rank"] = 3


def _negative_dropped(d):
    d["payloads"][1]["dropped"] = -5


def _negative_file_schema_version(d):
    d["schema_version"] = -1


def _negative_payload_schema_version(d):
    d["payloads"][3]["schema_version"] = -2


def _payload_schema_newer_than_file(d):
    d["schema_version"] = 1
    for p in d["payloads"]:  # a version-1 file whose last payload claims version 2
        p["events"] = [e for e in p["events"] if e["kind"] != "collective"]
        p["schema_version"] = 1
    d["payloads"][3]["schema_version"] = 2


def _huge_time(d):
    i, ev = first_op(d, 1)
    ev["t_start_ns"] = 2**63  # one past int64
    return i


def _huge_shape_entry(d):
    i, ev = first_op(d, 0)
    ev["in_local_shapes"][0][2] = 10**30
    return i


def _huge_clock_offset(d):
    d["clock_offsets_ns"]["2"] = -(2**64)


def _huge_payload_clock(d):
    d["payloads"][0]["clock"]["t_start_ns"] = MAX_ABS_INT + 1


def _deep_event_field(d):
    i, ev = first_op(d, 0)
    ev["in_local_shapes"] = nested(MAX_NESTING + 10)
    return i


def _deep_meta(d):
    d["meta"]["notes"] = nested(MAX_NESTING - 1, "x")  # one level past the bound (see the valid case)


def _world_size_too_small(d):
    d["payloads"][3]["world_size"] = 3


def _world_sizes_disagree(d):
    d["payloads"][0]["world_size"] = 8
    d["payloads"][1]["world_size"] = 8  # payloads 0 and 1 say 8, payload 2 says 4


def _negative_rank(d):
    d["ranks"][0] = -1
    d["payloads"][0]["rank"] = -1


def _ranks_and_payloads_differ_in_length(d):
    d["ranks"].append(4)


def _offset_of_unknown_rank(d):
    d["clock_offsets_ns"]["7"] = 0


def _offset_missing(d):
    del d["clock_offsets_ns"]["2"]


def _offset_not_int(d):
    d["clock_offsets_ns"]["1"] = 1.5


def _incomplete_unknown_rank(d):
    d["incomplete_ranks"] = [9]


def _null_payload_not_incomplete(d):
    d["payloads"][2] = None


def _unfinished_payload_not_incomplete(d):
    d["payloads"][1]["complete"] = False


def _bool_version(d):
    d["version"] = True


def _meta_not_object(d):
    d["meta"] = ["code"]


def _meta_code_not_text(d):
    d["meta"]["code"] = 42


def _meta_reason_of_no_rank(d):
    d["meta"]["incomplete_reasons"] = {"two": "did not finish"}


def _meta_mesh_without_domain(d):
    d["meta"]["mesh"] = {"ddp": 1}


def _meta_replica_difference_without_key(d):
    d["meta"]["replica_differences"] = [{"group_ranks": [0, 1], "reference_rank": 0, "by_rank": {}, "note": None}]


def _payload_meta_comm_not_bool(d):
    d["payloads"][2]["meta"]["comm"] = "yes"


CORRUPTIONS = [
    (_duplicate_rank, r'"ranks" lists rank 0 twice \("ranks"\[0\] and "ranks"\[1\]\)'),
    (_payload_says_other_rank, r'payload 2 says rank 3 but "ranks"\[2\] is 2'),
    (_negative_dropped, r'payload 1 \(rank 1\) field "dropped" = -5 is negative'),
    (_negative_file_schema_version, r'field "schema_version" = -1 is not a schema version'),
    (_negative_payload_schema_version, r"payload 3: payload schema_version -2 is not supported"),
    (_payload_schema_newer_than_file,
     r'payload 3 \(rank 3\) has schema_version 2, newer than the file\'s "schema_version" 1'),
    (_huge_time, r'payload 1 \(rank 1\) event #{i} field "t_start_ns" = 9223372036854775808 is out of range'),
    (_huge_shape_entry,
     r'payload 0 \(rank 0\) event #{i} field "in_local_shapes"\[0\]\[2\] = 10{{30}} is out of range'),
    (_huge_clock_offset, r'field "clock_offsets_ns"\["2"\] = -18446744073709551616 is out of range'),
    (_huge_payload_clock, r'payload 0 \(rank 0\) field "clock"\["t_start_ns"\] = 2305843009213693953 is out of range'),
    (_deep_event_field, (r'payload 0 \(rank 0\) event #{i} field "in_local_shapes"(\[0\])+\.\.\. \(\d+ levels more\) '
                         r'nests deeper than 64 levels')),
    (_deep_meta, r'field "meta"\["notes"\](\[0\])+.* nests deeper than 64 levels'),
    (_world_size_too_small, r'payload 3 \(rank 3\) field "world_size" = 3 does not hold rank 3'),
    (_world_sizes_disagree, r'payload 2 says "world_size" 4 but payload 0 says 8'),
    (_negative_rank, r'field "ranks" = \[-1, 1, 2, 3\] must be a list of ranks'),
    (_ranks_and_payloads_differ_in_length, r'"ranks" lists 5 ranks but "payloads" holds 4'),
    (_offset_of_unknown_rank, r'field "clock_offsets_ns" has an entry \'7\' that is not a rank'),
    (_offset_missing, r'field "clock_offsets_ns" has no offset for rank 2$'),
    (_offset_not_int, r'field "clock_offsets_ns"\["1"\] = 1.5 is not an integer'),
    (_incomplete_unknown_rank, r'field "incomplete_ranks" = \[9\] must list ranks of "ranks"'),
    (_null_payload_not_incomplete, r'payload 2 \(rank 2\) is null .* "incomplete_ranks" \[\] does not list rank 2'),
    (_unfinished_payload_not_incomplete, (r'payload 1 \(rank 1\) says "complete": false but "incomplete_ranks" \[\] '
                                          r"does not list rank 1")),
    (_bool_version, r"missing or invalid version field \(True\)"),
    (_meta_not_object, r'field "meta" must be an object'),
    (_meta_code_not_text, r"field \"meta\": trace meta: field 'code' = 42 has type int"),
    (_meta_reason_of_no_rank, r"trace meta incomplete_reasons: 'two': 'did not finish' is not a rank"),
    (_meta_mesh_without_domain, r"trace meta mesh: \{{'ddp': 1\}} is not"),
    (_meta_replica_difference_without_key, r"trace meta replica_differences #0: missing field\(s\) \['key'\]"),
    (_payload_meta_comm_not_bool, r"payload 2: payload of rank 2 meta: field 'comm' = 'yes' has type str"),
]


@pytest.mark.parametrize("corrupt, match", CORRUPTIONS, ids=[c.__name__.strip("_") for c, _ in CORRUPTIONS])
def test_self_contradicting_file_is_refused_naming_the_field(tmp_path, corrupt, match):
    d = golden()
    event_index = corrupt(d)
    path = tmp_path / NAME
    path.write_text(json.dumps(d))
    with pytest.raises(TraceFileError) as info:
        load_trace(path)
    message = str(info.value)
    assert message.startswith(f"{path}: "), message
    assert re.search(match.format(i=event_index), message), message


@pytest.mark.parametrize("corrupt, match", CORRUPTIONS, ids=[c.__name__.strip("_") for c, _ in CORRUPTIONS])
def test_self_contradicting_columnar_file_is_refused_naming_the_field(tmp_path, corrupt, match):
    """The same corruptions in a columnar file give the same message; the one a typed column cannot hold (a time
    beyond int64) is refused by the writer itself: a column's type is checked on reading."""
    d = golden()
    event_index = corrupt(d)
    path = tmp_path / COLUMNAR_NAME
    if corrupt.__name__.strip("_") == "huge_time":
        with pytest.raises((pa.ArrowException, OverflowError)):
            write_columnar(d, path)
        return
    write_columnar(d, path)
    with pytest.raises(TraceFileError) as info:
        load_trace(path)
    message = str(info.value)
    assert message.startswith(f"{path}: "), message
    assert re.search(match.format(i=event_index), message), message


def write_columnar(d: dict, path) -> None:
    with open(path, "wb") as f:
        columnar.write_document(d, f)


def _columnar_table():
    """The golden trace's columnar file, read as a pyarrow table."""
    sink = pa.BufferOutputStream()
    columnar.write_document(golden(), sink)
    return pa.ipc.open_file(pa.BufferReader(sink.getvalue())).read_all()


def _write_table(table, path) -> None:
    with pa.ipc.new_file(str(path), table.schema) as writer:
        writer.write_table(table)


def _set_header(table, **changes):
    header = json.loads(table.schema.metadata[b"sharddbg"])
    header.update(changes)
    return table.replace_schema_metadata({b"sharddbg": json.dumps(header).encode()})


def _set_cell(table, column: str, row: int, value, type_=None):
    values = table.column(column).to_pylist()
    values[row] = value
    i = table.column_names.index(column)
    return table.set_column(i, table.schema.field(i).with_type(type_ or table.schema.field(i).type),
                            pa.array(values, type=type_ or table.schema.field(i).type))


def _first_op_row(table) -> int:
    return table.column("kind").to_pylist().index("op")


COLUMNAR_CORRUPTIONS = {
    "truncated": (lambda t, path: path.write_bytes(_bytes_of(t)[: len(_bytes_of(t)) // 2]),
                  r"corrupt sharddbg trace \(columnar file\): not a readable Arrow IPC file .*corrupt or truncated"),
    "magic_then_garbage": (lambda t, path: path.write_bytes(b"ARROW1\0\0" + b"x" * 100),
                           r"not a readable Arrow IPC file"),
    "no_header": (lambda t, path: _write_table(t.replace_schema_metadata({}), path),
                  r"an Arrow file without the sharddbg header .*not a sharddbg trace"),
    "header_not_json": (lambda t, path: _write_table(t.replace_schema_metadata({b"sharddbg": b"{x"}), path),
                        r"its sharddbg header is not valid JSON"),
    "other_layout": (lambda t, path: _write_table(_set_header(t, layout="rows"), path),
                     r'"layout" \'rows\', not "columnar"'),
    "newer_columns": (lambda t, path: _write_table(_set_header(t, columns=99), path),
                      r"columns are of version 99, written by a newer sharddbg.*upgrade sharddbg"),
    "newer_schema": (lambda t, path: _write_table(_set_header(t, schema_version=99), path),
                     r"its events use schema version 99; this sharddbg reads up to .*upgrade sharddbg"),
    "newer_file_version": (lambda t, path: _write_table(_set_header(t, version=99), path),
                           r"trace file version 99 was written by a newer sharddbg"),
    "no_format": (lambda t, path: _write_table(_set_header(t, format="other"), path),
                  r'not a sharddbg trace \(no "format": "sharddbg.trace" field\)'),
    "missing_column": (lambda t, path: _write_table(t.drop_columns(["host_ms"]), path),
                       r"column 'host_ms' is missing"),
    "column_twice": (lambda t, path: _write_table(t.append_column(pa.field("seq", pa.int64()), t.column("seq")), path),
                     r"column 'seq' appears more than once"),
    "wrong_column_type": (lambda t, path: _write_table(t.set_column(
                              t.column_names.index("seq"), pa.field("seq", pa.large_string()),
                              pa.array([str(v) for v in t.column("seq").to_pylist()], pa.large_string())), path),
                          r"column 'seq' is of type large_string, expected int64"),
    "rank_not_listed": (lambda t, path: _write_table(_set_cell(t, "rank", 0, 7), path),
                        r'column "rank" holds rank 7, which "ranks" \[0, 1, 2, 3\] does not list'),
    "records_of_a_null_payload": (lambda t, path: _write_table(_set_header(
                                      t, payloads=[None] + json.loads(t.schema.metadata[b"sharddbg"])["payloads"][1:],
                                      incomplete_ranks=[0]), path),
                                  r"rank 0 has no payload \(null\) but \d+ records"),
    "json_column_not_json": (lambda t, path: _write_table(_set_cell(t, "in_local_shapes", _first_op_row(t), "[1,"),
                                                          path),
                             r"column 'in_local_shapes' holds '\[1,', not JSON"),
    "not_a_number": (lambda t, path: _write_table(_set_cell(t, "host_ms", _first_op_row(t), float("nan")), path),
                     r'payload 0 \(rank 0\) event #0 field "host_ms" = nan is not a finite number'),
    "huge_integer": (lambda t, path: _write_table(_set_cell(t, "t_start_ns", _first_op_row(t), 2**62), path),
                     r'payload 0 \(rank 0\) event #0 field "t_start_ns" = 4611686018427387904 is out of range'),
    "event_missing_its_kind_field": (lambda t, path: _write_table(_set_cell(t, "op", _first_op_row(t), None), path),
                                     r"payload 0: rank 0 event #0 \(op seq 0\): field 'op' = None has type NoneType"),
    "unknown_path": (lambda t, path: _write_table(_set_cell(t, "path", _first_op_row(t), "nowhere"), path),
                     r"payload 0: rank 0 event #0: unknown path 'nowhere'"),
    "shape_not_a_list": (lambda t, path: _write_table(_set_cell(t, "in_local_shapes", _first_op_row(t), '"x"'), path),
                         r"payload 0: rank 0 event #0 \(op seq 0\): field 'in_local_shapes' = 'x' has type str"),
    "error_missing_its_message": (
        lambda t, path: _write_table(_set_cell(t, "error", _first_op_row(t), '{"exc_type":"E"}'), path),
        r"payload 0: rank 0 event #0 error: missing field\(s\) \['message'"),
}


def _bytes_of(table) -> bytes:
    sink = pa.BufferOutputStream()
    with pa.ipc.new_file(sink, table.schema) as writer:
        writer.write_table(table)
    return sink.getvalue().to_pybytes()


@pytest.mark.parametrize("case", list(COLUMNAR_CORRUPTIONS))
def test_corrupt_columnar_file_is_refused_naming_the_cause(tmp_path, case):
    corrupt, match = COLUMNAR_CORRUPTIONS[case]
    path = tmp_path / COLUMNAR_NAME
    corrupt(_columnar_table(), path)
    with pytest.raises(TraceFileError) as info:
        load_trace(path)
    message = str(info.value)
    assert message.startswith(f"{path}: "), message
    assert re.search(match, message), message


TABLES = ("get_ops", "get_collectives", "get_op_summary", "get_comm_by_op", "get_errors", "get_cell_errors",
          "get_fallbacks", "get_replica_digests", "get_preflight", "get_findings")


def test_columnar_trace_keeps_its_columns_and_makes_records_only_when_asked(tmp_path):
    """A trace saved as .sdtrace.arrow and loaded holds its records as columns: its header is the JSON trace's,
    its tables (the op summary, communication per op, findings, ...) too, without a dict made per record;
    ``events(rank)`` makes that rank's records, the same as the file's (as this schema reads them); saved again as
    columns or as JSON it reads back the same."""
    t = load_trace(GOLDEN)
    t2 = load_trace(t.save(tmp_path / COLUMNAR_NAME))
    assert (tmp_path / COLUMNAR_NAME).read_bytes().startswith(b"ARROW1")
    d, d2 = t.to_dict(), t2.to_dict()
    assert {k: v for k, v in d.items() if k != "payloads"} == {k: v for k, v in d2.items() if k != "payloads"}
    for p, p2 in zip(d["payloads"], d2["payloads"]):
        assert {k: v for k, v in p.items() if k != "events"} == {k: v for k, v in p2.items() if k != "events"}
    held = [t2.payloads[r]["events"] for r in t2.ranks]
    assert all(isinstance(events, columnar.LazyRecords) for events in held)
    assert [len(events) for events in held] == [len(t.events(r)) for r in t.ranks]
    for table in TABLES:
        pd.testing.assert_frame_equal(getattr(t, table)(), getattr(t2, table)(), obj=table)
    assert not any(events.made for events in held), "a table made a dict per record"
    again = load_trace(t2.save(tmp_path / "again.sdtrace.arrow"))
    as_json = load_trace(t2.save(tmp_path / "again.sdtrace.json"))
    assert not any(events.made for events in held), "saving as columns made a dict per record"
    assert t2.events(0) == schema.current_events(t.payloads[0])
    assert held[0].made and not held[1].made, "events(rank) makes that rank's records only"
    for r in t.ranks:
        assert t2.events(r) == schema.current_events(t.payloads[r]) == again.events(r) == as_json.events(r)
    pd.testing.assert_frame_equal(t.get_op_summary(), again.get_op_summary())


def test_summary_and_comm_by_op_on_whole_columns_are_the_tables_of_the_call_by_call_sums(monkeypatch):
    """The op summary and the communication per op, worked out on whole columns (what a big trace gets), are the
    tables the call-by-call sums give (what a small one gets), on the golden trace and on its ops without
    collectives."""
    from sharddbg.analysis import comm as comm_analysis
    from sharddbg.analysis import summary

    t = load_trace(GOLDEN)
    ops, colls = t.get_ops(), t.get_collectives()
    assert len(ops) + len(colls) < comm_analysis._ROWS_BY_COLUMNS  # the golden trace takes the call-by-call sums
    for o, c in ((ops, colls), (ops, colls.iloc[0:0])):
        for nested in (False, True):
            pd.testing.assert_frame_equal(summary.op_summary_by_columns(o, c, nested),
                                          summary.op_summary_by_call(o, c, nested), check_dtype=len(c) > 0)
        pd.testing.assert_frame_equal(comm_analysis.comm_by_op_by_columns(c, o), comm_analysis.comm_by_op(c, o),
                                      check_dtype=len(c) > 0)
    # calls keyed by three columns where a seq is too large for the one-integer key
    monkeypatch.setattr(summary, "_keys_fit", lambda ops, colls: False)
    pd.testing.assert_frame_equal(summary.op_summary_by_columns(ops, colls, True),
                                  summary.op_summary_by_call(ops, colls, True))


def test_columnar_file_of_columns_version_1_still_loads(tmp_path):
    """A file of the first columns version (text in plain large_string columns, not dictionary-encoded) loads,
    as columns, to the same trace."""
    t = load_trace(GOLDEN)
    table = _columnar_table()
    for i, field in enumerate(table.schema):
        if pa.types.is_dictionary(field.type):
            table = table.set_column(i, pa.field(field.name, pa.large_string()),
                                     table.column(i).cast(pa.large_string()))
    path = tmp_path / COLUMNAR_NAME
    _write_table(_set_header(table, columns=1), path)
    t1 = load_trace(path)
    assert isinstance(t1.payloads[0]["events"], columnar.LazyRecords)
    pd.testing.assert_frame_equal(t.get_ops(), t1.get_ops())
    pd.testing.assert_frame_equal(t.get_collectives(), t1.get_collectives())


def test_columnar_file_whose_ranks_interleave_loads_record_by_record(tmp_path):
    """Rows of the ranks interleaved (a file no sharddbg writes, still a valid trace) load through the record by
    record path, to the same trace."""
    t = load_trace(GOLDEN)
    table = _columnar_table()
    order = sorted(range(table.num_rows), key=lambda i: (i % 2, i))
    path = tmp_path / COLUMNAR_NAME
    _write_table(table.take(order), path)
    t2 = load_trace(path)
    assert not isinstance(t2.payloads[0]["events"], columnar.LazyRecords)
    pd.testing.assert_frame_equal(t.get_ops(), t2.get_ops())


@pytest.mark.parametrize("name", ["run.sdtrace.parquet", "run.csv", "run.sdtrace", "run.feather"])
def test_save_refuses_a_suffix_it_does_not_write_before_writing(tmp_path, name):
    with pytest.raises(ValueError, match=r"writes JSON \(.sdtrace.json.*\) or the columnar Arrow IPC file "
                                         r"\(.sdtrace.arrow.*nothing was written"):
        load_trace(GOLDEN).save(tmp_path / name)
    assert list(tmp_path.iterdir()) == []


# ---- corruptions of the text itself (what json.dumps would not write) ----------------------------------
def _not_a_number(text):
    return text.replace('"host_ms":', '"host_ms":NaN,"was_host_ms":', 1)


def _overflowing_float(text):
    return text.replace('"host_ms":', '"host_ms":1e999,"was_host_ms":', 1)


def _nested_past_the_parser(text):
    return text.replace('"code":', '"code":' + "[" * 100_000 + "]" * 100_000 + ',"was_code":', 1)


def _too_many_digits(text):
    return text.replace('"dropped":0', '"dropped":' + "9" * 5000, 1)


TEXT_CORRUPTIONS = [
    (_not_a_number, r'payload 0 \(rank 0\) event #0 field "host_ms" = nan is not a finite number'),
    (_overflowing_float, r'payload 0 \(rank 0\) event #0 field "host_ms" = inf is not a finite number'),
    (_nested_past_the_parser, r"corrupt sharddbg trace: its JSON nests deeper than Python's parser can follow"),
    (_too_many_digits, (r"corrupt sharddbg trace: it holds an integer too long to read \(integers in a trace lie "
                        r"within \+-2\*\*61")),
]


@pytest.mark.parametrize("corrupt, match", TEXT_CORRUPTIONS, ids=[c.__name__.strip("_") for c, _ in TEXT_CORRUPTIONS])
def test_corrupt_text_is_refused_naming_the_cause(tmp_path, corrupt, match):
    d = golden()
    assert d["payloads"][0]["events"][0]["kind"] == "op"  # the first "host_ms" is that of event #0 of rank 0
    text = json.dumps(d, separators=(",", ":"))
    path = tmp_path / NAME
    path.write_text(corrupt(text))
    with pytest.raises(TraceFileError, match=match):
        load_trace(path)


# ---- valid files keep loading ---------------------------------------------------------------------------
def test_golden_trace_loads_unchanged():
    t = load_trace(GOLDEN)
    d = golden()
    assert content(t.to_dict()) == content(d)
    assert t.ranks == [0, 1, 2, 3] and t.incomplete_ranks == [] and t.dropped == 0
    assert len(t.get_ops()) == sum(e["kind"] == "op" for p in d["payloads"] for e in p["events"])


def test_schema_version_1_file_loads(tmp_path):
    """A file as sharddbg wrote it before collective records existed (schema version 1)."""
    d = golden()
    for p in d["payloads"]:
        p["events"] = [e for e in p["events"] if e["kind"] != "collective"]
        p["schema_version"] = 1
        del p["meta"]["comm"]
    d["schema_version"] = 1
    path = tmp_path / NAME
    path.write_text(json.dumps(d))
    t = load_trace(path)
    assert not t.collectives_recorded and t.get_collectives().empty
    assert len(t.get_ops()) == sum(len(p["events"]) for p in d["payloads"])


def test_file_without_optional_fields_loads(tmp_path):
    """"ranks", "clock_offsets_ns", "incomplete_ranks" and "meta" may be left out (ranks 0.., offsets 0)."""
    d = golden()
    for k in ("ranks", "clock_offsets_ns", "incomplete_ranks", "meta"):
        del d[k]
    path = tmp_path / NAME
    path.write_text(json.dumps(d))
    t = load_trace(path)
    assert t.ranks == [0, 1, 2, 3] and t.clock_offsets_ns == {0: 0, 1: 0, 2: 0, 3: 0} and t.meta == {}


def test_incomplete_trace_with_a_silent_rank_round_trips(tmp_path):
    """A hung recording: rank 1 sent a snapshot (complete False), rank 3 nothing; saved and read back."""
    d = golden()
    payloads = d["payloads"]
    payloads[1]["complete"] = False
    payloads[1]["dropped"] = 3
    with pytest.warns(ShardDbgWarning, match="3 events were dropped"):
        t = Trace.from_payloads([payloads[0], payloads[1], payloads[2], None], [0, 5, -5, 0])
    assert t.incomplete_ranks == [1, 3]
    with pytest.warns(ShardDbgWarning, match="3 events were dropped"):
        t2 = load_trace(t.save(tmp_path / NAME))
    assert t2.to_dict() == t.to_dict() and t2.incomplete_ranks == [1, 3]
    pd.testing.assert_frame_equal(t2.get_ops(), t.get_ops())


def test_extreme_but_valid_values_load(tmp_path):
    """An integer at the bound and meta nested exactly as deep as allowed load, and the analyses run."""
    d = golden()
    # a key of the meta's own (free: TRACE_META_FIELDS does not name it) nested as deep as allowed
    d["meta"]["notes"] = nested(MAX_NESTING - 2, "x")  # below the file's top and meta: MAX_NESTING levels
    d["clock_offsets_ns"]["0"] = -MAX_ABS_INT
    path = tmp_path / NAME
    path.write_text(json.dumps(d))
    t = load_trace(path)
    assert t.clock_offsets_ns[0] == -MAX_ABS_INT
    assert t.get_ops()["t_start_ns"].dtype == "Int64" and len(t.get_collectives()) > 0


def test_from_payloads_and_trace_agree_on_unfinished_ranks():
    """The constructor itself lists a rank whose payload is None or unfinished as incomplete, so that
    whatever a Trace saves, load_trace reads back."""
    d = golden()
    d["payloads"][2]["complete"] = False
    t = Trace(dict(enumerate(d["payloads"])), {}, incomplete_ranks=[])
    assert t.incomplete_ranks == [2]
    t = Trace({0: d["payloads"][0], 1: None}, {}, incomplete_ranks=[])
    assert t.incomplete_ranks == [1]


# ---- writers: a fresh temp file beside the target, renamed into place ----------------------------------
def _golden_trace(**meta) -> Trace:
    """The golden trace; with ``meta``: rebuilt with those meta entries added (a trace's meta is set when it is
    built)."""
    t = load_trace(GOLDEN)
    if not meta:
        return t
    return Trace.from_payloads(t.payloads, t.clock_offsets_ns, meta={**t.meta, **meta},
                               incomplete_ranks=t.incomplete_ranks)


WRITERS = {
    "save": lambda t, p: t.save(p),
    "to_perfetto": lambda t, p: t.to_perfetto(p),
    "to_html": lambda t, p: t.to_html(p),
}


@pytest.mark.parametrize("writer", list(WRITERS))
def test_writer_leaves_a_symlink_at_the_old_temp_name_alone(tmp_path, writer):
    victim = tmp_path / "victim.txt"
    victim.write_text("not yours")
    target = tmp_path / "out.sdtrace.json"
    planted = tmp_path / "out.sdtrace.json.tmp"  # the name earlier versions wrote through
    planted.symlink_to(victim)
    assert WRITERS[writer](_golden_trace(), target) == os.fspath(target)
    assert victim.read_text() == "not yours"
    assert planted.is_symlink() and os.readlink(planted) == os.fspath(victim)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out.sdtrace.json", "out.sdtrace.json.tmp", "victim.txt"]
    text = target.read_text(encoding="utf-8")
    if writer == "save":
        assert content(load_trace(target).to_dict()) == content(golden())
    elif writer == "to_perfetto":
        assert json.loads(text)["traceEvents"]
    else:
        assert text.startswith("<!DOCTYPE html>") and text.rstrip().endswith("</html>")


def test_failed_save_leaves_no_temp_file_and_no_target(tmp_path):
    t = _golden_trace(not_json=object())  # serialising fails part way through the file
    target = tmp_path / NAME
    with pytest.raises(TypeError, match="not JSON serializable"):
        t.save(target)
    assert list(tmp_path.iterdir()) == []


def test_failed_save_keeps_the_old_file(tmp_path):
    target = tmp_path / NAME
    _golden_trace().save(target)
    before = target.read_bytes()
    t = _golden_trace(wall_s=float("nan"))  # strict JSON refuses NaN, after much of the file was written
    with pytest.raises(ValueError, match="not JSON compliant"):
        t.save(target)
    assert target.read_bytes() == before and [p.name for p in tmp_path.iterdir()] == [NAME]


def test_failure_after_writing_leaves_no_temp_file(tmp_path):
    """The rename itself fails (the target became a folder while the file was written): the written temp file
    is removed, and the error names the target, not the temp file."""
    target = tmp_path / "taken"

    def write_then_take_the_name(f):
        f.write("x")
        target.mkdir()

    with pytest.raises(IsADirectoryError) as info:
        write_file_atomically(target, write_then_take_the_name)
    assert [p.name for p in tmp_path.iterdir()] == ["taken"] and list(target.iterdir()) == []
    assert str(info.value).startswith(f"{os.fspath(target)!r} is a folder, not a file") and ".tmp" not in str(info.value)


@pytest.mark.parametrize("writer", list(WRITERS))
def test_writing_to_a_folder_is_refused_with_a_file_name_to_use(tmp_path, writer):
    folder = tmp_path / "runs"
    folder.mkdir()
    with pytest.raises(IsADirectoryError) as info:
        WRITERS[writer](_golden_trace(), folder)
    suggested = {"save": "trace.sdtrace.json", "to_perfetto": "trace.perfetto.json", "to_html": "report.html"}[writer]
    assert str(info.value) == (f"{os.fspath(folder)!r} is a folder, not a file: give the path of the file to write, "
                               f"e.g. {os.path.join(folder, suggested)!r}")
    assert info.value.errno == errno.EISDIR
    assert [p.name for p in tmp_path.iterdir()] == ["runs"] and list(folder.iterdir()) == []


def test_a_failed_write_names_the_target_not_the_temp_file(tmp_path):
    target = tmp_path / NAME

    def disk_full(f):
        f.write("half")
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))  # what a write on a full disk raises: no file name

    with pytest.raises(OSError) as info:
        write_file_atomically(target, disk_full)
    assert info.value.errno == errno.ENOSPC and info.value.filename == os.fspath(target)
    assert os.fspath(target) in str(info.value) and list(tmp_path.iterdir()) == []


def test_save_into_a_missing_folder_names_the_target(tmp_path):
    target = tmp_path / "no" / NAME
    with pytest.raises(FileNotFoundError) as info:
        _golden_trace().save(target)
    assert info.value.filename == os.fspath(target) and list(tmp_path.iterdir()) == []


def test_write_file_atomically_removes_its_temp_file_when_the_writer_raises(tmp_path):
    during = []

    def half_then_fail(f):
        f.write("half a file")
        f.flush()
        during.extend(tmp_path.iterdir())
        raise RuntimeError("writer broke")

    with pytest.raises(RuntimeError, match="writer broke"):
        write_file_atomically(tmp_path / "x.txt", half_then_fail)
    # while writing, one hidden temp file named after the target sat beside it; now nothing is left
    assert len(during) == 1 and re.fullmatch(r"\.x\.txt\..+\.tmp", during[0].name)
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("umask, mode", [(0o022, 0o644), (0o077, 0o600), (0o002, 0o664)])
def test_new_file_mode_follows_the_umask(tmp_path, umask, mode):
    old = os.umask(umask)
    try:
        path = _golden_trace().save(tmp_path / NAME)
        written = write_file_atomically(tmp_path / "plain.txt", lambda f: f.write("x"))
    finally:
        os.umask(old)
    assert stat.S_IMODE(os.stat(path).st_mode) == mode
    assert stat.S_IMODE(os.stat(written).st_mode) == mode


def test_overwrite_keeps_the_existing_files_mode(tmp_path):
    target = tmp_path / NAME
    target.write_text("old")
    target.chmod(0o640)
    _golden_trace().save(target)
    assert stat.S_IMODE(target.stat().st_mode) == 0o640 and load_trace(target).ranks == [0, 1, 2, 3]



# ---- what is not a regular file is refused before it is read -----------------------------------------
def test_a_fifo_is_refused_at_once_naming_it(tmp_path):
    """Opening a FIFO waits for a writer (forever, when none comes): refused from its stat instead."""
    fifo = tmp_path / "pipe.sdtrace.json"
    os.mkfifo(fifo)
    outcome = []

    def load():
        try:
            load_trace(fifo)
        except Exception as e:  # noqa: BLE001 - what it raised is the outcome
            outcome.append(e)

    reader = threading.Thread(target=load, daemon=True)
    reader.start()
    reader.join(10)
    if reader.is_alive():  # it waits in open(): a writer that comes and goes lets it end
        os.close(os.open(fifo, os.O_WRONLY))
        reader.join(10)
        pytest.fail(f"load_trace({fifo}) waited for a writer instead of refusing")
    assert isinstance(outcome[0], TraceFileError), outcome
    assert str(outcome[0]) == (f"{fifo} is a FIFO (named pipe), not a trace file: give the path of a file written by "
                               f"Trace.save() (e.g. run.sdtrace.json)")


@pytest.mark.parametrize("path, what", [("/dev/zero", "a character device"), ("<tmp>", "a folder")])
def test_what_is_not_a_regular_file_is_refused_before_reading(tmp_path, path, what):
    path = os.fspath(tmp_path) if path == "<tmp>" else path
    with pytest.raises(TraceFileError, match=f"^{re.escape(path)} is {what}, not a trace file"):
        load_trace(path)


# ---- a big trace given as dicts keeps its records as columns ----------------------------------------------
def current_golden() -> dict:
    """The golden trace's document with its records as this schema writes them (the file is of schema 4): what a
    trace file of this sharddbg holds."""
    d = golden()
    for p in d["payloads"]:
        p["events"] = schema.current_events(p)
        p["schema_version"] = schema.SCHEMA_VERSION
    d["schema_version"] = schema.SCHEMA_VERSION
    return d


def _records_as_columns_from(monkeypatch, count: int) -> None:
    """A rank of ``count`` records or more makes the trace's records columns (the golden trace's ranks hold 26)."""
    from sharddbg import trace as trace_module

    monkeypatch.setattr(trace_module, "RECORDS_AS_COLUMNS_FROM", count)


def _as_json(value) -> str:
    """``value`` as JSON, its objects' keys sorted: equal texts are equal values of the same types (1 is not 1.0)."""
    return json.dumps(value, sort_keys=True)


def test_big_json_trace_keeps_its_records_as_columns_and_saves_the_file_of_its_dicts(tmp_path, monkeypatch):
    """A JSON trace of which a rank holds RECORDS_AS_COLUMNS_FROM records or more loads holding columns: its records
    (made when asked for) are the file's, types and all; its tables are those of the same trace held as dicts; saved
    as columns it writes the bytes the trace of dicts writes, saved as JSON the same document."""
    path = tmp_path / NAME
    d = current_golden()
    path.write_text(json.dumps(d))
    _records_as_columns_from(monkeypatch, 10**9)
    as_dicts = load_trace(path)
    _records_as_columns_from(monkeypatch, 26)
    as_columns = load_trace(path)
    assert all(isinstance(as_columns.payloads[r]["events"], columnar.LazyRecords) for r in as_columns.ranks)
    assert not any(isinstance(as_dicts.payloads[r]["events"], columnar.LazyRecords) for r in as_dicts.ranks)
    for table in TABLES:
        pd.testing.assert_frame_equal(getattr(as_dicts, table)(), getattr(as_columns, table)(), obj=table,
                                      check_exact=True)
    assert not any(as_columns.payloads[r]["events"].made for r in as_columns.ranks), "a table made the dicts"
    dicts_file = as_dicts.save(tmp_path / "dicts.sdtrace.arrow")
    columns_file = as_columns.save(tmp_path / "columns.sdtrace.arrow")
    assert Path(dicts_file).read_bytes() == Path(columns_file).read_bytes()
    assert json.loads(Path(as_columns.save(tmp_path / "columns.sdtrace.json")).read_text()) == d
    for r, p in zip(d["ranks"], d["payloads"]):
        assert _as_json(as_columns.events(r)) == _as_json(p["events"])
    _records_as_columns_from(monkeypatch, 27)  # no rank holds 27: every rank's records stay dicts
    assert not isinstance(load_trace(path).payloads[0]["events"], columnar.LazyRecords)


@pytest.mark.parametrize("corrupt, match", CORRUPTIONS, ids=[c.__name__.strip("_") for c, _ in CORRUPTIONS])
def test_self_contradicting_big_json_file_is_refused_as_its_dicts_are(tmp_path, monkeypatch, corrupt, match):
    """Every corruption of a file whose records would be held as columns gives the message of the records as dicts."""
    d = current_golden()
    event_index = corrupt(d)
    path = tmp_path / NAME
    path.write_text(json.dumps(d))
    messages = []
    for count in (10**9, 1):
        _records_as_columns_from(monkeypatch, count)
        with pytest.raises(TraceFileError) as info:
            load_trace(path)
        messages.append(str(info.value))
    assert messages[0] == messages[1]
    assert re.search(match.format(i=event_index), messages[1]), messages[1]


def _set_first_op(**fields):
    def change(d):
        i, ev = first_op(d, 1)
        ev.update(fields)
        return i
    return change


def _drop_from_first_op(name):
    def change(d):
        i, ev = first_op(d, 1)
        del ev[name]
        return i
    return change


def _set_first_collective(**fields):
    def change(d):
        ev = next(e for e in d["payloads"][2]["events"] if e["kind"] == "collective")
        ev.update(fields)
    return change


# a record of a big payload that the columns would not give back as it is, or that its checks refuse: (the change,
# what the message says; None: the file loads, its records as dicts)
ODD_RECORDS = {
    "unknown phase": (_set_first_op(phase="sideways"), r"rank 1 event #{i}: unknown phase 'sideways'"),
    "text in a float field": (_set_first_op(host_ms="fast"), r"field 'host_ms' = 'fast' has type str"),
    "float in an int field": (_set_first_op(t_start_ns=1.5), r"field 't_start_ns' = 1.5 has type float"),
    "bool in an int field": (_set_first_op(in_bytes=True), r"field 'in_bytes' = True has type bool"),
    "int in a bool field": (_set_first_op(fallback=1), r"field 'fallback' = 1 has type int"),
    "int in a text field": (_set_first_op(dtype=7), r"field 'dtype' = 7 has type int"),
    "field missing": (_drop_from_first_op("module"), r"missing field\(s\) \['module'\]"),
    "optional field null": (_set_first_op(spec_mismatches=None), r"field 'spec_mismatches' = None has type NoneType"),
    "optional item without its fields": (_set_first_op(replicas=[{"key": "w"}]), r"replicas: missing field"),
    "bad error record": (_set_first_op(error={"exc_type": "E"}), r"error: missing field"),
    "negative bytes": (_set_first_collective(bytes_sent=-1), r"negative byte count"),
    "unknown kind": (lambda d: d["payloads"][0]["events"].append({"kind": "mystery", "seq": 10**6}),
                     r"unknown kind 'mystery'"),
    "int in a float field": (_set_first_op(host_ms=3), None),
    "float of an int's value": (_set_first_op(t_end_ns=None, host_ms=2.0), None),
    "key beyond its kind's": (_set_first_op(note={"by": "hand"}), None),
    "meta record": (lambda d: d["payloads"][3]["events"].append({"kind": "meta", "seq": 10**6, "name": "cell",
                                                                   "data": {"a": [1, 2.5, None, True]}}), None),
}


@pytest.mark.parametrize("case", list(ODD_RECORDS))
def test_odd_record_in_a_big_json_file_reads_as_its_dicts(tmp_path, monkeypatch, case):
    """A record that the columns would not hold as it is (an int in a float field), or that the checks refuse, in a
    file whose records would be held as columns: the file is refused with the message of the records as dicts, or
    loads with the records exactly as written."""
    change, match = ODD_RECORDS[case]
    d = current_golden()
    event_index = change(d)
    path = tmp_path / NAME
    path.write_text(json.dumps(d))
    _records_as_columns_from(monkeypatch, 1)
    if match is not None:
        with pytest.raises(TraceFileError) as as_columns:
            load_trace(path)
        _records_as_columns_from(monkeypatch, 10**9)
        with pytest.raises(TraceFileError) as as_dicts:
            load_trace(path)
        assert str(as_columns.value) == str(as_dicts.value)
        assert re.search(match.format(i=event_index), str(as_columns.value)), str(as_columns.value)
        return
    t = load_trace(path)
    for r, p in zip(d["ranks"], d["payloads"]):
        assert _as_json(t.events(r)) == _as_json(p["events"])
    _records_as_columns_from(monkeypatch, 10**9)
    pd.testing.assert_frame_equal(t.get_ops(), load_trace(path).get_ops(), check_exact=True)


def test_big_dict_payloads_make_a_trace_of_columns_and_leave_the_callers_alone(monkeypatch):
    """``Trace.from_payloads`` of big dict payloads: the trace holds columns, its records equal the caller's, the
    caller's payloads and records are not changed; records the columns would not give back as they are (an int in a
    float field, a dict of int keys, a tuple, a numpy number) keep the trace of the caller's dicts, whose checks say
    what is wrong."""
    np = pytest.importorskip("numpy")
    d = current_golden()
    given = json.loads(json.dumps(d["payloads"]))
    kept = json.dumps(given)
    _records_as_columns_from(monkeypatch, 26)
    t = Trace.from_payloads(given, d["clock_offsets_ns"] and {int(k): v for k, v in d["clock_offsets_ns"].items()})
    assert all(isinstance(t.payloads[r]["events"], columnar.LazyRecords) for r in t.ranks)
    assert json.dumps(given) == kept and all(type(p["events"]) is list for p in given)
    assert [_as_json(t.events(r)) for r in t.ranks] == [_as_json(p["events"]) for p in given]
    _records_as_columns_from(monkeypatch, 10**9)
    as_dicts = Trace.from_payloads(given, {int(k): v for k, v in d["clock_offsets_ns"].items()})
    for table in TABLES:
        pd.testing.assert_frame_equal(getattr(as_dicts, table)(), getattr(t, table)(), obj=table, check_exact=True)
    _records_as_columns_from(monkeypatch, 26)
    i, ev = first_op({"payloads": given}, 0)
    for odd in ({"host_ms": 3}, {"sharding_shapes": {0: [1]}}):
        changed = json.loads(kept)
        changed[0]["events"][i] = dict(ev, **odd)
        t = Trace.from_payloads(changed)
        assert t.payloads[0]["events"] is changed[0]["events"], odd  # the caller's records, as before
    for bad in ({"in_bytes": np.int64(5)}, {"fallback": np.bool_(True)}, {"dtype": b"float32"},
                {"out_local_shape": tuple(ev["out_local_shape"])}):
        changed = json.loads(kept)
        changed[0]["events"][i] = dict(ev, **bad)
        messages = []
        for count in (26, 10**9):
            _records_as_columns_from(monkeypatch, count)
            with pytest.raises(schema.SchemaError) as info:
                Trace.from_payloads(changed)
            messages.append(str(info.value))
        assert messages[0] == messages[1] and "has type" in messages[0], messages
