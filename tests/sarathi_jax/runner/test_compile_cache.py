"""The persistent compilation cache (sarathi_jax/runner/compile_cache.py): where it goes, how it is turned off, and that
a second engine in a fresh process loads its executables instead of compiling them."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import jax
import pytest

from sarathi_jax.runner.compile_cache import (
    ENV_VAR,
    CompileRecorder,
    default_cache_dir,
    enable_compilation_cache,
    resolve_cache_dir,
)
from sarathi_jax.runner.executable_cache import SUBDIR
from sarathi_jax.runner.sample.sampler import SAMPLER_VARIANTS
from sarathi_jax.config.sizing import platform_buckets

REPO_ROOT = Path(__file__).resolve().parents[3]
# The script's engine (token_budget 32): its step buckets on this platform (4, 8, 16, 24, 32 on a CPU).
NUM_BUCKETS = len(platform_buckets(32, jax.default_backend()))


@pytest.fixture
def restore_jax_cache():
    """Tests here move JAX's process-wide cache; put it back for the tests after them."""
    saved = jax.config.jax_compilation_cache_dir
    yield
    enable_compilation_cache(saved)


def test_resolve_cache_dir(monkeypatch, tmp_path):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert default_cache_dir() == tmp_path / "xdg" / "sarathi-jax" / "jax"
    monkeypatch.setenv(ENV_VAR, str(tmp_path / "env"))
    assert resolve_cache_dir("auto") == str(tmp_path / "env")
    assert resolve_cache_dir(str(tmp_path / "mine")) == str(tmp_path / "mine")  # explicit beats the env var
    for off in ("0", "off", "OFF", "false", "none", ""):
        monkeypatch.setenv(ENV_VAR, off)
        assert resolve_cache_dir("auto") is None, off
    monkeypatch.setenv(ENV_VAR, str(tmp_path / "env"))
    assert resolve_cache_dir(None) is None and resolve_cache_dir("off") is None  # explicit off beats it too


def test_auto_without_env_var_uses_jax_setting_else_user_cache(monkeypatch, tmp_path, restore_jax_cache):
    monkeypatch.delenv(ENV_VAR)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    enable_compilation_cache(None)
    assert resolve_cache_dir("auto") == str(tmp_path / "xdg" / "sarathi-jax" / "jax")
    jax.config.update("jax_compilation_cache_dir", str(tmp_path / "users-own"))  # e.g. JAX_COMPILATION_CACHE_DIR
    assert resolve_cache_dir("auto") == str(tmp_path / "users-own")


def test_enable_switch_and_disable(tmp_path, restore_jax_cache):
    a, b = tmp_path / "a", tmp_path / "b"
    assert enable_compilation_cache(str(a)) == str(a) and a.is_dir()
    assert jax.config.jax_compilation_cache_dir == str(a)
    assert enable_compilation_cache(str(a)) == str(a)  # idempotent
    assert jax.config.jax_persistent_cache_min_compile_time_secs == 0  # CPU compiles are quick, cache them too
    jax.jit(lambda x: x * 3 + 1)(jax.numpy.ones(7)).block_until_ready()
    assert any(a.iterdir())
    # A new directory takes effect even though JAX opened the first one already.
    assert enable_compilation_cache(str(b)) == str(b)
    jax.jit(lambda x: x * 5 - 2)(jax.numpy.ones(9)).block_until_ready()
    assert any(b.iterdir())
    assert enable_compilation_cache("off") is None and jax.config.jax_compilation_cache_dir is None


def test_compile_seconds_counts_nested_and_overlapping_spans_once():
    r = CompileRecorder()
    r._spans += [(0.0, 4.0), (1.0, 2.0), (3.0, 6.0), (10.0, 11.0)]  # trace containing a nested trace, ...
    assert r.compile_seconds() == pytest.approx(7.0)
    assert r.compile_seconds(5.0, 10.5) == pytest.approx(1.5)


_SCRIPT = """
import json, sys
from sarathi_jax import EngineConfig, LLMEngine
engine = LLMEngine(EngineConfig("tiny-llama", token_budget=32, max_num_seqs=4, block_size=16, num_blocks=8,
                                max_model_len=64, compilation_cache_dir=sys.argv[1],
                                background_compile=sys.argv[2] == "background"))
print("STATS " + json.dumps(engine.startup_stats()))
from sarathi_jax import SamplingParams
engine.add_request("greedy", [1, 5, 9, 3], SamplingParams(max_tokens=5, temperature=0.0))
engine.add_request("sampled", [2, 7], SamplingParams(max_tokens=5, temperature=0.9, top_p=0.8, seed=3, logprobs=2))
engine.add_request("long", list(range(3, 23)), SamplingParams(max_tokens=3, temperature=0.0))
from sarathi_jax.runner.compile_cache import record_compiles
out = {}
with record_compiles() as serving:  # 4 + 2 + 20 prompt tokens (bucket 32), then decodes (bucket 4 on a CPU)
    while engine.has_unfinished_requests():
        for o in engine.step():
            out[o.request_id] = list(o.token_ids)
print("TOKENS " + json.dumps({"tokens": out, "loaded": engine.runner.executable_cache.hits,
                              "compilations": engine.runner.num_compilations,
                              "serving_executables": serving.executables}))
"""


