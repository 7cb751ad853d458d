"""The smoke matrix's configurations and what ``Cluster.smoke`` found running them.

``SmokeConfig`` is one configuration of the ShardTensor checklist (``full_matrix``, ``reduced_matrix``);
``ConfigOutcome`` is what one did on the ranks and ``Reference`` a single-device run; ``smoke_table`` turns them
into the result's table, one verdict per configuration (matches the single-device run within rtol, failed as
it must, or what is wrong); ``SmokeResult`` holds it, and its view comes through ``sharddbg.rendering``. Pure
data: no torch, no cluster.
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

import pandas as pd

from .. import rendering
from ..errors import ClusterError

if TYPE_CHECKING:
    import plotly.graph_objects as go

    from ..trace import Trace

__all__ = ["TABLE_COLUMNS", "WRAPPERS", "SmokeConfig", "SmokeError", "SmokeResult", "ConfigOutcome", "Reference",
           "full_matrix", "reduced_matrix", "resolve_configs", "smoke_table"]

WRAPPERS = ("none", "ddp", "fsdp2")
TABLE_COLUMNS = ["ok", "outcome", "mesh", "wrapper", "compiled", "training", "expected_error", "loss_off_step",
                 "loss_off_error", "loss_error", "loss_error_step", "grad_error", "grad_error_param", "step_ms",
                 "first_step_ms", "fallbacks", "fallback_ops", "collectives_per_step", "losses", "reference_losses", "about"]
BLAME_COLUMN = "without_sharddbg"  # after TABLE_COLUMNS when the wrong configurations were re-run (``blame=True``)

class SmokeError(ClusterError):
    """The smoke matrix cannot run as asked (bad arguments, or the single-device reference run failed)."""


@dataclass(frozen=True)
class SmokeConfig:
    """One configuration of the smoke matrix.

    ``ddp`` x ``domain``: the mesh (their product must be the cluster's size, unless the configuration
    is expected to fail with ``MeshError``); ``wrapper``: "none" (weights broadcast over the domain axis,
    nothing else), "ddp" (DistributedDataParallel over the ``ddp`` sub-mesh's group) or "fsdp2"
    (``fully_shard`` over the ``ddp`` sub-mesh); ``compiled``: the wrapped model through
    ``torch.compile(dynamic=False)``; ``training``: False for forward only (``torch.no_grad()``);
    ``single_device``: plain tensors on rank 0 alone (the reference is the eager one);
    ``samples_per_domain``: samples a domain group is handed at once (its single-device reference takes as
    many at once); ``expect_error``: the class name of
    the error this configuration must raise (it passes when it does); ``about``: what it checks.
    """

    name: str
    ddp: int = 1
    domain: int = 1
    wrapper: str = "none"
    compiled: bool = False
    training: bool = True
    single_device: bool = False
    samples_per_domain: int = 1
    expect_error: str | None = None
    about: str = ""

    @property
    def mesh_text(self) -> str:
        return "single device" if self.single_device else f"ddp={self.ddp} x domain={self.domain}"

    @property
    def samples(self) -> int:
        """Samples per step over the whole mesh: one per domain group."""
        return 1 if self.single_device else self.ddp

    def check(self, world_size: int) -> None:
        """Raise SmokeError naming what is wrong with this configuration on ``world_size`` ranks."""
        problems = []
        if not isinstance(self.name, str) or not self.name.strip():
            problems.append(f"name must be a non-empty string, got {self.name!r}")
        for field in ("ddp", "domain", "samples_per_domain"):
            value = getattr(self, field)
            if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 1:
                problems.append(f"{field} must be a whole number of at least 1, got {value!r}")
        for field in ("compiled", "training", "single_device"):
            if not isinstance(getattr(self, field), bool):
                problems.append(f"{field} must be True or False, got {getattr(self, field)!r}")
        if self.wrapper not in WRAPPERS:
            problems.append(f"wrapper must be one of {WRAPPERS}, got {self.wrapper!r}")
        if self.expect_error is not None and not (isinstance(self.expect_error, str) and self.expect_error.isidentifier()):
            problems.append(f"expect_error must be an exception's class name (e.g. 'ScatterError') or None, "
                            f"got {self.expect_error!r}")
        if not problems and self.single_device and (self.wrapper != "none" or self.samples_per_domain != 1):
            problems.append("a single-device configuration has no wrapper and one sample per step")
        if not problems and not self.single_device and self.expect_error != "MeshError" \
                and self.ddp * self.domain != world_size:
            problems.append(f"mesh ddp={self.ddp} x domain={self.domain} has {self.ddp * self.domain} ranks but the "
                            f"cluster has {world_size} (expect_error='MeshError' makes it an expected failure)")
        if problems:
            raise SmokeError(f"smoke configuration {self.name!r}: " + "; ".join(problems))


def _factor(world_size: int) -> tuple[int, int] | None:
    """The most balanced ddp x domain split with both above 1 (4 -> 2 x 2, 8 -> 2 x 4), or None (a prime)."""
    pairs = [(d, world_size // d) for d in range(2, world_size) if world_size % d == 0 and world_size // d > 1]
    return min(pairs, key=lambda p: (abs(p[0] - p[1]), p[0])) if pairs else None


def full_matrix(world_size: int) -> list[SmokeConfig]:
    """The checklist's whole matrix on ``world_size`` ranks: single-device reference; ddp=N; domain=N;
    ddp x domain with DDP; the same with FSDP2; FSDP2 degenerate ddp=1; each with and without
    torch.compile; one inference-only run; a batch of 2 per domain group (against the single device taking
    the same 2 samples at once); an invalid mesh factorization, which must fail. The ddp x domain rows are
    left out on a prime number of ranks."""
    if isinstance(world_size, bool) or not isinstance(world_size, numbers.Integral) or world_size < 1:
        raise SmokeError(f"world_size must be a whole number of at least 1, got {world_size!r}")
    n = int(world_size)
    eager = [
        SmokeConfig("single-device", single_device=True,
                    about="plain tensors on one rank: the reference every other row is compared with"),
        SmokeConfig(f"ddp={n}, DDP", ddp=n, domain=1, wrapper="ddp",
                    about="pure data parallel: one sample per rank, plain tensors, DDP averages gradients"),
        SmokeConfig(f"domain={n}", ddp=1, domain=n,
                    about="one sample sharded over every rank; weights broadcast over the domain axis"),
    ]
    split = _factor(n)
    if split:
        a, b = split
        eager += [
            SmokeConfig(f"ddp={a} x domain={b}, DDP", ddp=a, domain=b, wrapper="ddp",
                        about="DDP over the ddp sub-mesh's group; ShardTensor reduces over domain itself"),
            SmokeConfig(f"ddp={a} x domain={b}, FSDP2", ddp=a, domain=b, wrapper="fsdp2",
                        about="fully_shard over the ddp sub-mesh (parameters sharded over ddp)"),
        ]
    if n > 1:
        eager.append(SmokeConfig(f"domain={n}, FSDP2 ddp=1", ddp=1, domain=n, wrapper="fsdp2",
                                 about="degenerate FSDP2: parameters become DTensors, no ddp communication"))
    compiled = [replace(c, name=f"{c.name}, compiled", compiled=True,
                        about="the row above through torch.compile(dynamic=False)") for c in eager]
    rows = [row for pair in zip(eager, compiled) for row in pair]
    rows.append(SmokeConfig(f"domain={n}, inference", ddp=1, domain=n, training=False,
                            about="forward only, under torch.no_grad(), against the single-device forward"))
    if n > 1:
        bad = next(d for d in range(2, n + 2) if n % d)  # a domain size that does not divide n
        rows.append(SmokeConfig(f"invalid mesh domain={bad}", ddp=1, domain=bad, expect_error="MeshError",
                                about=f"{n} ranks cannot be split into domain groups of {bad}: refused before "
                                      f"anything runs"))
        rows.append(SmokeConfig(f"domain={n}, 2 samples per domain group", ddp=1, domain=n, samples_per_domain=2,
                                about="a batch of 2 sharded like one sample, against the single device taking "
                                      "the same 2 samples at once"))
    return rows


def reduced_matrix(world_size: int) -> list[SmokeConfig]:
    """The matrix CI runs: single-device, domain=N, ddp x domain with DDP and with FSDP2, domain=N compiled,
    and a batch of 2 per domain group (under a second on 4 CPU ranks)."""
    rows = {c.name: c for c in full_matrix(world_size)}
    n = world_size
    split = _factor(n)
    names = ["single-device", f"domain={n}", f"domain={n}, compiled", f"domain={n}, 2 samples per domain group"]
    if split:
        names[2:2] = [f"ddp={split[0]} x domain={split[1]}, DDP", f"ddp={split[0]} x domain={split[1]}, FSDP2"]
    return [rows[name] for name in names if name in rows]


def resolve_configs(configs, world_size: int) -> list[SmokeConfig]:
    if configs is None or configs == "full":
        chosen = full_matrix(world_size)
    elif configs == "reduced":
        chosen = reduced_matrix(world_size)
    elif isinstance(configs, (list, tuple)) and configs:
        by_name = {c.name: c for c in full_matrix(world_size)}
        chosen = []
        for c in configs:
            if isinstance(c, SmokeConfig):
                chosen.append(c)
            elif isinstance(c, str) and c in by_name:
                chosen.append(by_name[c])
            else:
                raise SmokeError(f"configs: {c!r} is neither a SmokeConfig nor the name of one of the matrix's "
                                 f"configurations on {world_size} ranks: {list(by_name)}")
    else:
        raise SmokeError(f"configs must be None (the whole matrix), 'reduced', or a non-empty list of SmokeConfig "
                         f"or configuration names, got {configs!r}")
    for c in chosen:
        c.check(world_size)
    names = [c.name for c in chosen]
    twice = sorted({name for name in names if names.count(name) > 1})
    if twice:
        raise SmokeError(f"configs: each name must be used once; {twice} appear more than once")
    return chosen


@dataclass
class ConfigOutcome:
    """What one configuration did, before it becomes a row of the table."""

    config: SmokeConfig
    losses: list | None = None  # per step, the mean over the ranks (each domain group's loss, averaged)
    step_ms: float = math.nan
    first_step_ms: float = math.nan
    grad_error: float = math.nan
    grad_error_param: str | None = None
    error_type: str | None = None  # the class name of what it raised
    error: str | None = None  # one line, its cause first ("rank 2 raised ...")
    trace: object = None  # the recorded step's Trace


class SmokeResult:
    """The smoke matrix's result: each configuration against the single-device run.

    ``ok`` says every configuration was as expected; ``table`` has one row per configuration, indexed by its
    name (``TABLE_COLUMNS``: ok, outcome, mesh, wrapper, compiled, training, expected_error, loss_off_step
    and loss_off_error (the first step whose loss is beyond ``rtol``, and its relative error), loss_error and
    loss_error_step (the worst step's), grad_error, grad_error_param, step_ms, first_step_ms, fallbacks, fallback_ops,
    collectives_per_step, losses, reference_losses, about; after a re-run without sharddbg, ``blame=True``, also
    without_sharddbg: what the re-run of each wrong configuration found); ``failed`` names the configurations that were
    not; ``trace(name)`` is the recorded step of a configuration (its fallbacks and collectives op by op);
    ``verdict`` is one line, also the repr; ``show()`` the view and ``plot_losses()`` the loss error per
    step. The constructor's arguments stay as attributes of the same names. ``Cluster.smoke`` builds it; its
    views come through ``sharddbg.rendering``.

    Parameters
    ----------
    table : pandas.DataFrame
        One row per configuration, indexed by its name, ``TABLE_COLUMNS`` (``smoke_table``).
    configs : list of SmokeConfig
        The configurations run, in the table's order.
    traces : dict
        Configuration name -> the ``Trace`` of its recorded step (one more step run under the recorder);
        compiled configurations, the single device and configurations that failed have none.
    rtol : float
        The relative tolerance the losses and first-step gradients were held to.
    steps : int
        The SGD steps each configuration ran.
    world_size : int
        The number of ranks.

    Examples
    --------
    >>> res = cl.smoke(setup, step, configs="reduced")
    >>> res.ok
    True
    >>> res  # doctest: +NORMALIZE_WHITESPACE
    smoke matrix on 4 ranks: all 6 configurations as expected (6 match the single-device run within rtol
    0.001)
    >>> res.table[["ok", "outcome"]]  # doctest: +NORMALIZE_WHITESPACE
                                            ok                        outcome
    config
    single-device                         True                  the reference
    domain=4                              True  matches the single-device run
    ddp=2 x domain=2, DDP                 True  matches the single-device run
    ddp=2 x domain=2, FSDP2               True  matches the single-device run
    domain=4, compiled                    True  matches the single-device run
    domain=4, 2 samples per domain group  True  matches the single-device run
    """

    def __init__(self, table, configs: list[SmokeConfig], traces: dict, rtol: float, steps: int, world_size: int):
        self.table = table
        self.configs = configs
        self.rtol = rtol
        self.steps = steps
        self.world_size = world_size
        self.traces = traces  # configuration name -> Trace of its recorded step
        self.blames: dict = {}  # configuration name -> Blame of its re-run without sharddbg (``blame=True``)

    @property
    def ok(self) -> bool:
        """Every configuration as expected: those expected to fail failed with their error, the others matched
        the single-device run within ``rtol``."""
        return bool(self.table["ok"].all())

    @property
    def failed(self) -> list[str]:
        """The names of the configurations that were not as expected."""
        return [name for name, ok in self.table["ok"].items() if not ok]

    @property
    def verdict(self) -> str:
        """One line, also the repr: on how many ranks, whether every configuration was as expected (how many
        matched the single-device run within ``rtol``, how many failed as expected), else each wrong one with
        its outcome."""
        n = len(self.table)
        expected = int(self.table["expected_error"].astype(bool).sum())
        if self.ok:
            matched = n - expected
            parts = [f"{matched} match{'es' if matched == 1 else ''} the single-device run within rtol {self.rtol:g}"
                     if matched else "", f"{expected} failed as expected" if expected else ""]
            return (f"smoke matrix on {self.world_size} ranks: all {n} configurations as expected ("
                    + ", ".join(p for p in parts if p) + ")")
        bad = self.failed
        return (f"smoke matrix on {self.world_size} ranks: {len(bad)} of {n} configurations wrong: "
                + "; ".join(f"{name}: {self.table.loc[name, 'outcome']}" for name in bad))

    def __repr__(self) -> str:
        return self.verdict

    def _repr_html_(self) -> str:
        return self.show().html()

    def _repr_mimebundle_(self, include=None, exclude=None):
        # the HTML and the payload the JupyterLab extension draws from (the view's table); the plain text stays
        # the verdict, as repr() gives it (the whole text is str() and show())
        bundle = self.show()._repr_mimebundle_(include, exclude)
        bundle["text/plain"] = repr(self)
        return bundle

    def trace(self, name: str) -> Trace:
        """The Trace of configuration ``name``'s recorded step (its ops, fallbacks, collectives).

        The step is one more step after the compared ones, run under the recorder.

        Parameters
        ----------
        name : str
            The configuration's name, as the table's index has it.

        Returns
        -------
        Trace
            That step on every rank.

        Raises
        ------
        SmokeError
            No configuration of this result has that name, or it has no recorded step: a compiled
            configuration (its steps run below the recorder), the single device (never recorded), or a
            configuration that failed before it got that far (see its outcome).

        Examples
        --------
        >>> res = cl.smoke(setup, step, configs="reduced")
        >>> t = res.trace("domain=4")
        >>> t.get_fallbacks()  # doctest: +SKIP
        >>> res.trace("domain=4, compiled")  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        sharddbg.analysis.smoke.SmokeError: configuration 'domain=4, compiled' is compiled: its steps run below ...
        """
        if name not in self.traces:
            config = next((c for c in self.configs if c.name == name), None)
            if config is None:
                why = f"there is no configuration {name!r} in this result: {[c.name for c in self.configs]}"
            elif config.compiled:
                why = f"configuration {name!r} is compiled: its steps run below the recorder and none was recorded"
            else:
                why = (f"configuration {name!r} has no recorded step (the single device is not recorded; a "
                       f"configuration that failed did not get that far: see its outcome)")
            raise SmokeError(why)
        return self.traces[name]

    def show(self) -> Any:
        """The view: the table with each verdict coloured, and the loss error per step (``plot_losses()``).

        Returns
        -------
        sharddbg.views.smoke.SmokeView
            Static HTML in a notebook (one row per configuration, its verdict coloured); ``text()`` gives it as
            plain text (also its ``str``), ``plot_losses()`` the figure of ``SmokeResult.plot_losses``.

        Examples
        --------
        >>> res = cl.smoke(setup, step, configs="reduced")
        >>> res.show()  # doctest: +SKIP
        >>> print(res.show().text())  # doctest: +ELLIPSIS
        smoke matrix on 4 ranks: all 6 configurations as expected (5 match the single-device run within rtol 0.001, ...
        configuration ...
        single-device ...
        ...
        """
        return rendering.smoke_view(self)

    def plot_losses(self) -> go.Figure:
        """Plotly: each configuration's loss error against the single-device run, per step (log scale).

        One line per configuration that ran (an exact match is drawn at 1e-12), ``rtol`` as a dashed line.
        Needs plotly (imported when called).

        Returns
        -------
        plotly.graph_objects.Figure
            The figure; it says so when no configuration ran to compare.

        Examples
        --------
        >>> res = cl.smoke(setup, step, configs="reduced")
        >>> res.plot_losses()  # doctest: +SKIP
        """
        return rendering.smoke_losses_figure(self)


@dataclass
class Reference:
    """A single-device run the configurations are compared with: ``samples`` per step, training or not."""

    losses: list
    step_ms: float
    first_step_ms: float
    grads: dict | None  # parameter name -> first-step gradient (numpy), for training


def _relative_errors(losses: list, reference: list) -> list[float]:
    return [abs(a - b) / max(abs(b), 1e-30) for a, b in zip(losses, reference)]


def smoke_table(configs: list[SmokeConfig], outcomes: dict[str, ConfigOutcome], references: dict, rtol: float,
                blames: dict | None = None):
    """The result's table: one row per configuration (``TABLE_COLUMNS``), indexed by its name, with its verdict
    (``ok``, ``outcome``) against the single-device ``references`` ((samples per step, samples at once,
    training) -> Reference); ``blames``: configuration name -> the ``analysis.blame.Blame`` of its re-run
    without sharddbg (said in ``without_sharddbg`` and after the outcome)."""
    blames = blames or {}

    rows = []
    for config in configs:
        o = outcomes[config.name]
        ref = references.get((config.samples, config.samples_per_domain, config.training))
        row = {"config": config.name, "mesh": config.mesh_text, "wrapper": config.wrapper,
               "compiled": config.compiled, "training": config.training,
               "expected_error": config.expect_error or "", "loss_off_step": None, "loss_off_error": math.nan,
               "loss_error": math.nan, "loss_error_step": None,
               "grad_error": o.grad_error, "grad_error_param": o.grad_error_param, "step_ms": o.step_ms,
               "first_step_ms": o.first_step_ms, "fallbacks": math.nan, "fallback_ops": "",
               "collectives_per_step": math.nan, "losses": o.losses,
               "reference_losses": list(ref.losses) if ref is not None and o.losses is not None else None,
               "about": config.about}
        if o.losses is not None and ref is not None:
            rel = _relative_errors(o.losses, ref.losses)
            row["loss_error"] = max(rel)
            row["loss_error_step"] = rel.index(max(rel))
            # the step where the run departs (a NaN loss departs too): where to look first, before the worst
            off = next((i for i, e in enumerate(rel) if not e <= rtol), None)
            if off is not None:
                row["loss_off_step"], row["loss_off_error"] = off, rel[off]
        if o.trace is not None:
            row.update(_comm_and_fallbacks(o.trace))
        row["ok"], row["outcome"] = _verdict(config, o, row, rtol)
        blame = blames.get(config.name)
        row[BLAME_COLUMN] = blame.short if blame is not None else ""
        if blame is not None:
            row["outcome"] += f"; {blame.short}"
        rows.append(row)
    table = pd.DataFrame(rows).set_index("config")[TABLE_COLUMNS + ([BLAME_COLUMN] if blames else [])]
    for column in ("loss_off_step", "loss_error_step"):
        table[column] = table[column].astype("Int64")  # a step number, or <NA>
    return table


def _comm_and_fallbacks(trace) -> dict:
    """Fallback calls and collectives per rank in the recorded step, and which ops fell back."""
    n = max(len(trace.ranks), 1)
    fallbacks = trace.get_fallbacks()
    collectives = trace.get_collectives()
    ops = fallbacks.sort_values("calls", ascending=False)["op"].tolist() if len(fallbacks) else []
    return {"fallbacks": float(fallbacks["calls"].sum()) / n if len(fallbacks) else 0.0,
            "fallback_ops": ", ".join(ops),
            "collectives_per_step": len(collectives) / n}


def _loss_off(row: dict) -> str:
    """"loss off from step 1 (by 2.1e-03, relative; worst 9.7e-03 at step 2)": the first step beyond the
    tolerance, where the run departs, then the worst one when it is another."""
    first, worst = row["loss_off_step"], row["loss_error_step"]
    if first is None:  # the worst is beyond the tolerance only through a NaN among the errors
        first, row["loss_off_step"], row["loss_off_error"] = worst, worst, row["loss_error"]
    text = f"loss off from step {first} (by {row['loss_off_error']:.1e}, relative"
    if worst != first:
        text += f"; worst {row['loss_error']:.1e} at step {worst}"
    return text + ")"


def _verdict(config: SmokeConfig, o: ConfigOutcome, row: dict, rtol: float) -> tuple[bool, str]:
    if config.expect_error:
        if o.error_type == config.expect_error:
            return True, f"failed as expected: {o.error}"
        if o.error is not None:
            return False, f"should have failed with {config.expect_error}, but: {o.error}"
        return False, f"should have failed with {config.expect_error}, but ran to the end"
    if o.error is not None:
        return False, o.error
    if config.single_device and not config.compiled and config.training:
        return True, "the reference"
    wrong = []
    if not row["loss_error"] <= rtol:
        wrong.append(_loss_off(row))
    if config.training and not o.grad_error <= rtol:
        wrong.append(f"gradient of {o.grad_error_param} off by {o.grad_error:.1e} (relative to its largest value)")
    if wrong:
        return False, "; ".join(wrong) + f", beyond rtol {rtol:g}"
    return True, "matches the single-device run"
