"""One configuration of the smoke matrix, run on a rank: build the user's model from a fixed seed, set it up
the way the configuration says (weights broadcast over the domain axis, DDP over the ``ddp`` sub-mesh's
group, FSDP2 over the ``ddp`` sub-mesh, ``torch.compile``, or nothing), and run a few steps of the user's
``step`` on data drawn from the same seeds as the single-device run; what comes back is plain data: the
loss of every step, each step's time, the gradients' error against the single-device ones, and the
recorder's payload of one more step (its fallbacks and collectives).

The client (``sharddbg.cluster.smoke``) decides the matrix and compares; the mesh is the rank's own
(``rank_state``): the client rebuilds it for each configuration (``Cluster.remesh``).
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass

from ..errors import ShardDbgError
from .rank_state import STATE

WRAPPERS = ("none", "ddp", "fsdp2")
# Events kept for the one recorded step: a step of a model that fits a smoke test is far below this.
RECORDED_STEP_MAX_EVENTS = 200_000


class SmokeStepError(ShardDbgError, ValueError):
    """The user's ``setup`` or ``step`` returned something the smoke run cannot use."""


@dataclass(frozen=True)
class RunPlan:
    """What the client asks one run to do (sent as a plain dict: ``RunPlan(**plan)``)."""

    config: str  # the configuration's name, for messages and the context
    wrapper: str  # none | ddp | fsdp2
    compiled: bool
    training: bool  # False: forward only, under torch.no_grad()
    single_device: bool  # plain tensors in one process, no collective (the reference)
    samples: int  # samples per step: the single-device run takes them one after the other
    samples_per_domain: int  # samples a domain group is handed at once (the single device takes as many)
    steps: int
    seed: int
    lr: float
    record: bool  # run one more step under the recorder (not compared, not timed)
    return_grads: bool  # send the first step's gradients back (the reference run)


class SmokeContext:
    """The second argument of the user's ``step(model, ctx)``: where this step runs and how to hand it data.

    Draw the step's data from torch's global generator (``torch.randn(...)``): it is seeded for each step
    and sample alike in every configuration, so the single-device run and every sharded run see the same
    sample. Pass each whole tensor through ``ctx.shard(t, dim)`` (split along ``dim`` over this rank's
    domain group) or ``ctx.replicate(t)`` (the whole tensor on every rank of it, for targets): both give the
    tensor itself back where there is nothing to split (a single device, a domain group of one rank).

    A configuration that hands a domain group several samples at once (``samples_per_domain``) stacks them on
    the batch axis: the drawn sample, then copies of it rolled by 1, 2, ... along its last axis (other samples,
    so that a port mixing them shows), the same in the single-device run it is compared with.
    """

    def __init__(self, config: str, step: int, sample: int, training: bool, mesh, domain_size: int,
                 samples_per_domain: int):
        self.config = config  # the configuration's name ("ddp=2 x domain=2, DDP")
        self.step = step  # 0, 1, ...
        self.sample = sample  # which sample of the step this domain group works on (its ddp coordinate)
        self.training = training
        self.mesh = mesh  # the ("ddp", "domain") DeviceMesh; None on the single device
        self.domain_size = domain_size  # ranks one sample is sharded over (1: nothing is split)
        self.samples_per_domain = samples_per_domain

    def __repr__(self) -> str:
        return (f"SmokeContext(config={self.config!r}, step={self.step}, sample={self.sample}, "
                f"training={self.training}, domain_size={self.domain_size})")

    def shard(self, tensor, dim: int, *, batch_dim: int | None = 0, requires_grad: bool = False):
        """``tensor`` (the whole sample) split along ``dim`` over this rank's domain group, as a ShardTensor
        (``sharddbg.engine.scatter``); the tensor itself where the domain group is one rank."""
        return self._place(tensor, dim=dim, batch_dim=batch_dim, replicate=False, requires_grad=requires_grad)

    def replicate(self, tensor, *, batch_dim: int | None = 0, requires_grad: bool = False):
        """``tensor`` whole on every rank of the domain group (a Replicate ShardTensor); the tensor itself
        where the domain group is one rank."""
        return self._place(tensor, dim=None, batch_dim=batch_dim, replicate=True, requires_grad=requires_grad)

    def _place(self, tensor, *, dim, batch_dim, replicate: bool, requires_grad: bool):
        import torch

        if self.samples_per_domain > 1 and batch_dim is not None:
            tensor = torch.cat(_batch_of(tensor, self.samples_per_domain, batch_dim), dim=batch_dim)
        if self.domain_size == 1:
            tensor = tensor.detach()
            return tensor.requires_grad_(True) if requires_grad else tensor
        from ._scatter import scatter

        return scatter(tensor, dim, batch_dim=batch_dim, replicate=replicate, requires_grad=requires_grad)


