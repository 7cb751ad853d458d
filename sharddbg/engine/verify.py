"""What runs on a rank for ``Cluster.check`` (the numerical check) and ``Cluster.doctor`` (the pitfall doctor).

The check, in four calls from the client (``engine.api``), around the user's statement run as a cell:

1. ``check_prepare``: every rank reads the names the statement uses, and the ranks agree (one
   ``all_gather_object``) that the request is sound before any data moves; then TF32 off and deterministic
   algorithms on, the gradients of the inputs and parameters set aside, each input's and each distributed
   parameter's ``full_tensor()`` gathered, and the first rank of each domain group writes its group's
   bundle for the reference process (``engine.reference``) with its RNG state as it was before the statement;
2. (the statement runs as a cell on every rank);
3. ``check_backward``: the loss, ``backward()``, and where every compared tensor's local data lies in the
   global tensor (one ``all_gather_object`` of the layouts: uneven shards, and slices a spec calls whole);
4. ``check_compare``: each rank compares its local data with its slice of the reference; no communication.
``check_finish`` puts the gradients and the settings back (also after a failure).

The doctor (``doctor_facts``) reads what it needs on each rank without communicating; the client compares
the ranks' answers.
"""

from __future__ import annotations

import ast
import builtins
import hashlib
import os
import sys
import time
import types
from dataclasses import dataclass, field

from ..errors import ShardDbgError
from . import reference
from .rank_state import STATE, current_rank
from .recorder import plan_cache

__all__ = ["CheckSetupError", "check_prepare", "check_backward", "check_compare", "check_finish", "doctor_facts",
           "statement_names", "default_tolerance", "DEFAULT_RTOL"]

# Relative tolerance by dtype: about 100x what a different reduction order (the sharded sums) costs in
# that precision. The absolute tolerance defaults to rtol x the tensor's largest reference magnitude,
# because reduction-order error scales with the whole tensor, not with each element.
DEFAULT_RTOL = {"torch.float64": 1e-7, "torch.float32": 1e-4, "torch.float16": 5e-3, "torch.bfloat16": 2e-2,
                "torch.complex128": 1e-7, "torch.complex64": 1e-4}


class CheckSetupError(ShardDbgError, ValueError):
    """The check cannot run as asked (raised on every rank alike, so no rank waits for another)."""


def default_tolerance(dtype: str, scale: float, rtol: float | None, atol: float | None) -> tuple[float, float]:
    """(rtol, atol) for a tensor of ``dtype`` whose largest reference magnitude is ``scale``: the given
    values where given; integer and bool tensors must match exactly."""
    if rtol is None:
        rtol = DEFAULT_RTOL.get(dtype, 0.0)
    if atol is None:
        atol = rtol * scale
    return float(rtol), float(atol)


# ---- the names a statement uses ------------------------------------------------------------------------
class _NameUse(ast.NodeVisitor):
    """The names a statement reads before it binds them (in the order it reads them) and the names it
    binds at its top level, visiting each construct in the order Python evaluates it."""

    def __init__(self):
        self.reads: list[str] = []
        self.assigned: list[str] = []
        self.bound: set[str] = set()
        self.scopes: list[set[str]] = []  # names local to the functions and comprehensions being visited

    def _load(self, name: str) -> None:
        if name in self.bound or any(name in scope for scope in self.scopes) or name in self.reads:
            return
        self.reads.append(name)

    def _store(self, name: str) -> None:
        if self.scopes:
            self.scopes[-1].add(name)
            return
        self.bound.add(name)
        if name not in self.assigned:
            self.assigned.append(name)

    def visit_Name(self, node: ast.Name) -> None:
        (self._load if isinstance(node.ctx, ast.Load) else self._store)(node.id)

    def visit_Assign(self, node: ast.Assign) -> None:
        self.visit(node.value)
        for target in node.targets:
            self.visit(target)

    def visit_AnnAssign(self, node: ast.AnnAssign) -> None:
        if node.value is not None:
            self.visit(node.value)
        self.visit(node.target)

    def visit_AugAssign(self, node: ast.AugAssign) -> None:
        if isinstance(node.target, ast.Name):
            self._load(node.target.id)
        self.visit(node.value)
        self.visit(node.target)

    def visit_NamedExpr(self, node: ast.NamedExpr) -> None:
        self.visit(node.value)
        self.visit(node.target)

    def visit_For(self, node) -> None:
        self.visit(node.iter)
        self.visit(node.target)
        for child in node.body + node.orelse:
            self.visit(child)

    visit_AsyncFor = visit_For

    def visit_With(self, node) -> None:
        for item in node.items:
            self.visit(item.context_expr)
            if item.optional_vars is not None:
                self.visit(item.optional_vars)
        for child in node.body:
            self.visit(child)

    visit_AsyncWith = visit_With

    def visit_Import(self, node) -> None:
        for alias in node.names:
            self._store(alias.asname or alias.name.split(".")[0])

    visit_ImportFrom = visit_Import

    def visit_ExceptHandler(self, node: ast.ExceptHandler) -> None:
        if node.type is not None:
            self.visit(node.type)
        if node.name:
            self._store(node.name)
        for child in node.body:
            self.visit(child)

    def _function(self, node, body) -> None:
        for default in node.args.defaults + [d for d in node.args.kw_defaults if d is not None]:
            self.visit(default)
        for decorator in getattr(node, "decorator_list", []):
            self.visit(decorator)
        if not isinstance(node, ast.Lambda):
            self._store(node.name)
        args = node.args
        names = {a.arg for a in args.posonlyargs + args.args + args.kwonlyargs}
        names |= {a.arg for a in (args.vararg, args.kwarg) if a is not None}
        self.scopes.append(names)
        for child in body:
            self.visit(child)
        self.scopes.pop()

    def visit_FunctionDef(self, node) -> None:
        self._function(node, node.body)

    visit_AsyncFunctionDef = visit_FunctionDef

    def visit_Lambda(self, node: ast.Lambda) -> None:
        self._function(node, [node.body])

    def visit_ClassDef(self, node: ast.ClassDef) -> None:
        for child in node.bases + node.decorator_list + [k.value for k in node.keywords]:
            self.visit(child)
        self._store(node.name)
        self.scopes.append(set())
        for child in node.body:
            self.visit(child)
        self.scopes.pop()

    def _comprehension(self, node, results) -> None:
        self.scopes.append(set())
        for generator in node.generators:
            self.visit(generator.iter)
            self.visit(generator.target)
            for condition in generator.ifs:
                self.visit(condition)
        for result in results:
            self.visit(result)
        self.scopes.pop()

    def visit_ListComp(self, node) -> None:
        self._comprehension(node, [node.elt])

    visit_SetComp = visit_GeneratorExp = visit_ListComp

    def visit_DictComp(self, node: ast.DictComp) -> None:
        self._comprehension(node, [node.key, node.value])


