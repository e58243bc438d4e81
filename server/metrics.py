"""Prometheus metrics of one server, on the server's own `CollectorRegistry` (never the global one).

Names follow vLLM's (`vllm:` -> `sarathi:`), labelled with `model_name` like vLLM's. prometheus_client appends
`_total` to counters, so the counters read `sarathi:num_preemptions_total`, `sarathi:prompt_tokens_total`,
`sarathi:generation_tokens_total`, exactly as vLLM's do.

| metric | type | meaning |
| --- | --- | --- |
| sarathi:time_to_first_token_seconds | histogram | server receipt -> first token |
| sarathi:inter_token_latency_seconds | histogram | between consecutive tokens of a request |
| sarathi:e2e_request_latency_seconds | histogram | server receipt -> finished |
| sarathi:request_queue_time_seconds | histogram | server receipt -> first scheduled |
| sarathi:num_requests_running | gauge | engine's running sequences |
| sarathi:num_requests_waiting | gauge | engine's waiting sequences |
| sarathi:kv_cache_usage_perc | gauge | fraction of KV blocks in use (0..1, as vLLM) |
| sarathi:num_preemptions_total | counter | preemptions, cumulative |
| sarathi:prompt_tokens_total | counter | prompt tokens of requests that got their first token |
| sarathi:generation_tokens_total | counter | generated tokens |
| sarathi:request_success_total | counter | finished requests, label finished_reason |
| sarathi:request_rejected_total | counter | requests refused, label reason (not in vLLM) |
| sarathi:prefix_cache_queries_total | counter | prompt tokens looked up in the prefix cache at admission |
| sarathi:prefix_cache_hits_total | counter | of those, tokens found cached (not recomputed) |
| sarathi:spec_decode_num_drafts_total | counter | speculative decoding: verification steps (chunks with drafts) |
| sarathi:spec_decode_num_draft_tokens_total | counter | draft tokens proposed and verified |
| sarathi:spec_decode_num_accepted_tokens_total | counter | of those, accepted |
| sarathi:spec_decode_num_emitted_tokens_total | counter | tokens the verification steps emitted (not in vLLM V1) |

A registry the server makes itself also carries prometheus_client's standard process metrics
(`process_resident_memory_bytes`, `process_cpu_seconds_total`, `process_open_fds`, ...; Linux only), which the
soak (server/soak.py) reads.
"""

from __future__ import annotations

import time
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, ProcessCollector, start_http_server

PREFIX = "sarathi:"

# Latency buckets: 2.0 is Sarathi-Serve's median scheduling-delay bound (bench.peer's capacity check reads it;
# it gives vLLM these same request-latency buckets).
LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.0, 2.5, 5.0, 7.5,
                   10.0, 20.0, 40.0, 80.0, 160.0)
_ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4,
                0.5, 0.75, 1.0, 2.5, 5.0)


