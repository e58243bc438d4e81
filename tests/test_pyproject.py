"""pyproject.toml's dependency floors are the versions the suite last passed with (README, "Versions"): the
environment running the suite must meet every declared bound, else a passing run says nothing about them."""

from __future__ import annotations

import importlib.metadata
import tomllib
from pathlib import Path

from packaging.requirements import Requirement

PYPROJECT = tomllib.loads((Path(__file__).resolve().parents[1] / "pyproject.toml").read_text())


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
    project = PYPROJECT["project"]
    assert not _unmet(project["dependencies"] + project["optional-dependencies"]["test"])


def test_every_dependency_has_a_floor():
    project = PYPROJECT["project"]
    for text in project["dependencies"] + project["optional-dependencies"]["test"]:
        assert any(s.operator == ">=" for s in Requirement(text).specifier), text


def test_a_floor_above_the_installed_version_is_reported():
    assert _unmet(["numpy>=999"]) == [f"numpy>=999: {importlib.metadata.version('numpy')} installed"]
    assert _unmet(["no-such-package-sarathi>=1"]) == ["no-such-package-sarathi>=1: not installed"]