def statement_names(stmt: str, loss: str | None = None) -> tuple[list[str], list[str]]:
    """(names the statement, then the loss expression, read before binding them; names the statement binds
    at its top level), each in order of first use. Builtins are left out of the reads."""
    use = _NameUse()
    use.visit(ast.parse(stmt))
    if loss:
        use.visit(ast.parse(loss, mode="eval"))
    reads = [n for n in use.reads if not hasattr(builtins, n)]
    return reads, use.assigned


# ---- distributed tensors, as plain facts ------------------------------------------------------------------
def _shard_tensor_type():
    module = sys.modules.get("physicsnemo.domain_parallel.shard_tensor")
    return module.ShardTensor if module is not None else None


def _kind(value) -> str:
    """ShardTensor, DTensor, Tensor, or the type's name."""
    import torch
    from torch.distributed.tensor import DTensor

    shard_tensor = _shard_tensor_type()
    if shard_tensor is not None and isinstance(value, shard_tensor):
        return "ShardTensor"
    if isinstance(value, DTensor):
        return "DTensor"
    if isinstance(value, torch.Tensor):
        return "Tensor"
    return type(value).__name__


def _placement(p) -> tuple:
    from torch.distributed.tensor import Partial, Replicate, Shard

    if type(p) is Shard:
        return ("shard", int(p.dim))
    if isinstance(p, Replicate):
        return ("replicate",)
    if isinstance(p, Partial):
        return ("partial",)
    return ("other", repr(p))


@dataclass
class TensorLayout:
    """Where a distributed tensor's local data lives, read without communication (what every rank sends to
    the others so that each can place its own slice)."""

    mesh_ranks: tuple[int, ...]
    coordinate: tuple[int, ...]
    placements: tuple[tuple, ...]
    local_shape: tuple[int, ...]
    global_shape: tuple[int, ...]


def _layout_and_local(value):
    """(TensorLayout, the local tensor) of a ShardTensor or DTensor; (None, value) for a plain tensor."""
    kind = _kind(value)
    if kind == "ShardTensor":
        spec = value._spec
        mesh, placements, global_shape, local = spec.mesh, spec.placements, spec.tensor_meta.shape, value._local_tensor
    elif kind == "DTensor":
        mesh, placements, global_shape, local = value.device_mesh, value.placements, value.shape, value._local_tensor
    else:
        return None, value
    layout = TensorLayout(mesh_ranks=tuple(int(r) for r in mesh.mesh.flatten().tolist()),
                          coordinate=tuple(int(c) for c in mesh.get_coordinate()),
                          placements=tuple(_placement(p) for p in placements),
                          local_shape=tuple(int(s) for s in local.shape), global_shape=tuple(int(s) for s in global_shape))
    return layout, local


@dataclass
class Location:
    """Where a rank's local data lies in the global tensor: ``offsets`` per dim (None: it cannot be placed,
    ``problem`` says why), ``row_dim`` the first split dim (the one whose rows the check reports),
    ``inferred``: the spec calls a dim whole that the ranks hold slices of (placed in mesh order)."""

    offsets: tuple[int, ...] | None
    row_dim: int | None = None
    inferred: list[str] = field(default_factory=list)
    problem: str | None = None


def locate(mine: TensorLayout, everyone: list[TensorLayout | None]) -> Location:
    """Place ``mine`` in the global tensor from every rank's layout of the same tensor (pure)."""
    peers = [p for p in everyone if p is not None and p.mesh_ranks == mine.mesh_ranks]
    ndim = len(mine.global_shape)
    if len(mine.local_shape) != ndim:
        return Location(None, problem=f"local data of {len(mine.local_shape)} dims for a {ndim}-d tensor")
    offsets = [0] * ndim
    split: list[int] = []
    inferred: list[str] = []
    for d in range(ndim):
        along = [i for i, p in enumerate(mine.placements) if p == ("shard", d)]
        if len(along) > 1:
            return Location(None, problem=f"dim {d} is sharded over {len(along)} mesh dims")
        if along:
            mesh_dim = along[0]
        elif mine.local_shape[d] != mine.global_shape[d]:
            mesh_dim = next((i for i in range(len(mine.coordinate))
                             if sum(p.local_shape[d] for p in _line(peers, mine, i)) == mine.global_shape[d]), None)
            if mesh_dim is None:
                return Location(None, problem=(
                    f"the spec says dim {d} is whole ({mine.global_shape[d]}), but this rank holds "
                    f"{mine.local_shape[d]} of it and the ranks' pieces do not add up to it"))
            inferred.append(f"the spec says dim {d} is whole ({mine.global_shape[d]}) but the ranks hold slices "
                            f"of it; compared as the slices they hold, in mesh order")
        else:
            continue
        line = _line(peers, mine, mesh_dim)
        total = sum(p.local_shape[d] for p in line)
        if total != mine.global_shape[d]:
            return Location(None, problem=(f"the {len(line)} shards along mesh dim {mesh_dim} hold {total} of dim "
                                           f"{d}'s {mine.global_shape[d]}"))
        offsets[d] = sum(p.local_shape[d] for p in line if p.coordinate[mesh_dim] < mine.coordinate[mesh_dim])
        split.append(d)
    return Location(tuple(offsets), split[0] if split else None, inferred)


