"""The unsharded reference of ``Cluster.check``: the user's statement run again in a separate single process.

The client starts it with its own Python (``python -m sharddbg.engine.reference JOB_DIR``), so that the
client itself never imports torch. It reads what the ranks left in ``JOB_DIR`` for each domain group (the
group's first rank wrote ``group<g>/bundle.pkl``: every input's ``full_tensor()``, the models with that
rank's weights, the other values the statement reads, its RNG state) and ``job.json`` (the statement, the
loss, the names), runs the statement on plain tensors with ``sharddbg.engine.scatter`` as the identity, and
writes ``group<g>/reference.pt`` (outputs and gradients) for the ranks to compare against. A failure is
written to ``reference-error.json`` (what raised, where in the statement), and the exit status is 1.

The same module holds what both sides must agree on: how tensors cross in the bundle (``BundlePickler`` on
the rank, ``rebuild_tensor`` here), the default loss and the names of the files.
"""

from __future__ import annotations

import io
import json
import os
import pickle
import sys
import traceback

JOB_FILE = "job.json"
BUNDLE_FILE = "bundle.pkl"
REFERENCE_FILE = "reference.pt"
ERROR_FILE = "reference-error.json"
LOSSES_FILE = "reference-losses.json"  # {group: the reference's loss value}
STATEMENT_FILENAME = "<statement>"  # what tracebacks of the reference call the user's statement
LOSS_FILENAME = "<loss>"

# How the gradients of a check come about, decided on the ranks and followed by the reference:
BACKWARD_BY_CHECK = "check"  # the check calls backward() on the loss
BACKWARD_BY_STATEMENT = "statement"  # the statement ran its own backward (gradients were there after it)
BACKWARD_NONE = "none"  # no gradients compared (grads=False, or nothing requires grad)
BACKWARD_SKIPPED = "skipped"  # not run: an output's spec disagrees with its data (its backward can crash ranks)
BACKWARD_FAILED = "failed"  # backward() raised on every rank: outputs compared, gradients not


def group_dir(job_dir: str, group: int) -> str:
    """Where domain group ``group`` (its ddp index) keeps its bundle and its reference."""
    return os.path.join(job_dir, f"group{group}")


def rebuild_tensor(data, is_parameter: bool, requires_grad: bool):
    """A tensor as the bundle carries it: a plain leaf (a Parameter where it was one) with the flag it had."""
    import torch

    if is_parameter:
        return torch.nn.Parameter(data, requires_grad=requires_grad)
    return data.requires_grad_(requires_grad) if data.is_floating_point() or data.is_complex() else data


def default_loss(outputs):
    """The loss when none is given: the sum over the outputs that require grad of the mean of their squares;
    None when none requires grad. The same expression on ShardTensors (ranks) and plain tensors (reference)."""
    terms = [o.square().mean() for o in outputs if o.requires_grad]
    if not terms:
        return None
    loss = terms[0]
    for term in terms[1:]:
        loss = loss + term
    return loss


def _bundle_pickler_class():
    import cloudpickle

    class BundlePickler(cloudpickle.Pickler):
        """cloudpickle (classes and functions of the user's cells travel by value) where every tensor
        becomes a plain CPU leaf rebuilt by ``rebuild_tensor``: a distributed one by the full tensor
        gathered for it beforehand (``full_of``: id -> full tensor), any other by its detached data."""

        def __init__(self, file, full_of: dict):
            super().__init__(file, protocol=pickle.HIGHEST_PROTOCOL)
            self.full_of = full_of
            self.plain_ids: set[int] = set()
            self.keep: list = []  # the plain copies stay alive while pickling, so no id is reused

        def reducer_override(self, obj):
            import torch

            if isinstance(obj, torch.Tensor) and id(obj) not in self.plain_ids:
                data = self.full_of.get(id(obj))
                if data is None:
                    if is_distributed(obj):
                        raise pickle.PicklingError(
                            f"a {type(obj).__name__} of global shape {tuple(obj.shape)} that the check did not gather")
                    wait = getattr(obj, "wait", None)  # an AsyncCollectiveTensor: its result
                    data = wait() if callable(wait) and type(obj) is not torch.Tensor else obj
                data = data.detach().cpu()
                if type(data) is not torch.Tensor:
                    data = data.as_subclass(torch.Tensor)
                data = data.clone()
                self.plain_ids.add(id(data))
                self.keep.append(data)
                return rebuild_tensor, (data, isinstance(obj, torch.nn.Parameter), bool(obj.requires_grad))
            return super().reducer_override(obj)

    return BundlePickler


def dumps_bundle(obj, full_of: dict) -> bytes:
    """``obj`` as the reference process will load it (see ``BundlePickler``)."""
    buffer = io.BytesIO()
    _bundle_pickler_class()(buffer, full_of).dump(obj)
    return buffer.getvalue()


def is_distributed(tensor) -> bool:
    """A ShardTensor or a DTensor (its data is spread over ranks)."""
    from torch.distributed.tensor import DTensor

    if isinstance(tensor, DTensor):
        return True
    shard_tensor = sys.modules.get("physicsnemo.domain_parallel.shard_tensor")
    return shard_tensor is not None and isinstance(tensor, shard_tensor.ShardTensor)


# ---- the reference process ------------------------------------------------------------------------------
class ReferenceFailure(Exception):
    """The statement (or the loss, or the backward) raised in the reference; ``record`` says what and where."""

    def __init__(self, record: dict):
        super().__init__(record["message"])
        self.record = record


def identity_scatter(tensor, dim=None, *, batch_dim=0, replicate=False, requires_grad=False):
    """``sharddbg.engine.scatter`` in the reference: the whole tensor, a leaf that requires grad where the
    sharded one would."""
    result = tensor.detach()
    if requires_grad or tensor.requires_grad:
        result.requires_grad_(True)
    return result


