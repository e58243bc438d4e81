"""A deterministic fake engine with the Engine API on a virtual clock, for bench tests.

Every step runs all admitted requests: a new request gets its whole prompt and its first token in its first
step, the others one decode token each. A step lasts `base + per_seq * num_seqs + per_prefill_token *
prefill_tokens` virtual seconds, so latency grows with load. At most `max_num_seqs` run at once; the rest wait.
"""

from __future__ import annotations

from types import SimpleNamespace

from sarathi_jax.outputs import IterationRecord, RequestMetrics, RequestOutput


class FakeClock:
    def __init__(self) -> None:
        self.t = 100.0  # not 0, so that tests catch missing rebasing

    def now(self) -> float:
        return self.t

    def advance_to(self, t: float) -> None:
        self.t = max(self.t, t)


class _Req:
    def __init__(self, rid, prompt, params, arrival):
        self.rid = rid
        self.prompt = tuple(prompt)
        self.params = params
        self.metrics = RequestMetrics(arrival_time=arrival)
        self.tokens: list[int] = []
        self.finish_reason = None


class FakeEngine:
    def __init__(self, *, base=0.01, per_seq=0.0001, per_prefill_token=0.0, max_num_seqs=10_000,
                 max_model_len=4096, vocab_size=1000):
        self.clock = FakeClock()
        self.base, self.per_seq, self.per_prefill_token = base, per_seq, per_prefill_token
        self.max_num_seqs = max_num_seqs
        self.max_model_len = max_model_len
        self.model_config = SimpleNamespace(vocab_size=vocab_size)
        self.iteration_log: list[IterationRecord] = []
        self.waiting: list[_Req] = []
        self.running: list[_Req] = []
        self.pending: list[RequestOutput] = []
        self.ids: set[str] = set()
        self.num_preemptions = 0

    def add_request(self, request_id, prompt, params, arrival_time=None):
        if request_id in self.ids:
            raise ValueError(f"request_id {request_id!r} is already in use")
        if len(prompt) + params.max_tokens > self.max_model_len:
            raise ValueError("prompt: too long")
        if any(not 0 <= t < self.model_config.vocab_size for t in prompt):
            raise ValueError("prompt: token ids outside the vocabulary")
        self.ids.add(request_id)
        self.waiting.append(_Req(request_id, prompt, params, self.clock.now() if arrival_time is None else arrival_time))

    def has_unfinished_requests(self):
        return bool(self.waiting or self.running or self.pending)

    def _out(self, r: _Req, new: int) -> RequestOutput:
        done = r.finish_reason is not None
        return RequestOutput(r.rid, r.prompt, tuple(r.tokens[len(r.tokens) - new:]) if new else (), tuple(r.tokens),
                             "", "", (), done, r.finish_reason, r.metrics)

    def step(self):
        outs, self.pending = self.pending, []
        while self.waiting and len(self.running) < self.max_num_seqs:
            self.running.append(self.waiting.pop(0))
        if not self.running:
            return outs
        start = self.clock.now()
        new = [r for r in self.running if not r.tokens]
        prefill = sum(len(r.prompt) for r in new)
        for r in new:
            if r.metrics.first_scheduled_time is None:
                r.metrics.first_scheduled_time = start
        num_seqs = len(self.running)
        num_decode = num_seqs - len(new)
        dur = self.base + self.per_seq * num_seqs + self.per_prefill_token * prefill
        self.clock.t = start + dur
        now = self.clock.t
        for r in list(self.running):
            r.tokens.append(len(r.tokens) % self.model_config.vocab_size)
            if r.metrics.first_token_time is None:
                r.metrics.first_token_time = now
            r.metrics.token_times.append(now)
            if len(r.tokens) >= r.params.max_tokens:
                r.finish_reason = "length"
                r.metrics.finished_time = now
                self.running.remove(r)
            outs.append(self._out(r, 1))
        self.iteration_log.append(IterationRecord(
            iteration=len(self.iteration_log), start_time=start, duration=dur, num_prefill_tokens=prefill,
            num_decode_tokens=num_decode, num_seqs=num_seqs, chunk_sizes=tuple(len(r.prompt) for r in new),
            num_preemptions=0, num_padded_tokens=prefill + num_decode))
        return outs

    def abort(self, request_id):
        for q in (self.waiting, self.running):
            for r in q:
                if r.rid == request_id:
                    q.remove(r)
                    r.finish_reason = "abort"
                    r.metrics.finished_time = self.clock.now()
                    self.pending.append(self._out(r, 0))
                    return True
        return False

    def stats(self):
        return {"num_running": len(self.running), "num_waiting": len(self.waiting), "num_free_blocks": 0,
                "num_total_blocks": 0, "kv_cache_usage": 0.0, "num_preemptions": self.num_preemptions}
