"""The smoke matrix (``Cluster.smoke``): the ShardTensor checklist's configurations run on the ranks at hand
and compared with the same model trained on a single device.

Each configuration is a :class:`SmokeConfig`. The client rebuilds the mesh on the same engines for each
(``Cluster.remesh``; configurations are run grouped by mesh, so it is rebuilt as few times as possible), asks
every rank to run it (``engine.api.smoke_run``) and compares: each step's loss with the single-device run's
(same seed, same data, the same global batch: ddp=2 takes two samples per step, so the single-device run
takes those two one after the other and averages; a domain group handed 2 samples at once is compared with
the single device taking the same 2 at once), the first step's gradients, and from one more step run
under the recorder, the fallbacks and collectives per step (not for a compiled configuration: dynamo
re-traces the model under the recorder's modes and fails inside ShardTensor's dispatch, and the compiled
graph would run below the recorder anyway). Expected failures pass when they raise the
error named (an invalid mesh factorization is refused before anything runs).
"""

from __future__ import annotations

import math
import numbers
from ..analysis.smoke import (TABLE_COLUMNS, ConfigOutcome, Reference, SmokeConfig, SmokeError, SmokeResult,
                              full_matrix, reduced_matrix, resolve_configs, smoke_table)
from ..engine import api
from ..errors import (
    MeshError,
    RankDiedError,
    RankError,
    RankTimeoutError,
    hide_own_frames,
)
from . import arguments
from .execution import RankExecution
from .group import DistributedGroup
from .mesh import MeshSpec, resolve_mesh

__all__ = [
    "TABLE_COLUMNS",
    "SmokeConfig",
    "SmokeError",
    "SmokeResult",
    "full_matrix",
    "portable_function",
    "reduced_matrix",
    "run_smoke",
]

DEFAULT_TIMEOUT_S = 300.0  # per configuration: torch.compile on 4 CPU ranks of 2 cores takes 20-40 s alone
MAX_STEPS = 100


def _check_callable(name: str, fn, arity: int) -> None:
    import inspect

    if not callable(fn):
        raise SmokeError(f"{name} must be a function, got {type(fn).__name__} {fn!r}")
    try:
        inspect.signature(fn).bind(*([None] * arity))
    except TypeError:
        wanted = "setup()" if arity == 0 else "step(model, ctx)"
        raise SmokeError(f"{name} must be callable as {wanted}; its signature is {name}{inspect.signature(fn)}") from None
    except ValueError:
        pass  # a builtin without a signature: it is called as it is


def _number(name: str, value, *, integral: bool = False, low: float | None = None, high: float | None = None):
    ok = not isinstance(value, bool) and isinstance(value, numbers.Integral if integral else numbers.Real)
    if ok:
        ok = math.isfinite(float(value)) and (low is None or value >= low) and (high is None or value <= high)
    if not ok:
        what = "a whole number" if integral else "a finite number"
        bounds = f" from {low:g} to {high:g}" if low is not None and high is not None else \
            f" above {low:g}" if low is not None else ""
        raise SmokeError(f"{name} must be {what}{bounds}, got {type(value).__name__} {value!r}")
    return int(value) if integral else float(value)


def run_smoke(execution: RankExecution, group: DistributedGroup, setup, step, configs=None, *, steps: int = 3,
              seed: int = 0, lr: float = 0.01,
              rtol: float = 1e-3, timeout: float | None = DEFAULT_TIMEOUT_S, blame: bool = False) -> SmokeResult:
    """``Cluster.smoke``: the matrix on the ranks of ``execution``, whose process ``group`` is rebuilt for each
    mesh and put back at the end. ``blame``: each wrong configuration run again without sharddbg."""
    __tracebackhide__ = hide_own_frames()
    _check_callable("setup", setup, 0)
    _check_callable("step", step, 2)
    steps = _number("steps", steps, integral=True, low=2, high=MAX_STEPS)
    seed = _number("seed", seed, integral=True, low=0)
    lr = _number("lr", lr, low=0)
    rtol = _number("rtol", rtol, low=0)
    if rtol <= 0:
        raise SmokeError(f"rtol must be above 0, got {rtol!r}")
    timeout = arguments.seconds("timeout", timeout, allow_none=True) or DEFAULT_TIMEOUT_S
    if not isinstance(blame, bool):
        raise SmokeError(f"blame must be True or False, got {blame!r}")
    chosen = resolve_configs(configs, execution.n)
    setup, step = portable_function(setup), portable_function(step)
    if blame:
        from .blame import PlainServer

        PlainServer.start()  # its imports overlap the matrix
    runner = _MatrixRunner(execution, group, setup, step, steps=steps, seed=seed, lr=lr, rtol=rtol, timeout=timeout)
    outcomes = runner.run_all(chosen)
    table = smoke_table(chosen, outcomes, runner.references, rtol)
    blames = runner.blame_all(chosen, table) if blame else {}
    if blames:
        table = smoke_table(chosen, outcomes, runner.references, rtol, blames)
    result = SmokeResult(table, chosen, {name: o.trace for name, o in outcomes.items() if o.trace is not None}, rtol,
                         steps, execution.n)
    result.blames = blames
    return result


