"""Paths are made absolute where they enter (sarathi_jax/utils/paths.py): the helpers, and each entry that takes a path
(EngineConfig.model, the compilation cache setting and its environment variable, the bench's and the server's
options) read a relative path against the current directory at entry, so a later change of directory (or a
library that refuses relative paths) does not change what it names. The converter's own entries are tested in
tests/checkpoints_convert."""

from __future__ import annotations

import argparse
import os

import pytest

from sarathi_jax.bench.args import build_parser as bench_parser
from sarathi_jax.runner.compile_cache import ENV_VAR, resolve_cache_dir
from sarathi_jax.config.engine_config import EngineConfig
from sarathi_jax.utils.paths import absolute_path, cli_path, cli_program
from server.__main__ import build_parser as server_parser
from server.__main__ import engine_config_from_args


def test_absolute_path_joins_the_current_directory_and_expands_home(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert absolute_path("a/../b") == str(tmp_path / "b")
    assert absolute_path("~/x") == str(tmp_path / "home" / "x")
    assert absolute_path(tmp_path / "c") == str(tmp_path / "c")  # os.PathLike too
    with pytest.raises(ValueError, match="empty path"):
        absolute_path("")
    with pytest.raises(argparse.ArgumentTypeError, match="empty path"):
        cli_path("")


def test_cli_program_keeps_a_bare_name_for_the_path_lookup(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert cli_program("python3") == "python3"
    assert cli_program("venv/bin/python") == str(tmp_path / "venv" / "bin" / "python")


def test_engine_config_model_folder_is_absolute_and_presets_stay_names(tmp_path, monkeypatch):
    (tmp_path / "ckpt").mkdir()
    monkeypatch.chdir(tmp_path)
    config = EngineConfig(model="./ckpt")
    monkeypatch.chdir("/")
    assert config.model == str(tmp_path / "ckpt")
    assert EngineConfig(model="tiny-llama").model == "tiny-llama"
    with pytest.raises(ValueError, match="preset name or a checkpoint folder"):
        EngineConfig(model="")


def test_compilation_cache_setting_and_env_var_are_absolute(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert resolve_cache_dir("cache") == str(tmp_path / "cache")
    monkeypatch.setenv(ENV_VAR, "env-cache")
    assert resolve_cache_dir("auto") == str(tmp_path / "env-cache")
    assert resolve_cache_dir("off") is None  # the off words are not paths


def test_bench_path_options_are_absolute(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    args = bench_parser().parse_args(["--out", "results", "--prompts-file", "q.txt", "--simulate",
                                      "--cost-model", "cm.json"])
    assert (args.out, args.prompts_file, args.cost_model) == tuple(
        str(tmp_path / name) for name in ("results", "q.txt", "cm.json"))


def test_server_model_folder_is_absolute(tmp_path, monkeypatch):
    (tmp_path / "ckpt").mkdir()
    monkeypatch.chdir(tmp_path)
    args = server_parser().parse_args(["--model", "ckpt", "--compilation-cache-dir", "jax-cache"])
    config = engine_config_from_args(args)
    assert config.model == str(tmp_path / "ckpt")
    assert resolve_cache_dir(config.compilation_cache_dir) == os.path.join(tmp_path, "jax-cache")
