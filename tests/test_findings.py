"""What a trace says is wrong (``analysis.findings``), tested once, on the golden trace and on copies of it
made worse by hand: which findings, in which order, with which numbers (counted here from the payloads
themselves), and that every front end (the %%shard_trace summary line, the explorer's text, static HTML and
widget data, the HTML report) shows exactly that list, in that order, and decides nothing of its own."""

from __future__ import annotations

import copy
import html
import json
import re
from pathlib import Path

import pytest

import sharddbg
from sharddbg.analysis.findings import (CATEGORIES, CATEGORY_TITLES, FINDING_FIELDS, SEVERITIES, TRACE_FINDING_KINDS,
                                        Finding, finding_order_key, trace_findings)
from sharddbg.analysis.ops import AUTOGRAD_ENTRY_OPS, FALLBACK_PATHS, is_metadata_op
from sharddbg.magics import trace_summary
from sharddbg.trace import Trace
from sharddbg.views import explorer as ex
from sharddbg.views.common import SEVERITY_MARKS

GOLDEN = Path(__file__).parent / "data" / "conv4.sdtrace.json"


@pytest.fixture(scope="module")
def golden() -> Trace:
    return sharddbg.load_trace(GOLDEN)


def _ops(trace):
    return [dict(e, rank=r) for r in trace.ranks for e in trace.events(r) if e["kind"] == "op"]


def test_the_golden_trace_names_its_error_then_its_fallbacks(golden):
    found = golden.findings
    assert [(f.kind, f.severity) for f in found] == [("error", "fail"), ("fallback", "warn"),
                                                    ("metadata_fallback", "info")]
    error, fallback, metadata = found
    # the exception, from the op records where it started (the origin is the record itself)
    origins = [o for o in _ops(golden) if o["error"] is not None and o["error"]["origin_seq"] == o["seq"]]
    assert {(o["error"]["exc_type"], o["op"]) for o in origins} == {("TypeError", "Tensor.add")}
    assert error.ranks == tuple(sorted({o["rank"] for o in origins})) == (0, 1, 2, 3)
    first = origins[0]
    assert error.location == f"cell [{first['user_cell']}], line {first['user_frame'].rsplit(':', 1)[1].split()[0]}: " \
                             f"`{first['user_code']}`"
    assert error.sentence.startswith(f"ranks 0-3 raised TypeError: {first['error']['message'].splitlines()[0]} "
                                     f"in Tensor.add ({error.location})")
    assert "unsupported operand type(s)" in error.sentence and error.op == "Tensor.add"
    # the ops computed through a fallback: forward calls on a fallback path (or whose handler fell back), not the
    # calls that enter the autograd engine; metadata reads apart
    took = [o for o in _ops(golden) if o["phase"] == "forward" and o["op"] not in AUTOGRAD_ENTRY_OPS
            and (o["path"] in FALLBACK_PATHS or o["fallback"])]
    compute = {o["op"] for o in took if not is_metadata_op(o["op"])}
    reads = [o for o in took if is_metadata_op(o["op"])]
    assert fallback.sentence.startswith(f"{len(compute)} op(s) computed through a DTensor fallback (")
    assert set(re.search(r"fallback \((.*)\)$", fallback.sentence).group(1).split(", ")) == compute
    assert metadata.sentence == f"{len(reads)} metadata reads through the fallback"


def test_worse_copies_add_their_findings_in_order(golden):
    payloads = {r: copy.deepcopy(golden.payloads[r]) for r in golden.ranks}
    payloads[1]["dropped"] = 7
    payloads[2]["complete"] = False
    with pytest.warns(sharddbg.errors.ShardDbgWarning):  # the dropped events are announced when it is built
        worse = Trace.from_payloads(payloads, golden.clock_offsets_ns,
                                    meta={"incomplete_reasons": {"2": "did not finish within 3 s"}})
    kinds = [f.kind for f in worse.findings]
    assert kinds == ["error", "incomplete_ranks", "dropped_events", "fallback", "metadata_fallback"]
    by_kind = {f.kind: f for f in worse.findings}
    assert by_kind["incomplete_ranks"].sentence == "the recording of rank 2 is incomplete (rank 2 did not finish " \
                                                   "within 3 s)"
    assert by_kind["dropped_events"].sentence == "7 events dropped: the recorder's buffer was full on rank 1"
    assert by_kind["dropped_events"].ranks == (1,) and "--max-events" in by_kind["dropped_events"].fix
    # sorted by category first, then by severity, then by kind
    order = [(CATEGORIES.index(f.category), SEVERITIES.index(f.severity), TRACE_FINDING_KINDS.index(f.kind))
             for f in worse.findings]
    assert order == sorted(order)