def _batch_of(tensor, count: int, batch_dim: int) -> list:
    """``count`` samples made from ``tensor``: itself, then copies rolled by 1, 2, ... along its last axis
    (when that is not the batch axis). Identical copies would hide a port that swaps or mixes the samples;
    rolled ones differ and stay a sample of the same kind (the same values, dtype and range)."""
    last = tensor.dim() - 1
    if last < 0 or last == batch_dim % tensor.dim():
        return [tensor] * count
    return [tensor if k == 0 else tensor.roll(k, dims=last) for k in range(count)]


def run(setup, step, plan: dict, reference_grads: dict | None) -> dict:
    """One configuration on this rank (``plan``: a :class:`RunPlan` as a dict; ``setup`` and ``step``: the
    functions, or cloudpickle's bytes of them). ``reference_grads``:
    parameter name -> the single-device run's first-step gradient (numpy), or None.

    Returns ``losses`` (each step's loss as this rank sees it; the single-device run: the mean over the
    step's samples), ``step_s`` (each step's time: forward, backward, optimizer step), ``grad_error``
    (the largest error of a first-step gradient, relative to that gradient's largest value; None without
    a reference) with ``grad_error_param`` and ``grad_error_abs``, ``grads`` (with ``return_grads``),
    ``payload`` (the recorded step, with ``record``), ``rank``, ``coordinate``."""
    import torch

    p = RunPlan(**plan)
    setup, step = _loaded(setup), _loaded(step)
    if p.wrapper not in WRAPPERS:
        raise SmokeStepError(f"unknown wrapper {p.wrapper!r}; one of {WRAPPERS}")
    if not p.compiled:
        return _run(setup, step, p, reference_grads)
    torch._dynamo.reset()  # no graph or guard of an earlier configuration (another mesh, another shape)
    try:
        with _without_compile_caches():
            return _run(setup, step, p, reference_grads)
    finally:
        torch._dynamo.reset()


def _loaded(fn):
    """A function sent as cloudpickle's bytes (its module pickled by value), or the function itself."""
    if isinstance(fn, bytes):
        import cloudpickle

        return cloudpickle.loads(fn)
    return fn


@contextlib.contextmanager
def _without_compile_caches():
    """Compile from scratch, without inductor's and AOTAutograd's on-disk caches. Every rank of a CPU host
    shares one cache folder, and a compiled ShardTensor graph holds this rank's own halo exchange (its
    all_to_all split sizes) under a key that is the same on every rank: a rank loading another rank's entry
    sends the wrong sizes and aborts the process (seen: SIGABRT in gloo's all_to_all)."""
    import torch._functorch.config as functorch_config
    import torch._inductor.config as inductor_config

    with inductor_config.patch(fx_graph_cache=False), functorch_config.patch(enable_autograd_cache=False):
        yield


def _run(setup, step, p: RunPlan, reference_grads: dict | None) -> dict:
    import torch

    from .recorder import Recorder

    mesh = None if p.single_device else STATE.mesh
    if mesh is None and not p.single_device:
        raise ShardDbgError("torch.distributed is not set up on this engine; start it with sharddbg.Cluster")
    ddp_index, domain_size = (0, 1) if mesh is None else (mesh.get_coordinate()[0], mesh["domain"].size())
    model = _build(setup, p.seed)
    if domain_size > 1:
        _broadcast_over_domain(model, mesh)
    if p.compiled:
        _compile_regions(model)
    runner = wrapped = _wrap(model, p.wrapper, mesh)
    if not p.training:
        model.eval()
    optimizer = torch.optim.SGD(wrapped.parameters(), lr=p.lr) if p.training else None  # after wrapping
    samples = range(p.samples) if p.single_device else [ddp_index]
    out = {"rank": STATE.rank if not p.single_device else 0, "coordinate": None if mesh is None else
           [int(c) for c in mesh.get_coordinate()], "losses": [], "step_s": [], "grad_error": None,
           "grad_error_abs": None, "grad_error_param": None, "grads": None, "payload": None}
    for k in range(p.steps + (1 if p.record else 0)):
        recorded = p.record and k == p.steps
        recorder = Recorder(max_events=RECORDED_STEP_MAX_EVENTS) if recorded else contextlib.nullcontext()
        values = []
        elapsed = 0.0
        with recorder:
            for sample in samples:
                ctx = SmokeContext(p.config, k, sample, p.training, mesh, domain_size, p.samples_per_domain)
                torch.manual_seed(_data_seed(p.seed, k, sample))
                t0 = _now()
                if p.training:
                    loss = step(runner, ctx)
                    _check_loss(loss)
                    (loss / len(samples) if len(samples) > 1 else loss).backward()
                else:
                    with torch.no_grad():
                        loss = step(runner, ctx)
                        _check_loss(loss)
                elapsed += _now() - t0
                values.append(loss)
            if p.training and k == 0:
                grads = _full_grads(model)  # collectives on FSDP2's mesh: every rank, same order
                if p.return_grads:
                    out["grads"] = {name: g.numpy() for name, g in grads.items()}
                if reference_grads is not None:
                    out.update(_grad_error(grads, reference_grads))
            t0 = _now()
            if optimizer is not None:
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
            elapsed += _now() - t0
        if recorded:
            out["payload"] = recorder.payload(complete=True)
        else:
            out["losses"].append(sum(_loss_value(v) for v in values) / len(values))
            out["step_s"].append(elapsed)
    return out