def _line(peers: list[TensorLayout], mine: TensorLayout, mesh_dim: int) -> list[TensorLayout]:
    """The ranks whose coordinates equal ``mine``'s except along ``mesh_dim``."""
    return [p for p in peers if all(p.coordinate[k] == mine.coordinate[k]
                                    for k in range(len(mine.coordinate)) if k != mesh_dim)]


# ---- one check on this rank ----------------------------------------------------------------------------
@dataclass
class SavedSettings:
    """TF32 and determinism as they were before the check."""

    cuda_matmul_tf32: bool
    cudnn_tf32: bool
    matmul_precision: str
    deterministic: bool
    deterministic_warn_only: bool
    cudnn_deterministic: bool
    cudnn_benchmark: bool

    @classmethod
    def read(cls) -> "SavedSettings":
        import torch

        return cls(torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32,
                   torch.get_float32_matmul_precision(), torch.are_deterministic_algorithms_enabled(),
                   torch.is_deterministic_algorithms_warn_only_enabled(), torch.backends.cudnn.deterministic,
                   torch.backends.cudnn.benchmark)

    def restore(self) -> None:
        import torch

        torch.backends.cuda.matmul.allow_tf32 = self.cuda_matmul_tf32
        torch.backends.cudnn.allow_tf32 = self.cudnn_tf32
        torch.set_float32_matmul_precision(self.matmul_precision)
        torch.use_deterministic_algorithms(self.deterministic, warn_only=self.deterministic_warn_only)
        torch.backends.cudnn.deterministic = self.cudnn_deterministic
        torch.backends.cudnn.benchmark = self.cudnn_benchmark


@dataclass
class Compared:
    """One tensor this rank compares with the reference."""

    name: str  # as the result shows it: "y", "x.grad", "model.0.weight.grad"
    kind: str  # "output", "input grad", "parameter grad"
    source: tuple[str, str]  # where the reference keeps it: (section, name)
    local: object  # the rank's data (a plain tensor), None when the rank has no gradient
    layout: TensorLayout | None = None  # None: a plain tensor, compared whole
    how: str = "whole"  # "local shard", "whole", "full_tensor()"
    location: Location | None = None


@dataclass
class CheckState:
    """The check in progress on this rank (between check_prepare and check_finish)."""

    job_dir: str
    stmt: str
    loss: str | None
    grads: bool
    group: int  # this rank's domain group (its ddp index)
    leader: bool  # the first rank of its domain group: writes the group's bundle
    inputs: dict  # name -> the sharded value as it was before the statement
    models: dict  # name -> the module (unwrapped from DDP)
    outputs: list[str]
    outputs_inferred: bool  # taken from the names the statement binds (those that are no tensor are left out)
    settings: SavedSettings
    saved_grads: list = field(default_factory=list)  # (tensor, its .grad before the check)
    compared: list[Compared] = field(default_factory=list)
    backward: str = reference.BACKWARD_NONE
    backward_note: str = ""
    store_key: str | None = None  # this rank's key in the rendezvous store when its backward raised


CURRENT: CheckState | None = None


def _namespace() -> dict:
    from IPython import get_ipython

    shell = get_ipython()
    if shell is None:
        raise CheckSetupError("cl.check runs on the ranks of a sharddbg cluster (no IPython kernel here)")
    return shell.user_ns


def _group_of(rank: int) -> tuple[int, bool]:
    ddp, domain = STATE.mesh_shape or (1, 1)
    return rank // domain, rank % domain == 0


def _gather(obj) -> list:
    """``obj`` from every rank, in rank order (one all_gather_object over the world)."""
    import torch.distributed as dist

    out: list = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


def _agree(problems: list[str], plan=None) -> None:
    """Every rank learns every rank's problems (and plan); all raise the same CheckSetupError when any rank
    has one or the plans differ, so none is left waiting in a collective the others skip."""
    gathered = _gather((current_rank(), problems, plan))
    by_problem: dict[str, list[int]] = {}
    for rank, rank_problems, _ in gathered:
        for problem in rank_problems:
            by_problem.setdefault(problem, []).append(rank)
    lines = [problem + ("" if len(ranks) == len(gathered) else f" (on rank{'s' if len(ranks) > 1 else ''} "
                        f"{', '.join(map(str, ranks))})") for problem, ranks in by_problem.items()]
    plans: dict[str, list[int]] = {}
    for rank, _, rank_plan in gathered:
        plans.setdefault(repr(rank_plan), []).append(rank)
    if not lines and len(plans) > 1:
        lines.append("the ranks disagree about the names: " + "; ".join(
            f"ranks {ranks} see {text}" for text, ranks in plans.items()))
    if lines:
        raise CheckSetupError("cl.check: " + "; ".join(lines))


def _unwrap(module):
    """The module DDP wraps (the same parameters); FSDP wrappers are refused by the caller."""
    from torch.nn.parallel import DistributedDataParallel

    return module.module if isinstance(module, DistributedDataParallel) else module


def _wrapper_problem(name: str, module) -> str | None:
    from torch.distributed.fsdp import FSDPModule, FullyShardedDataParallel

    if any(isinstance(m, FullyShardedDataParallel) for m in module.modules()):
        return (f"{name} holds FullyShardedDataParallel (FSDP1), whose flattened parameters cannot be copied to "
                f"one process; FSDP1 fights ShardTensor anyway (%shard_doctor): check the module unwrapped")
    if any(isinstance(m, FSDPModule) for m in module.modules()):
        return f"{name} is wrapped by fully_shard (FSDP2): check the module before wrapping it"
    return None


