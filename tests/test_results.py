"""The verification results as data, without a cluster: built from records shaped as the ranks send them
(``engine.api.check_compare``), they answer what a user asks of them and refuse what they cannot answer."""

from __future__ import annotations

import math

import pytest

from sharddbg.analysis.check import CheckResult, check_tables


def _record(tensor, rank, rows, *, max_rel, ok=True, kind="output"):
    """One rank's comparison record of one tensor: ``rows`` (row, max_abs, ok) along its sharded dim."""
    return {"tensor": tensor, "kind": kind, "rank": rank, "group": 0, "ok": ok,
            "max_abs": max((e for _, e, _ in rows), default=math.nan), "max_rel": max_rel, "ratio": math.nan,
            "rtol": 1e-4, "atol": 1e-6, "bad": sum(not k for *_, k in rows), "numel": 8 * len(rows),
            "dtype": "torch.float32", "shape": [1, len(rows), 8], "reference_shape": [1, 8, 8], "compared": "rows",
            "row_dim": 1, "note": None, "rows": [list(r) for r in rows]}


def _result(records) -> CheckResult:
    table, rows = check_tables(records)
    return CheckResult("y = net(x)", table, rows, inputs=["x"], outputs=["y"], models=[], backward="none",
                       backward_note="", loss=None, reference_loss=None, tf32={"applies": False}, groups=[0])


def test_boundaries_come_from_the_rows_each_rank_holds():
    r = _result([[_record("y", 0, [(0, 0.0, True), (1, 0.0, True)], max_rel=0.0)],
                 [_record("y", 1, [(2, 0.0, True), (3, 0.0, True)], max_rel=0.0)]])
    assert r.ok and r.tensors() == ["y"] and r.boundaries("y") == [2]
    assert r.verdict.startswith("check passed: 1 tensors (outputs and gradients) on 2 ranks agree with the unsharded "
                                "reference (largest error 0 of the tensor's scale, y;")


def test_a_tensor_it_did_not_compare_is_refused_by_name():
    r = _result([[_record("y", 0, [(0, 0.0, True)], max_rel=0.0)]])
    for ask in (lambda: r.boundaries("z"), lambda: r.boundary_pattern("z"), lambda: r.plot_rows("z")):
        with pytest.raises(KeyError, match=r"no compared tensor named 'z'; this check compared \['y'\]"):
            ask()


def test_a_pass_with_nothing_to_measure_says_so():
    """Tensors with no element on either side (a gradient neither run made) pass with no relative error: the
    verdict says there was nothing to measure, not "largest error nan"."""
    r = _result([[_record("w.grad", 0, [], max_rel=math.nan, kind="parameter grad")]])
    assert r.ok and "no element held a value to compare" in r.verdict and "nan" not in r.verdict
