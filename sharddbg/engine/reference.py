"""The unsharded reference of ``Cluster.check``: the user's statement run again in a separate single process.

The client starts it with its own Python (``python -m sharddbg.engine.reference JOB_DIR``), so that the
client itself never imports torch. It reads what the ranks left in ``JOB_DIR`` for each domain group (the
group's first rank wrote ``group<g>/bundle.pkl``: every input's ``full_tensor()``, the models with that
rank's weights, the other values the statement reads, its RNG state) and ``job.json`` (the statement, the
loss, the names), runs the statement on plain tensors with ``sharddbg.engine.scatter`` as the identity, and
writes ``group<g>/reference.pt`` (outputs and gradients) for the ranks to compare against. A failure is
written to ``reference-error.json`` (what raised, where in the statement), and the exit status is 1.

The reference sees what the ranks see: the group's first rank also writes ``group<g>/environment.json``
(its ``sys.path``, its working directory, and the modules the bundle refers to, with the file each came
from), and the reference takes that path and directory before it loads the bundle, so a model whose class
lives in a module the ranks imported from their own path (``sys.path.insert(0, "examples/..."); from model
import Net``) is rebuilt from the same file. A module that path would not lead back to (made in memory,
loaded from a file by another name, its folder gone from the path) travels inside the bundle, by value, as
classes and functions of the user's cells always do. What still cannot be rebuilt (a module whose top-level
code needs the ranks) is written to ``reference-error.json`` with the module and where the ranks found it.

Each reference is a fresh process, but not a fresh Python: ``python -m sharddbg.engine.reference --serve``
(started by the client once per cluster, in the client's environment) imports torch and sharddbg's engine, what
every reference imports before it reads a job, then forks one process per job (``serve``). The forked process
runs ``main`` as the command above would, in the client's working directory, with stdout and stderr in the job
folder, and exits: it has the interpreter state of a new process that got that far (torch's defaults, its own
thread count from the environment, no torch.distributed, TF32 off by ``_settings``), without the seconds of
torch's import. The server is a plain Python besides: never the cluster's fork server, whose processes
registered physicsnemo's patches and run with the cluster's own environment.

The same module holds what both sides must agree on: how tensors cross in the bundle (``BundlePickler`` on
the rank, ``rebuild_tensor`` here), the environment file, the default loss and the names of the files.
"""

from __future__ import annotations

import contextlib
import importlib
import io
import json
import os
import pickle
import sys
import traceback
import types
from dataclasses import asdict, dataclass, field

JOB_FILE = "job.json"
BUNDLE_FILE = "bundle.pkl"
ENVIRONMENT_FILE = "environment.json"  # the ranks' sys.path, working directory and the bundle's modules
REFERENCE_FILE = "reference.pt"
ERROR_FILE = "reference-error.json"
LOSSES_FILE = "reference-losses.json"  # {group: the reference's loss value}
STDOUT_FILE = "reference-stdout.txt"  # a forked reference's stdout and stderr (``serve``)
STDERR_FILE = "reference-stderr.txt"
SERVE = "--serve"  # the argument that makes this module the server of forked references
REBUILDING = "rebuilding the ranks' values"  # the ``what`` of a failure to load the bundle
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
        gathered for it beforehand (``full_of``: id -> full tensor), any other by its detached data.
        ``modules`` collects the name of every module whose classes, functions or self the pickle refers
        to; with ``with_data=False`` tensors carry no data (a scan: what would be pickled, cheaply)."""

        def __init__(self, file, full_of: dict, with_data: bool = True):
            super().__init__(file, protocol=pickle.HIGHEST_PROTOCOL)
            self.full_of = full_of
            self.with_data = with_data
            self.modules: dict[str, None] = {}  # insertion-ordered set
            self.plain_ids: set[int] = set()
            self.keep: list = []  # the plain copies stay alive while pickling, so no id is reused

        def reducer_override(self, obj):
            import torch

            if isinstance(obj, torch.Tensor) and id(obj) not in self.plain_ids:
                data = self.full_of.get(id(obj))
                if data is None and is_distributed(obj):
                    raise pickle.PicklingError(
                        f"a {type(obj).__name__} of global shape {tuple(obj.shape)} that the check did not gather")
                if not self.with_data:
                    return tuple, ()
                if data is None:
                    wait = getattr(obj, "wait", None)  # an AsyncCollectiveTensor: its result
                    data = wait() if callable(wait) and type(obj) is not torch.Tensor else obj
                data = data.detach().cpu()
                if type(data) is not torch.Tensor:
                    data = data.as_subclass(torch.Tensor)
                data = data.clone()
                self.plain_ids.add(id(data))
                self.keep.append(data)
                return rebuild_tensor, (data, isinstance(obj, torch.nn.Parameter), bool(obj.requires_grad))
            if isinstance(obj, (type, types.FunctionType)):
                module = getattr(obj, "__module__", None)
                if isinstance(module, str):
                    self.modules.setdefault(module)
            elif isinstance(obj, types.ModuleType):
                self.modules.setdefault(obj.__name__)
            return super().reducer_override(obj)

    return BundlePickler


@dataclass
class Pickled:
    """A value as the bundle carries it: its bytes (empty after a scan) and the modules it refers to."""

    data: bytes
    modules: list[str]


def dumps_bundle(obj, full_of: dict, *, with_data: bool = True) -> Pickled:
    """``obj`` as the reference process will load it (see ``BundlePickler``); ``with_data=False``: a scan,
    the modules only (it raises where the real pickle would)."""
    buffer = io.BytesIO()
    pickler = _bundle_pickler_class()(buffer, full_of, with_data)
    pickler.dump(obj)
    return Pickled(buffer.getvalue() if with_data else b"", list(pickler.modules))


# ---- the modules a bundle refers to -----------------------------------------------------------------------
@dataclass
class ModuleOrigin:
    """A module the bundle refers to, as the ranks have it."""

    name: str
    file: str | None  # where the ranks loaded it from (None: built in, or made in memory)
    by_value: bool  # carried inside the bundle: the ranks' sys.path would not lead a new process back to it
    names: list[str] = field(default_factory=list)  # the statement's variables (models, values) that reach it


@dataclass
class RankEnvironment:
    """What the reference process takes from the group's first rank before loading the bundle."""

    sys_path: list[str]
    cwd: str
    modules: list[ModuleOrigin]

    @classmethod
    def read(cls, path: str) -> "RankEnvironment":
        with open(path) as f:
            raw = json.load(f)
        return cls(raw["sys_path"], raw["cwd"], [ModuleOrigin(**m) for m in raw["modules"]])

    def write(self, path: str) -> None:
        with open(path, "w") as f:
            json.dump(asdict(self), f)

    def origin(self, module: str | None) -> ModuleOrigin | None:
        """The module ``module`` names (or its package, or one of its submodules), as the ranks have it."""
        if not module:
            return None
        for candidate in self.modules:
            if candidate.name == module:
                return candidate
        for candidate in self.modules:
            if candidate.name.startswith(module + ".") or module.startswith(candidate.name + "."):
                return candidate
        return None


