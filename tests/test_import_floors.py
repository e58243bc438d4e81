"""The floors: the project's packages stand in layers (`LAYERS`, bottom first), every import between modules
points down that order or stays level, no packages import each other in a cycle, and no modules either. The
layering, and what each package owns, is docs/design/README.md's; each package's __init__ docstring says the
same for its own part.

A module belongs to the innermost listed package that contains it (`package_of`); `sarathi_jax` is listed for
its __init__ alone, so a new subpackage or top module of it must be listed by name. The package graph is the
module graph with each module replaced by its package.

The module graph is read from the source with `ast`, so what runs at import time and what runs later count
alike: module-level and function-level imports, imports under `if TYPE_CHECKING:` (a type named is a dependency
too), `importlib.import_module("...")` with a literal name, and the names a package resolves lazily
(`lazy_exports`: `from sarathi_jax import LLM` depends on sarathi_jax.llm, and the package on each module it
exports from). Importing `a.b.c` runs `a/__init__` and `a/b/__init__` too; that is not counted, since every
submodule would otherwise depend on its package's exports.
"""

from __future__ import annotations

import ast
from collections.abc import Iterable, Mapping
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[1]
LIBRARY = ("pallas_kernels", "sarathi_jax", "checkpoints_convert", "server")  # what the wheel installs
INSTRUMENTS = ("benchmarks",)  # developer instruments, run from a clone; never imported by the library
ROOTS = LIBRARY + INSTRUMENTS

# Bottom first. A package's modules may import from its own package, the other packages of its layer (no cycle
# among them) and the layers below.
Layers = tuple[tuple[str, frozenset[str]], ...]
LAYERS: Layers = (
    ("kernels", frozenset({"pallas_kernels"})),
    ("utilities", frozenset({"sarathi_jax.utils"})),
    ("requests, sequences, outputs, the grammar engine", frozenset({"sarathi_jax.request"})),
    ("speculative decoding's plain parts", frozenset({"sarathi_jax.spec_decode"})),
    ("schedulers and the block manager", frozenset({"sarathi_jax.scheduler"})),
    ("models", frozenset({"sarathi_jax.models"})),
    ("configuration", frozenset({"sarathi_jax.config"})),
    ("parallelism", frozenset({"sarathi_jax.parallel"})),
    ("model runner", frozenset({"sarathi_jax.runner"})),
    ("engine core and its API", frozenset({"sarathi_jax.core"})),
    ("simulator and cost models", frozenset({"sarathi_jax.sim"})),
    ("engine", frozenset({"sarathi_jax.engine"})),
    ("disaggregated prefill and decode", frozenset({"sarathi_jax.disagg"})),
    ("offline API and engine factory", frozenset({"sarathi_jax", "sarathi_jax.llm", "sarathi_jax.factory"})),
    ("checkpoint converter", frozenset({"checkpoints_convert"})),
    ("servers and their client", frozenset({"server"})),
    ("bench and load driver", frozenset({"sarathi_jax.bench"})),
    ("developer instruments", frozenset({"benchmarks"})),
)
# Listed for the module itself (its __init__), not for the modules under it.
SHALLOW = frozenset({"sarathi_jax"})


# ----------------------------------------------------------------------------------------------- the graph


