"""The floors: every import between the project's modules points down the layer order (`LAYERS`), and no
modules import each other in a cycle.

Read from the source with `ast`, so what runs at import time and what runs later count alike: module-level and
function-level imports, imports under `if TYPE_CHECKING:` (a type named is a dependency too),
`importlib.import_module("...")` with a literal name, and the names a package resolves lazily (`lazy_exports`:
`from sarathi_jax import LLM` depends on sarathi_jax.llm, and the package on each module it exports from).
Importing `a.b.c` runs `a/__init__` and `a/b/__init__` too; that is not counted, since every submodule would
otherwise depend on its package's exports.
"""

from __future__ import annotations

import ast
from collections.abc import Iterable, Mapping
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("pallas_kernels", "sarathi_jax", "checkpoints_convert", "server")

# Bottom first. A module may import from its own layer and the layers below it. A pattern names a module, or
# ends in `*` (`a.b.*`: a.b and everything below it; `a.b.peer_*`: the modules whose names start so); the most
# specific pattern that matches a module places it. Every module must be placed (see docs/design.md).
Layers = tuple[tuple[str, tuple[str, ...]], ...]
LAYERS: Layers = (
    ("kernels", ("pallas_kernels.*",)),
    ("kernel benchmark and tuner", ("benchmarks.kernels", "pallas_kernels.bench_*", "pallas_kernels.tune")),
    ("grammar engine (llguidance, no JAX)", ("sarathi_jax.request.structured_outputs",)),
    ("plain data: requests, sequences, KV blocks, model shapes", (
        "sarathi_jax.utils.lazy_exports", "sarathi_jax.utils.paths", "sarathi_jax.utils.percentiles", "sarathi_jax.request.sampling_params", "sarathi_jax.request.outputs",
        "sarathi_jax.request.tokenizer", "sarathi_jax.request.chat_template", "sarathi_jax.request.sequence", "sarathi_jax.scheduler.block_manager",
        "sarathi_jax.models.config", "sarathi_jax.models.presets", "sarathi_jax.spec_decode.speculative",
        "sarathi_jax.spec_decode.ngram_proposer",
    )),
    ("scheduling and configuration (no JAX)", ("sarathi_jax.scheduler.*", "sarathi_jax.config.engine_config", "sarathi_jax.config.flags", "sarathi_jax.config.sizing",
                                               "sarathi_jax.config.disaggregation")),
    ("models", ("sarathi_jax.models.*",)),
    ("parallelism", ("sarathi_jax.parallel.*",)),
    ("model runner", (
        "sarathi_jax.runner.sample.inputs", "sarathi_jax.runner.sample.vocab_major", "sarathi_jax.runner.sample.sampler", "sarathi_jax.runner.step_inputs", "sarathi_jax.runner.input_batch",
        "sarathi_jax.runner.sample.rejection",
        "sarathi_jax.runner.compile_cache", "sarathi_jax.runner.executable_cache", "sarathi_jax.runner.precompile",
        "sarathi_jax.runner.model_runner", "sarathi_jax.runner.draft_runner",
    )),
    ("engine", ("sarathi_jax.core.admission", "sarathi_jax.core.engine_core", "sarathi_jax.core.engine_api", "sarathi_jax.engine.llm_engine",
                "sarathi_jax.sim.simulator", "sarathi_jax.sim.cost_model", "sarathi_jax.core.arrival_loop",
                "sarathi_jax.engine.token_budget", "sarathi_jax.sim.tp_cost", "sarathi_jax.disagg.state",
                "sarathi_jax.disagg.flow",
                "sarathi_jax.disagg.sim_engine", "sarathi_jax.disagg.kv_transfer", "sarathi_jax.disagg.real_engine",
                "sarathi_jax.engine.gc_heap")),
    ("offline API", ("sarathi_jax", "sarathi_jax.llm")),
    ("checkpoint converter", ("checkpoints_convert.*",)),
    ("benchmarks", ("sarathi_jax.bench.*",)),
    ("servers and their clients", ("server.*",)),
    ("server comparisons (drive this server and vLLM's with sarathi_jax.bench.loadgen)", (
        "benchmarks.peer.*",
    )),
)

# Imports known to break the floors, each removed by other work on issue 28 (item 4); empty this once that work
# is merged (test_known_exceptions_are_still_needed says when). Nothing else may be added here.
KNOWN_EXCEPTIONS: frozenset[tuple[str, str]] = frozenset()


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