def _module_tensors(module) -> list[tuple[str, object]]:
    """The module's parameters and buffers, each once, in a fixed order."""
    return list(module.named_parameters()) + list(module.named_buffers())


def _classify(name: str, value) -> tuple[str, object]:
    """How a name the statement reads reaches the reference: ("module", its name), ("scatter",),
    ("no_patches",), ("unavailable", why), ("problem", text) or ("value", value)."""
    import torch
    from torch.distributed.device_mesh import DeviceMesh

    from . import patches
    from ._scatter import scatter

    if isinstance(value, types.ModuleType):
        return "module", value.__name__
    if value is scatter:
        return "scatter", None
    if value is patches.without_patches:
        return "no_patches", None
    if isinstance(value, torch.Tensor) and reference.is_distributed(value):
        return "problem", (f"{name} is a {_kind(value)} the statement reads: name it in inputs= so that the "
                           f"reference gets its full tensor")
    if isinstance(value, torch.nn.Module):
        problem = _wrapper_problem(name, value)
        if problem:
            return "problem", problem
        if any(reference.is_distributed(t) for _, t in _module_tensors(value)):
            return "problem", (f"{name} is a module with distributed parameters the statement uses: name it in "
                               f"model= so that they are gathered")
        return "value", _unwrap(value)
    if isinstance(value, DeviceMesh):
        return "unavailable", "a DeviceMesh; the reference is one process without torch.distributed"
    return "value", value


def check_prepare(job_dir: str, stmt: str, loss: str | None, inputs, outputs, models, grads: bool) -> dict:
    """Step 1 of the check (see the module's docstring). ``inputs`` / ``outputs`` / ``models``: names, or
    None to take them from the statement (the tensors it reads / the names it binds / the modules it
    reads). Returns what this rank found: the names, its group, TF32 as it was."""
    global CURRENT
    import torch

    if CURRENT is not None:
        check_finish()  # a check cut short (the client stopped waiting): start clean
    namespace = _namespace()
    reads, assigned = statement_names(stmt, loss)
    problems: list[str] = []
    if inputs is None:
        inputs = [n for n in reads if isinstance(namespace.get(n), torch.Tensor)]
    if models is None:
        models = [n for n in reads if isinstance(namespace.get(n), torch.nn.Module) and n not in inputs]
    outputs_inferred = outputs is None
    if outputs_inferred:
        outputs = list(assigned)
    input_values = {}
    for name in inputs:
        if name not in namespace:
            problems.append(f"no variable {name!r} on the ranks (inputs=)")
        elif not isinstance(namespace[name], torch.Tensor):
            problems.append(f"{name} is a {type(namespace[name]).__name__}, not a tensor (inputs=)")
        else:
            input_values[name] = namespace[name]
    model_values = {}
    for name in models:
        if name not in namespace:
            problems.append(f"no variable {name!r} on the ranks (model=)")
        elif not isinstance(namespace[name], torch.nn.Module):
            problems.append(f"{name} is a {type(namespace[name]).__name__}, not a torch.nn.Module (model=)")
        else:
            problem = _wrapper_problem(name, namespace[name])
            if problem:
                problems.append(problem)
            else:
                model_values[name] = _unwrap(namespace[name])
    values: dict[str, tuple[str, object]] = {}
    for name in reads:
        if name in input_values or name in model_values or name not in namespace:
            continue
        how, value = _classify(name, namespace[name])
        if how == "problem":
            problems.append(value)
        else:
            values[name] = (how, value)
    plan = ([(n, _kind(v)) for n, v in input_values.items()],
            [(n, [(p, _kind(t)) for p, t in _module_tensors(m)]) for n, m in model_values.items()],
            sorted((n, how) for n, (how, _) in values.items()), list(outputs))
    _agree(problems, plan)
    unsynced = _unsynced_parameters(model_values)

    rank = current_rank()
    group, leader = _group_of(rank)
    settings = SavedSettings.read()
    state = CheckState(job_dir=job_dir, stmt=stmt, loss=loss, grads=grads, group=group, leader=leader,
                       inputs=input_values, models=model_values, outputs=list(outputs),
                       outputs_inferred=outputs_inferred, settings=settings)
    CURRENT = state
    _check_settings()
    rng = torch.get_rng_state()  # before the statement: the reference starts from it
    full_inputs = {}
    full_of: dict[int, object] = {}
    with torch.no_grad():
        for name, value in input_values.items():
            full = value.full_tensor() if reference.is_distributed(value) else value
            full_inputs[name] = (full.detach(), bool(value.requires_grad))
        for module in model_values.values():
            for _, tensor in _module_tensors(module):
                if reference.is_distributed(tensor) and id(tensor) not in full_of:
                    full_of[id(tensor)] = tensor.full_tensor()
    if grads:
        _set_grads_aside(state)
    if leader:
        _write_bundle(state, full_inputs, full_of, values, rng)
    device = STATE.device or "cpu"
    return {"rank": rank, "group": group, "inputs": list(input_values), "models": list(model_values),
            "outputs": list(outputs), "device": device, "tf32": _tf32_facts(settings, device),
            "deterministic_before": settings.deterministic, "unsynced": unsynced}


def _unsynced_parameters(models: dict) -> list[str]:
    """The plain parameters of ``models`` whose values differ across this rank's domain group (one
    all_gather_object of digests): the reference takes the group's first rank's, so these explain a failure."""
    digests = {f"{m}.{p}": _digest(t) for m, module in models.items() for p, t in module.named_parameters()
               if _kind(t) == "Tensor"}
    everyone = _gather(digests)
    group = _mesh_group_ranks("domain") or [current_rank()]
    return [name for name, digest in digests.items() if any(everyone[r].get(name) != digest for r in group)]


