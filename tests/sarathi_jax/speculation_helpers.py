"""Helpers shared by the draft-model speculation tests (imported, not collected): HF oracles (the target, and the
target cut to its first layers), an engine maker, a step observer, serving and leak checks."""

from __future__ import annotations

import numpy as np
import torch

from sarathi_jax import EngineConfig, LLMEngine, SamplingParams

MAX_TOKENS = 24
PATTERN_LENGTHS = (3, 5, 9, 13, 30, 70)
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)


def make_prompts() -> list[list[int]]:
    rng = np.random.default_rng(7)
    return [rng.integers(3, 256, size=n).tolist() * 2 for n in PATTERN_LENGTHS]


def self_spec(num_layers: int, k: int = 4) -> dict:
    return {"method": "self", "num_layers": num_layers, "num_speculative_tokens": k}


def hf_model(model_dir, num_layers=None):
    from transformers import AutoModelForCausalLM

    extra = {} if num_layers is None else {"num_hidden_layers": num_layers}  # the first layers, norm, LM head
    return AutoModelForCausalLM.from_pretrained(model_dir, torch_dtype=torch.float32, **extra).eval()


def with_idle_layers(model_dir, folder, first: int):
    """A copy of the checkpoint in `model_dir` (into `folder`) whose layers from `first` on add nothing to the
    residual stream (their output projections zeroed): its first `first` layers give exactly its tokens, so a
    "self" draft of them is always accepted (float32 near-ties aside)."""
    import shutil

    for path in model_dir.iterdir():  # the tokenizer's files; the config and weights are written below
        if path.name.startswith("tokenizer"):
            shutil.copy(path, folder / path.name)
    model = hf_model(model_dir)
    with torch.no_grad():
        for layer in model.model.layers[first:]:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
    model.save_pretrained(folder)
    return folder


def hf_greedy(model, prompt, max_tokens):
    from transformers import GenerationConfig

    config = GenerationConfig(max_new_tokens=max_tokens, do_sample=False, eos_token_id=None, pad_token_id=0,
                              bos_token_id=None)
    ids = torch.tensor([list(prompt)])
    with torch.no_grad():
        out = model.generate(ids, generation_config=config, attention_mask=torch.ones_like(ids))
    return out[0, len(prompt):].tolist()


def make_engine(model_dir, speculative_config, **overrides) -> LLMEngine:
    fields = dict(model=model_dir, token_budget=64, max_num_seqs=16, block_size=16, num_blocks=256, max_model_len=512,
                  speculative_config=speculative_config, compilation_cache_dir=None)
    fields.update(overrides)
    return LLMEngine(EngineConfig(**fields), warmup=False)


def observe(engine) -> list[list[tuple]]:
    """Each dispatched step's chunks as (seq_id, num_new_tokens, draft tokens, is_decode, tokens before them)."""
    steps = []
    engine.runner.observe_steps(lambda chunks, packed, variant: steps.append(
        [(c.seq.seq_id, c.num_new_tokens, c.draft_token_ids, c.is_decode, tuple(c.seq.token_ids)) for c in chunks]))
    return steps


def assert_no_leak(engine):
    bm = engine.block_manager
    bm.check_invariants([])
    assert bm.num_free_blocks == bm.num_total_blocks


def serve(engine, requests: dict, group: int = 4) -> dict[str, list]:
    """Serve the (prompt, params) of `requests`, `group` at a time (each draft needs a sampling row, and a step
    has max_num_seqs of them): each request's outputs."""
    outs: dict[str, list] = {}
    items = list(requests.items())
    for first in range(0, len(items), group):
        for rid, (prompt, params) in items[first : first + group]:
            engine.add_request(rid, prompt, params)
        while engine.has_unfinished_requests():
            for out in engine.step():
                outs.setdefault(out.request_id, []).append(out)
    return outs


def assert_drafts_are_the_cut_models(model_dir, num_layers, steps, most=40):
    """Each proposal is the greedy continuation of HF's model cut to `num_layers` layers (the first `most`)."""
    draft = hf_model(model_dir, num_layers)
    proposals = [(tokens, d) for step in steps for _, _, d, _, tokens in step if d][:most]
    assert proposals
    same = sum(hf_greedy(draft, tokens, len(d)) == list(d) for tokens, d in proposals)
    assert same >= 0.9 * len(proposals), (same, len(proposals))  # float32 near-ties may differ, rarely


def assert_placed_as_the_target(engine, tp: int):
    """The draft's parameters and KV cache on the target's devices, sharded by the target's rules: the KV cache
    with the target's sharding (kept through serving: no step resharded it), each device holding 1/tp of it
    and about 1/tp of the parameters (norms replicate); one device without tensor parallelism."""
    import jax

    from sarathi_jax.parallel import per_device_bytes

    stage, target = engine.draft_runner.stage, engine.runner.stages[0]
    devices = set(engine.devices)
    assert len(devices) == tp
    kv_usage, param_usage = per_device_bytes(stage.kv_cache), per_device_bytes(stage.params)
    assert set(kv_usage) == set(param_usage) == devices
    if tp == 1:
        assert devices == {jax.devices()[0]}
        return
    assert all(pages.sharding == target.kv_sharding for pages in stage.kv_cache)
    assert set(kv_usage.values()) == {sum(pages.nbytes for pages in stage.kv_cache) // tp}
    total = sum(leaf.nbytes for leaf in jax.tree.leaves(stage.params))
    assert all(nbytes <= 1.05 * total / tp for nbytes in param_usage.values()), (param_usage, total)
