"""The package's layering, read from the source (no imports run): the rules docs/architecture.md ("How it is built")
states.

- no import cycle anywhere in the package, counting the imports made inside functions; the seam
  (``sharddbg.rendering``), whose imports of views and exporters wait until a view is asked for, is the one
  place allowed to close a loop, and imports under ``if TYPE_CHECKING:`` (never run) do not count;
- below the front ends (the magics and the command line), only the seam imports a view or exporter module;
- engine/ (runs inside each rank) imports nothing from cluster/, views/, analysis/, trace.py or the magics;
- views/ import no ipyparallel and nothing from engine/ or cluster/ (they read a Trace, analyses and results);
- the data layer (schema, trace, analysis) imports no views, no cluster, no engine;
- no module reads another sharddbg module's underscore names;
- a view never probes a trace with getattr/hasattr: it reads Trace.get_*() and analysis/, typed.
"""

from __future__ import annotations

import ast
from pathlib import Path

PKG = Path(__file__).resolve().parents[1] / "sharddbg"


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(PKG.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


MODULES = {_module_name(p): p for p in sorted(PKG.rglob("*.py"))}
PACKAGES = {name for name, p in MODULES.items() if p.name == "__init__.py"}


def _resolve(importer: str, module: str | None, level: int) -> str:
    """Absolute name of ``from <level dots><module> import ...`` written in module ``importer``."""
    if level == 0:
        return module or ""
    base = importer.split(".") if importer in PACKAGES else importer.split(".")[:-1]
    base = base[: len(base) - (level - 1)]
    return ".".join(base + ([module] if module else []))


class _Imports(ast.NodeVisitor):
    """Every sharddbg module a file imports (module level and inside functions), and the names it takes."""

    def __init__(self, importer: str) -> None:
        self.importer = importer
        self.modules: set[str] = set()  # imported when the code runs (at import time or inside a function)
        self.type_only: set[str] = set()  # imported under ``if TYPE_CHECKING:`` only: for type checkers, never run
        self.top_level: set[str] = set()  # imported when the module itself is imported
        self.names: list[tuple[str, str, int]] = []  # (module, name, line) of `from module import name`
        self.aliases: dict[str, str] = {}  # local name -> sharddbg module it is bound to
        self.depth = 0  # inside how many function definitions
        self.typing_only = 0  # inside how many ``if TYPE_CHECKING:`` blocks

    def _add(self, target: str) -> None:
        # the deepest sharddbg module named (a package import counts as its __init__)
        while target and target not in MODULES:
            target = target.rpartition(".")[0]
        if not target.startswith("sharddbg"):
            return
        if self.typing_only:
            self.type_only.add(target)
            return
        self.modules.add(target)
        if self.depth == 0:
            self.top_level.add(target)

    def visit_If(self, node: ast.If) -> None:
        if ast.unparse(node.test) in ("TYPE_CHECKING", "typing.TYPE_CHECKING"):
            self.typing_only += 1
            for child in node.body:
                self.visit(child)
            self.typing_only -= 1
            for child in node.orelse:
                self.visit(child)
        else:
            self.generic_visit(node)

    def _nested(self, node) -> None:
        self.depth += 1
        self.generic_visit(node)
        self.depth -= 1

    visit_FunctionDef = visit_AsyncFunctionDef = _nested

    def visit_Import(self, node: ast.Import) -> None:
        for a in node.names:
            if a.name.startswith("sharddbg"):
                self._add(a.name)
                if a.asname:
                    self.aliases[a.asname] = a.name

    def visit_ImportFrom(self, node: ast.ImportFrom) -> None:
        src = _resolve(self.importer, node.module, node.level)
        if not src.startswith("sharddbg"):
            return
        for a in node.names:
            full = f"{src}.{a.name}"
            if full in MODULES:  # `from . import recorder`: a module
                self._add(full)
                self.aliases[a.asname or a.name] = full
            else:
                self._add(src)
                self.names.append((src, a.name, node.lineno))


def _scan(name: str) -> tuple[_Imports, ast.Module]:
    tree = ast.parse(MODULES[name].read_text(), filename=str(MODULES[name]))
    v = _Imports(name)
    v.visit(tree)
    return v, tree


SCANS = {name: _scan(name) for name in MODULES}


def _imports(name: str) -> set[str]:
    return {m for m in SCANS[name][0].modules if m != name}


def _in(name: str, prefix: str) -> bool:
    return name == prefix or name.startswith(prefix + ".")


# The seam between the data and its views: its imports of views and exporters run only when a view is asked for.
SEAM = "sharddbg.rendering"
# The front ends: they parse what a person typed and call the API (and may show a view directly).
FRONT_ENDS = ("sharddbg.magics", "sharddbg.cli", "sharddbg.labserver")
RENDERED = ("sharddbg.views", "sharddbg.exporters")


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The import cycles of ``graph`` (module -> the modules it imports), each as a path back to its start."""
    state: dict[str, int] = {}
    cycles = []

    def visit(m, path):
        state[m] = 1
        for d in sorted(graph.get(m, ())):
            if state.get(d) == 1:
                cycles.append(path[path.index(d):] + [d] if d in path else [m, d])
            elif d not in state:
                visit(d, path + [d])
        state[m] = 2

    for m in sorted(graph):
        if m not in state:
            visit(m, [m])
    return cycles


def test_engine_has_no_import_cycle():
    engine = [m for m in MODULES if _in(m, "sharddbg.engine")]
    # a package's __init__ only re-exports lazily; it is not a place code depends on
    graph = {m: {d for d in _imports(m) if _in(d, "sharddbg.engine") and d != "sharddbg.engine"} for m in engine}
    cycles = _cycles(graph)
    assert not cycles, "import cycles among engine modules: " + "; ".join(" -> ".join(c) for c in cycles)


# Package faces: an __init__ whose every import waits inside a function (``sharddbg``, ``sharddbg.engine``): a
# table of contents of lazy accessors. A module importing one (the engine hands the ``sharddbg`` package to the
# user's cells) depends on nothing in it.
FACES = {m for m in PACKAGES if not SCANS[m][0].top_level}


def test_no_import_cycle_in_the_package():
    """Every import that runs counts, the ones inside functions too; only the seam's imports of the views and
    exporters are set aside (they are the one loop by design: a view reads the data that asked for it), and an
    import of a package face (it only holds lazy accessors)."""
    graph = {m: {d for d in _imports(m) if d not in FACES and not (m == SEAM and any(_in(d, r) for r in RENDERED))}
             for m in MODULES}
    cycles = _cycles(graph)
    assert not cycles, "import cycles: " + "; ".join(" -> ".join(c) for c in cycles)


def test_below_the_front_ends_only_the_seam_reaches_views_and_exporters():
    allowed = (SEAM, *FRONT_ENDS, *RENDERED)
    bad = []
    for m in MODULES:
        if any(_in(m, a) for a in allowed):
            continue
        for d in _imports(m) | SCANS[m][0].type_only:
            if any(_in(d, r) for r in RENDERED):
                bad.append(f"{m} imports {d}")
    assert not bad, "only sharddbg.rendering may import a view or exporter below the front ends: " + "; ".join(bad)


def _forbidden(layer: str, banned: tuple[str, ...], top_level_only: bool = False) -> list[str]:
    bad = []
    for m in MODULES:
        if _in(m, layer):
            for d in (SCANS[m][0].top_level - {m}) if top_level_only else _imports(m):
                if any(_in(d, b) for b in banned):
                    bad.append(f"{m} imports {d}")
    return bad


def test_engine_imports_no_client_side_module():
    assert not _forbidden("sharddbg.engine", ("sharddbg.cluster", "sharddbg.views", "sharddbg.analysis",
                                              "sharddbg.trace", "sharddbg.magics", "sharddbg.cli"))


def test_views_import_no_engine_no_cluster_no_ipyparallel():
    assert not _forbidden("sharddbg.views", ("sharddbg.engine", "sharddbg.cluster", "sharddbg.magics"))
    ipp = []
    for m in MODULES:
        if _in(m, "sharddbg.views"):
            for node in ast.walk(SCANS[m][1]):
                names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                    [node.module or ""] if isinstance(node, ast.ImportFrom) and node.level == 0 else []
                ipp += [f"{m} imports {n}" for n in names if n.split(".")[0] in ("ipyparallel", "zmq", "torch")]
    assert not ipp, ipp


def test_data_layer_imports_no_views_cluster_or_engine():
    for layer in ("sharddbg.schema", "sharddbg.analysis"):
        assert not _forbidden(layer, ("sharddbg.views", "sharddbg.cluster", "sharddbg.engine", "sharddbg.magics"))
    # Trace is the front object: its show() / plot_*() / to_html() hand over to the seam, which imports the views
    assert not _forbidden("sharddbg.trace", ("sharddbg.cluster", "sharddbg.engine", "sharddbg.magics", "sharddbg.views",
                                             "sharddbg.exporters"))


def test_no_module_reads_another_modules_private_names():
    bad = []
    for m, (v, tree) in SCANS.items():
        for src, name, line in v.names:
            if name.startswith("_") and not name.startswith("__") and src != m:
                bad.append(f"{m}:{line} imports {name} from {src}")
        for node in ast.walk(tree):
            if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name)
                    and node.value.id in v.aliases and node.attr.startswith("_") and not node.attr.startswith("__")
                    and v.aliases[node.value.id] != m):
                bad.append(f"{m}:{node.lineno} reads {v.aliases[node.value.id]}.{node.attr}")
    assert not bad, "\n".join(bad)


def test_private_modules_are_imported_only_inside_their_package():
    bad = []
    for m, (v, _tree) in SCANS.items():
        for d in v.modules:
            leaf = d.rpartition(".")[2]
            if leaf.startswith("_") and not leaf.startswith("__"):
                owner = d.rpartition(".")[0]
                if not _in(m, owner):
                    bad.append(f"{m} imports {d}")
    assert not bad, bad


def test_views_do_not_probe_a_trace():
    bad = []
    for m, (_v, tree) in SCANS.items():
        if not _in(m, "sharddbg.views"):
            continue
        for node in ast.walk(tree):
            if (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
                    and node.func.id in ("getattr", "hasattr") and node.args
                    and "trace" in ast.unparse(node.args[0]).lower()):
                bad.append(f"{m}:{node.lineno}: {ast.unparse(node)}")
    assert not bad, bad


def test_the_rules_see_real_imports():
    """The scanner itself: it must find imports that exist, or every rule above passes vacuously."""
    assert "sharddbg.schema" in _imports("sharddbg.trace")
    assert any(_in(d, "sharddbg.engine") for d in _imports("sharddbg.cluster.cluster"))
    assert len([m for m in MODULES if _in(m, "sharddbg.engine")]) >= 8
    # an import inside a function counts; one under `if TYPE_CHECKING:` is for type checkers only
    assert "sharddbg.views.explorer" in _imports(SEAM) and SEAM not in SCANS[SEAM][0].top_level
    assert "sharddbg.trace" in SCANS["sharddbg.views.explorer"][0].type_only
    assert "sharddbg.trace" not in _imports("sharddbg.views.explorer")
    assert FACES == {"sharddbg", "sharddbg.engine", "sharddbg.engine.jobs", "sharddbg.views", "sharddbg.exporters"}, FACES
    # the cycle finder finds a cycle
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == [["a", "b", "c", "a"]]