def _tf32_facts(settings: SavedSettings, device: str) -> dict:
    """Whether TF32 was on before the check (it exists on CUDA only)."""
    on_cuda = device.startswith("cuda")
    return {"was_on": on_cuda and (settings.cuda_matmul_tf32 or settings.cudnn_tf32
                                   or settings.matmul_precision != "highest"),
            "applies": on_cuda, "cuda_matmul_allow_tf32": settings.cuda_matmul_tf32,
            "cudnn_allow_tf32": settings.cudnn_tf32, "float32_matmul_precision": settings.matmul_precision}


def _check_settings() -> None:
    import torch

    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    torch.set_float32_matmul_precision("highest")
    torch.backends.cudnn.deterministic = True
    torch.backends.cudnn.benchmark = False
    torch.use_deterministic_algorithms(True, warn_only=True)


def _grad_leaves(state: CheckState) -> list:
    """The tensors whose gradients the check compares: inputs and parameters that require grad."""
    leaves = [v for v in state.inputs.values() if v.requires_grad]
    for module in state.models.values():
        leaves += [p for p in module.parameters() if p.requires_grad]
    return leaves


def _set_grads_aside(state: CheckState) -> None:
    """Keep each gradient as it was and clear it, so the check's backward starts from none."""
    seen = set()
    for tensor in _grad_leaves(state):
        if id(tensor) in seen:
            continue
        seen.add(id(tensor))
        state.saved_grads.append((tensor, tensor.grad))
        tensor.grad = None
        if not tensor.is_leaf:
            tensor.retain_grad()


def _write_bundle(state: CheckState, full_inputs: dict, full_of: dict, values: dict, rng) -> None:
    """The group's bundle for the reference process, and what the reference must take from this rank to
    load it: ``sys.path``, the working directory, the modules the bundle refers to (see ``engine.reference``)."""
    import cloudpickle

    bundle = {"inputs": full_inputs, "models": state.models, "rng": rng, "values": {}, "modules": {},
              "scatter_names": [], "no_patches_names": [], "unavailable": {}}
    copied: dict = {}
    for name, (how, value) in values.items():
        if how == "module" and reference.found_again(value):
            bundle["modules"][name] = value
        elif how == "module":  # a module the reference could not import by its name: it travels by value
            copied[name] = _namespace()[name]
        elif how == "scatter":
            bundle["scatter_names"].append(name)
        elif how == "no_patches":
            bundle["no_patches_names"].append(name)
        elif how == "unavailable":
            bundle["unavailable"][name] = value
        else:
            copied[name] = value
    registered: list[str] = []
    try:
        reaches = _carry_by_value(state.models, copied, full_of, bundle["unavailable"], registered)
        bundle["values"] = copied
        try:
            pickled = reference.dumps_bundle(bundle, full_of)
        except Exception as exc:
            raise CheckSetupError(f"cl.check: the model(s) {', '.join(state.models) or '(none)'} cannot be copied "
                                  f"to the reference process: {type(exc).__name__}: {exc}") from exc
        by_value = set(registered) | set(cloudpickle.list_registry_pickle_by_value())
    finally:
        for unit in registered:
            cloudpickle.unregister_pickle_by_value(sys.modules[unit])
    origins = [reference.ModuleOrigin(m, _module_file(m), m == "__main__" or _within(m, by_value),
                                      [n for n, modules in reaches.items() if m in modules])
               for m in pickled.modules if m != "builtins"]
    folder = reference.group_dir(state.job_dir, state.group)
    os.makedirs(folder, mode=0o700, exist_ok=True)
    environment = reference.RankEnvironment([str(p) for p in sys.path if isinstance(p, (str, os.PathLike))],
                                            os.getcwd(), origins)
    environment.write(os.path.join(folder, reference.ENVIRONMENT_FILE))
    with open(os.path.join(folder, reference.BUNDLE_FILE), "wb") as f:
        f.write(pickled.data)


def _within(module: str, units: set[str]) -> bool:
    """``module`` is one of ``units`` or inside one of them (a submodule of a package)."""
    return any(module == u or module.startswith(u + ".") for u in units)


def _module_file(name: str) -> str | None:
    file = getattr(sys.modules.get(name), "__file__", None)
    return os.path.abspath(file) if isinstance(file, str) else None


def _carry_by_value(models: dict, copied: dict, full_of: dict, unavailable: dict, registered: list[str]) -> dict:
    """Scan the models and the values the reference gets (``copied``; one that cannot be copied moves to
    ``unavailable``) for the modules they refer to; every module that a new process with this rank's
    ``sys.path`` and working directory would not import from the same file is registered with cloudpickle to
    travel by value (its name appended to ``registered``: the caller unregisters it), and the scan repeats
    (a class carried by value brings the globals of its module). Returns each variable's modules."""
    import cloudpickle

    judged: dict[str, bool] = {}  # top-level name -> found again
    for _ in range(10):  # each round adds modules reached only through code now carried by value
        reaches: dict[str, list[str]] = {}
        for name, value in [*models.items(), *copied.items()]:
            try:
                reaches[name] = reference.dumps_bundle(value, full_of, with_data=False).modules
            except Exception as exc:  # noqa: BLE001 - a value stays on the ranks, the reason kept; a model raises
                if name in models:
                    raise CheckSetupError(f"cl.check: the model {name} cannot be copied to the reference process: "
                                          f"{type(exc).__name__}: {exc}") from exc
                unavailable[name] = f"it cannot be copied ({type(exc).__name__}: {exc})"
                del copied[name]
        carried = set(cloudpickle.list_registry_pickle_by_value())
        units = set()
        for module in {m for modules in reaches.values() for m in modules}:
            top = module.partition(".")[0]
            if top == "__main__" or _within(module, carried):
                continue
            if top not in judged:
                judged[top] = reference.found_again(top)
            unit = reference.by_value_unit(module)
            if not judged[top] and unit in sys.modules:
                units.add(unit)
        if not units:
            return reaches
        for unit in sorted(units):
            cloudpickle.register_pickle_by_value(sys.modules[unit])
            registered.append(unit)
    return reaches


