"""A small stand-in for `sarathi_jax.engine.LLMEngine` implementing the Engine API of docs/design.md.

Development aid only (the server tests run against the real engine). Deterministic: the next token of a
request is a function of its last token and length, so greedy outputs are reproducible.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field

from sarathi_jax.outputs import RequestMetrics, RequestOutput, TokenLogprob
from sarathi_jax.sampling_params import SamplingParams


class ByteTokenizer:
    class _Enc:
        def __init__(self, ids):
            self.ids = ids

    def encode(self, text: str):
        return self._Enc([b for b in text.encode("utf-8")])

    def decode(self, ids) -> str:
        return bytes(int(i) % 256 for i in ids).decode("utf-8", errors="replace")


@dataclass
class FakeModelConfig:
    architecture: str = "FakeForCausalLM"
    vocab_size: int = 256
    eos_token_id: int = 0


@dataclass
class _Req:
    rid: str
    prompt: list[int]
    params: SamplingParams
    metrics: RequestMetrics
    output: list[int] = field(default_factory=list)
    computed: int = 0
    blocks: int = 0


class FakeEngine:
    def __init__(self, *, num_blocks=64, block_size=16, token_budget=64, max_num_seqs=16, max_model_len=256,
                 step_time=0.002, with_tokenizer=True):
        self.model_config = FakeModelConfig()
        self.max_model_len = max_model_len
        self.tokenizer = ByteTokenizer() if with_tokenizer else None
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.token_budget = token_budget
        self.max_num_seqs = max_num_seqs
        self.step_time = step_time
        self.iteration_log = []
        self._free = num_blocks
        self._waiting: list[_Req] = []
        self._running: list[_Req] = []
        self._pending_outputs: list[RequestOutput] = []
        self._ids: set[str] = set()
        self._preemptions = 0

    # --- API -----------------------------------------------------------------------------------------------
    def add_request(self, request_id, prompt, params, arrival_time=None):
        if request_id in self._ids:
            raise ValueError(f"request_id: {request_id!r} is already in use")
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("prompt: text prompts need a tokenizer")
            ids = self.tokenizer.encode(prompt).ids
        else:
            ids = [int(t) for t in prompt]
        if not ids:
            raise ValueError("prompt: must not be empty")
        bad = [t for t in ids if not 0 <= t < self.model_config.vocab_size]
        if bad:
            raise ValueError(f"prompt: token id {bad[0]} is outside the vocabulary [0, {self.model_config.vocab_size})")
        if len(ids) + 1 > self.max_model_len:
            raise ValueError(f"prompt: {len(ids)} tokens is too long (max_model_len {self.max_model_len})")
        if not isinstance(params, SamplingParams):
            raise ValueError("params: must be SamplingParams")
        self._ids.add(request_id)
        now = time.monotonic()
        self._waiting.append(_Req(request_id, ids, params, RequestMetrics(arrival_time or now)))

    def abort(self, request_id):
        for lst in (self._waiting, self._running):
            for r in lst:
                if r.rid == request_id:
                    lst.remove(r)
                    self._free += r.blocks
                    self._ids.discard(request_id)
                    r.metrics.finished_time = time.monotonic()
                    self._pending_outputs.append(self._out(r, [], True, "abort"))
                    return True
        return False

    def has_unfinished_requests(self):
        return bool(self._waiting or self._running or self._pending_outputs)

    def stats(self):
        return dict(num_running=len(self._running), num_waiting=len(self._waiting), num_free_blocks=self._free,
                    num_total_blocks=self.num_blocks, kv_cache_usage=1 - self._free / self.num_blocks,
                    num_preemptions=self._preemptions)

    def step(self):
        outs, self._pending_outputs = self._pending_outputs, []
        time.sleep(self.step_time)
        now = time.monotonic()
        budget = self.token_budget
        # decodes first
        for r in list(self._running):
            if r.computed >= len(r.prompt) + len(r.output) - 1 and r.output:
                budget -= 1
        while self._waiting and len(self._running) < self.max_num_seqs:
            r = self._waiting[0]
            need = math.ceil((len(r.prompt) + r.params.max_tokens) / self.block_size)
            if need > self._free:
                break
            self._waiting.pop(0)
            r.blocks = need
            self._free -= need
            r.metrics.first_scheduled_time = now
            self._running.append(r)
        for r in list(self._running):
            total = len(r.prompt) + len(r.output)
            todo = total - r.computed
            if todo > 1 or not r.output:
                n = min(todo, budget)
                if n <= 0:
                    continue
                budget -= n
                r.computed += n
                if r.computed < total:
                    continue
            else:
                r.computed += 1
            last = (r.output or r.prompt)[-1]
            tok = (last * 31 + total * 7 + 3) % self.model_config.vocab_size
            r.output.append(tok)
            if r.metrics.first_token_time is None:
                r.metrics.first_token_time = now
            r.metrics.token_times.append(now)
            reason = None
            if tok in r.params.stop_token_ids or (tok == self.model_config.eos_token_id and not r.params.ignore_eos
                                                   and len(r.output) >= r.params.min_tokens):
                reason = "stop"
            elif len(r.output) >= r.params.max_tokens or total + 1 >= self.max_model_len:
                reason = "length"
            lp = None
            if r.params.logprobs is not None:
                lp = TokenLogprob(tok, -1.0, tuple(range(r.params.logprobs)), tuple([-2.0] * r.params.logprobs))
            if reason:
                self._running.remove(r)
                self._free += r.blocks
                self._ids.discard(r.rid)
                r.metrics.finished_time = now
            outs.append(self._out(r, [tok], reason is not None, reason, (lp,) if lp else ()))
        return outs

    def _out(self, r, new, finished, reason, lps=()):
        dec = self.tokenizer.decode if self.tokenizer else None
        return RequestOutput(
            request_id=r.rid, prompt_token_ids=tuple(r.prompt), new_token_ids=tuple(new), token_ids=tuple(r.output),
            text_delta=dec(new) if dec else "", text=dec(r.output) if dec else "", new_logprobs=lps,
            finished=finished, finish_reason=reason, metrics=r.metrics)
