"""Offline API: `LLM(model).generate(prompts, params)` runs requests to completion on an `LLMEngine` (or, with
`disaggregation="P:D"`, a `DisaggregatedEngine`)."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

from sarathi_jax.request.chat_template import ChatTemplate
from sarathi_jax.config.engine_config import EngineConfig
from sarathi_jax.factory import build_engine
from sarathi_jax.request.outputs import RequestOutput, TokenLogprob
from sarathi_jax.request.sampling_params import SamplingParams

Prompt = str | list[int]


class LLM:
    """`LLM("tiny-llama")` or `LLM("/path/to/hf_checkpoint", token_budget=256, scheduler="vllm")`.

    Keyword arguments are `EngineConfig`'s fields, with its defaults (None: derived from the others); any other
    name is a TypeError. `warmup=False` skips compiling ahead (`LLMEngine`).
    """

    def __init__(self, model: str, *, warmup: bool = True, **engine_config: Any) -> None:
        config = EngineConfig(model=model, **engine_config)
        self.engine = build_engine(config, warmup=warmup)
        self._next_id = 0

    @property
    def chat_template(self) -> ChatTemplate | None:
        """The model folder's chat template (tokenizer_config.json / chat_template.jinja), or None."""
        return self.engine.admission.chat_template

    def chat_prompt_ids(self, messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool = True,
                        **template_kwargs: Any) -> list[int]:
        """Token ids of a conversation rendered with the model's chat template (no special tokens added on top:
        the template writes them, as HF's `apply_chat_template(..., tokenize=True)`). ValueError (naming
        `messages`) when the model has no chat template."""
        return self.engine.admission.chat_prompt_ids(messages, add_generation_prompt, **template_kwargs)

    def chat(
        self,
        messages: Sequence[Mapping[str, Any]] | Sequence[Sequence[Mapping[str, Any]]],
        params: SamplingParams | Sequence[SamplingParams] | None = None,
        **template_kwargs: Any,
    ) -> list[RequestOutput]:
        """`generate` on conversations: one conversation (a list of `{"role", "content"}` messages) or a list of
        them, each rendered with the model's chat template and an assistant turn opened. Generation stops at
        EOS / the end-of-turn ids of `generation_config.json` unless `params.ignore_eos`. A model without a
        chat template raises ValueError."""
        conversations = [messages] if messages and isinstance(messages[0], Mapping) else list(messages)
        prompts = [self.chat_prompt_ids(conv, **template_kwargs) for conv in conversations]  # type: ignore[arg-type]
        return self.generate(prompts, params)

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        params: SamplingParams | Sequence[SamplingParams] | None = None,
        priority: Sequence[int] | None = None,
        *,
        slo_ttft_s: float | Sequence[float | None] | None = None,
        slo_tbt_s: float | Sequence[float | None] | None = None,
    ) -> list[RequestOutput]:
        """Run every prompt to completion; returns one output per prompt, in order. `priority`: one per prompt
        (lower is served first under scheduling_policy="priority"); None: all 0. `slo_ttft_s`, `slo_tbt_s`:
        SLO targets in seconds, one for all prompts or one per prompt (None: none); each output's `metrics`
        says whether its request met them (`slo_met`).

        Each returned output covers the whole request: `new_token_ids`, `text_delta` and `new_logprobs`
        hold everything generated. Bad input raises ValueError before anything runs.
        """
        if isinstance(prompts, str) or (isinstance(prompts, list) and prompts and isinstance(prompts[0], int)):
            prompts = [prompts]  # a single prompt
        prompts = list(prompts)
        if params is None or isinstance(params, SamplingParams):
            params = [params or SamplingParams()] * len(prompts)
        if len(params) != len(prompts):
            raise ValueError(f"params: got {len(params)} SamplingParams for {len(prompts)} prompts")
        priority = [0] * len(prompts) if priority is None else list(priority)
        if len(priority) != len(prompts):
            raise ValueError(f"priority: got {len(priority)} priorities for {len(prompts)} prompts")
        ttfts, tbts = _per_prompt("slo_ttft_s", slo_ttft_s, len(prompts)), _per_prompt("slo_tbt_s", slo_tbt_s, len(prompts))

        request_ids = []
        try:
            for prompt, p, prio, ttft, tbt in zip(prompts, params, priority, ttfts, tbts):
                request_id = f"llm-{self._next_id}"
                self._next_id += 1
                self.engine.add_request(request_id, prompt, p, priority=prio, slo_ttft_s=ttft, slo_tbt_s=tbt)
                request_ids.append(request_id)
        except ValueError:
            for request_id in request_ids:
                self.engine.abort(request_id)
            self.engine.step()  # flush the abort outputs
            raise

        wanted = set(request_ids)
        finals: dict[str, RequestOutput] = {}
        logprobs: dict[str, list[TokenLogprob]] = {rid: [] for rid in request_ids}
        while len(finals) < len(request_ids):
            for out in self.engine.step():
                if out.request_id not in wanted:
                    continue
                logprobs[out.request_id].extend(out.new_logprobs)
                if out.finished:
                    finals[out.request_id] = dataclasses.replace(
                        out,
                        new_token_ids=out.token_ids,
                        text_delta=out.text,
                        new_logprobs=tuple(logprobs[out.request_id]),
                    )
        return [finals[rid] for rid in request_ids]


def _per_prompt(name: str, value: object, num_prompts: int) -> list:
    """One value per prompt: a sequence of them as is (its length checked), anything else for every prompt
    (admission judges the values)."""
    if isinstance(value, (list, tuple)):
        if len(value) != num_prompts:
            raise ValueError(f"{name}: got {len(value)} values for {num_prompts} prompts")
        return list(value)
    return [value] * num_prompts
