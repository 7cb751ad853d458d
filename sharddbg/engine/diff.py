"""What runs on a rank (and in the reference process) for ``Cluster.diff``: the check's steps with every op's
output kept on both sides and compared op by op.

On the ranks, around the check's own calls (``engine.verify``):

1. ``diff_prepare``: ``check_prepare`` (names agreed, TF32 off, the reference's bundle), then an
   ``OutputKeeper`` (``recorder.outputs``) on the running recording, or on a recording of the diff's own;
2. (the statement runs as a cell: every op the user's code calls is kept, with its call site and occurrence);
3. ``diff_backward``: the keeper stops taking ops, ``check_backward`` runs the loss and the backward (the
   gradient reaching each kept output is kept by its node's pre-hook), and every kept tensor is placed in its
   global tensor (one ``all_gather_object``);
4. ``diff_compare``: each kept output and gradient against this rank's slice of the reference's, matched by
   (call site, op, occurrence); no communication. ``diff_finish`` removes the keeper, then ``check_finish``.

In the reference process ``ReferenceOps`` (a ``TorchFunctionMode``) sees the same calls on plain tensors and
keeps the same outputs and gradients (``group<g>/diff-reference.pt``).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any

from . import reference, verify
from .rank_state import current_rank
from .recorder import outputs as kept_outputs
from .reference_ops import DIFF_REFERENCE_FILE

__all__ = ["diff_prepare", "diff_backward", "diff_compare", "diff_finish", "selector", "input_layouts"]


def selector(ops) -> Any:
    """The predicate over op names that ``ops=`` stands for: None (every op), names (an op's full name,
    ``torch.conv2d``, or its last part, ``conv2d``), or a callable taking the name."""
    if ops is None or callable(ops):
        return ops
    names = set(ops)
    return lambda name: name in names or name.rsplit(".", 1)[-1] in names


@dataclass
class DiffState:
    """The diff in progress on this rank (between diff_prepare and diff_finish)."""

    keeper: kept_outputs.OutputKeeper
    recording: Any  # the Recorder the keeper rides on
    own_recording: bool  # started for the diff (stopped by it) rather than the user's
    module_names: dict  # the recorder's module path -> the path from the model's name
    entries: list = field(default_factory=list)  # [(KeptOp, "output"/"gradient", index, verify.Compared)]


CURRENT: DiffState | None = None
DIFF_MAX_EVENTS = 20_000  # the diff's own recording: the statement's ops, the loss and the backward


def diff_prepare(job_dir: str, stmt: str, loss, inputs, outputs, models, grads: bool, ops, max_bytes: int) -> dict:
    """``check_prepare``, then the keeper on a running recording (see the module docstring)."""
    global CURRENT
    from ..options import RecordingOptions
    from .recorder import recording

    if CURRENT is not None:
        diff_finish()
    prepared = verify.check_prepare(job_dir, stmt, loss, inputs, outputs, models, grads)
    state = verify.CURRENT
    if current_rank() == 0:
        prepared["estimated_bytes"] = estimate_bytes(stmt, selector(ops), state)
    params = {id(p): f"{m}.{name}" for m, module in state.models.items() for name, p in module.named_parameters()}
    # the recorder names a module by its path in the outermost module (that one by its class): by the model's name here
    modules = {(path or type(module).__name__): (f"{m}.{path}" if path else m)
               for m, module in state.models.items() for path, _ in module.named_modules()}
    rec = recording.active_recorder()
    own = rec is None
    if own:  # ops only (no collectives, no spec check): the explorer the result opens on the departing op
        rec = recording.Recorder(RecordingOptions(max_events=DIFF_MAX_EVENTS, comm=False, spec_check=False))
        rec.__enter__()
    keeper = kept_outputs.OutputKeeper(selector(ops), params, stmt, max_bytes, rank=current_rank(), corrupt=kept_outputs.TEST_CORRUPTION,
                                       shard_tensor_cls=rec.shard_tensor_cls)
    rec.outputs = keeper
    CURRENT = DiffState(keeper, rec, own, modules)
    return prepared


def _global_meta(value):
    """A tensor of ``value``'s whole shape and dtype on the meta device (no data)."""
    import torch

    spec = getattr(value, "_spec", None)
    shape = tuple(spec.tensor_meta.shape) if reference.is_distributed(value) and spec is not None and \
        spec.tensor_meta is not None else tuple(value.shape)
    return torch.empty(shape, dtype=value.dtype, device="meta")