def layer_of(module: str, layers: Layers) -> int | None:
    """Index of the layer whose most specific pattern matches `module` (None: no pattern does)."""
    best: tuple[int, int] | None = None  # (specificity, layer)
    for index, (_, patterns) in enumerate(layers):
        for pattern in patterns:
            if pattern.endswith(".*"):
                prefix = pattern[:-2]
                hit = module == prefix or module.startswith(prefix + ".")
                specificity = 2 * len(prefix)
            elif pattern.endswith("*"):
                hit, specificity = module.startswith(pattern[:-1]), 2 * len(pattern[:-1])
            else:
                hit, specificity = module == pattern, 2 * len(pattern) + 1
            if hit and (best is None or specificity > best[0]):
                best = (specificity, index)
    return None if best is None else best[1]


def upward_imports(graph: Mapping[str, set[str]], layers: Layers,
                   exceptions: frozenset[tuple[str, str]] = frozenset()) -> list[str]:
    found = []
    for module, targets in sorted(graph.items()):
        for target in sorted(targets):
            low, high = layer_of(module, layers), layer_of(target, layers)
            if (module, target) not in exceptions and low is not None and high is not None and high > low:
                found.append(f"{module} ({layers[low][0]}) imports {target} ({layers[high][0]})")
    return found


def import_cycles(graph: Mapping[str, set[str]], exceptions: frozenset[tuple[str, str]] = frozenset()
                  ) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), each sorted."""
    edges = {m: sorted(t for t in ts if t in graph and (m, t) not in exceptions) for m, ts in graph.items()}
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


def test_every_module_has_a_layer():
    unplaced = [m for m in project_modules(REPO_ROOT, PACKAGES) if layer_of(m, LAYERS) is None]
    assert not unplaced, f"place these modules in LAYERS (tests/test_import_floors.py): {unplaced}"


@pytest.fixture(scope="module")
def project_graph() -> dict[str, set[str]]:
    return import_graph(REPO_ROOT, PACKAGES)


def test_no_import_runs_upward(project_graph):
    found = upward_imports(project_graph, LAYERS, KNOWN_EXCEPTIONS)
    assert not found, "imports from a lower layer to a higher one:\n" + "\n".join(found)


def test_no_import_cycles(project_graph):
    cycles = import_cycles(project_graph, KNOWN_EXCEPTIONS)
    assert not cycles, f"modules that import each other: {cycles}"


def test_known_exceptions_are_still_needed(project_graph):
    gone = sorted(e for e in KNOWN_EXCEPTIONS if e[1] not in project_graph.get(e[0], set()))
    assert not gone, f"these imports are gone: remove them from KNOWN_EXCEPTIONS: {gone}"


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


def test_the_checks_find_an_upward_import_and_a_cycle(tmp_path):
    write_tree(tmp_path, {
        "low/__init__.py": "", "low/a.py": "def f():\n    import high.b\n", "low/c.py": "from low import d\n",
        "low/d.py": "import low.c\n", "high/__init__.py": "", "high/b.py": "from low import a\n",
    })
    graph = import_graph(tmp_path, ["low", "high"])
    layers = (("bottom", ("low.*",)), ("top", ("high.*",)))
    assert upward_imports(graph, layers) == ["low.a (bottom) imports high.b (top)"]
    assert import_cycles(graph) == [["high.b", "low.a"], ["low.c", "low.d"]]
    assert import_cycles(graph, frozenset({("low.d", "low.c"), ("low.a", "high.b")})) == []
    assert upward_imports(graph, layers, frozenset({("low.a", "high.b")})) == []


def test_the_most_specific_pattern_places_a_module():
    assert LAYERS[layer_of("benchmarks.peer.servers", LAYERS)][0].startswith("server comparisons")
    assert LAYERS[layer_of("sarathi_jax.bench.runs", LAYERS)][0] == "benchmarks"
    assert LAYERS[layer_of("sarathi_jax.bench.roofline", LAYERS)][0] == "benchmarks"
    assert LAYERS[layer_of("sarathi_jax.models.presets", LAYERS)][0].startswith("plain data")
    assert LAYERS[layer_of("sarathi_jax.models.llama", LAYERS)][0] == "models"
    assert LAYERS[layer_of("benchmarks.kernels", LAYERS)][0] == "kernel benchmark and tuner"
    assert layer_of("sarathi_jax.not_placed", LAYERS) is None
