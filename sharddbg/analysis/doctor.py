"""What ``Cluster.doctor`` found: the known ShardTensor pitfalls, checked against what the ranks hold.

Every rank answers ``engine.api.doctor_facts`` (what it reads without communicating: digests of the plain
parameters, the ShardTensors' shapes and autograd flags, unwaited collectives, optimizers' parameter groups,
FSDP1 and DDP wrappers); ``examine`` compares the ranks' answers, with the last check and the last trace's
ops, and turns them into one row per check:

1. weights synced over the domain axis (plain parameters equal on every rank of a domain group);
2. samples kept apart in each domain group: a batch larger than 1 per domain group is a warning (right for
   ops that keep the samples apart, at a cost; ops that flatten the batch with a sharded dim would mix
   them), a failure where the last trace saw an op do it (``sample_mixes``);
3. ``requires_grad`` of ShardTensor leaves reaching autograd;
4. async collectives waited;
5. optimizer parameter groups not mixing distributed and plain parameters in foreach kernels;
6. no FSDP1;
7. DDP over the ``ddp`` axis only;
8. gradients reduced once over the domain axis (from the last ``Cluster.check``, which compares them with
   an unsharded reference);
9. DTensor's redistribution plan cache free of stale entries (from the last trace, which watches it: see
   ``sharddbg.analysis.plan_cache``), with the number of entries each rank holds now.

Each row: ``ok``, ``warn`` (a risk, or right here but wrong elsewhere), ``fail`` (the mistake is there) or
``skip`` (nothing to examine), what was found and the fix. ``DoctorReport`` holds them; its views come through
``sharddbg.rendering``. Pure data: no torch, no cluster.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import pandas as pd

from .. import rendering
from .check import whole_multiple
from .findings import PLAN_CACHE_FIX, Finding, plan_cache_finding

if TYPE_CHECKING:
    from ..trace import Trace
    from .check import CheckResult

__all__ = ["DoctorReport", "Finding", "examine", "TABLE_COLUMNS", "CHECKS", "STATUSES", "FIXES"]

TABLE_COLUMNS = ["check", "status", "found", "fix", "ranks"]
STATUSES = ("ok", "warn", "fail", "skip")
WEIGHTS_SYNCED = "weights synced over the domain axis"
SAMPLES_APART = "samples kept apart in each domain group"
REQUIRES_GRAD = "requires_grad of ShardTensor leaves"
ASYNC_WAITED = "async collectives waited"
OPTIMIZER_GROUPS = "optimizer groups by tensor type"
NO_FSDP1 = "no FSDP1"
DDP_GROUP = "DDP over the ddp axis only"
REDUCED_ONCE = "gradients reduced once over the domain axis"
PLAN_CACHE = "redistribution plan cache without stale entries"
CHECKS = (WEIGHTS_SYNCED, SAMPLES_APART, REQUIRES_GRAD, ASYNC_WAITED, OPTIMIZER_GROUPS, NO_FSDP1, DDP_GROUP,
          REDUCED_ONCE, PLAN_CACHE)

FIXES = {
    WEIGHTS_SYNCED: ("broadcast every plain parameter from the domain group's first rank at start-up (before "
                     "wrapping): g = mesh['domain'].get_group(); for p in model.parameters(): "
                     "dist.broadcast(p.data, src=dist.get_process_group_ranks(g)[0], group=g)"),
    SAMPLES_APART: ("a batch of 1 per domain group, the batch scaled over the ddp axis (each ddp rank its own "
                    "sample), avoids the cost and the risk; where a larger batch stays, keep dim 0 out of every "
                    "view/reshape that merges a sharded dim: x.reshape(B, -1, C), not x.reshape(B * N, C)"),
    REQUIRES_GRAD: ("create the leaf with the flag: sharddbg.engine.scatter(t, dim, requires_grad=True) or "
                    "scatter_tensor(..., requires_grad=True); never set it on the local tensor"),
    ASYNC_WAITED: "call .wait() (or to_local()) on every AsyncCollectiveTensor before dropping or reusing it",
    OPTIMIZER_GROUPS: ("split the parameter groups by tensor type and mesh (distributed in one group, plain in "
                       "another), or pass foreach=False; build the optimizer after wrapping"),
    NO_FSDP1: ("use DDP with the ddp sub-mesh's group, or FSDP2: fully_shard(model, mesh=mesh['ddp']); "
               "FullyShardedDataParallel fights ShardTensor's weight promotion"),
    DDP_GROUP: "DDP(model, process_group=mesh['ddp'].get_group())",
    REDUCED_ONCE: ("do not reduce gradients over the domain axis yourself (no all_reduce or hook over the domain "
                   "group): ShardTensor's backward already sums the promoted weights' gradients there"),
    PLAN_CACHE: PLAN_CACHE_FIX,
}


class DoctorReport:
    """What ``Cluster.doctor`` found: one row per known ShardTensor pitfall, ok, warn, fail or skip.

    ``table`` has one row per check (``TABLE_COLUMNS``: check, status, found, fix, ranks), in the order of
    ``CHECKS``; ``ok`` says no check failed; ``failures()`` gives the failed rows, ``status(check)`` and
    ``finding(check)`` one check's status and row; ``verdict`` is one line, also the repr; ``text()`` and
    ``show()`` the whole report. ``findings`` and ``names`` stay as attributes. ``Cluster.doctor`` builds it
    (through ``examine``); its views come through ``sharddbg.rendering``.

    Parameters
    ----------
    findings : list of Finding
        One per check: ``kind`` the check's name (one of ``CHECKS``), ``severity`` its status (one of
        ``STATUSES``), ``sentence`` what was found, ``fix`` the fix, ``ranks`` the ranks concerned. ``table``
        is made of them (check, status, found, fix, ranks).
    names : list of str
        The variables examined; ``[]`` when every variable of the ranks' namespaces was.

    Examples
    --------
    Four ranks on one domain group, ``net`` built from each rank's own seed and never broadcast:

    >>> rep = cl.doctor()
    >>> rep.ok
    False
    >>> rep  # doctest: +NORMALIZE_WHITESPACE
    doctor: FAILED (4 ok, 1 fail, 4 skip); weights synced over the domain axis: 2 of 2 plain parameters differ
    across the ranks of a domain group (ranks 1-3 from their group's first rank): net.0.weight, net.0.bias;
    they train "fine" and wrong
    >>> rep.table[["check", "status"]]
                                                 check status
    0              weights synced over the domain axis   fail
    1          samples kept apart in each domain group     ok
    2              requires_grad of ShardTensor leaves     ok
    3                         async collectives waited     ok
    4                  optimizer groups by tensor type   skip
    5                                         no FSDP1     ok
    6                       DDP over the ddp axis only   skip
    7      gradients reduced once over the domain axis   skip
    8  redistribution plan cache without stale entries   skip
    """

    def __init__(self, findings: list[Finding], names: list[str]):
        self.findings = findings
        self.names = names  # the variables examined ([]: every one)
        self.table = pd.DataFrame([{"check": f.kind, "status": f.severity, "found": f.sentence, "fix": f.fix,
                                    "ranks": list(f.ranks)} for f in findings], columns=TABLE_COLUMNS)

    @property
    def ok(self) -> bool:
        """No check failed (warnings and skipped checks do not count)."""
        return not (self.table["status"] == "fail").any()

    def failures(self) -> pd.DataFrame:
        """The checks that failed (warnings and skipped checks are not among them).

        Returns
        -------
        pandas.DataFrame
            Those rows of ``table`` (``TABLE_COLUMNS``: check, status, found, fix, ranks), with its index;
            empty when ``ok``.

        Examples
        --------
        >>> rep = cl.doctor()
        >>> rep.failures()[["check", "ranks"]]
                                         check      ranks
        0  weights synced over the domain axis  [1, 2, 3]
        """
        return self.table[self.table["status"] == "fail"]

    def status(self, check: str) -> str:
        """The status of one check.

        Parameters
        ----------
        check : str
            The check's name, one of ``CHECKS`` (``"no FSDP1"``, ``"weights synced over the domain axis"``, ...;
            the module's constants such as ``NO_FSDP1`` hold them).

        Returns
        -------
        str
            ``"ok"``, ``"warn"``, ``"fail"`` or ``"skip"``.

        Raises
        ------
        KeyError
            No check of the report has that name (the message lists the checks).

        Examples
        --------
        >>> from sharddbg.analysis.doctor import NO_FSDP1
        >>> rep = cl.doctor()
        >>> rep.status(NO_FSDP1)
        'ok'
        >>> rep.status("weights synced over the domain axis")
        'fail'
        """
        found = self.table[self.table["check"] == check]
        if found.empty:
            raise KeyError(f"no doctor check named {check!r}; the checks: {', '.join(CHECKS)}")
        return str(found["status"].iloc[0])

    def finding(self, check: str) -> Finding:
        """The row of one check, as the ``Finding`` it was made from.

        Parameters
        ----------
        check : str
            The check's name, one of ``CHECKS`` (the module's constants such as ``WEIGHTS_SYNCED`` hold them).

        Returns
        -------
        Finding
            ``kind`` (the check), ``severity`` (its status), ``sentence`` (what was found), ``fix``, ``ranks``
            (the ranks concerned), and ``op`` where the check names one (the plan cache's).

        Raises
        ------
        KeyError
            No check of the report has that name (the message lists the checks).

        Examples
        --------
        >>> from sharddbg.analysis.doctor import WEIGHTS_SYNCED
        >>> f = cl.doctor().finding(WEIGHTS_SYNCED)
        >>> f.severity, f.ranks
        ('fail', (1, 2, 3))
        >>> f.fix  # doctest: +ELLIPSIS
        "broadcast every plain parameter from the domain group's first rank at start-up (before wrapping): ..."
        """
        for f in self.findings:
            if f.kind == check:
                return f
        raise KeyError(f"no doctor check named {check!r}; the checks: {', '.join(CHECKS)}")

    @property
    def verdict(self) -> str:
        """One line, also the repr: ``"doctor: FAILED"``, ``"doctor: warnings"`` or
        ``"doctor: no pitfall found"``, how many checks have each status, then the first failure (else the
        first warning) and how many more there are."""
        counts = {s: int((self.table["status"] == s).sum()) for s in STATUSES}
        tally = ", ".join(f"{counts[s]} {s}" for s in STATUSES if counts[s])
        bad = [f for f in self.findings if f.severity == "fail"] or [f for f in self.findings if f.severity == "warn"]
        head = "doctor: " + ("FAILED" if counts["fail"] else "warnings" if counts["warn"] else "no pitfall found")
        text = f"{head} ({tally})"
        if bad:
            text += f"; {bad[0].kind}: {bad[0].sentence}"
            if len(bad) > 1:
                text += f"; and {len(bad) - 1} more"
        return text

    def __repr__(self) -> str:
        return self.verdict

    def text(self) -> str:
        """The report in words: the verdict, then one block per check.

        Each block: the status and the check, what was found, and the fix for a check that failed or warned.

        Returns
        -------
        str
            The text of ``show()``.

        Examples
        --------
        >>> print(cl.doctor().text())  # doctest: +ELLIPSIS
        doctor: FAILED (4 ok, 1 fail, 4 skip); weights synced over the domain axis: 2 of 2 plain parameters ...
        ✖ fail  weights synced over the domain axis: 2 of 2 plain parameters differ across the ranks of a ...
                fix: broadcast every plain parameter from the domain group's first rank at start-up ...
        ✔ ok    samples kept apart in each domain group: every sharded activation has a batch (dim 0) of 1
        ...
        """
        return self.show().text()

    def _repr_html_(self) -> str:
        return self.show().html()

    def _repr_mimebundle_(self, include=None, exclude=None):
        # the HTML and the payload the JupyterLab extension draws from (the view's table); the plain text stays
        # the verdict, as repr() gives it (the whole text is str() and show())
        bundle = self.show()._repr_mimebundle_(include, exclude)
        bundle["text/plain"] = repr(self)
        return bundle

    def show(self) -> Any:
        """The view: the verdict, then one row per check tinted by status.

        Returns
        -------
        sharddbg.views.check.DoctorView
            Static HTML in a notebook (the fix shown for the checks that failed or warned); ``html()`` and
            ``text()`` give it as HTML and plain text.

        Examples
        --------
        >>> cl.doctor("net", "x").show()  # doctest: +SKIP
        """
        return rendering.doctor_view(self)


def examine(facts: list[dict], check: CheckResult | None, trace: Trace | None, names: list[str]) -> DoctorReport:
    """Every check over the ranks' ``facts`` (``engine.api.doctor_facts``, one per rank), the last numerical
    ``check`` and the last ``trace`` (either None when there is none); ``names``: the variables examined."""
    findings = [weights_synced(facts), samples_apart(facts, trace), requires_grad(facts), async_waited(facts),
                optimizer_groups(facts), no_fsdp1(facts), ddp_group(facts), reduced_once(check),
                plan_cache(trace, facts)]
    return DoctorReport(findings, list(names))


def _ranks_by_name(facts: list[dict], key: str) -> dict[str, set]:
    """Each name listed under ``key`` in the ranks' facts -> the ranks that list it."""
    out: dict[str, set] = {}
    for f in facts:
        for name in f[key]:
            out.setdefault(name, set()).add(f["rank"])
    return out


def _ranks_of(by_name: dict[str, set]) -> list[int]:
    """Every rank of a name -> ranks mapping, sorted."""
    return sorted({r for rs in by_name.values() for r in rs})


def ranks_text(ranks) -> str:
    ranks = sorted(set(int(r) for r in ranks))
    if len(ranks) > 2 and ranks == list(range(ranks[0], ranks[-1] + 1)):
        return f"ranks {ranks[0]}-{ranks[-1]}"
    return ("rank " if len(ranks) == 1 else "ranks ") + ", ".join(map(str, ranks))


def _listed(items: list[str], limit: int = 3) -> str:
    return ", ".join(items[:limit]) + (f" and {len(items) - limit} more" if len(items) > limit else "")


def weights_synced(facts: list[dict]) -> Finding:
    """Each plain parameter's digest compared across the ranks of each domain group."""
    check = WEIGHTS_SYNCED
    by_group: dict[tuple, dict[str, dict[int, str]]] = {}
    for f in facts:
        group = tuple(f["domain_group"]) or (f["rank"],)
        for p in f["params"]:
            if "digest" in p:
                by_group.setdefault(group, {}).setdefault(f"{p['module']}.{p['param']}", {})[f["rank"]] = p["digest"]
    if not by_group:
        return Finding(check, "skip", "no module with plain parameters among the examined variables")
    differing: dict[str, set[int]] = {}  # parameter -> the ranks that differ from their group's first rank
    total = 0
    for group, params in by_group.items():
        if len(group) < 2:
            continue
        for name, digests in params.items():
            total += 1
            first = digests.get(group[0])
            odd = [r for r in group if digests.get(r) != first]
            if odd:
                differing.setdefault(name, set()).update(odd)
    if not total:
        return Finding(check, "skip", "the domain axis has one rank: nothing to sync")
    n_params = len({n for params in by_group.values() for n in params})
    if differing:
        ranks = _ranks_of(differing)
        return Finding(check, "fail", f"{len(differing)} of {n_params} plain parameters differ across the ranks of a "
                                      f"domain group ({ranks_text(ranks)} from their group's first rank): "
                                      f"{_listed(list(differing))}; they train \"fine\" and wrong", FIXES[check],
                       tuple(ranks))
    return Finding(check, "ok", f"every plain parameter ({n_params} per group) is the same on every rank of its "
                                f"domain group", FIXES[check])


# view-like ops: they regroup dims without moving data, so the dims they merge can be read off the shapes
_VIEW_OPS = re.compile(r"(^|\.)(view|reshape|_unsafe_view|_reshape_alias|flatten|view_as|reshape_as)(\.|$)")
# a plain Shard(d) as the trace writes it ("S(1)", or "Shard(dim=1)" from older torch; a strided shard is
# "_S(0, 2)"), and each placement of a placements string such as "(S(1), R)"
_SHARD = re.compile(r"^(?:S\((\d+)\)|Shard\(dim=(\d+)\))$")
_PLACEMENT = re.compile(r"_?[A-Za-z]+(?:\([^()]*\))?")


def _placements(text) -> list[str]:
    return _PLACEMENT.findall(text) if isinstance(text, str) else []


def _shard_dim(placement: str) -> int | None:
    match = _SHARD.match(placement)
    return None if match is None else int(match.group(1) or match.group(2))


@dataclass
class SampleMix:
    """An op call of a trace that merged the batch (dim 0, more than one sample) with a sharded dim and
    called the result a plain Shard of the merged dim: each rank's shard then holds rows of every sample,
    which the spec places as consecutive rows of the merged dim (any op along it, and ``full_tensor()``,
    mixes the samples)."""

    op: str
    location: str
    ranks: tuple[int, ...]
    samples: int
    sharded_dim: int
    before: str  # "(2, 16, 8) S(1)": the input's global shape and placements
    after: str  # "(32, 8) S(0)"


def _batch_group(old: list[int], new: list[int]) -> tuple[range, range] | None:
    """The dims of ``old`` and of ``new`` that a view merges with (or splits from) dim 0: the shortest
    leading runs whose sizes multiply to the same number; None where the shapes do not correspond."""
    if not old or not new or 0 in old or 0 in new:
        return None
    i = j = 0
    left, right = old[0], new[0]
    while left != right:
        if left < right and i + 1 < len(old):
            i += 1
            left *= old[i]
        elif right < left and j + 1 < len(new):
            j += 1
            right *= new[j]
        else:
            return None
    return range(i + 1), range(j + 1)


def sample_mixes(ops: pd.DataFrame) -> list[SampleMix]:
    """The view-like op calls of a trace's ops (``Trace.get_ops()``) that mixed samples (``SampleMix``), one
    per op and place in the code, with the ranks that made it. A merge whose result DTensor records as a
    strided shard, or that replicated the tensor first, keeps the samples right (it only costs)."""
    found: dict[tuple[str, str], SampleMix] = {}
    if ops is None or ops.empty:
        return []
    for row in ops.itertuples(index=False):
        if not _VIEW_OPS.search(str(row.op)) or not row.in_global_shapes or row.out_global_shape is None:
            continue
        old, new = list(row.in_global_shapes[0] or []), list(row.out_global_shape or [])
        before = _placements((row.in_placements or [None])[0])
        after = _placements(row.placements)
        if not before or len(before) != len(after) or len(old) < 2 or old[0] < 2:
            continue
        group = _batch_group(old, new)
        if group is None:
            continue
        for p_in, p_out in zip(before, after):  # mesh dim by mesh dim
            dim, out_dim = _shard_dim(p_in), _shard_dim(p_out)
            if dim is None or out_dim is None or dim == 0 or dim not in group[0] or out_dim not in group[1]:
                continue
            location = row.location if isinstance(row.location, str) else ""
            mix = found.setdefault((str(row.op), location), SampleMix(
                str(row.op), location, (), int(old[0]), dim, f"{tuple(old)} {', '.join(before)}",
                f"{tuple(new)} {', '.join(after)}"))
            mix.ranks = tuple(sorted(set(mix.ranks) | {int(row.rank)}))
            break
    return list(found.values())


def samples_apart(facts: list[dict], trace=None) -> Finding:
    """A batch (dim 0) larger than 1 in the sharded activations of the ranks (ShardTensors of 3+ dims split
    along a dim other than 0): right for ops that keep the samples apart, so a warning that names the ops
    where it matters; a failure where the last ``trace`` saw a view-like op merge the batch with a sharded
    dim into a plain shard (``sample_mixes``): there the samples are mixed."""
    check = SAMPLES_APART
    mixes = sample_mixes(trace.get_ops()) if trace is not None else []
    if mixes:
        parts = [f"{m.op} ({m.location or 'no place recorded'}) merged the batch ({m.samples} samples) with "
                 f"sharded dim {m.sharded_dim}: {m.before} -> {m.after} on {ranks_text(m.ranks)}" for m in mixes]
        ranks = sorted({r for m in mixes for r in m.ranks})
        return Finding(check, "fail", f"in the last trace, {_listed(parts)}; each rank's shard now holds rows of "
                                      f"every sample, which the spec places as consecutive rows of one: the "
                                      f"samples are mixed (cl.check on that cell shows where)", FIXES[check],
                       tuple(ranks))
    seen: dict[str, tuple[dict, set]] = {}
    any_sharded = False
    for f in facts:
        for t in f["shard_tensors"]:
            if t["sharded_dims"] and len(t["global_shape"]) >= 3:
                any_sharded = True
                if 0 not in t["sharded_dims"] and t["global_shape"][0] > 1:
                    seen.setdefault(t["name"], (t, set()))[1].add(f["rank"])
    if not any_sharded:
        return Finding(check, "skip", "no sharded activation (a ShardTensor of 3 or more dims) among the examined "
                                      "variables")
    if seen:
        parts = [f"{name}: global shape {tuple(t['global_shape'])}, split along dim "
                 f"{', '.join(map(str, t['sharded_dims']))}, a batch of {t['global_shape'][0]} per domain group"
                 for name, (t, _) in seen.items()]
        ranks = sorted({r for _, rs in seen.values() for r in rs})
        seen_by_trace = ("the last trace saw no op merge them" if trace is not None else
                         "no trace yet: record a step (%%shard_trace) and run the doctor again to see whether one does")
        return Finding(check, "warn", f"{_listed(parts)}: right where every op keeps the samples apart "
                                      f"(convolutions, normalizations, pointwise ops, a linear over the last dim), "
                                      f"at that many times the memory and work per rank; a view/reshape that "
                                      f"merges dim 0 with a sharded dim (batch x tokens flattened for a linear or "
                                      f"attention) would mix them: {seen_by_trace}", FIXES[check], tuple(ranks))
    return Finding(check, "ok", "every sharded activation has a batch (dim 0) of 1", FIXES[check])


def requires_grad(facts: list[dict]) -> Finding:
    """A ShardTensor leaf whose local tensor requires grad while autograd's own flag on it is False (no gradient
    will reach it), and whether ``requires_grad_`` works at all in this physicsnemo."""
    check = REQUIRES_GRAD
    split: dict[str, set] = {}
    without: dict[str, set] = {}
    works = [f["requires_grad_works"] for f in facts if f["requires_grad_works"] is not None]
    leaves = 0
    for f in facts:
        for t in f["shard_tensors"]:
            if not t["is_leaf"]:
                continue
            leaves += 1
            if t["local_requires_grad"] and not t["wrapper_requires_grad"]:
                split.setdefault(t["name"], set()).add(f["rank"])
            elif not t["wrapper_requires_grad"]:
                without.setdefault(t["name"], set()).add(f["rank"])
    if split:
        ranks = _ranks_of(split)
        return Finding(check, "fail", f"{_listed(sorted(split))}: .requires_grad says True (its local tensor has the "
                                      f"flag) but autograd's flag on the ShardTensor is False, so no gradient reaches "
                                      f"it", FIXES[check], tuple(ranks))
    if works and not all(works):
        names = sorted(without)
        found = ("requires_grad_(True) on a ShardTensor does nothing in this physicsnemo (it takes the DTensor "
                 "fallback and sets the flag on a temporary)")
        if names:  # whether they should require grad, only their author knows
            found += f"; ShardTensor leaves that do not require grad: {_listed(names)} (set on purpose?)"
        ranks = _ranks_of(without)
        return Finding(check, "warn", found, FIXES[check], tuple(ranks))
    if not leaves:
        return Finding(check, "skip", "no ShardTensor leaf among the examined variables")
    return Finding(check, "ok", f"requires_grad_ works on ShardTensor here, and the flags of the ShardTensor "
                                f"leaves ({leaves // len(facts) or leaves} per rank) agree with autograd's", FIXES[check])


def async_waited(facts: list[dict]) -> Finding:
    """Variables that hold an AsyncCollectiveTensor, and functional collectives never waited (torch's registry)."""
    check = ASYNC_WAITED
    held = _ranks_by_name(facts, "async_tensors")
    pending = {f["rank"]: f["unwaited"] for f in facts if f["unwaited"]}
    if held:
        ranks = _ranks_of(held)
        found = f"{_listed(sorted(held))} hold{'s' if len(held) == 1 else ''} an AsyncCollectiveTensor never waited"
        if pending:
            found += f"; {max(pending.values())} functional collective(s) issued and never waited"
        return Finding(check, "fail", found + " (warnings at exit, and its data may not be there yet)", FIXES[check],
                       tuple(ranks))
    if pending:
        return Finding(check, "warn", f"{max(pending.values())} functional collective(s) issued and never waited "
                                      f"on {ranks_text(pending)} (results dropped in a warm-up or a benchmark?)",
                       FIXES[check], tuple(sorted(pending)))
    return Finding(check, "ok", "no AsyncCollectiveTensor left unwaited", FIXES[check])


def optimizer_groups(facts: list[dict]) -> Finding:
    """Parameter groups that mix distributed and plain parameters, judged by whether foreach kernels run them."""
    check = OPTIMIZER_GROUPS
    failing, warning, total = [], [], 0
    ranks: set[int] = set()
    for f in facts:
        for opt in f["optimizers"]:
            for g in opt["groups"]:
                total += 1
                if not (g["distributed"] and g["plain"]):
                    continue
                text = (f"{opt['name']} group {g['index']}: {g['distributed']} distributed and {g['plain']} plain "
                        f"parameters")
                if g["foreach"] or g["fused"] or (g["foreach"] is None and g["cuda"]):
                    failing.append(text + (" with foreach=True" if g["foreach"] else " with fused kernels" if g["fused"]
                                           else " on CUDA, where foreach is the default"))
                    ranks.add(f["rank"])
                elif g["foreach"] is None:
                    warning.append(text)
                    ranks.add(f["rank"])
    if not total:
        return Finding(check, "skip", "no optimizer among the examined variables")
    failing, warning = list(dict.fromkeys(failing)), list(dict.fromkeys(warning))
    if failing:
        return Finding(check, "fail", f"{_listed(failing)}: foreach kernels cannot mix DTensor/ShardTensor and plain "
                                      f"parameters", FIXES[check], tuple(sorted(ranks)))
    if warning:
        return Finding(check, "warn", f"{_listed(warning)}: fine on CPU, where foreach is off by default; on GPU "
                                      f"the default foreach kernels fail", FIXES[check], tuple(sorted(ranks)))
    return Finding(check, "ok", "no optimizer group mixes distributed and plain parameters in foreach kernels",
                   FIXES[check])


def no_fsdp1(facts: list[dict]) -> Finding:
    check = NO_FSDP1
    found = _ranks_by_name(facts, "fsdp1")
    if found:
        ranks = _ranks_of(found)
        return Finding(check, "fail", f"FullyShardedDataParallel (FSDP1) wraps {_listed(sorted(found))}",
                       FIXES[check], tuple(ranks))
    if not any(f["params"] for f in facts):
        return Finding(check, "skip", "no module among the examined variables")
    return Finding(check, "ok", "no FullyShardedDataParallel in the examined modules", FIXES[check])


def ddp_group(facts: list[dict]) -> Finding:
    """Each DDP wrapper's process group against the rank's group along the mesh's ddp axis."""
    check = DDP_GROUP
    wrong: dict[str, tuple[list, int, list, set]] = {}
    seen = 0
    for f in facts:
        for w in f["ddp_wrappers"]:
            seen += 1
            if sorted(w["group"]) != sorted(f["ddp_group"]):
                entry = wrong.setdefault(w["name"], (w["group"], f["rank"], f["ddp_group"], set()))
                entry[3].add(f["rank"])
    if not seen:
        return Finding(check, "skip", "no DistributedDataParallel among the examined variables")
    if wrong:
        parts = []
        for name, (group, rank, axis, _) in wrong.items():
            whole = f"the whole world ({group})" if len(group) == len(facts) else f"ranks {group}"
            parts.append(f"{name} is DDP over {whole}, not over the ddp axis (rank {rank}: {axis}): it averages "
                         f"the gradients over the domain axis too")
        ranks = sorted({r for *_, rs in wrong.values() for r in rs})
        return Finding(check, "fail", _listed(parts), FIXES[check], tuple(ranks))
    return Finding(check, "ok", "every DDP wrapper reduces over its rank's ddp axis", FIXES[check])


def reduced_once(check) -> Finding:
    """Parameter gradients that the last numerical check found a whole multiple of the reference's."""
    name = REDUCED_ONCE
    if check is None:
        return Finding(name, "skip", "no numerical check yet: run cl.check(...) on a forward and backward (it compares "
                                     "every parameter gradient with an unsharded reference)", FIXES[name])
    grads = check.table[check.table["kind"] == "parameter grad"]
    if grads.empty:
        return Finding(name, "skip", f"the last cl.check compared no parameter gradient ({check.backward_note or 'no model'})",
                       FIXES[name])
    multiples = []
    ranks: set[int] = set()
    for tensor in dict.fromkeys(grads["tensor"]):
        rows = grads[grads["tensor"] == tensor]
        k = whole_multiple(rows["ratio"])
        if k and not rows["ok"].all():
            multiples.append((tensor, k))
            ranks.update(int(r) for r in rows["rank"])
    if multiples:
        parts = [f"{t} is {k}x the unsharded reference's" for t, k in multiples]
        return Finding(name, "fail", f"{_listed(parts)} (last cl.check): reduced over the domain axis once more than "
                                     f"it should be", FIXES[name], tuple(sorted(ranks)))
    n = grads["tensor"].nunique()
    return Finding(name, "ok", f"the last cl.check found none of {n} parameter gradients a multiple of the "
                               f"reference's", FIXES[name])


def plan_cache(trace, facts: list[dict]) -> Finding:
    """Stale entries the last trace saw left in DTensor's redistribution plan cache (a performance pitfall:
    each step gets slower), and how many entries each rank holds now."""
    name = PLAN_CACHE
    known = {f["rank"]: f["plan_cache_entries"] for f in facts if f.get("plan_cache_entries") is not None}
    now = ""
    if known:
        most = max(known, key=lambda r: known[r])
        now = f"; the cache holds {known[most]:,} entries now on rank {most}"
    growth = trace.get_plan_cache_growth() if trace is not None else None
    if growth is None or growth.empty:
        what = "no trace yet" if trace is None else "the last trace did not watch the cache (an older sharddbg)"
        return Finding(name, "skip", f"{what}: record a few training steps with %%shard_trace (or cl.trace) and "
                                     f"run the doctor again{now}", FIXES[name])
    stale = plan_cache_finding(trace.get_plan_cache(), growth)
    if stale is not None:
        return Finding(name, "warn", f"in the last trace, {stale.sentence}{now}", stale.fix, stale.ranks, stale.op)
    # every rank has a cache of its own: its misses are counted per rank, never summed over ranks
    misses = sorted(int(m) for m in growth["misses"])
    lo, hi = misses[0], misses[-1]
    counted = (f"{lo} miss{'es' if lo != 1 else ''} on each rank" if lo == hi
               else f"{lo} to {hi} misses per rank")
    return Finding(name, "ok", f"the last trace left no stale entry ({counted} while recording){now}", FIXES[name])
