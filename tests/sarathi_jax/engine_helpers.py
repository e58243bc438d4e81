"""Helpers shared by the engine tests (imported, not collected)."""

from __future__ import annotations

from sarathi_jax import LLMEngine, SamplingParams


def run_staggered(engine: LLMEngine, prompts, params: SamplingParams, arrive_every: int = 3,
                  max_steps: int = 10_000) -> dict[str, list[int]]:
    """Add request `r{i}` every `arrive_every` steps, so prompts arrive while earlier requests decode; step until
    all finish. Returns each request's output tokens."""
    finished: dict[str, list[int]] = {}
    pending = list(enumerate(prompts))
    steps = 0
    while pending or engine.has_unfinished_requests():
        if pending and steps % arrive_every == 0:
            i, prompt = pending.pop(0)
            engine.add_request(f"r{i}", prompt, params)
        for out in engine.step():
            if out.finished:
                finished[out.request_id] = list(out.token_ids)
        steps += 1
        assert steps < max_steps
    return finished


def hf_generate(model_dir, prompts, max_tokens: int) -> list[list[int]]:
    """HF `generate` greedy continuations, one prompt at a time, EOS disabled: the oracle."""
    import torch
    from transformers import AutoModelForCausalLM, GenerationConfig

    model = AutoModelForCausalLM.from_pretrained(model_dir, torch_dtype=torch.float32).eval()
    model.generation_config.eos_token_id = None  # else generate() fills the None below from it
    config = GenerationConfig(max_new_tokens=max_tokens, do_sample=False, eos_token_id=None, pad_token_id=0,
                              bos_token_id=None)
    with torch.no_grad():
        outs = [model.generate(ids, generation_config=config, attention_mask=torch.ones_like(ids))
                for ids in (torch.tensor([p]) for p in prompts)]
    return [out[0, len(p):].tolist() for out, p in zip(outs, prompts)]