class _NoPatchesToRemove:
    """``sharddbg.engine.without_patches`` in the reference: one process has no patches to remove."""

    def __init__(self, *ops):
        pass

    def __enter__(self):
        return None

    def __exit__(self, *exc):
        return False


def _settings() -> None:
    """TF32 off and deterministic algorithms where torch has them, as on the ranks during the check."""
    import torch

    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    torch.backends.cudnn.deterministic = True
    torch.backends.cudnn.benchmark = False
    torch.set_float32_matmul_precision("highest")
    torch.use_deterministic_algorithms(True, warn_only=True)


def _where(exc: BaseException, source: str, filename: str) -> tuple[int | None, str]:
    """The line of the user's statement (or loss) where ``exc`` was raised, and its text."""
    line = None
    for frame in traceback.extract_tb(exc.__traceback__):
        if frame.filename == filename:
            line = frame.lineno
    if line is None and isinstance(exc, SyntaxError) and exc.filename == filename:
        line = exc.lineno
    lines = source.splitlines()
    return line, (lines[line - 1].strip() if line and 0 < line <= len(lines) else "")


def _failure(group: int, what: str, exc: BaseException, source: str, filename: str, unavailable: dict) -> ReferenceFailure:
    line, text = _where(exc, source, filename)
    message = f"{type(exc).__name__}: {exc}"
    name = getattr(exc, "name", None)
    if isinstance(exc, NameError) and name in unavailable:
        message += f" ({name} stays on the ranks: {unavailable[name]})"
    frames = [f for f in traceback.format_exception(type(exc), exc, exc.__traceback__)]
    return ReferenceFailure({"group": group, "what": what, "type": type(exc).__name__, "message": message,
                             "line": line, "code": text, "traceback": "".join(frames)})


def run_group(job: dict, job_dir: str, group: int) -> float | None:
    """The statement for one domain group, unsharded; its outputs and gradients to ``reference.pt``; the
    loss value (None without a backward by the check)."""
    import importlib

    import torch

    import sharddbg
    import sharddbg.engine

    # in this process only: the statement's scatter is the identity, and there are no patches to remove
    sharddbg.engine.scatter = identity_scatter
    sharddbg.engine.without_patches = _NoPatchesToRemove
    with open(os.path.join(group_dir(job_dir, group), BUNDLE_FILE), "rb") as f:
        bundle = pickle.load(f)
    namespace: dict = {"__name__": "__main__", "__builtins__": __builtins__}
    namespace.update(torch=torch, nn=torch.nn, F=torch.nn.functional, sharddbg=sharddbg)
    for name, module_name in bundle["modules"].items():
        namespace[name] = importlib.import_module(module_name)
    for name in bundle["scatter_names"]:
        namespace[name] = identity_scatter
    for name in bundle["no_patches_names"]:
        namespace[name] = _NoPatchesToRemove
    namespace.update(bundle["values"])
    namespace.update(bundle["models"])
    inputs = {}
    for name, (data, requires_grad) in bundle["inputs"].items():
        inputs[name] = data.detach().requires_grad_(requires_grad) if requires_grad else data.detach()
    namespace.update(inputs)
    models = bundle["models"]
    torch.set_rng_state(bundle["rng"])
    unavailable = bundle["unavailable"]
    stmt = job["stmt"]
    try:
        exec(compile(stmt, STATEMENT_FILENAME, "exec"), namespace)  # noqa: S102 - the user's own statement
    except Exception as exc:
        raise _failure(group, "the statement", exc, stmt, STATEMENT_FILENAME, unavailable) from None
    outputs = {}
    for name in job["outputs"]:
        value = namespace.get(name)
        if isinstance(value, torch.Tensor):
            outputs[name] = value
    loss_value = None
    if job["backward"] == BACKWARD_BY_CHECK:
        try:
            if job["loss"]:
                loss = eval(compile(job["loss"], LOSS_FILENAME, "eval"), namespace)  # noqa: S307
            else:
                loss = default_loss(list(outputs.values()))
        except Exception as exc:
            raise _failure(group, "the loss", exc, job["loss"] or "", LOSS_FILENAME, unavailable) from None
        if loss is not None:
            loss_value = float(loss.detach().double().sum())
            try:
                loss.backward()
            except Exception as exc:
                raise _failure(group, "the backward pass", exc, stmt, STATEMENT_FILENAME, unavailable) from None
    result = {
        "outputs": {n: v.detach().clone() for n, v in outputs.items()},
        "input_grads": {n: (None if t.grad is None else t.grad.detach().clone()) for n, t in inputs.items()},
        "param_grads": {f"{m}.{p}": (None if param.grad is None else param.grad.detach().clone())
                        for m, module in models.items() for p, param in module.named_parameters()},
        "loss": loss_value,
    }
    torch.save(result, os.path.join(group_dir(job_dir, group), REFERENCE_FILE))
    return loss_value


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    job_dir = argv[0]
    with open(os.path.join(job_dir, JOB_FILE)) as f:
        job = json.load(f)
    _settings()
    losses = {}
    try:
        for group in job["groups"]:
            losses[group] = run_group(job, job_dir, group)
    except ReferenceFailure as failure:
        with open(os.path.join(job_dir, ERROR_FILE), "w") as f:
            json.dump(failure.record, f)
        return 1
    with open(os.path.join(job_dir, LOSSES_FILE), "w") as f:
        json.dump({str(g): loss for g, loss in losses.items()}, f)
    return 0


if __name__ == "__main__":
    sys.exit(main())