def estimate_bytes(stmt: str, select, state) -> int | None:
    """The bytes of every selected op's whole output, as the single-device reference would keep them, from a run
    of the statement before the ranks run it: on the meta device (shapes, no data, no communication), with the
    inputs and the models' tensors in their whole shapes, ``scatter`` as the identity, its printing swallowed
    and torch's random state put back. None where the statement cannot run there (data-dependent code, a tensor
    of its own on a real device): the diff then tells after the sharded run."""
    import contextlib
    import copy
    import io

    import torch
    from torch.overrides import TorchFunctionMode

    from .recorder.tensors import op_name, result_tensors

    namespace = dict(verify.namespace())
    for name, value in state.inputs.items():
        namespace[name] = _global_meta(value).requires_grad_(bool(value.requires_grad)
                                                             and value.is_floating_point())
    for name, module in state.models.items():
        memo = {}
        for tensor in list(module.parameters()) + list(module.buffers()):
            meta = _global_meta(tensor)
            memo[id(tensor)] = torch.nn.Parameter(meta, requires_grad=tensor.requires_grad) \
                if isinstance(tensor, torch.nn.Parameter) else meta
        namespace[name] = copy.deepcopy(module, memo)
    scatter, without_patches = _scatter_function(), _without_patches_function()
    for name, value in list(namespace.items()):
        if value is scatter:
            namespace[name] = lambda tensor, *args, **kwargs: tensor.to("meta")
        elif value is without_patches:
            namespace[name] = lambda *ops: contextlib.nullcontext()
    if "sharddbg" in namespace:
        import types

        namespace["sharddbg"] = types.SimpleNamespace(engine=types.SimpleNamespace(
            scatter=lambda tensor, *args, **kwargs: tensor.to("meta"), without_patches=lambda *ops: contextlib.nullcontext()))
    total = [0]

    class Outputs(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            res = func(*args, **(kwargs or {}))  # the calls inside it are not seen: the mode is off while it runs
            if select is None or select(op_name(func)):
                total[0] += sum(t.numel() * t.element_size() for t in result_tensors(res))
            return res

    rng = torch.get_rng_state()
    try:
        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()), Outputs():
            exec(compile(stmt, kept_outputs.STATEMENT_SITE, "exec"), namespace)  # noqa: S102 - the user's statement
    except Exception:  # noqa: BLE001 - not runnable on the meta device: no estimate
        return None
    finally:
        torch.set_rng_state(rng)
    return total[0]


def _scatter_function():
    from ._scatter import scatter

    return scatter


def _without_patches_function():
    from .patches import without_patches

    return without_patches


def _layout(spec, local) -> verify.TensorLayout:
    mesh = spec.mesh
    return verify.TensorLayout(mesh_ranks=tuple(int(r) for r in mesh.mesh.flatten().tolist()),
                               coordinate=tuple(int(c) for c in mesh.get_coordinate()),
                               placements=tuple(verify.placement(p) for p in spec.placements),
                               local_shape=tuple(int(s) for s in local.shape),
                               global_shape=tuple(int(s) for s in spec.tensor_meta.shape))


def _compared(name: str, kind: str, kept: kept_outputs.KeptTensor, like: kept_outputs.KeptTensor | None) -> verify.Compared:
    """The Compared record of a kept tensor: a Partial one summed (``full_tensor()``), a plain one placed like
    ``like`` (the output it is the gradient of) when it has that output's local shape."""
    if kept.partial is not None:
        return verify.Compared(name, kind, ("", name), kept.partial.full_tensor().detach(), None, "full_tensor()")
    if kept.spec is not None:
        return verify.Compared(name, kind, ("", name), kept.local, _layout(kept.spec, kept.local), "local shard")
    if like is not None and like.spec is not None and tuple(kept.local.shape) == tuple(like.local.shape) \
            and like.partial is None:
        return verify.Compared(name, kind, ("", name), kept.local, _layout(like.spec, kept.local), "local shard")
    return verify.Compared(name, kind, ("", name), kept.local, None, "whole")


def _detach_keeper(state: DiffState) -> None:
    if state.recording.outputs is state.keeper:
        state.recording.outputs = None


