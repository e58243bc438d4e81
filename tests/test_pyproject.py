"""pyproject.toml: the dependency floors are the versions the suite last passed with (README, "Versions"): the
environment running the suite must meet every declared bound, else a passing run says nothing about them. The
`test` extra pulls every other extra but the CUDA ones; and the packages the wheel installs are the library's
alone (no `benchmarks/`, no tests), each a package with a docstring.
"""

from __future__ import annotations

import ast
import importlib.metadata
import tomllib
from pathlib import Path

import setuptools
from packaging.requirements import Requirement

REPO_ROOT = Path(__file__).resolve().parents[1]
PYPROJECT = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())
HARDWARE_EXTRAS = ("cuda", "cuda12")  # JAX's CUDA plugins: not for the CPU suite


def _declared() -> list[str]:
    """The core dependencies and every extra's but the CUDA ones."""
    project = PYPROJECT["project"]
    extras = project["optional-dependencies"]
    return project["dependencies"] + [r for name, reqs in extras.items() if name not in HARDWARE_EXTRAS for r in reqs]


def _unmet(requirements: list[str]) -> list[str]:
    unmet = []
    for text in requirements:
        req = Requirement(text)
        try:
            version = importlib.metadata.version(req.name)
        except importlib.metadata.PackageNotFoundError:
            unmet.append(f"{req}: not installed")
            continue
        if not req.specifier.contains(version, prereleases=True):
            unmet.append(f"{req}: {version} installed")
    return unmet


def test_the_installed_versions_meet_every_declared_floor():
    assert not _unmet(_declared())


def test_every_dependency_has_a_floor():
    # `==` is a floor too: grpcio-tools is pinned to the version that generated the committed gRPC modules.
    for text in _declared():
        assert any(s.operator in (">=", "==") for s in Requirement(text).specifier), text


def test_the_test_extra_pulls_every_other_extra():
    extras = PYPROJECT["project"]["optional-dependencies"]
    test = set(extras["test"])
    missing = {name: sorted(set(reqs) - test) for name, reqs in extras.items()
               if name not in HARDWARE_EXTRAS + ("test",) and not set(reqs) <= test}
    assert not missing, f"CI installs the test extra alone: add these to it: {missing}"


def test_the_core_leaves_out_the_tools():
    core = {Requirement(r).name for r in PYPROJECT["project"]["dependencies"]}
    assert not core & {"matplotlib", "tqdm", "grpcio-tools"}, "a tool's dependency is an extra (plots, progress, proto)"


def _packages() -> list[str]:
    """What setuptools installs: `[tool.setuptools.packages.find]` (namespaces on, as pyproject's default)."""
    find = PYPROJECT["tool"]["setuptools"]["packages"]["find"]
    assert find.get("namespaces", True)
    return setuptools.find_namespace_packages(str(REPO_ROOT), include=find["include"], exclude=find.get("exclude", ()))


def test_the_wheel_holds_the_library_alone():
    packages = _packages()
    assert not [p for p in packages if p.split(".")[0] in ("benchmarks", "tests")], packages
    assert {"sarathi_jax", "pallas_kernels", "checkpoints_convert", "server"} <= set(packages)


def test_every_package_of_the_library_has_a_docstring():
    packages = set(_packages())
    for top in ("sarathi_jax", "pallas_kernels", "checkpoints_convert"):
        for folder in sorted({f.parent for f in (REPO_ROOT / top).rglob("*.py")}):
            name = ".".join(folder.relative_to(REPO_ROOT).parts)
            assert name in packages, f"{name} holds Python code but the wheel leaves it out"
            init = folder / "__init__.py"
            assert init.exists(), f"{name}: no __init__.py"
            assert ast.get_docstring(ast.parse(init.read_text())), f"{name}/__init__.py: no docstring saying what it owns"


def test_the_package_data_is_there():
    covered = set()
    for package, patterns in PYPROJECT["tool"]["setuptools"]["package-data"].items():
        folder = REPO_ROOT.joinpath(*package.split("."))
        for pattern in patterns:
            assert list(folder.glob(pattern)), f"{package}: {pattern} matches nothing"
            covered.update(folder.glob(pattern))
    # The data the library reads at run time (tables, traces, the proto) must travel with it.
    data = [f for top in ("sarathi_jax", "pallas_kernels", "checkpoints_convert", "server")
            for f in (REPO_ROOT / top).rglob("*") if f.suffix in (".json", ".csv", ".proto") and f.is_file()]
    assert not [str(f.relative_to(REPO_ROOT)) for f in data if f not in covered], "add them to package-data"


def test_a_floor_above_the_installed_version_is_reported():
    assert _unmet(["numpy>=999"]) == [f"numpy>=999: {importlib.metadata.version('numpy')} installed"]
    assert _unmet(["no-such-package-sarathi>=1"]) == ["no-such-package-sarathi>=1: not installed"]