def test_more_distinct_errors_than_named_are_counted(golden):
    """Five distinct exceptions: three named one by one, the other two in one more finding."""
    payloads = {r: copy.deepcopy(golden.payloads[r]) for r in golden.ranks}
    for r, p in payloads.items():
        for k, o in enumerate(e for e in p["events"] if e["kind"] == "op" and e["error"] is not None
                              and e["error"]["origin_seq"] == e["seq"]):
            o["error"]["message"] = f"distinct {r}"
    found = [f for f in Trace.from_payloads(payloads, golden.clock_offsets_ns).findings if f.kind == "error"]
    assert [f.sentence.split(":")[1].split(" in ")[0].strip() for f in found[:3]] == ["distinct 0", "distinct 1",
                                                                                     "distinct 2"]
    assert found[3].sentence == "1 more distinct exception(s) on rank 3" and len(found) == 4


def test_the_overview_counts_what_the_payloads_hold(golden):
    ov = golden.overview
    ops = _ops(golden)
    colls = [e for r in golden.ranks for e in golden.events(r) if e["kind"] == "collective"]
    assert ov.op_calls == len(ops) and ov.errors == sum(o["error"] is not None for o in ops)
    assert ov.collectives == len(colls)
    assert ov.collectives_per_rank == max(sum(c in golden.events(r) for c in colls) for r in golden.ranks)
    assert ov.headline().startswith(f"{len(ops)} op calls on 4 ranks, {ov.errors} raised, ")
    assert f"{ov.collectives} collectives (at most {ov.collectives_per_rank} per rank" in ov.headline()


def test_every_front_end_shows_the_same_list_in_its_order(golden, tmp_path):
    found = golden.findings
    assert found == trace_findings(golden)
    # the summary line: the headline, then each sentence, in order
    line = trace_summary(golden)
    at = [line.index(f.sentence) for f in found]
    assert at == sorted(at) and line.startswith(f"sharddbg: recorded {golden.overview.headline()}; ")
    # the explorer's text: one line each, under the headline
    lines = ex.explorer_text(golden).splitlines()
    assert lines[0] == f"Trace explorer: {golden.overview.headline()}"
    assert lines[1:1 + len(found)] == [f"  {SEVERITY_MARKS[f.severity]} {CATEGORY_TITLES[f.category]}: {f.text()}"
                                       for f in found]
    # the static HTML and the report: one entry each, escaped, in order, classed by severity and category
    page = Path(golden.to_html(tmp_path / "report.html")).read_text()
    for rendered in (ex.explorer_html(golden), page):
        assert _shown_findings(rendered) == [_expected_entry(f) for f in found]
    # the widget's data and the view's payload: the findings as data
    data = ex.explorer_data(golden)
    assert data["findings"] == [f.as_dict() for f in found] and data["headline"] == golden.overview.headline()
    assert ex.explorer_summary(golden)["findings"] == data["findings"]


def _shown_findings(rendered: str) -> list[tuple]:
    """Each finding of a static page: (tag, severity, category, its one line, what opens under it)."""
    return re.findall(r'<(div|details) class="sd-finding sd-finding-(\w+) sd-category-(\w+)">(?:<summary>)?(.*?)'
                      r'(?:</summary><div class="sd-finding-details">(.*?)</div></details>|</div>)',
                      rendered[rendered.index('<div class="sd-findings">'):], re.S)


def _expected_entry(f: Finding) -> tuple:
    head = html.escape(f"{SEVERITY_MARKS[f.severity]} ") + f'<span class="sd-finding-category">' \
        f'{html.escape(CATEGORY_TITLES[f.category])}</span> {html.escape(f.summary())}'
    return ("details" if f.details() else "div", f.severity, f.category, head, html.escape(f.details()))