class ServerMetrics:
    def __init__(self, model_name: str, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry if registry is not None else CollectorRegistry(auto_describe=True)
        self.model_name = model_name
        labels = ["model_name"]
        r = self.registry

        def hist(name, doc, buckets):
            return Histogram(PREFIX + name, doc, labels, registry=r, buckets=buckets).labels(model_name)

        self.ttft = hist("time_to_first_token_seconds", "Time to first token.", LATENCY_BUCKETS)
        self.itl = hist("inter_token_latency_seconds", "Time between consecutive tokens.", _ITL_BUCKETS)
        self.e2e = hist("e2e_request_latency_seconds", "End-to-end request latency.", LATENCY_BUCKETS)
        self.queue_time = hist("request_queue_time_seconds", "Time from arrival to first scheduled.",
                               LATENCY_BUCKETS)
        self.num_running = Gauge(PREFIX + "num_requests_running", "Requests running in the engine.", labels,
                                 registry=r).labels(model_name)
        self.num_waiting = Gauge(PREFIX + "num_requests_waiting", "Requests waiting in the engine.", labels,
                                 registry=r).labels(model_name)
        self.kv_usage = Gauge(PREFIX + "kv_cache_usage_perc", "KV-cache usage, 0..1 (1 = 100%).", labels,
                              registry=r).labels(model_name)
        self.preemptions = Counter(PREFIX + "num_preemptions", "Cumulative preemptions.", labels,
                                   registry=r).labels(model_name)
        self.prompt_tokens = Counter(PREFIX + "prompt_tokens", "Prefilled prompt tokens.", labels,
                                     registry=r).labels(model_name)
        self.generation_tokens = Counter(PREFIX + "generation_tokens", "Generated tokens.", labels,
                                         registry=r).labels(model_name)
        self._success = Counter(PREFIX + "request_success", "Finished requests.", labels + ["finished_reason"],
                                registry=r)
        self._rejected = Counter(PREFIX + "request_rejected", "Refused requests.", labels + ["reason"], registry=r)
        self.prefix_cache_queries = Counter(PREFIX + "prefix_cache_queries", "Prefix-cache queries, in tokens.",
                                            labels, registry=r).labels(model_name)
        self.prefix_cache_hits = Counter(PREFIX + "prefix_cache_hits", "Prefix-cache hits, in tokens.", labels,
                                         registry=r).labels(model_name)
        # Speculative decoding (engine stat -> counter): vLLM's spec_decode_* names.
        self._spec_counters = {
            f"spec_num_{what}": Counter(PREFIX + f"spec_decode_num_{name}", text, labels, registry=r).labels(model_name)
            for what, name, text in (("verify_steps", "drafts", "Verification steps (chunks with drafts)."),
                                     ("draft_tokens", "draft_tokens", "Draft tokens verified."),
                                     ("accepted_tokens", "accepted_tokens", "Draft tokens accepted."),
                                     ("emitted_tokens", "emitted_tokens", "Tokens verification steps emitted."))}
        if registry is None:  # a registry given is the caller's (the global one has these already)
            ProcessCollector(registry=r)  # this process's memory, CPU time and open files
        self._last_totals: dict[str, int] = {}  # engine stat -> the cumulative total already counted
        self._http = None

    def request_finished(self, reason: str) -> None:
        self._success.labels(self.model_name, reason).inc()

    def request_rejected(self, reason: str) -> None:
        self._rejected.labels(self.model_name, reason).inc()

    def observe_output(self, state: Any, out: Any) -> None:
        """Record one of a request's outputs: queue time, TTFT, inter-token latencies, token counts and, when it
        finishes, end-to-end latency and the finish reason. `state` (a `server.request_state.ActiveRequest`) has
        the request's `arrival_time` and keeps what is already counted (`tokens_seen`, `queue_time_observed`)."""
        rm = out.metrics
        if not state.queue_time_observed and rm.first_scheduled_time is not None:
            state.queue_time_observed = True
            self.queue_time.observe(max(0.0, rm.first_scheduled_time - state.arrival_time))
        n_new = len(out.new_token_ids)
        if n_new:
            count = len(out.token_ids)
            times = list(rm.token_times[:count])
            if state.tokens_seen == 0:
                first = rm.first_token_time if rm.first_token_time is not None else time.monotonic()
                self.ttft.observe(max(0.0, first - state.arrival_time))
                self.prompt_tokens.inc(len(out.prompt_token_ids))
            start = max(state.tokens_seen - 1, 0)
            for a, b in zip(times[start:], times[start + 1:]):
                self.itl.observe(max(0.0, b - a))
            state.tokens_seen = count
            self.generation_tokens.inc(n_new)
        if out.finished:
            end = rm.finished_time if rm.finished_time is not None else time.monotonic()
            self.e2e.observe(max(0.0, end - state.arrival_time))
            self.request_finished(out.finish_reason or "stop")

    def update_engine_stats(self, stats: dict) -> None:
        """Called from the engine thread after each iteration (prometheus_client is thread-safe)."""
        self.num_running.set(stats.get("num_running", 0))
        self.num_waiting.set(stats.get("num_waiting", 0))
        self.kv_usage.set(stats.get("kv_cache_usage", 0.0))
        for key, counter in (("num_preemptions", self.preemptions), ("prefix_cache_queries", self.prefix_cache_queries),
                             ("prefix_cache_hits", self.prefix_cache_hits), *self._spec_counters.items()):
            total, last = int(stats.get(key, 0)), self._last_totals.get(key, 0)
            if total > last:  # the engine's totals are cumulative; counters take the increase
                counter.inc(total - last)
            self._last_totals[key] = max(total, last)

    def serve(self, port: int, addr: str = "0.0.0.0") -> int:
        """Start the HTTP /metrics endpoint in a daemon thread; returns the bound port (port 0 picks one)."""
        httpd, _thread = start_http_server(port, addr=addr, registry=self.registry)
        self._http = httpd
        return httpd.server_port

    def close(self) -> None:
        if self._http is not None:
            self._http.shutdown()
            self._http.server_close()
            self._http = None
