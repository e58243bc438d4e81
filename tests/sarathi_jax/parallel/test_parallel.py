"""Tensor and pipeline parallelism on 8 virtual CPU devices (XLA_FLAGS set in tests/conftest.py).

Every parallel engine runs the same ragged, staggered greedy workload as a single-device engine and must
produce the same tokens, and logits within 1e-5 relative (max|diff| / max|ref| per sampled row), compared
row by row keyed by (request, position) since pipelined engines batch differently. The same runs check
per-device memory and, with PP, that micro-batches overlapped. Engines compile one bucket (token_budget 16)
so that the whole module stays well under a minute of compile time on two cores.
"""

from __future__ import annotations

import dataclasses

import jax
import numpy as np
import pytest

from sarathi_jax import EngineConfig, LLMEngine, SamplingParams
from sarathi_jax.models import ModelConfig
from sarathi_jax.config.sizing import platform_buckets
from sarathi_jax.parallel import (
    initialize_distributed_from_env,
    make_plan,
    per_device_bytes,
    split_layers,
    validate_parallel_config,
)
from tests.sarathi_jax.engine_helpers import run_staggered

PROMPT_LENGTHS = (3, 17, 30, 9, 45, 1)
MAX_TOKENS = 6
RTOL = 1e-5


def make_engine(model_dir, tp: int = 1, pp: int = 1, **overrides) -> LLMEngine:
    fields = dict(model=str(model_dir), token_budget=16, max_num_seqs=4, block_size=16, num_blocks=48,
                  max_model_len=128, tensor_parallel_size=tp, pipeline_parallel_size=pp)
    fields.update(overrides)
    return LLMEngine(EngineConfig(**fields), warmup=False)


@dataclasses.dataclass
class Run:
    engine: LLMEngine
    tokens: dict[str, list[int]]
    logits: dict[tuple[str, int], np.ndarray]  # (request id, tokens so far) -> logits of the sampled row


def run_workload(engine: LLMEngine, prompts, arrive_every: int = 1) -> Run:
    """Greedy requests arriving one per `arrive_every` steps; records every sampled row's logits."""
    engine.runner.capture_logits(True)
    submitted = []
    submit = engine.runner.submit

    def spy(chunks, *args):
        pending = submit(chunks, *args)
        submitted.append((chunks, pending))
        return pending

    engine.runner.submit = spy
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    tokens = run_staggered(engine, prompts, params, arrive_every, max_steps=1000)
    logits = {}
    for chunks, step in submitted:
        step.result()
        for i, chunk in enumerate(chunks):
            if chunk.needs_sample:
                logits[(chunk.seq.seq_id, chunk.start_position + chunk.num_new_tokens)] = step.logits[i]
    del engine.runner.submit
    return Run(engine, tokens, logits)


def assert_same_run(got: Run, ref: Run) -> None:
    assert got.tokens == ref.tokens
    assert got.logits.keys() == ref.logits.keys()
    for key, ref_row in ref.logits.items():
        err = np.max(np.abs(got.logits[key] - ref_row)) / np.max(np.abs(ref_row))
        assert err <= RTOL, f"logits of {key} differ by {err:.2e} relative"


@pytest.fixture(scope="module")
def model_dir(tiny_checkpoint):
    return tiny_checkpoint()


@pytest.fixture(scope="module")
def prompts():
    rng = np.random.default_rng(7)
    return [rng.integers(3, 256, size=n).tolist() for n in PROMPT_LENGTHS]


@pytest.fixture(scope="module")
def reference(model_dir, prompts) -> Run:
    run = run_workload(make_engine(model_dir), prompts)
    assert len(run.tokens) == len(prompts) and all(len(t) == MAX_TOKENS for t in run.tokens.values())
    assert len({t for toks in run.tokens.values() for t in toks}) > 3  # not a degenerate model
    return run


