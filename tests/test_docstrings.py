"""Every public method and function of the surface users call (``Cluster``, ``Trace``, the result objects, the
recording options, the engine's helpers and the engine API the client calls) says what it takes, gives and
raises, numpy-style, with an example: the API reference (docs/, mkdocstrings) is rendered from these.

Read from the objects themselves (``inspect``) and their source (``ast``, for the ``raise`` statements): a
method without its sections fails here, naming it and what is missing.
"""

from __future__ import annotations

import ast
import inspect
import re
import textwrap

import pytest

import sharddbg
from sharddbg.analysis.check import CheckResult
from sharddbg.analysis.doctor import DoctorReport
from sharddbg.analysis.findings import Finding, TraceOverview
from sharddbg.analysis.patch_check import PatchCheck
from sharddbg.analysis.replica_check import ReplicaCheck
from sharddbg.analysis.smoke import SmokeResult
from sharddbg.cluster import Cluster
from sharddbg.cluster.execution import PendingCell
from sharddbg.engine import api as engine_api
from sharddbg.engine._scatter import scatter
from sharddbg.engine.patches import registered_patches, without_patches
from sharddbg.options import RecordingOptions
from sharddbg.patches import scaffold
from sharddbg.trace import Trace, load_trace

CLASSES = [Cluster, Trace, CheckResult, DoctorReport, SmokeResult, ReplicaCheck, RecordingOptions, Finding,
           TraceOverview, PendingCell, PatchCheck]
FUNCTIONS = [load_trace, sharddbg.record, sharddbg.last_trace, sharddbg.inspect, scatter, without_patches,
             registered_patches, scaffold] + [getattr(engine_api, name) for name in engine_api.__all__
                                    if inspect.isfunction(getattr(engine_api, name))]
SECTION = re.compile(r"^(?P<name>Parameters|Returns|Yields|Raises|Examples|See Also|Notes)\n-{3,}$", re.M)


def _members() -> list[tuple[str, object]]:
    """(qualified name, function) of every public method each class defines itself, and every function."""
    out = []
    for cls in CLASSES:
        for name, member in vars(cls).items():
            if name.startswith("_"):
                continue
            fn = member.__func__ if isinstance(member, (classmethod, staticmethod)) else member
            if inspect.isfunction(fn):
                out.append((f"{cls.__name__}.{name}", fn))
    out += [(f"{fn.__module__}.{fn.__qualname__}", fn) for fn in FUNCTIONS]
    return out


MEMBERS = _members()


def _sections(doc: str) -> dict[str, str]:
    """Section name -> its text, of a numpy-style docstring."""
    doc = inspect.cleandoc(doc)
    found = list(SECTION.finditer(doc))
    return {m["name"]: doc[m.end():(found[i + 1].start() if i + 1 < len(found) else len(doc))]
            for i, m in enumerate(found)}


def _raises(fn) -> bool:
    """The function's own body holds a ``raise`` of an exception (not a bare re-raise, not in a nested def)."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(fn)))
    body = tree.body[0]
    stack = list(body.body)
    while stack:
        node = stack.pop()
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda, ast.ClassDef)):
            continue
        if isinstance(node, ast.Raise) and node.exc is not None:
            return True
        stack.extend(ast.iter_child_nodes(node))
    return False


def _problems(fn) -> list[str]:
    doc = fn.__doc__
    if not doc or not doc.strip():
        return ["no docstring"]
    sections = _sections(doc)
    problems = []
    signature = inspect.signature(fn)
    params = [p for p in signature.parameters.values() if p.name not in ("self", "cls")]
    if params:
        text = sections.get("Parameters")
        if text is None:
            problems.append("no Parameters section")
        else:
            for p in params:
                shown = {inspect.Parameter.VAR_POSITIONAL: f"*{p.name}",
                         inspect.Parameter.VAR_KEYWORD: f"**{p.name}"}.get(p.kind, p.name)
                if not re.search(rf"^{re.escape(shown)}\b", text, re.M):
                    problems.append(f"parameter {shown} not described")
    returns_none = signature.return_annotation in (None, "None")
    if signature.return_annotation is inspect.Signature.empty:
        problems.append("no return annotation")
    elif not returns_none and "Returns" not in sections and "Yields" not in sections:
        problems.append("no Returns section")
    if _raises(fn) and "Raises" not in sections:
        problems.append("raises, but no Raises section")
    if ">>>" not in sections.get("Examples", ""):
        problems.append("no example (an Examples section with >>>)")
    return problems


@pytest.mark.parametrize("name, fn", MEMBERS, ids=[name for name, _ in MEMBERS])
def test_public_method_documents_itself(name, fn):
    assert not _problems(fn), f"{name}: " + "; ".join(_problems(fn))


def test_the_rule_sees_what_is_missing():
    """The checker itself: a bare function fails every rule, a documented one passes."""

    def bare(x, *rest, flag=False):
        if flag:
            raise ValueError("no")
        return x

    assert set(_problems(bare)) == {"no docstring"}
    bare.__doc__ = "Only words."
    assert set(_problems(bare)) == {"no Parameters section", "no return annotation",
                                    "raises, but no Raises section", "no example (an Examples section with >>>)"}

    def documented(x: int, *rest: int, flag: bool = False) -> int:
        """Give ``x`` back.

        Parameters
        ----------
        x : int
            What comes back.
        *rest : int
            Ignored.
        flag : bool
            Refuse.

        Returns
        -------
        int
            ``x``.

        Raises
        ------
        ValueError
            With ``flag``.

        Examples
        --------
        >>> documented(1)
        1
        """
        if flag:
            raise ValueError("no")
        return x

    assert _problems(documented) == []
    assert len(MEMBERS) > 100  # the surface above: every class's methods and the engine API