def _same_place(spec, module) -> bool:
    """Whether ``spec`` (what a finder found for the module's name) loads ``module``'s own file or folder."""
    mine = getattr(module, "__file__", None)
    if spec.origin and mine and spec.has_location:
        return os.path.realpath(spec.origin) == os.path.realpath(mine)
    found = {os.path.realpath(p) for p in (spec.submodule_search_locations or ())}
    return bool(found & {os.path.realpath(p) for p in (getattr(module, "__path__", None) or ())})


def found_again(module_name: str) -> bool:
    """Whether a new process with this process's ``sys.path`` and working directory would import the module
    ``module_name`` from where this one has it (judged by its top-level package: a built-in one, or one the
    import system's finders lead back to the same file). ``__main__`` never is (cloudpickle carries its
    classes and functions by value)."""
    top = module_name.partition(".")[0]
    module = sys.modules.get(top)
    if top == "__main__" or module is None:
        return False
    if top in sys.builtin_module_names:
        return True
    spec = getattr(module, "__spec__", None)
    if spec is not None and spec.origin in ("built-in", "frozen"):
        return True
    for finder in sys.meta_path:
        find_spec = getattr(finder, "find_spec", None)
        if find_spec is None:
            continue
        try:
            found = find_spec(top, None)
        except Exception:  # noqa: BLE001 - a finder that cannot answer for this name leads nowhere
            continue
        if found is not None:
            return _same_place(found, module)
    return False


def by_value_unit(module_name: str) -> str:
    """The module to register for pickling by value so that ``module_name`` travels by value: its top-level
    package where the ranks have it (its submodules refer to each other), else the module itself."""
    top = module_name.partition(".")[0]
    return top if top in sys.modules else module_name


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


def _enter(environment: RankEnvironment) -> None:
    """The ranks' working directory and ``sys.path`` (theirs first, then this process's own entries), so that
    the bundle's modules are imported from where the ranks imported them."""
    if environment.cwd and os.path.isdir(environment.cwd):
        os.chdir(environment.cwd)
    sys.path[:] = list(dict.fromkeys(list(environment.sys_path) + sys.path))
    importlib.invalidate_caches()


def _rebuild_failure(group: int, exc: BaseException, environment: RankEnvironment,
                     variables: list[str] | None = None) -> ReferenceFailure:
    """Loading the bundle (or importing a module the statement reads) raised: which module, where the ranks
    found it, and the variables that need it."""
    origin = None
    module = getattr(exc, "name", None) if isinstance(exc, ImportError) else None
    if module:
        origin = environment.origin(module)
    if origin is None:  # raised by a module's top-level code while it was imported: the innermost such frame
        files = {os.path.realpath(m.file): m for m in environment.modules if m.file}
        for frame in reversed(traceback.extract_tb(exc.__traceback__)):
            origin = files.get(os.path.realpath(frame.filename)) if frame.name == "<module>" else None
            if origin is not None:
                break
    if origin is not None:
        module = origin.name
    names = variables if variables is not None else (origin.names if origin is not None else [])
    frames = traceback.format_exception(type(exc), exc, exc.__traceback__)
    return ReferenceFailure({"group": group, "what": REBUILDING, "type": type(exc).__name__,
                             "message": f"{type(exc).__name__}: {exc}", "line": None, "code": "",
                             "module": module, "module_file": origin.file if origin is not None else None,
                             "by_value": bool(origin is not None and origin.by_value), "names": list(names),
                             "cwd": environment.cwd, "traceback": "".join(frames)})