def _build(setup, seed: int):
    import torch

    torch.manual_seed(seed)
    model = setup()
    if not isinstance(model, torch.nn.Module):
        raise SmokeStepError(f"setup() must return the model (a torch.nn.Module); it returned "
                             f"{type(model).__name__}")
    device = STATE.device or "cpu"
    return model.to(device)


def _broadcast_over_domain(model, mesh) -> None:
    """Every parameter and buffer from the domain group's first rank: neither DDP nor FSDP2 syncs weights
    over the domain axis, and unsynced weights train "fine" and wrong."""
    import torch.distributed as dist

    group = mesh["domain"].get_group()
    source = dist.get_global_rank(group, 0)
    for tensor in list(model.parameters()) + list(model.buffers()):
        dist.broadcast(tensor.data, src=source, group=group)


def _compile_regions(model) -> None:
    """Regional compile: each direct child of the model compiled in place (``Module.compile``, so names and
    parameters stay), before wrapping; the model itself when it has no children. The root's own code and the
    wrapper's hooks run eagerly: torch.compile of a whole DDP or FSDP2 model fails in dynamo inside
    ShardTensor's dispatch (``delattr`` of its conversion guard, torch 2.14.1, physicsnemo 2.2.2)."""
    children = list(model.children())
    for module in children or [model]:
        module.compile(dynamic=False)


def _wrap(model, wrapper: str, mesh):
    if wrapper == "ddp":
        from torch.nn.parallel import DistributedDataParallel

        # the ddp sub-mesh's group: the default (world) group would average over the domain axis too
        return DistributedDataParallel(model, process_group=mesh["ddp"].get_group())
    if wrapper == "fsdp2":
        from torch.distributed.fsdp import fully_shard

        return fully_shard(model, mesh=mesh["ddp"])
    return model


def _data_seed(seed: int, step: int, sample: int) -> int:
    """The generator's seed for one sample of one step: the same in every configuration."""
    return (seed * 1_000_003 + step * 1_009 + sample + 1) % (2**63 - 1)


def _now() -> float:
    import torch

    if STATE.device and STATE.device.startswith("cuda") and torch.cuda.is_initialized():
        torch.cuda.synchronize()
    return time.perf_counter()


def _is_distributed(tensor) -> bool:
    from physicsnemo.domain_parallel import ShardTensor
    from torch.distributed.tensor import DTensor

    return isinstance(tensor, (ShardTensor, DTensor))


def _check_loss(loss) -> None:
    import torch

    if not isinstance(loss, torch.Tensor):
        raise SmokeStepError(f"step(model, ctx) must return the loss as a tensor; it returned {type(loss).__name__}")
    if loss.numel() != 1:
        raise SmokeStepError(f"step(model, ctx) must return the loss as one number; it returned a tensor of "
                             f"shape {tuple(loss.shape)}")


def _loss_value(loss) -> float:
    """The loss as a number (a ShardTensor's whole value: a collective over its mesh, every rank alike)."""
    loss = loss.detach()
    if _is_distributed(loss):
        loss = loss.full_tensor()
    return float(loss.float().cpu().reshape(()).item())


def _full_grads(model) -> dict:
    """Each parameter's gradient, whole, on the CPU, as float32 (an FSDP2 or DTensor gradient is gathered)."""
    grads = {}
    for name, param in model.named_parameters():
        grad = param.grad
        if grad is None:
            continue
        grad = grad.detach()
        if _is_distributed(grad):
            grad = grad.full_tensor()
        grads[name] = grad.float().cpu()
    return grads


def _grad_error(grads: dict, reference: dict) -> dict:
    """The largest error of any gradient against the reference, relative to that reference's largest value."""
    import torch

    missing = sorted(set(reference) - set(grads))
    extra = sorted(set(grads) - set(reference))
    if missing or extra:
        raise SmokeStepError(
            "the model's parameters with a gradient differ from the single-device run's: "
            + "; ".join(part for part in (f"no gradient here for {missing}" if missing else "",
                                          f"only here: {extra}" if extra else "") if part))
    worst = {"grad_error": 0.0, "grad_error_abs": 0.0, "grad_error_param": None}
    for name, grad in grads.items():
        ref = torch.as_tensor(reference[name])
        if tuple(ref.shape) != tuple(grad.shape):
            raise SmokeStepError(f"the gradient of {name} has shape {tuple(grad.shape)} here and "
                                 f"{tuple(ref.shape)} on the single device")
        abs_err = float((grad - ref).abs().max()) if grad.numel() else 0.0
        scale = float(ref.abs().max()) if ref.numel() else 0.0
        rel = abs_err / scale if scale > 0 else (0.0 if abs_err == 0 else float("inf"))
        if worst["grad_error_param"] is None or rel > worst["grad_error"]:
            worst = {"grad_error": rel, "grad_error_abs": abs_err, "grad_error_param": name}
    return worst