def portable_function(fn):
    """``fn`` as cloudpickle's bytes, by value: the globals it reads (a constant, a model class defined in the
    notebook) travel with it, which ipyparallel's own pickling of a function does not do (NameError on the
    engine), and a ``setup`` or ``step`` of a test module or a file next to the notebook reaches engines that
    cannot import that module (its module is pickled by value too; installed packages stay by reference)."""
    import sys

    try:
        import cloudpickle
    except ImportError:  # ipyparallel's pickling: fine for self-contained functions
        return fn
    module = sys.modules.get(getattr(fn, "__module__", None) or "")
    path = getattr(module, "__file__", None) or ""
    by_value = module is not None and module.__name__ != "__main__" and path and "-packages" not in path
    if not by_value:
        return cloudpickle.dumps(fn)
    cloudpickle.register_pickle_by_value(module)
    try:
        return cloudpickle.dumps(fn)
    finally:
        cloudpickle.unregister_pickle_by_value(module)


class _MatrixRunner:
    """Runs configurations on one cluster: references on rank 0, the others on every rank, mesh by mesh."""

    def __init__(self, execution: RankExecution, group: DistributedGroup, setup, step, *, steps, seed, lr, rtol,
                 timeout):
        self.execution = execution
        self.group = group
        self.setup, self.step = setup, step
        self.steps, self.seed, self.lr, self.rtol, self.timeout = steps, seed, lr, rtol, timeout
        self.references: dict[tuple[int, int, bool], Reference] = {}  # (samples, at once, training)

    def plan(self, config: SmokeConfig, *, single_device: bool, samples: int, record: bool,
             return_grads: bool) -> dict:
        return {"config": config.name, "wrapper": config.wrapper, "compiled": config.compiled,
                "training": config.training, "single_device": single_device, "samples": samples,
                "samples_per_domain": config.samples_per_domain, "steps": self.steps, "seed": self.seed,
                "lr": self.lr, "record": record, "return_grads": return_grads}

    def reference(self, samples: int, training: bool, at_once: int = 1) -> Reference:
        """The eager single-device run with ``samples`` per step, one after the other, each handed as
        ``at_once`` samples stacked on the batch axis, as a domain group of the configuration gets them (run
        once, kept)."""
        __tracebackhide__ = hide_own_frames()
        key = (samples, at_once, training)
        if key not in self.references:
            what = f"{samples} sample{'s' if samples > 1 else ''} per step" + \
                (f", {at_once} at once" if at_once > 1 else "")
            config = SmokeConfig("single-device" if samples == at_once == 1 else f"single-device, {what}",
                                 single_device=True, training=training)
            plan = self.plan(config, single_device=True, samples=samples, record=False, return_grads=training)
            plan["samples_per_domain"] = at_once  # the same batch the configuration's domain group is handed
            try:
                (out,) = self.execution.apply(api.smoke_run, (self.setup, self.step, plan, None), {}, [0],
                                              self.timeout, display=False,
                                              what=f"the single-device reference run ({what})")
            except (RankError, RankTimeoutError) as exc:
                raise SmokeError(f"the single-device reference run failed, so nothing can be compared: "
                                 f"{_first_line(exc)}") from exc
            self.references[key] = Reference(out["losses"], 1e3 * _median(out["step_s"][1:]),
                                             1e3 * out["step_s"][0], out["grads"])
        return self.references[key]

    def blame_all(self, configs: list[SmokeConfig], table) -> dict:
        """Each wrong configuration (not one expected to fail) run again without sharddbg (``cluster.blame``),
        against the single-device run it was compared with: configuration name -> ``Blame``."""
        from .blame import blame_smoke

        blames = {}
        for config in configs:
            ref = self.references.get((config.samples, config.samples_per_domain, config.training))
            if table.loc[config.name, "ok"] or config.expect_error or ref is None:
                continue
            plan = self.plan(config, single_device=config.single_device, samples=config.samples, record=False,
                             return_grads=False)
            blames[config.name] = blame_smoke(
                plan, self.setup, self.step, ref.losses, ref.grads if config.training else None, rtol=self.rtol,
                world_size=1 if config.single_device else self.execution.n, mesh_shape=[config.ddp, config.domain],
                timeout=self.timeout)
        return blames

    def run_all(self, configs: list[SmokeConfig]) -> dict[str, ConfigOutcome]:
        __tracebackhide__ = hide_own_frames()
        original = self.group.mesh
        outcomes: dict[str, ConfigOutcome] = {}
        dead = None
        try:
            for config in sorted(configs, key=lambda c: self._order(c, original)):
                if dead is not None:
                    outcomes[config.name] = ConfigOutcome(config, error_type="RankDiedError",
                                                          error=f"not run: {dead}")
                    continue
                try:
                    outcomes[config.name] = self.run_one(config)
                except RankDiedError as exc:
                    dead = _first_line(exc)
                    outcomes[config.name] = ConfigOutcome(config, error_type="RankDiedError", error=dead)
        finally:
            if dead is None and (self.group.mesh != original or self.execution.broken is not None):
                self.group.rebuild(self.execution, original, self.timeout)
        return outcomes

    @staticmethod
    def _order(config: SmokeConfig, original: MeshSpec):
        """Single-device runs first, then the cluster's own mesh, then mesh by mesh: fewest rebuilds."""
        if config.single_device:
            return (0, 0, 0)
        same = (config.ddp, config.domain) == original.shape
        return (1, 0 if same else 1, config.ddp)

    def run_one(self, config: SmokeConfig) -> ConfigOutcome:
        __tracebackhide__ = hide_own_frames()
        if config.single_device and not config.compiled and config.training:
            ref = self.reference(1, True)
            return ConfigOutcome(config, losses=list(ref.losses), step_ms=ref.step_ms,
                                 first_step_ms=ref.first_step_ms, grad_error=0.0)
        if not config.single_device:
            try:
                if (config.ddp, config.domain) != self.group.mesh.shape or self.execution.broken is not None:
                    mesh = resolve_mesh(self.execution.n, {"ddp": config.ddp, "domain": config.domain})
                    self.group.rebuild(self.execution, mesh, self.timeout)
            except MeshError as exc:
                return ConfigOutcome(config, error_type="MeshError", error=f"MeshError: {exc}")
        expected_to_run = config.expect_error is None
        ref = self.reference(config.samples, config.training, config.samples_per_domain) if expected_to_run \
            else None
        plan = self.plan(config, single_device=config.single_device, samples=config.samples,
                         record=not config.single_device and not config.compiled, return_grads=False)
        ranks = [0] if config.single_device else list(range(self.execution.n))
        try:
            outs = self.execution.apply(api.smoke_run, (self.setup, self.step, plan, ref.grads if ref else None),
                                        {}, ranks, self.timeout, display=False,
                                        what=f"smoke configuration {config.name!r}")
        except RankError as exc:
            cause = exc.errors[exc.causes[0]] if exc.causes else None
            return ConfigOutcome(config, error_type=cause.type_name if cause else "RankError", error=_first_line(exc))
        except RankTimeoutError as exc:
            return ConfigOutcome(config, error_type="RankTimeoutError", error=_first_line(exc))
        return self.outcome(config, outs)

    def outcome(self, config: SmokeConfig, outs: list[dict]) -> ConfigOutcome:
        from ..trace import Trace

        losses = [sum(o["losses"][k] for o in outs) / len(outs) for k in range(self.steps)]
        errors = [o["grad_error"] for o in outs if o["grad_error"] is not None]
        worst = max((o for o in outs if o["grad_error"] is not None), key=lambda o: o["grad_error"], default=None)
        trace = None
        payloads = {o["rank"]: o["payload"] for o in outs if o["payload"] is not None}
        if payloads:
            trace = Trace.from_payloads(payloads, meta={"code": f"smoke configuration {config.name!r}: one step",
                                                        "mesh": {"ddp": config.ddp, "domain": config.domain},
                                                        "smoke_config": config.name})
        return ConfigOutcome(
            config, losses=losses,
            step_ms=1e3 * max(_median(o["step_s"][1:]) for o in outs),
            first_step_ms=1e3 * max(o["step_s"][0] for o in outs),
            grad_error=max(errors) if errors else math.nan,
            grad_error_param=None if worst is None else
            (worst["grad_error_param"] if len(outs) == 1 else f"{worst['grad_error_param']} (rank {worst['rank']})"),
            trace=trace)


def _median(values: list) -> float:
    values = sorted(values)
    if not values:
        return math.nan
    mid = len(values) // 2
    return values[mid] if len(values) % 2 else (values[mid - 1] + values[mid]) / 2


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__