def project_modules(root: Path, packages: Iterable[str]) -> dict[str, Path]:
    """Dotted module name -> file, for every .py file of `packages` under `root`."""
    modules = {}
    for package in packages:
        for path in sorted((root / package).rglob("*.py")):
            parts = path.relative_to(root).with_suffix("").parts
            modules[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return modules


def _lazy_exports(package: str, tree: ast.Module, modules: Mapping[str, Path]) -> dict[str, str]:
    """A package's lazily resolved names -> their modules: the module-level dict of module names (full, or
    relative to the package) in a package that calls `lazy_exports`."""
    calls = any(isinstance(n, ast.Call) and getattr(n.func, "id", None) == "lazy_exports" for n in ast.walk(tree))

    def module_named(value: ast.expr | None) -> str | None:
        if not (isinstance(value, ast.Constant) and isinstance(value.value, str)):
            return None
        return next((name for name in (value.value, f"{package}.{value.value}") if name in modules), None)

    table: dict[str, str] = {}
    for node in tree.body if calls else ():
        if isinstance(node, ast.Assign) and isinstance(node.value, ast.Dict):
            pairs = [(k, module_named(v)) for k, v in zip(node.value.keys, node.value.values)]
            if pairs and all(m is not None for _, m in pairs):
                table.update({k.value: m for k, m in pairs if isinstance(k, ast.Constant) and m is not None})
    return table


def import_graph(root: Path, packages: Iterable[str]) -> dict[str, set[str]]:
    """Module -> the project modules it imports (see the module docstring for what counts)."""
    modules = project_modules(root, packages)
    trees = {name: ast.parse(path.read_text(), str(path)) for name, path in modules.items()}
    lazy = {name: _lazy_exports(name, tree, modules) for name, tree in trees.items()}

    def resolve(name: str) -> str | None:
        while name and name not in modules:
            name = name.rpartition(".")[0]
        return name or None

    def targets(module: str, node: ast.AST) -> list[str | None]:
        if isinstance(node, ast.Import):
            return [resolve(alias.name) for alias in node.names]
        if isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                package = module if modules[module].name == "__init__.py" else module.rpartition(".")[0]
                parts = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(parts + ([node.module] if node.module else []))
            found = []
            for alias in node.names:
                if f"{base}.{alias.name}" in modules:
                    found.append(f"{base}.{alias.name}")
                else:
                    found.append(lazy.get(base, {}).get(alias.name) or resolve(base))
            return found
        if (isinstance(node, ast.Call) and getattr(node.func, "attr", getattr(node.func, "id", None)) == "import_module"
                and node.args and isinstance(node.args[0], ast.Constant) and isinstance(node.args[0].value, str)):
            return [resolve(node.args[0].value)]
        return []

    graph: dict[str, set[str]] = {}
    for module, tree in trees.items():
        edges = set(lazy[module].values())
        for node in ast.walk(tree):
            edges.update(t for t in targets(module, node) if t is not None)
        edges.discard(module)
        graph[module] = edges
    return graph


# ----------------------------------------------------------------------------------------------- the checks


def package_of(module: str, layers: Layers = LAYERS, shallow: frozenset[str] = SHALLOW) -> str | None:
    """The innermost listed package containing `module` (a shallow one contains only itself); None: none does."""
    listed = {name for _, names in layers for name in names}
    parts = module.split(".")
    for n in range(len(parts), 0, -1):
        name = ".".join(parts[:n])
        if name in listed and (name == module or name not in shallow):
            return name
    return None


def layer_of(package: str, layers: Layers = LAYERS) -> int:
    return next(i for i, (_, names) in enumerate(layers) if package in names)


def package_graph(graph: Mapping[str, set[str]], layers: Layers = LAYERS, shallow: frozenset[str] = SHALLOW
                  ) -> dict[str, set[str]]:
    """Package -> the packages its modules import (not itself); modules in no listed package are left out."""
    packages: dict[str, set[str]] = {name: set() for _, names in layers for name in names}
    for module, targets in graph.items():
        source = package_of(module, layers, shallow)
        for target in targets:
            owner = package_of(target, layers, shallow)
            if source is not None and owner is not None and owner != source:
                packages[source].add(owner)
    return packages


def upward_imports(graph: Mapping[str, set[str]], layers: Layers = LAYERS, shallow: frozenset[str] = SHALLOW
                   ) -> list[str]:
    found = []
    for module, targets in sorted(graph.items()):
        source = package_of(module, layers, shallow)
        for target in sorted(targets):
            owner = package_of(target, layers, shallow)
            if source is None or owner is None:
                continue
            low, high = layer_of(source, layers), layer_of(owner, layers)
            if high > low:
                found.append(f"{module} ({source}: {layers[low][0]}) imports {target} ({owner}: {layers[high][0]})")
    return found


def edges_within(graph: Mapping[str, set[str]], packages: Iterable[str], layers: Layers = LAYERS,
                 shallow: frozenset[str] = SHALLOW) -> list[str]:
    """The module imports between different packages of `packages`: what makes a package cycle."""
    members = set(packages)
    found = []
    for module, targets in sorted(graph.items()):
        source = package_of(module, layers, shallow)
        for target in sorted(targets):
            owner = package_of(target, layers, shallow)
            if source in members and owner in members and owner != source:
                found.append(f"{module} -> {target}")
    return found


def import_cycles(graph: Mapping[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one node (Tarjan), each sorted: modules that import each
    other, or, on `package_graph`, packages."""
    edges = {m: sorted(t for t in ts if t in graph) for m, ts in graph.items()}
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in edges[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                components.append(sorted(component))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return sorted(components)


# ----------------------------------------------------------------------------------------------- the project


def test_every_module_is_in_a_listed_package():
    unplaced = [m for m in project_modules(REPO_ROOT, ROOTS) if package_of(m) is None]
    assert not unplaced, f"list their packages in LAYERS (tests/test_import_floors.py): {unplaced}"


def test_every_package_is_listed_once():
    names = [name for _, names in LAYERS for name in names]
    assert len(names) == len(set(names))
    modules = project_modules(REPO_ROOT, ROOTS)
    assert not [name for name in names if name not in modules], "LAYERS names a package that is not there"


@pytest.fixture(scope="module")
def project_graph() -> dict[str, set[str]]:
    return import_graph(REPO_ROOT, ROOTS)


def test_no_import_runs_upward(project_graph):
    found = upward_imports(project_graph)
    assert not found, "imports from a lower layer to a higher one:\n" + "\n".join(found)


def test_no_package_cycles(project_graph):
    cycles = import_cycles(package_graph(project_graph))
    assert not cycles, "packages that import each other:\n" + "\n".join(
        f"{cycle}: " + ", ".join(edges_within(project_graph, cycle)) for cycle in cycles)


def test_no_module_cycles(project_graph):
    cycles = import_cycles(project_graph)
    assert not cycles, f"modules that import each other: {cycles}"


def test_the_library_never_imports_the_instruments(project_graph):
    found = [f"{m} -> {t}" for m, ts in sorted(project_graph.items()) if m.split(".")[0] in LIBRARY
             for t in sorted(ts) if t.split(".")[0] in INSTRUMENTS]
    assert not found, "the installed packages import benchmarks/, which the wheel leaves out:\n" + "\n".join(found)


# ----------------------------------------------------------------------------------------------- the checker


def write_tree(root: Path, files: Mapping[str, str]) -> None:
    for name, text in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)


def test_the_graph_sees_every_kind_of_import(tmp_path):
    write_tree(tmp_path, {
        "pkg/__init__.py": "from pkg.lazy_exports import lazy_exports\n"
                           "_EXPORTS = {'Thing': 'sub.thing', 'x': 'pkg.sub.sibling'}\n"  # relative or full names
                           "__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)\n",
        "pkg/lazy_exports.py": "",
        "pkg/sub/__init__.py": "",
        "pkg/sub/thing.py": "from . import sibling\nfrom .sibling import x\n",
        "pkg/sub/sibling.py": "x = 1\n",
        "pkg/top.py": "import importlib\nfrom typing import TYPE_CHECKING\nimport os\n"
                      "if TYPE_CHECKING:\n    from pkg.sub import sibling\n"
                      "def f():\n    from pkg import Thing\n    return importlib.import_module('pkg.lazy_exports')\n",
    })
    graph = import_graph(tmp_path, ["pkg"])
    assert graph["pkg.top"] == {"pkg.sub.sibling", "pkg.sub.thing", "pkg.lazy_exports"}  # not os, not pkg
    assert graph["pkg.sub.thing"] == {"pkg.sub.sibling"}  # `from . import sibling`: the module, not the package
    assert graph["pkg"] == {"pkg.lazy_exports", "pkg.sub.thing", "pkg.sub.sibling"}


TOY_LAYERS: Layers = (("bottom", frozenset({"low"})), ("middle", frozenset({"mid.a", "mid.b"})),
                      ("top", frozenset({"high", "mid"})))


def test_a_module_belongs_to_the_innermost_listed_package():
    assert package_of("mid.a.x", TOY_LAYERS, frozenset()) == "mid.a"
    assert package_of("mid.c", TOY_LAYERS, frozenset()) == "mid"
    assert package_of("mid.c", TOY_LAYERS, frozenset({"mid"})) is None  # shallow: its own __init__ only
    assert package_of("mid", TOY_LAYERS, frozenset({"mid"})) == "mid"
    assert package_of("elsewhere.x", TOY_LAYERS, frozenset()) is None


def test_the_checks_find_an_upward_import_and_the_cycles(tmp_path):
    write_tree(tmp_path, {
        "low/__init__.py": "", "low/a.py": "def f():\n    import high.b\n", "low/c.py": "from low import d\n",
        "low/d.py": "import low.c\n", "high/__init__.py": "", "high/b.py": "from low import a\n",
        "mid/__init__.py": "", "mid/a/__init__.py": "", "mid/a/x.py": "from mid.b import y\n",
        "mid/b/__init__.py": "", "mid/b/y.py": "", "mid/b/z.py": "import mid.a\n",  # two packages, no module cycle
    })
    graph = import_graph(tmp_path, ["low", "mid", "high"])
    assert upward_imports(graph, TOY_LAYERS, frozenset()) == ["low.a (low: bottom) imports high.b (high: top)"]
    assert import_cycles(graph) == [["high.b", "low.a"], ["low.c", "low.d"]]
    packages = package_graph(graph, TOY_LAYERS, frozenset())
    assert packages == {"low": {"high"}, "mid.a": {"mid.b"}, "mid.b": {"mid.a"}, "high": {"low"}, "mid": set()}
    assert import_cycles(packages) == [["high", "low"], ["mid.a", "mid.b"]]
    assert edges_within(graph, ["mid.a", "mid.b"], TOY_LAYERS, frozenset()) == ["mid.a.x -> mid.b.y", "mid.b.z -> mid.a"]


def test_the_project_layers_place_modules_as_documented():
    assert package_of("benchmarks.peer.servers") == "benchmarks"
    assert package_of("sarathi_jax.bench.loadgen") == "sarathi_jax.bench"
    assert package_of("sarathi_jax.runner.sample.sampler") == "sarathi_jax.runner"
    assert package_of("pallas_kernels.tune") == "pallas_kernels"
    assert package_of("server.proto.sarathi.v1.generation_pb2") == "server"
    assert package_of("sarathi_jax") == "sarathi_jax"
    assert package_of("sarathi_jax.not_listed") is None
    assert layer_of("benchmarks") == len(LAYERS) - 1