def _require_check() -> CheckState:
    if CURRENT is None:
        raise CheckSetupError("cl.check: no check is in progress on this rank (check_prepare first)")
    return CURRENT


def _entry(name: str, kind: str, source: tuple[str, str], value) -> Compared:
    """The Compared record of ``value``; a Partial value is summed first (``full_tensor()``, a collective
    every rank makes for the same tensor)."""
    if value is None:
        return Compared(name, kind, source, None)
    layout, local = _layout_and_local(value)
    if layout is not None and any(p[0] in ("partial", "other") for p in layout.placements):
        return Compared(name, kind, source, value.full_tensor().detach(), None, "full_tensor()")
    if layout is None:
        return Compared(name, kind, source, local.detach(), None, "whole")
    return Compared(name, kind, source, local.detach(), layout, "local shard")


def _place(entries: list[Compared]) -> None:
    """Every rank's layouts of ``entries`` (one all_gather_object); each places its own local data."""
    gathered = _gather({e.name: e.layout for e in entries})
    for e in entries:
        if e.layout is not None:
            e.location = locate(e.layout, [g.get(e.name) for g in gathered])


def check_backward() -> dict:
    """Step 3: the outputs as the statement left them, the loss and its backward, the gradients; each
    placed in its global tensor. Returns this rank's loss value and how the gradients came about."""
    import torch

    state = _require_check()
    namespace = _namespace()
    problems = []
    outputs = {}
    for name in state.outputs:
        value = namespace.get(name)
        if isinstance(value, torch.Tensor):
            outputs[name] = value
        elif not state.outputs_inferred:
            problems.append(f"the statement left no variable {name!r} (outputs=)" if name not in namespace else
                            f"{name} is a {type(value).__name__} after the statement, not a tensor (outputs=)")
    leaves = _grad_leaves(state) if state.grads else []
    by_statement = any(t.grad is not None for t in leaves)
    # the same decisions on every rank: they rest on what every rank found (one exchange)
    _agree(problems, [(n, _kind(v)) for n, v in outputs.items()])
    statement_flags = _gather(by_statement)
    with torch.no_grad():
        entries = [_entry(n, "output", ("outputs", n), v) for n, v in outputs.items()]
    _place(entries)
    misplaced = [e for e in entries if e.location is not None and (e.location.problem or e.location.inferred)]
    loss_value = None
    if not state.grads or not leaves:
        state.backward = reference.BACKWARD_NONE
        state.backward_note = "gradients not compared" if not state.grads else "nothing the check compares requires grad"
    elif any(statement_flags):
        state.backward = reference.BACKWARD_BY_STATEMENT
        state.backward_note = "the statement ran its own backward; the check compares the gradients it left"
    elif misplaced:
        state.backward = reference.BACKWARD_SKIPPED
        state.backward_note = (f"backward not run: the spec of {', '.join(sorted({e.name for e in misplaced}))} "
                               f"disagrees with its data on some ranks (a backward through it can crash them)")
    else:
        loss = eval(compile(state.loss, reference.LOSS_FILENAME, "eval"), namespace) if state.loss \
            else reference.default_loss(list(outputs.values()))
        if loss is None or not loss.requires_grad:
            state.backward = reference.BACKWARD_NONE
            state.backward_note = "the loss does not require grad"
        else:
            with torch.no_grad():
                whole = loss.full_tensor() if reference.is_distributed(loss) else loss
                loss_value = float(whole.detach().double().sum())
            try:
                loss.backward()
                state.backward = reference.BACKWARD_BY_CHECK
            except Exception as exc:  # noqa: BLE001 - raised alike on every rank: a finding; else re-raised
                failure = _backward_failure(exc)
                if not _every_rank_failed(state, failure):
                    raise
                state.backward = reference.BACKWARD_FAILED
                state.backward_note = f"the backward raised on every rank: {failure}; gradients not compared"
    grads: list[Compared] = []
    if state.backward in (reference.BACKWARD_BY_CHECK, reference.BACKWARD_BY_STATEMENT):
        with torch.no_grad():
            for name, value in state.inputs.items():
                if value.requires_grad:
                    grads.append(_entry(f"{name}.grad", "input grad", ("input_grads", name), value.grad))
            for model, module in state.models.items():
                for pname, param in module.named_parameters():
                    if param.requires_grad:
                        grads.append(_entry(f"{model}.{pname}.grad", "parameter grad",
                                            ("param_grads", f"{model}.{pname}"), param.grad))
        _place(grads)
    state.compared = entries + grads
    return {"rank": current_rank(), "loss": loss_value, "backward": state.backward, "note": state.backward_note,
            "outputs": list(outputs)}


def check_compare(rtol: float | None, atol: float | None) -> list[dict]:
    """Step 4: each compared tensor against this rank's slice of its group's reference, as plain records."""
    import torch

    state = _require_check()
    ref = torch.load(os.path.join(reference.group_dir(state.job_dir, state.group), reference.REFERENCE_FILE),
                     weights_only=True)
    return [_compare(e, ref[e.source[0]].get(e.source[1]), rtol, atol, state.group) for e in state.compared]