def test_findings_are_ordered_by_what_they_mean_and_collapse_to_their_first_clause(golden, tmp_path):
    """An exception the cell caught comes before a performance warning; each long finding shows its first
    clause, the rest and the fix behind a click, in the static explorer, the report and the widget's data."""
    made = [Finding("plan_cache", "warn", "ranks 0-3: 4 stale entries (after 2 calls)", fix="clear it"),
            Finding("replicas_agree", "ok", "replicas agree on every rank"),
            Finding("error_handled", "info", "1 op call raised and the cell handled it: TypeError"),
            Finding("incomplete_ranks", "fail", "the recording of rank 2 is incomplete"),
            Finding("spec_mismatch", "fail", "1 result(s) whose spec disagrees"),
            Finding("metadata_fallback", "info", "4 metadata reads through the fallback"),
            Finding("collective_missing", "fail", "rank 3 never issued all_reduce")]
    assert [f.kind for f in sorted(made, key=finding_order_key)] == [
        "collective_missing", "error_handled", "spec_mismatch", "incomplete_ranks", "plan_cache",
        "metadata_fallback", "replicas_agree"]
    assert [f.category for f in sorted(made, key=finding_order_key)] == [
        "error", "error", "wrong_result", "hang", "performance", "performance", "fact"]
    # a doctor's check (a kind that is not a trace's) takes its category from its severity, or is given one
    assert Finding("some_check", "warn", "x").category == "performance"
    assert Finding("some_check", "fail", "x", category="wrong_result").category == "wrong_result"
    with pytest.raises(ValueError, match="category is one of"):
        Finding("error", "fail", "x", category="bad")
    # the first clause, and the rest with the fix
    plan = made[0]
    assert plan.summary() == plan.text().split("; ")[0] and plan.details() == "clear it"
    long = Finding("plan_cache", "warn", "ranks 0-3: ShardTensor.redistribute (in ShardTensor.backward), a -> b, "
                   + "changed its target spec " * 8 + "(3 now); more", fix="clear it")
    assert long.summary() == "Ranks 0-3: ShardTensor.redistribute (in ShardTensor.backward), a -> b"
    assert long.details() == "changed its target spec " * 7 + "changed its target spec (3 now); more; clear it"
    error = Finding("error", "fail", "rank 0 raised TypeError: x, y in Tensor.add (cell [2], line 6: `a, b`)"
                    + "; PyTorch would have hidden it")
    assert error.summary() == "Rank 0 raised TypeError: x, y in Tensor.add (cell [2], line 6: `a, b`)"
    assert made[1].summary() == "Replicas agree on every rank" and made[1].details() == ""
    # the golden trace with its exception handled: the handled error is an error, above the fallbacks
    payloads = {r: copy.deepcopy(golden.payloads[r]) for r in golden.ranks}
    for p in payloads.values():
        for e in p["events"]:
            if e["kind"] == "op" and e["error"] is not None:
                e["error"]["handled"] = True
    caught = Trace.from_payloads(payloads, golden.clock_offsets_ns)
    assert [(f.kind, f.category) for f in caught.findings] == [
        ("error_handled", "error"), ("fallback", "performance"), ("metadata_fallback", "performance")]
    page = Path(caught.to_html(tmp_path / "report.html")).read_text()
    for rendered in (ex.explorer_html(caught), page):
        shown = _shown_findings(rendered)
        assert shown == [_expected_entry(f) for f in caught.findings]
        assert [s[0] for s in shown] == ["details", "details", "div"]  # the two long ones collapse
        assert "<details open" not in rendered.split('<div class="sd-findings">')[1].split("</div></div>")[0]
    data = ex.explorer_data(caught)
    assert [(d["category"], d["summary"], d["details"]) for d in data["findings"]] == [
        (f.category, f.summary(), f.details()) for f in caught.findings]
    assert data["category_titles"] == CATEGORY_TITLES


def test_a_finding_is_typed_and_travels_as_json():
    f = Finding("plan_cache", "warn", "ranks 0-3: a stale entry", fix="clear it", ranks=(0, 1, 2, 3), op="x")
    assert f.text() == "Ranks 0-3: a stale entry; clear it"
    d = json.loads(json.dumps(f.as_dict()))
    assert list(d) == list(FINDING_FIELDS) and d["ranks"] == [0, 1, 2, 3] and d["text"] == f.text()
    with pytest.raises(ValueError, match="severity is one of"):
        Finding("error", "bad", "x")


def test_the_doctors_rows_are_findings_too():
    from sharddbg.analysis import doctor

    report = doctor.examine([], None, None, [])
    assert all(isinstance(f, Finding) for f in report.findings)
    assert list(report.table["check"]) == [f.kind for f in report.findings] == list(doctor.CHECKS)
    assert list(report.table["status"]) == [f.severity for f in report.findings]
