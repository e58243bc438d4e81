"""Offline API: `LLM(model).generate(prompts, params)` runs requests to completion on an `LLMEngine` (or, with
`disaggregation="P:D"`, a `DisaggregatedEngine`)."""

from __future__ import annotations

import dataclasses
import numbers
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

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

        A prompt is a string or a sequence of integer token ids (a 1-D integer numpy array included). Each
        returned output covers the whole request: `new_token_ids`, `text_delta` and `new_logprobs` hold
        everything generated. Bad input raises ValueError before anything runs. An exception or Ctrl-C
        (KeyboardInterrupt) while it runs aborts this call's requests before it propagates: their KV blocks
        are freed and the next call is served as if this one had not been made.
        """
        prompts = _prompt_list(prompts)
        params = _params_list(params, len(prompts))
        priority = [0] * len(prompts) if priority is None else list(priority)
        if len(priority) != len(prompts):
            raise ValueError(f"priority: got {len(priority)} priorities for {len(prompts)} prompts")
        ttfts, tbts = _per_prompt("slo_ttft_s", slo_ttft_s, len(prompts)), _per_prompt("slo_tbt_s", slo_tbt_s, len(prompts))

        request_ids: list[str] = []
        try:
            for prompt, p, prio, ttft, tbt in zip(prompts, params, priority, ttfts, tbts):
                request_id = f"llm-{self._next_id}"
                self._next_id += 1
                request_ids.append(request_id)  # first: an interrupt inside add_request may leave it queued
                self.engine.add_request(request_id, prompt, p, priority=prio, slo_ttft_s=ttft, slo_tbt_s=tbt)
            return self._run(request_ids)
        except BaseException:  # a refused prompt, an engine error, Ctrl-C: this call's requests end here
            self._abandon(request_ids)
            raise

    def _run(self, request_ids: list[str]) -> list[RequestOutput]:
        """Step the engine until every request of `request_ids` has finished; their whole outputs, in order."""
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

    def _abandon(self, request_ids: list[str]) -> None:
        """Abort a failed call's requests (their KV blocks are freed at once, a token in flight is dropped), so the
        engine serves the next call. When nothing else is queued, the engine is stepped until idle, which lets
        the batches still in flight retire and the abort outputs come out; requests queued through
        `self.engine` directly are left to their caller, whose next `step()` does the same."""
        for request_id in request_ids:
            self.engine.abort(request_id)
        stats = self.engine.stats()
        if not stats["num_running"] and not stats["num_waiting"]:
            while self.engine.has_unfinished_requests():
                self.engine.step()


def _prompt_list(prompts: object) -> list:
    """`generate`'s prompts as a list: one prompt (a string or a sequence of integer token ids, a numpy array
    included) or a sequence of them. ValueError naming `prompts` for anything else."""
    if prompts is None or isinstance(prompts, (bytes, bytearray, memoryview, Mapping)):
        raise ValueError(f"prompts: expected a string, token ids or a list of them, got {type(prompts).__name__}"
                         + (" (decode bytes to a string)" if isinstance(prompts, (bytes, bytearray)) else ""))
    if isinstance(prompts, str) or _is_token_ids(prompts):
        return [prompts]
    try:
        return list(prompts)  # type: ignore[call-overload]
    except TypeError:
        raise ValueError(f"prompts: expected a string, token ids or a list of them, got "
                         f"{type(prompts).__name__}") from None


def _is_token_ids(value: object) -> bool:
    """A non-empty sequence of integers (numpy's included, bools not): one prompt's token ids."""
    if isinstance(value, np.ndarray):
        return value.ndim == 1 and value.size > 0 and np.issubdtype(value.dtype, np.integer)
    return (isinstance(value, Sequence) and not isinstance(value, (str, bytes, bytearray)) and len(value) > 0
            and all(isinstance(t, numbers.Integral) and not isinstance(t, bool) for t in value))


def _params_list(params: object, num_prompts: int) -> list[SamplingParams]:
    """One SamplingParams per prompt: one for all (None: the defaults) or a sequence of them."""
    if params is None or isinstance(params, SamplingParams):
        return [params or SamplingParams()] * num_prompts
    if isinstance(params, Sequence) and not isinstance(params, (str, bytes)):
        params = list(params)
        if not all(isinstance(p, SamplingParams) for p in params):
            raise ValueError("params: expected SamplingParams or a list of them, got a list holding "
                             + ", ".join(sorted({type(p).__name__ for p in params if not isinstance(p, SamplingParams)})))
        if len(params) != num_prompts:
            raise ValueError(f"params: got {len(params)} SamplingParams for {num_prompts} prompts")
        return params
    hint = " (SamplingParams(**d) makes one from a dict)" if isinstance(params, Mapping) else ""
    raise ValueError(f"params: expected SamplingParams or a list of them, got {type(params).__name__}{hint}")


def _per_prompt(name: str, value: object, num_prompts: int) -> list:
    """One value per prompt: a sequence of them as is (its length checked), anything else for every prompt
    (admission judges the values)."""
    if isinstance(value, (list, tuple)):
        if len(value) != num_prompts:
            raise ValueError(f"{name}: got {len(value)} values for {num_prompts} prompts")
        return list(value)
    return [value] * num_prompts