def test_single_device_engine_stays_on_the_default_device(reference):
    assert len(jax.devices()) == 8, "tests/conftest.py should give 8 virtual CPU devices"
    engine = reference.engine
    assert engine.parallel_plan is None and engine.runner.timeline is None
    arrays = jax.tree.leaves((engine.runner.params, engine.runner.kv_caches))
    assert {d for a in arrays for d in a.devices()} == {jax.devices()[0]}
    assert engine.pipeline_stats()["bubble_fraction"] is None


@pytest.fixture(scope="module")
def engines() -> dict:
    """Engines built by test_parallel_engine_matches_single_device, by (tp, pp), reused to save compiles."""
    return {}


@pytest.mark.parametrize("tp,pp", [(2, 1), (4, 1), (1, 2), (1, 4), (2, 2)], ids=lambda v: str(v))
def test_parallel_engine_matches_single_device(model_dir, prompts, reference, engines, tp, pp):
    engine = engines[(tp, pp)] = make_engine(model_dir, tp, pp)
    run = run_workload(engine, prompts)
    assert_same_run(run, reference)
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_total_blocks

    # Placement: stage s on mesh row s; every device of a stage holds 1/tp of the stage's params and KV.
    plan = engine.parallel_plan
    assert plan.mesh.axis_names == ("pp", "tp") and plan.mesh.devices.shape == (pp, tp)
    ref_runner = reference.engine.runner
    num_layers = engine.model_config.num_hidden_layers
    ref_kv_bytes = sum(per_device_bytes(ref_runner.kv_caches).values())
    for s, stage in enumerate(engine.runner.stages):
        start, end = stage.layer_range
        assert (start, end) == split_layers(num_layers, pp)[s]
        stage_devices = set(plan.mesh.devices[s])
        # The stage's layers and its other params: a slice of the stacked layers (scanned), or the
        # `layers_{i}` trees of its range under their global names (unrolled, the CPU default).
        ref_stage_params = {
            k: jax.tree.map(lambda x: x[start:end], v) if k == "layers" else v
            for k, v in ref_runner.params.items() if k in stage.params
        }
        if "layers" in stage.params:
            assert jax.tree.leaves(stage.params["layers"])[0].shape[0] == end - start
        else:
            layer_keys = {k for k in stage.params if k.startswith("layers_")}
            assert layer_keys == {f"layers_{i}" for i in range(start, end)}
        stage_param_bytes = sum(per_device_bytes(ref_stage_params).values())
        param_usage = per_device_bytes(stage.params)
        assert set(param_usage) == stage_devices
        assert sum(param_usage.values()) >= stage_param_bytes  # nothing missing
        for device, nbytes in param_usage.items():
            assert nbytes <= 1.05 * stage_param_bytes / tp, (device, nbytes, stage_param_bytes)  # norms replicate
        kv_usage = per_device_bytes(stage.kv_cache)
        assert set(kv_usage) == stage_devices
        for nbytes in kv_usage.values():
            assert nbytes * tp * num_layers == ref_kv_bytes * (end - start)

    stats = engine.pipeline_stats()
    if pp > 1:
        assert stats["num_stages"] == pp and stats["num_microbatches"] == len(engine.iteration_log)
        assert engine.max_microbatches_in_flight >= 2, "the engine never had two micro-batches in flight"
        assert stats["max_in_flight"] == engine.max_microbatches_in_flight
        assert 0.0 <= stats["bubble_fraction"] < 1.0
        assert all(busy > 0 for busy in stats["stage_busy_s"]) and stats["wall_s"] > 0
    # One trace per stage per bucket the run used (built lazily: no warm-up), no more.
    used = {r.num_padded_tokens for r in engine.iteration_log}
    assert used <= set(engine.runner.buckets)
    assert engine.runner.num_step_compilations == pp * len(used)


