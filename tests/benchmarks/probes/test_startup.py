"""`benchmarks.probes.startup`: the parent's loop over child processes (their argv, cold/warm labels, the token
check, the --json file, a failing child), with `subprocess.run` replaced by a fake child."""

from __future__ import annotations

import json
import subprocess

import pytest

from benchmarks.probes import startup


class FakeChildren:
    """Stands in for the child processes: records argv, writes a cache file like a real cold run would."""

    def __init__(self, generated: list[list[int]], returncode: int = 0) -> None:
        self.generated = generated
        self.returncode = returncode
        self.argv: list[list[str]] = []

    def __call__(self, argv, capture_output, text, env):
        assert capture_output and text
        i = len(self.argv)
        self.argv.append(list(argv))
        cache_dir = argv[argv.index("--cache-dir") + 1]
        with open(f"{cache_dir}/entry-{i}", "w") as f:
            f.write("x")
        stats = {"load_s": 0.1, "compile_s": 2.0 - i, "generated": self.generated[i]}
        return subprocess.CompletedProcess(argv, self.returncode, stdout="noise\n" + json.dumps(stats) + "\n",
                                           stderr=f"log\nstartup line {i}\n")


def test_first_run_is_cold_the_others_warm_and_stats_are_written(tmp_path, monkeypatch, capsys):
    fake = FakeChildren([[5, 6, 7], [5, 6, 7], [5, 6, 7]])
    monkeypatch.setattr(startup.subprocess, "run", fake)
    cache = tmp_path / "cache"
    cache.mkdir()
    out = tmp_path / "runs.json"
    assert startup.main(["--runs", "3", "--cache-dir", str(cache), "--token-budget", "64", "--json", str(out)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert [line.split(":")[0] for line in lines] == ["run 1 (cold cache)", "run 2 (warm cache)", "run 3 (warm cache)"]
    assert lines[1].endswith("startup line 1")
    argv = fake.argv[0]
    assert argv[1:4] == ["-m", "benchmarks.probes.startup", "--child"]
    assert argv[argv.index("--model") + 1] == "tiny-llama" and argv[argv.index("--dtype") + 1] == "float32"
    assert argv[argv.index("--token-budget") + 1] == "64"
    assert "--max-num-seqs" not in argv and "--num-blocks" not in argv  # unset options are not passed on
    assert all(a == argv for a in fake.argv)
    data = json.loads(out.read_text())
    assert data["model"] == "tiny-llama" and data["cache_dir"] == str(cache)
    assert [r["compile_s"] for r in data["runs"]] == [2.0, 1.0, 0.0]
    assert all(r["process_wall_s"] >= 0 and r["generated"] == [5, 6, 7] for r in data["runs"])


def test_runs_that_generate_different_tokens_fail(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(startup.subprocess, "run", FakeChildren([[1, 2], [1, 3]]))
    out = tmp_path / "runs.json"
    assert startup.main(["--runs", "2", "--cache-dir", str(tmp_path), "--json", str(out)]) == 1
    assert "different tokens" in capsys.readouterr().err
    assert not out.exists()


def test_a_failing_child_stops_the_runs_with_its_exit_status(tmp_path, monkeypatch, capsys):
    fake = FakeChildren([[1]], returncode=3)
    monkeypatch.setattr(startup.subprocess, "run", fake)
    assert startup.main(["--runs", "2", "--cache-dir", str(tmp_path)]) == 3
    assert len(fake.argv) == 1
    assert "startup line 0" in capsys.readouterr().err


def test_arguments_are_checked():
    with pytest.raises(SystemExit):
        startup.main(["--dtype", "float16"])
    with pytest.raises(SystemExit):
        startup.main(["--runs", "two"])