def run_group(job: dict, job_dir: str, group: int) -> float | None:
    """The statement for one domain group, unsharded; its outputs and gradients to ``reference.pt``; the
    loss value (None without a backward by the check)."""
    import torch

    import sharddbg
    import sharddbg.engine

    # in this process only: the statement's scatter is the identity, and there are no patches to remove
    sharddbg.engine.scatter = identity_scatter
    sharddbg.engine.without_patches = _NoPatchesToRemove
    environment = RankEnvironment.read(os.path.join(group_dir(job_dir, group), ENVIRONMENT_FILE))
    _enter(environment)
    try:
        with open(os.path.join(group_dir(job_dir, group), BUNDLE_FILE), "rb") as f:
            bundle = pickle.load(f)
    except Exception as exc:  # noqa: BLE001 - a module the bundle needs: named, with where the ranks had it
        raise _rebuild_failure(group, exc, environment) from None
    namespace: dict = {"__name__": "__main__", "__builtins__": __builtins__}
    namespace.update(torch=torch, nn=torch.nn, F=torch.nn.functional, sharddbg=sharddbg)
    for name, module_name in bundle["modules"].items():
        try:
            namespace[name] = importlib.import_module(module_name)
        except Exception as exc:  # noqa: BLE001 - as above
            raise _rebuild_failure(group, exc, environment, [name]) from None
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
    ops = None
    if job.get("diff") is not None:  # Cluster.diff: every op's output kept too (engine.reference_ops)
        from .reference_ops import ReferenceOps

        ops = ReferenceOps(stmt, job["diff"]["selected"])
    try:
        with ops if ops is not None else contextlib.nullcontext():
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
    if ops is not None:
        ops.save(group_dir(job_dir, group))
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


# ---- the server of forked references ----------------------------------------------------------------------
def serve() -> int:
    """Import what every reference imports before it reads its job, then, for each request on stdin (a JSON line:
    ``{"job_dir": ..., "cwd": ...}``), fork a process that runs ``main([job_dir])`` and exits. Replies on stdout,
    one JSON line each: ``{"ready": pid}`` once, then per request ``{"started": pid}`` and ``{"pid": pid,
    "returncode": status}`` (negative: killed by that signal, as ``subprocess`` says). One job at a time; ends
    when stdin closes (its owner, the client, ended or closed it). Single-threaded whenever it forks: it runs no
    torch compute itself."""
    import torch  # noqa: F401 - imported before any job, as main() imports it (``_settings``) before reading one

    import sharddbg.engine  # noqa: F401 - as run_group does before it reads the bundle

    started_in = os.getcwd()  # python -m put it first on sys.path
    replies = sys.stdout
    _reply(replies, ready=os.getpid())
    for line in sys.stdin:
        request = json.loads(line)
        for stream in (sys.stdout, sys.stderr):
            stream.flush()  # nothing buffered is written twice by the child
        pid = os.fork()
        if pid == 0:
            _run_forked(request["job_dir"], request["cwd"], started_in)
        _reply(replies, started=pid)
        _, status = os.waitpid(pid, 0)
        _reply(replies, pid=pid, returncode=os.waitstatus_to_exitcode(status))
    return 0


def _reply(out, **payload) -> None:
    out.write(json.dumps(payload) + "\n")
    out.flush()


def _run_forked(job_dir: str, cwd: str, started_in: str) -> None:
    """In the forked process: what ``python -m sharddbg.engine.reference JOB_DIR`` started in ``cwd`` would do,
    its output in the job folder; never returns."""
    code = 1
    try:
        os.dup2(os.open(os.devnull, os.O_RDONLY), 0)
        for fd, name in ((1, STDOUT_FILE), (2, STDERR_FILE)):
            target = os.open(os.path.join(job_dir, name), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            os.dup2(target, fd)
            os.close(target)
        os.chdir(cwd)
        if sys.path and sys.path[0] == started_in:
            sys.path[0] = cwd
        code = main([job_dir])
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    except BaseException:  # noqa: BLE001 - as an uncaught exception ends a new process: its traceback, status 1
        traceback.print_exc()
        code = 1
    finally:
        import atexit

        atexit._run_exitfuncs()  # what a new process runs at its exit (the imports' handlers too)
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(Exception):
                stream.flush()
        os._exit(code)


if __name__ == "__main__":
    sys.exit(serve() if sys.argv[1:] == [SERVE] else main())