def test_background_compile_on_a_tp_pp_mesh(model_dir, prompts, reference):
    """Built ahead of time stage by stage (each stage lowers with the previous one's activations on its own
    sub-mesh): the largest bucket before the engine is ready, the rest on a background thread while it serves.
    The same tokens and logits as the lazily compiled single-device engine, and nothing compiles once the
    build is done."""
    fields = dict(model=str(model_dir), token_budget=32, max_num_seqs=4, block_size=16, num_blocks=48,
                  max_model_len=128, tensor_parallel_size=2, pipeline_parallel_size=2, compilation_cache_dir=None)
    engine = LLMEngine(EngineConfig(**fields))
    runner = engine.runner
    assert runner.buckets == platform_buckets(32, jax.default_backend())
    assert engine.startup_stats()["background_executables"] > 0
    assert_same_run(run_workload(engine, prompts), reference)
    assert engine.wait_until_compiled(timeout=600) and runner.ready_buckets == runner.buckets
    assert runner.num_step_compilations == 2 * len(runner.buckets)  # every bucket of both stages, once
    compiled = runner.num_compilations
    assert_same_run(run_workload(engine, prompts), reference)
    assert runner.num_compilations == compiled


def test_abort_while_in_flight_with_pp(model_dir, prompts, reference, engines):
    engine = engines.get((1, 2)) or make_engine(model_dir, 1, 2)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    for i in range(3):
        engine.add_request(f"r{i}", prompts[i], params)
    engine.step()  # r0 and a chunk of r1 dispatched as one micro-batch, not retired (1 < pp in flight)
    seq = next(s for s in engine.scheduler.running if s.seq_id == "r1")
    assert engine.scheduler.is_in_flight(seq)
    assert engine.abort("r1")
    engine.add_request("r3", prompts[3], params)  # may reuse r1's freed blocks while r1's batch is in flight
    finished = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                finished[out.request_id] = out
    assert finished["r1"].finish_reason == "abort"
    for rid in ("r0", "r2", "r3"):
        assert list(finished[rid].token_ids) == reference.tokens[rid]
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_total_blocks


def test_llm_passes_parallel_sizes_through(model_dir):
    from sarathi_jax import LLM

    llm = LLM(str(model_dir), token_budget=16, max_num_seqs=4, num_blocks=48, max_model_len=128,
              tensor_parallel_size=2, pipeline_parallel_size=2, warmup=False)
    plan = llm.engine.parallel_plan
    assert (plan.tensor_parallel_size, plan.pipeline_parallel_size) == (2, 2)


def test_pallas_attention_runs_per_shard(model_dir, prompts, reference):
    """The Pallas kernel (interpreted on CPU) under shard_map sees local heads: same tokens and logits."""
    assert_same_run(run_workload(make_engine(model_dir, 2, attention_backend="pallas"), prompts), reference)


