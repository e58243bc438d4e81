"""Every command of benchmarks/ stays runnable from a clone: `python -m benchmarks.NAME --help`, from the
repository root in a fresh interpreter, exits 0 with its usage; and benchmarks/README.md lists each one.

The commands are found, not listed: a module with an `if __name__ == "__main__":` block, or a package with a
`__main__.py`."""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[2]
BENCHMARKS = REPO_ROOT / "benchmarks"
# Run by vLLM's own interpreter (`python -c "$(cat vllm_offline.py)" SPEC OUT`), never with -m from here.
NOT_COMMANDS = {"benchmarks.peer.vllm_offline"}


def _runs_as_main(path: Path) -> bool:
    for node in ast.parse(path.read_text()).body:
        if (isinstance(node, ast.If) and isinstance(node.test, ast.Compare)
                and isinstance(node.test.left, ast.Name) and node.test.left.id == "__name__"
                and any(isinstance(c, ast.Constant) and c.value == "__main__" for c in node.test.comparators)):
            return True
    return False


def commands() -> list[str]:
    found = set()
    for path in BENCHMARKS.rglob("*.py"):
        parts = path.relative_to(REPO_ROOT).with_suffix("").parts
        if parts[-1] == "__main__":
            found.add(".".join(parts[:-1]))
        elif parts[-1] != "__init__" and _runs_as_main(path):
            found.add(".".join(parts))
    return sorted(found - NOT_COMMANDS)


COMMANDS = commands()


def test_the_commands_are_found():
    for name in ("benchmarks.peer", "benchmarks.gpu_report", "benchmarks.soak", "benchmarks.probes.loop_cost"):
        assert name in COMMANDS
    assert "benchmarks.soak_server" not in COMMANDS and "benchmarks.kernels_cpu" not in COMMANDS  # modules only


def test_the_readme_lists_every_command():
    readme = (BENCHMARKS / "README.md").read_text()
    missing = [name for name in COMMANDS if f"python -m {name}" not in readme]
    assert not missing, f"benchmarks/README.md: add a line for {missing}"


@pytest.mark.parametrize("name", COMMANDS)
def test_help_runs_from_the_repository_root(name):
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    env.pop("PYTHONPATH", None)  # the clone's root as the working directory is all it needs
    done = subprocess.run([sys.executable, "-m", name, "--help"], cwd=REPO_ROOT, env=env, capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "usage:" in done.stdout, done.stdout[-3000:]