def _compare(e: Compared, expected, rtol, atol, group: int) -> dict:
    import torch

    record = {"tensor": e.name, "kind": e.kind, "rank": current_rank(), "group": group, "compared": e.how,
              "dtype": None, "shape": None, "reference_shape": None, "max_abs": float("nan"),
              "max_rel": float("nan"), "ratio": float("nan"), "rtol": float("nan"), "atol": float("nan"),
              "bad": 0, "numel": 0, "ok": False, "row_dim": None, "row_start": None, "rows": [], "note": ""}
    notes = []
    if e.location is not None and e.location.inferred:
        notes += e.location.inferred
        record["compared"] = "slices its spec calls whole"
    if expected is None and e.local is None:
        record.update(ok=True, note="no gradient, on this rank nor in the unsharded reference")
        return record
    if e.local is None:
        record["note"] = "no gradient on this rank, but the unsharded reference has one"
        record["reference_shape"] = tuple(expected.shape)
        return record
    local = e.local
    record.update(dtype=str(local.dtype), shape=tuple(local.shape), numel=int(local.numel()))
    if expected is None:
        record["note"] = ("the unsharded reference has no tensor of that name" if e.kind == "output"
                          else "a gradient on this rank, but none in the unsharded reference")
        return record
    record["reference_shape"] = tuple(expected.shape)
    if e.location is not None and e.location.problem:
        record["note"] = "; ".join(notes + [f"cannot be placed in the global tensor: {e.location.problem}"])
        return record
    offsets = e.location.offsets if e.location is not None else (0,) * expected.ndim
    part = expected
    if len(offsets) == expected.ndim and local.ndim == expected.ndim:
        part = expected[tuple(slice(o, o + n) for o, n in zip(offsets, local.shape))]
    if tuple(part.shape) != tuple(local.shape):
        record["note"] = "; ".join(notes + [f"shape {tuple(local.shape)} does not fit the reference's "
                                            f"{tuple(expected.shape)}" + (f" at offsets {offsets}" if any(offsets) else "")])
        return record
    a, b = _wide(local), _wide(part)
    scale = float(expected.detach().abs().max()) if expected.numel() else 0.0
    rtol_used, atol_used = default_tolerance(str(expected.dtype), scale, rtol, atol)
    diff = torch.nan_to_num((a - b).abs(), nan=float("inf"))
    good = diff <= atol_used + rtol_used * b.abs()
    max_abs = float(diff.max()) if diff.numel() else 0.0
    norm_a, norm_b = float(a.norm()), float(b.norm())
    record.update(max_abs=max_abs, max_rel=(max_abs / scale if scale > 0 else (0.0 if max_abs == 0 else float("inf"))),
                  ratio=(norm_a / norm_b if norm_b > 0 else (1.0 if norm_a == 0 else float("inf"))),
                  rtol=rtol_used, atol=atol_used, bad=int((~good).sum()), ok=bool(good.all()),
                  note="; ".join(notes))
    row_dim = e.location.row_dim if e.location is not None else None
    if row_dim is not None and a.ndim:
        others = tuple(d for d in range(a.ndim) if d != row_dim)
        per_row = diff.amax(dim=others) if others else diff
        row_good = good.all(dim=others) if others else good
        start = offsets[row_dim]
        record.update(row_dim=row_dim, row_start=start,
                      rows=[(start + i, float(err), bool(ok)) for i, (err, ok) in
                            enumerate(zip(per_row.tolist(), row_good.tolist()))])
    return record


def _wide(tensor):
    """The tensor on the CPU in double precision (complex: complex128), for the comparison itself."""
    import torch

    tensor = tensor.detach().cpu()
    return tensor.to(torch.complex128) if tensor.is_complex() else tensor.to(torch.float64)


BACKWARD_AGREE_S = 10.0  # how long a rank whose backward raised waits to hear that every other rank's did too


def _backward_failure(exc: BaseException) -> str:
    """"RuntimeError: boom (at cell [4], line 2: `raise ...`)": what the backward raised, and where (the
    innermost frame: a cell's line, or a file's)."""
    import traceback

    from .recorder.cells import position

    frames = traceback.extract_tb(exc.__traceback__)
    where = f" (at {position(frames[-1].filename, frames[-1].lineno, frames[-1].name)})" if frames else ""
    first_line = str(exc).splitlines()[0] if str(exc) else ""
    return f"{type(exc).__name__}: {first_line}{where}"


def _every_rank_failed(state: CheckState, failure: str) -> bool:
    """This rank's backward raised: did every rank's? Told through the rendezvous store, within
    ``BACKWARD_AGREE_S`` (a rank whose backward went on may be waiting in one of its collectives: then this
    rank re-raises and the cluster releases that one, as for any cell). Every rank answers alike: they all
    see the same keys."""
    import torch.distributed as dist
    from torch.distributed.distributed_c10d import _get_default_store

    store = _get_default_store()
    prefix = f"sharddbg/check/{os.path.basename(state.job_dir)}/backward-failed/"
    state.store_key = prefix + str(current_rank())
    store.set(state.store_key, failure)
    keys = [prefix + str(r) for r in range(dist.get_world_size())]
    deadline = time.monotonic() + BACKWARD_AGREE_S
    while not store.check(keys):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)
    return True


def check_finish() -> None:
    """Put back what the check changed on this rank (gradients, TF32 and determinism); no communication."""
    global CURRENT
    state, CURRENT = CURRENT, None
    if state is None:
        return
    if state.store_key is not None:  # every rank has read it: they all went on past the backward
        try:
            from torch.distributed.distributed_c10d import _get_default_store

            _get_default_store().delete_key(state.store_key)
        except Exception:  # noqa: BLE001 - a store gone with its group: nothing left to clean
            pass
    for tensor, grad in state.saved_grads:
        tensor.grad = grad
    state.settings.restore()


# ---- the doctor ------------------------------------------------------------------------------------------
_IPYTHON_NAMES = {"In", "Out", "exit", "quit", "get_ipython"}


def _digest(tensor) -> str:
    """A digest of the tensor's bytes: equal digests, equal values (bit for bit)."""
    import torch

    data = tensor.detach().cpu().contiguous().view(-1)
    return hashlib.blake2b(data.view(torch.uint8).numpy().tobytes() if data.numel() else b"",
                           digest_size=12).hexdigest()