def _start_in_fresh_process(cache_dir: Path, build: str = "foreground") -> dict:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(REPO_ROOT), os.environ.get("PYTHONPATH")])),
               XLA_PYTHON_CLIENT_PREALLOCATE="false")  # on a GPU this test process already holds most memory
    proc = subprocess.run([sys.executable, "-c", _SCRIPT, str(cache_dir), build], cwd=REPO_ROOT, env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = proc.stdout.splitlines()
    stats = json.loads(next(x for x in lines if x.startswith("STATS "))[len("STATS "):])
    stats["run"] = json.loads(next(x for x in lines if x.startswith("TOKENS "))[len("TOKENS "):])
    return stats


def _cache_entries(cache_dir: Path) -> list[str]:
    # JAX's executables; on a GPU, XLA's own autotuning cache may sit beside them in a subdirectory.
    return sorted(p.name for p in cache_dir.iterdir() if p.name.endswith("-cache"))


def test_second_engine_in_a_fresh_process_hits_the_cache(tmp_path):
    cache = tmp_path / "jax-cache"
    cold = _start_in_fresh_process(cache)
    assert cold["compilation_cache_dir"] == str(cache)
    assert cold["executables"] > 0 and cold["cache_hits"] == 0 and cold["cache_misses"] == cold["executables"]
    entries = _cache_entries(cache)
    assert len(entries) == cold["executables"]  # one entry per executable compiled

    warm = _start_in_fresh_process(cache)
    assert warm["executables"] == cold["executables"]
    assert warm["cache_hits"] == warm["executables"] and warm["cache_misses"] == 0
    assert _cache_entries(cache) == entries  # nothing new was compiled or written
    # The model steps and sampler variants came ready-made (sarathi_jax/runner/executable_cache.py): not even traced.
    assert cold["executables_loaded"] == 0 and cold["run"]["loaded"] == 0
    assert warm["executables_loaded"] == warm["run"]["loaded"] == NUM_BUCKETS + len(SAMPLER_VARIANTS)
    assert len(list((cache / SUBDIR).iterdir())) == warm["executables_loaded"]
    # Same tokens from the loaded executables, and serving compiled nothing in either process.
    assert warm["run"]["tokens"] == cold["run"]["tokens"]
    assert warm["run"]["compilations"] == cold["run"]["compilations"] == NUM_BUCKETS + len(SAMPLER_VARIANTS)
    # Nothing at all (not even a small host-side program) compiled or loaded while serving, also when the
    # warm start skipped running the buckets that came ready-made.
    assert warm["run"]["serving_executables"] == cold["run"]["serving_executables"] == 0
    # With background compile (the default) a warm start loads everything before it is ready: nothing is
    # left to the background.
    default = _start_in_fresh_process(cache, "background")
    assert default["background_executables"] == 0 and default["executables_loaded"] == NUM_BUCKETS + len(SAMPLER_VARIANTS)
    assert default["run"]["tokens"] == cold["run"]["tokens"] and default["run"]["serving_executables"] == 0


def test_executable_cache_keys_and_fallbacks(tmp_path):
    """Keys are computed without tracing from what the function closes over and the arguments' shapes; a
    value that only has an address cannot be keyed (not cached); a damaged entry is a miss, not an error."""
    import functools

    import jax.numpy as jnp

    from sarathi_jax.runner.executable_cache import ExecutableCache, Undescribable, describe

    cache = ExecutableCache(tmp_path / SUBDIR)
    args = (jnp.zeros((4, 8)), None)
    key = cache.key("f", ("step", 3), args)
    assert key is not None and key == cache.key("f", ("step", 3), args)  # stable
    assert key != cache.key("f", ("step", 4), args)  # another closure
    assert key != cache.key("f", ("step", 3), (jnp.zeros((4, 9)), None))  # another shape
    assert key != cache.key("f", ("step", 3), (jnp.zeros((4, 8), jnp.int32), None))  # another dtype

    def scale(x, factor=2.0):
        return x * factor

    assert describe(functools.partial(scale, factor=3.0)) != describe(functools.partial(scale, factor=4.0))
    with pytest.raises(Undescribable):
        describe(object())
    assert cache.key("f", object(), args) is None  # not cacheable, silently

    import jax

    compiled = jax.jit(scale).lower(args[0]).compile()
    cache.save(key, compiled)
    loaded = cache.load(key, jax.devices()[:1])
    assert loaded is not None and float(loaded(jnp.ones((4, 8)))[0, 0]) == 2.0
    (tmp_path / SUBDIR / f"{key}.exe").write_bytes(b"not an executable")
    assert cache.load(key, jax.devices()[:1]) is None and cache.misses == 1


def test_programs_from_jax_cache_are_not_saved_as_ready_made_executables(tmp_path, restore_jax_cache):
    """XLA:CPU cannot re-serialize an executable that JAX loaded from its persistent cache (the copy loads,
    then fails with "Function ... not found" when run). An engine without warm-up fills JAX's cache; the next
    one's warm-up compiles the same programs (JAX cache hits) and must not save them as ready-made
    executables; a third engine then loads only what can run, and all three give the same tokens."""
    from sarathi_jax import EngineConfig, LLMEngine, SamplingParams

    fields = dict(model="tiny-llama", token_budget=32, max_num_seqs=4, block_size=16, num_blocks=8,
                  max_model_len=64, compilation_cache_dir=str(tmp_path / "jax-cache"))

    def serve(engine: LLMEngine) -> dict:
        engine.add_request("greedy", [1, 5, 9, 3], SamplingParams(max_tokens=5, temperature=0.0))
        engine.add_request("sampled", [2, 7], SamplingParams(max_tokens=5, temperature=0.9, top_p=0.8, seed=3))
        engine.add_request("long", list(range(3, 23)), SamplingParams(max_tokens=3, temperature=0.0))
        out = {}
        while engine.has_unfinished_requests():
            for o in engine.step():
                out[o.request_id] = list(o.token_ids)
        return out

    expected = serve(LLMEngine(EngineConfig(**fields), warmup=False))
    second = LLMEngine(EngineConfig(**fields, background_compile=False))
    assert second.startup_stats()["cache_hits"] > 0  # the warm-up found programs in JAX's cache
    assert serve(second) == expected
    third = LLMEngine(EngineConfig(**fields, background_compile=False))
    assert serve(third) == expected


_TWO_ENGINES_SCRIPT = """
import json, sys
from sarathi_jax import EngineConfig, LLMEngine, SamplingParams
out = {}
for scheduler in ("sarathi", "vllm"):  # the bench's default: two engines in one process
    engine = LLMEngine(EngineConfig("tiny-llama", scheduler=scheduler, token_budget=32, max_num_seqs=4,
                                    num_blocks=8, max_model_len=64, compilation_cache_dir=sys.argv[1],
                                    background_compile=False))
    engine.add_request("a", [1, 5, 9, 3], SamplingParams(max_tokens=4, temperature=0.0))
    engine.add_request("b", [2, 7], SamplingParams(max_tokens=4, temperature=0.9, top_p=0.8, seed=3))
    while engine.has_unfinished_requests():
        for o in engine.step():
            out[f"{scheduler}-{o.request_id}"] = list(o.token_ids)
print("TOKENS " + json.dumps(out))
"""


def test_programs_reused_in_process_by_a_second_engine_are_not_saved(tmp_path):
    """A second engine in a process gets programs the first one built back from JAX's in-process cache, with
    no compile event: one the first engine loaded from JAX's persistent cache must not be saved as a ready-made
    executable either. Three processes with the bench's two engines: fresh; with a changed executable-cache key
    (an environment variable in its fingerprint) but JAX's cache warm; then that key again, which loads what
    the second process saved. Were such a program saved, the third would fail with XLA's "Function ... not found"."""
    runs = []
    for key_change in ("1", "2", "2"):
        env = dict(os.environ, SARATHI_TEST_KEY=key_change, XLA_PYTHON_CLIENT_PREALLOCATE="false",
                   PYTHONPATH=os.pathsep.join(filter(None, [str(REPO_ROOT), os.environ.get("PYTHONPATH")])))
        proc = subprocess.run([sys.executable, "-c", _TWO_ENGINES_SCRIPT, str(tmp_path / "jax-cache")],
                              cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=300)
        assert proc.returncode == 0, proc.stderr[-3000:]
        runs.append(json.loads(next(x for x in proc.stdout.splitlines() if x.startswith("TOKENS "))[7:]))
    assert runs[0] == runs[1] == runs[2] and len(runs[0]) == 4