def test_kv_heads_replicated_when_fewer_than_devices(tiny_checkpoint, prompts):
    model_dir = tiny_checkpoint(num_key_value_heads=2)
    ref = run_workload(make_engine(model_dir), prompts[:3])
    engine = make_engine(model_dir, tp=4)
    plan = engine.parallel_plan
    assert plan.kv_replication == 2 and plan.model_config.num_key_value_heads == 4
    assert_same_run(run_workload(engine, prompts[:3]), ref)
    # Each device holds one KV head: half of the single-device cache (1 / kv_heads, not 1 / tp).
    ref_bytes = sum(per_device_bytes(ref.engine.runner.kv_caches).values())
    assert set(per_device_bytes(engine.runner.kv_caches).values()) == {ref_bytes // 2}


@pytest.mark.parametrize("family,name", [("hf", "qwen2"), ("falcon", "falcon-7b")])
def test_other_families_tp2_pp2(request, prompts, family, name):
    """Qwen2 (q/k/v biases, tied embedding copied to the last stage) and Falcon-7B style (multi-query: one KV
    head replicated on both TP devices, parallel attention + MLP, tied) through TP=2 x PP=2."""
    model_dir = request.getfixturevalue(f"{family}_checkpoint")(name)
    ref = run_workload(make_engine(model_dir), prompts[:4])
    engine = make_engine(model_dir, 2, 2)
    assert_same_run(run_workload(engine, prompts[:4]), ref)
    plan = engine.parallel_plan
    assert engine.model_config.tie_word_embeddings
    embedding = plan.embedding_name
    assert embedding in engine.runner.stages[0].params and embedding in engine.runner.stages[-1].params
    if name == "falcon-7b":
        assert plan.kv_replication == 2


def _config(**overrides) -> ModelConfig:
    base = dict(architecture="LlamaForCausalLM", vocab_size=256, hidden_size=64, intermediate_size=128,
                num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=4, head_dim=16, rms_norm_eps=1e-6,
                rope_theta=1e4, rope_scaling=None, max_position_embeddings=1024, tie_word_embeddings=False,
                attention_bias=False, attention_out_bias=False, qk_norm=False, sliding_window=None,
                bos_token_id=1, eos_token_ids=(2,), torch_dtype=None)
    return ModelConfig(**{**base, **overrides})


@pytest.mark.parametrize(
    "overrides,tp,pp,match",
    [
        ({}, 3, 1, "num_attention_heads=8 is not divisible by tensor_parallel_size=3"),
        ({}, 4, 4, "needs 16 devices, but only 8"),
        ({}, 1, 5, "pipeline_parallel_size=5 exceeds num_hidden_layers=4"),
        (dict(num_attention_heads=12, num_key_value_heads=6), 4, 1, "num_key_value_heads=6 and tensor_parallel_size=4"),
        (dict(intermediate_size=130), 4, 1, "intermediate_size=130 is not divisible"),
    ],
)
def test_bad_split_is_a_clear_error(overrides, tp, pp, match):
    with pytest.raises(ValueError, match=match):
        validate_parallel_config(_config(**overrides), tp, pp, len(jax.devices()))


def test_bad_configuration_fails_at_engine_construction(model_dir):
    with pytest.raises(ValueError, match="not divisible by tensor_parallel_size=3"):
        make_engine(model_dir, tp=3)
    with pytest.raises(ValueError, match="needs 16 devices"):
        make_engine(model_dir, tp=8, pp=2)
    with pytest.raises(ValueError, match="tensor_parallel_size must be a positive integer"):
        EngineConfig(model=str(model_dir), tensor_parallel_size=0)


def test_plan_rules_and_stages():
    plan = make_plan(_config(vocab_size=250), tensor_parallel_size=4, pipeline_parallel_size=2)
    assert not plan.shard_vocab  # 250 % 4: embedding and LM head stay replicated
    specs = plan.param_specs()
    P = jax.sharding.PartitionSpec
    # Stacked layer params: the leading layers axis is never sharded.
    assert specs["layers"]["self_attn"]["qkv_proj"]["kernel"] == P(None, None, "tp", None, None)
    assert specs["layers"]["self_attn"]["o_proj"]["kernel"] == P(None, "tp", None, None)
    assert specs["layers"]["mlp"]["gate_up_proj"]["kernel"] == P(None, None, None, "tp")
    assert specs["layers"]["mlp"]["down_proj"]["kernel"] == P(None, "tp", None)
    # Checkpoints are read with separate q/k/v (q split over heads) and gate/up, fused on the devices.
    loading_specs = plan.param_specs(for_loading=True)
    assert loading_specs["layers"]["self_attn"]["q_proj"]["kernel"] == P(None, None, "tp", None)
    assert loading_specs["layers"]["mlp"]["up_proj"]["kernel"] == P(None, None, "tp")
    assert specs["embed_tokens"] == P(None, None)
    assert plan.kv_cache_sharding(1).spec == P(None, None, None, "tp", None)
    shardings = plan.param_shardings()
    # With 2 stages the stacked layers span both: staged on the host, then cut per stage by place_params.
    assert shardings["layers"]["mlp"]["gate_up_proj"]["kernel"].device_set == {jax.local_devices(backend="cpu")[0]}
    assert set(shardings["embed_tokens"].device_set) == set(plan.mesh.devices[0])
    assert set(shardings["norm"]["scale"].device_set) == set(plan.mesh.devices[1])
    assert split_layers(5, 2) == ((0, 3), (3, 5))


def test_distributed_env():
    assert initialize_distributed_from_env({}) is False
    with pytest.raises(ValueError, match="SARATHI_NUM_PROCESSES"):
        initialize_distributed_from_env({"SARATHI_COORDINATOR_ADDRESS": "127.0.0.1:1234"})
    with pytest.raises(ValueError, match="not in"):
        initialize_distributed_from_env({"SARATHI_COORDINATOR_ADDRESS": "127.0.0.1:1234",
                                         "SARATHI_NUM_PROCESSES": "2", "SARATHI_PROCESS_ID": "2"})


def _free_ports(n: int) -> list[int]:
    import socket

    socks = [socket.socket() for _ in range(n)]
    for s in socks:
        s.bind(("127.0.0.1", 0))
    ports = [s.getsockname()[1] for s in socks]
    for s in socks:
        s.close()
    return ports


def run_two_processes(model_dir, prompts, devices_per_process: int, *args: str) -> list[list[str]]:
    """Two worker processes on loopback (JAX CPU backend, gloo collectives), `devices_per_process` CPU devices
    each, started through the SARATHI_* variables with ports picked free; `args` after the prompts: tp pp
    max_tokens [disaggregation]. Each process's output lines."""
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    coordinator, *transfer = _free_ports(3)
    root = Path(__file__).resolve().parents[3]
    procs = []
    for rank in range(2):
        env = {
            **os.environ,
            "XLA_FLAGS": f"--xla_force_host_platform_device_count={devices_per_process}",
            "PYTHONPATH": os.pathsep.join([str(root), os.environ.get("PYTHONPATH", "")]),
            "SARATHI_COORDINATOR_ADDRESS": f"127.0.0.1:{coordinator}",
            "SARATHI_NUM_PROCESSES": "2",
            "SARATHI_PROCESS_ID": str(rank),
            "SARATHI_TRANSFER_ADDRESS": f"127.0.0.1:{transfer[rank]}",
        }
        tp, pp, max_tokens, *rest = args
        cmd = [sys.executable, str(Path(__file__).with_name("multihost_worker.py")), str(model_dir), tp, pp,
               json.dumps(prompts), max_tokens, *rest]
        procs.append(subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    outputs = []
    try:
        for p in procs:
            out, _ = p.communicate(timeout=300)
            outputs.append(out)
            assert p.returncode == 0, out[-3000:]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    return [out.splitlines() for out in outputs]


def tagged(lines: list[str], tag: str):
    import json

    return json.loads(next(line for line in lines if line.startswith(tag + " ")).removeprefix(tag + " "))


def test_multihost_loopback(model_dir, prompts, reference):
    """Two processes, two CPU devices each: TP=2 x PP=2 with one stage per process (stage activations and
    sampled tokens cross processes over the DCN socket transfer), same tokens as the single-device engine."""
    for lines in run_two_processes(model_dir, prompts, 2, "2", "2", str(MAX_TOKENS)):
        assert tagged(lines, "RESULT") == reference.tokens


@pytest.mark.parametrize("split,devices_per_process", [("1:1", 1), ("2:2", 2)])
def test_multihost_disaggregation(model_dir, prompts, reference, split, devices_per_process):
    """Prefill/decode disaggregation across two processes: the prefill instance on process 0's
    devices, the decode instance on process 1's, both processes driving both; every prompt's K/V blocks cross
    processes (`KVBlockMover`'s device_put) and each instance's sampled tokens reach the other process. Chunked
    prefills (prompts up to 45 tokens, budget 16); same tokens as the single-device colocated engine."""
    for lines in run_two_processes(model_dir, prompts, devices_per_process, "1", "1", str(MAX_TOKENS), split):
        assert tagged(lines, "RESULT") == reference.tokens
        num_transfers, num_bytes, _ = tagged(lines, "TRANSFERS")
        assert num_transfers == len(prompts) and num_bytes > 0  # every request moved once (max_tokens > 1)