def diff_backward() -> dict:
    """The keeper stops taking ops; the check's loss and backward; every kept tensor placed. Returns the
    check's answer with what was kept (``ops``: each kept call, in order), what it would need (bytes) and
    the op names seen (kept or not, and those nested inside other ops)."""
    state = _require()
    _detach_keeper(state)
    after = verify.check_backward()
    keeper = state.keeper
    keeper.close()
    limit_everywhere = verify.gather(keeper.over_limit)
    described = []
    if not any(limit_everywhere):
        for op in keeper.kept:
            for i, out in enumerate(op.outputs):
                state.entries.append((op, "output", i, _compared(f"{op.key}#{i}", "op output", out, None)))
            if op.grad is not None:
                state.entries.append((op, "gradient", 0, _compared(f"{op.key}#grad", "op gradient", op.grad,
                                                                     op.outputs[0])))
        verify.place([e for *_, e in state.entries])
    for op in keeper.kept:
        described.append({"key": op.key, "op": op.op, "site": op.site, "module": state.module_names.get(op.module, op.module), "seq": op.seq,
                          "occurrence": op.occurrence, "sources": op.sources, "gradient": op.grad is not None,
                          "outputs": len(op.outputs), "position": _position(op.frame, op.site),
                          "caller": op.caller})
    return {"check": after, "ops": described, "needed_bytes": keeper.needed, "kept_bytes": keeper.nbytes,
            "global_bytes": keeper.global_bytes, "over_limit": keeper.over_limit, "seen": dict(keeper.seen),
            "nested": dict(keeper.nested), "selected": sorted({op.op for op in keeper.kept})}


def _position(frame, site) -> str | None:
    """'cell [3], line 7: `...`' or 'model.py:12 in forward: `...`' (None in the statement: the client names its
    lines itself)."""
    if not frame or not site or site[0] == kept_outputs.STATEMENT_SITE:
        return None
    from .recorder.cells import cell_name, position

    filename, line, function = frame
    if cell_name(filename) is None or function == "<module>":
        return position(*frame)
    where = position(filename, line)  # a cell's line: the function it is in named too, as a file's line has it
    return where.replace(f", line {line}", f", line {line} in {function}", 1)


def diff_compare(rtol: float | None, atol: float | None) -> dict:
    """The check's records, and one record per kept output and gradient against its reference partner."""
    import torch

    state = _require()
    check_records = verify.check_compare(rtol, atol)
    group = verify.CURRENT.group
    path = os.path.join(reference.group_dir(verify.CURRENT.job_dir, group), DIFF_REFERENCE_FILE)
    ref = torch.load(path, weights_only=True)
    records = []
    for op, what, index, entry in state.entries:
        partner = ref["ops"].get(op.key)
        if partner is None:
            expected = None
        elif what == "output":
            expected = partner["outputs"][index] if index < len(partner["outputs"]) else None
        else:
            expected = partner["grad"]
        record = verify.compare(entry, expected, rtol, atol, group)
        if partner is None:
            record["note"] = "no call of this op at this site in the single-device run"
        elif expected is None and what == "gradient":
            record["note"] = "no gradient reached this op in the single-device run"
        record.update(key=op.key, op=op.op, seq=op.seq, occurrence=op.occurrence, phase=(
            "forward" if what == "output" else "backward"), output=index, matched=partner is not None)
        records.append(record)
    payload = None
    if state.own_recording:  # the run as the explorer shows it (the user's own recording keeps its events itself)
        _detach_keeper(state)
        state.recording.close()
        payload = state.recording.payload(complete=True)
    return {"check": check_records, "ops": records, "reference_errors": ref.get("errors", []), "payload": payload}


def diff_finish() -> None:
    """Remove the keeper (and the diff's own recording), then ``check_finish``; safe after a failure."""
    global CURRENT
    state, CURRENT = CURRENT, None
    try:
        if state is not None:
            _detach_keeper(state)
            state.keeper.close()
            if state.own_recording:
                state.recording.close()
    finally:
        verify.check_finish()


def _require() -> DiffState:
    if CURRENT is None:
        raise verify.CheckSetupError("cl.diff: no diff is in progress on this rank (diff_prepare first)")
    return CURRENT


# ---- what a re-run without sharddbg needs (cluster.blame) ---------------------------------------------------
def input_layouts(names: list[str]) -> dict:
    """How each distributed input among ``names`` is laid out on this rank: its mesh dims, placements and
    every rank's piece shapes (a plain input: absent), for the re-run without sharddbg to shard it alike."""
    layouts = {}
    namespace = verify.namespace()
    for name in names:
        value = namespace.get(name)
        spec = getattr(value, "_spec", None)
        if spec is None or not reference.is_distributed(value):
            continue
        shapes = getattr(spec, "_sharding_shapes", None) or {}
        layouts[name] = {"mesh_dims": list(spec.mesh.mesh_dim_names or ()),
                         "placements": [list(verify.placement(p)) for p in spec.placements],
                         "sharding_shapes": {str(k): [[int(x) for x in s] for s in v] for k, v in shapes.items()}}
    return layouts