def doctor_facts(names=None) -> dict:
    """What the pitfall doctor needs from this rank, read without communication: the plain parameters'
    digests, the ShardTensors' shapes and grad flags, unwaited collectives, optimizers' parameter groups,
    FSDP1 and DDP wrappers. ``names``: the variables to examine (None: every public one)."""
    import torch
    from torch.distributed.fsdp import FullyShardedDataParallel
    from torch.nn.parallel import DistributedDataParallel

    namespace = _namespace()
    missing = []
    if names:
        chosen = {}
        for name in names:
            if name in namespace:
                chosen[name] = namespace[name]
            else:
                missing.append(name)
    else:
        chosen = {n: v for n, v in namespace.items() if not n.startswith("_") and n not in _IPYTHON_NAMES
                  and not isinstance(v, (types.ModuleType, type, types.FunctionType))}
    rank = current_rank()
    ddp_size, domain_size = STATE.mesh_shape or (1, 1)
    facts = {"rank": rank, "ddp": rank // domain_size, "domain": rank % domain_size, "missing": missing,
             "params": [], "shard_tensors": [], "async_tensors": [], "optimizers": [], "fsdp1": [], "ddp_wrappers": [],
             "physicsnemo": (STATE.patches.physicsnemo if STATE.patches else None),
             "requires_grad_works": None, "unwaited": _unwaited_collectives(),
             "plan_cache_entries": plan_cache.cache_entries(),
             "ddp_group": _mesh_group_ranks("ddp"), "domain_group": _mesh_group_ranks("domain")}
    seen_modules: set[int] = set()
    seen_params: set[int] = set()  # a parameter reached through two variables (a model and its DDP) counts once
    for name, value in chosen.items():
        if isinstance(value, torch.nn.Module):
            for path, sub in value.named_modules():
                if isinstance(sub, FullyShardedDataParallel):
                    facts["fsdp1"].append(f"{name}.{path}" if path else name)
                if isinstance(sub, DistributedDataParallel):
                    facts["ddp_wrappers"].append({"name": f"{name}.{path}" if path else name,
                                                  "group": _group_ranks(sub.process_group)})
            if id(value) not in seen_modules:
                seen_modules.add(id(value))
                for pname, param in value.named_parameters():
                    if id(param) in seen_params:
                        continue
                    seen_params.add(id(param))
                    entry = {"module": name, "param": pname, "kind": _kind(param), "shape": tuple(param.shape)}
                    if entry["kind"] == "Tensor":
                        entry["digest"] = _digest(param)
                    facts["params"].append(entry)
        elif isinstance(value, torch.optim.Optimizer):
            facts["optimizers"].append({"name": name, "groups": [_optimizer_group(i, g)
                                                                 for i, g in enumerate(value.param_groups)]})
        elif isinstance(value, torch.Tensor):
            if _is_async(value):
                facts["async_tensors"].append(name)
            if _kind(value) == "ShardTensor":
                facts["shard_tensors"].append(_shard_facts(name, value))
                if facts["requires_grad_works"] is None:
                    facts["requires_grad_works"] = _requires_grad_works(value)
    return facts


def _autograd_flag(value) -> bool:
    """The flag autograd itself reads on a ShardTensor (ShardTensor.requires_grad also answers True when
    only its local tensor has the flag)."""
    import torch

    with torch._C.DisableTorchFunctionSubclass():
        return bool(torch.Tensor.requires_grad.__get__(value))


def _requires_grad_works(value) -> bool:
    """Whether ``requires_grad_(True)`` on a ShardTensor sets autograd's flag in this physicsnemo (older
    releases send it through the DTensor fallback, which sets it on a temporary that is thrown away); tried
    on a detached copy of ``value``, so the user's tensor is left as it is."""
    import torch

    with torch.no_grad():
        probe = value.detach()
    probe.requires_grad_(True)
    return _autograd_flag(probe)


def _unwaited_collectives() -> int | None:
    """Functional collectives issued on this rank and never waited (torch's work registry); None where this
    torch does not say."""
    import torch

    count = getattr(torch._C._distributed_c10d, "_get_work_registry_size", None)
    return int(count()) if count is not None else None


def _is_async(value) -> bool:
    from torch.distributed._functional_collectives import AsyncCollectiveTensor

    if isinstance(value, AsyncCollectiveTensor):
        return True
    _, local = _layout_and_local(value)
    return isinstance(local, AsyncCollectiveTensor)


def _group_ranks(group) -> list[int]:
    import torch.distributed as dist

    try:
        return [int(r) for r in dist.get_process_group_ranks(group)]
    except Exception:  # noqa: BLE001 - a destroyed group: no ranks
        return []


def _mesh_group_ranks(dim: str) -> list[int]:
    """The ranks of this rank's group along the cluster mesh's ``dim``."""
    mesh = STATE.mesh
    if mesh is None:
        return []
    return [int(r) for r in mesh[dim].mesh.flatten().tolist()]


def _optimizer_group(index: int, group: dict) -> dict:
    params = group.get("params", [])
    kinds = [_kind(p) for p in params]
    return {"index": index, "foreach": group.get("foreach"), "fused": group.get("fused"),
            "distributed": sum(k in ("ShardTensor", "DTensor") for k in kinds), "plain": kinds.count("Tensor"),
            "cuda": any(getattr(p, "is_cuda", False) for p in params)}


def _shard_facts(name: str, value) -> dict:
    spec = value._spec
    wrapper_flag = _autograd_flag(value)
    return {"name": name, "global_shape": tuple(int(s) for s in spec.tensor_meta.shape),
            "sharded_dims": sorted({int(p.dim) for p in spec.placements if _placement(p)[0] == "shard"}),
            "mesh_dims": list(spec.mesh.mesh_dim_names or ()), "requires_grad": bool(value.requires_grad),
            "wrapper_requires_grad": wrapper_flag, "local_requires_grad": bool(value._local_tensor.requires_grad),
            "is_leaf": bool(value.is_leaf)}


# ---- shared with the op-by-op diff (engine.diff), which runs the check's steps around its own -------------
gather = _gather
place = _place
compare = _compare
placement = _placement
namespace = _namespace
