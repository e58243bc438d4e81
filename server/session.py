"""`RequestSession`: what both front ends (server/grpc_service.py, server/http_api.py) talk to.

One admission path, one back-pressure rule, one set of metrics: a front end calls `admit`, reads the outputs
with `next_output` and calls `release` when it is done. Each request gets an asyncio queue; the engine thread
(`EngineWorker`) pushes the request's outputs into it with `loop.call_soon_threadsafe`. A request whose RPC or
HTTP request ends early is aborted in the engine from `release`, which frees its KV blocks before the engine's
next iteration. The server's lifecycle (start, drain, stop) is `GenerationServer`'s, in server/service.py.

`ServerMetrics`: the Prometheus metrics of one server, on the server's own `CollectorRegistry` (never the
global one). Names follow vLLM's (`vllm:` -> `sarathi:`), labelled with `model_name` like vLLM's.
prometheus_client appends `_total` to counters, so the counters read `sarathi:num_preemptions_total`,
`sarathi:prompt_tokens_total`, `sarathi:generation_tokens_total`, exactly as vLLM's do.

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
| sarathi:num_relegations_total | counter | scheduling policy "deadline": requests relegated for missing their TTFT (not in vLLM) |
| sarathi:prompt_tokens_total | counter | prompt tokens of requests that got their first token |
| sarathi:generation_tokens_total | counter | generated tokens |
| sarathi:request_success_total | counter | finished requests, label finished_reason |
| sarathi:request_rejected_total | counter | requests refused, label reason (not in vLLM) |
| sarathi:request_slo_total | counter | finished requests that carried SLO targets, labels slo (their targets, `ttft=S,tbt=S`: the class) and result (`met`, `missed`); the first 16 distinct target pairs get their own slo value, later ones `other` (not in vLLM) |
| sarathi:prefix_cache_queries_total | counter | prompt tokens looked up in the prefix cache at admission |
| sarathi:prefix_cache_hits_total | counter | of those, tokens found cached (not recomputed) |
| sarathi:spec_decode_num_drafts_total | counter | speculative decoding: verification steps (chunks with drafts) |
| sarathi:spec_decode_num_draft_tokens_total | counter | draft tokens proposed and verified |
| sarathi:spec_decode_num_accepted_tokens_total | counter | of those, accepted |
| sarathi:spec_decode_num_emitted_tokens_total | counter | tokens the verification steps emitted (not in vLLM V1) |
| sarathi:kv_transfers_total | counter | disaggregation: requests whose K/V moved from prefill to decode (not in vLLM) |
| sarathi:kv_transfer_bytes_total | counter | disaggregation: bytes those copies moved |
| sarathi:kv_transfer_seconds_total | counter | disaggregation: seconds those copies took |

A registry the server makes itself also carries prometheus_client's standard process metrics
(`process_resident_memory_bytes`, `process_cpu_seconds_total`, `process_open_fds`, ...; Linux only), which the
soak (benchmarks/soak.py) reads.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import Callable, Mapping
from typing import Any

import grpc
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, ProcessCollector, start_http_server

from sarathi_jax.core.admission import Admission, AdmissionError, AdmittedRequest
from sarathi_jax.request.outputs import RequestOutput
from server.compile_pool import CompilePool, FieldNamer, same_name
from server.engine_worker import EngineError, EngineWorker, ServingEngine
from server.request_state import SHUTDOWN_ABORT_MESSAGE, ActiveRequest, RequestError

log = logging.getLogger(__name__)

DEFAULT_MAX_WAITING_REQUESTS = 1024
DEFAULT_MAX_WAITING_PROMPT_TOKENS = 1 << 20
# A client's request id is echoed on every streamed message: bounded, so that it cannot multiply the output.
DEFAULT_MAX_REQUEST_ID_LENGTH = 256


class RequestSession:
    """The requests in flight over one `EngineWorker` thread, on one asyncio loop (`bind`).

    Back-pressure: a request is refused with RESOURCE_EXHAUSTED when admitting it would leave more than
    `max_waiting_requests` requests, or more than `max_waiting_prompt_tokens` prompt tokens, waiting, where
    waiting means admitted but without its first output yet. A lone request is always admitted whatever its
    prompt length (the engine bounds that with max_model_len). Once `stop_admitting` is called every new
    request is refused with UNAVAILABLE. A client request id longer than `max_request_id_length` characters is
    refused with INVALID_ARGUMENT. A constrained request's grammar compiles in `compiles` (off the loop) once
    those checks pass, its id and back-pressure share held meanwhile.
    """

    def __init__(self, engine: ServingEngine, engine_config: Any, model_name: str, worker: EngineWorker,
                 metrics: ServerMetrics, *, max_waiting_requests: int | None = DEFAULT_MAX_WAITING_REQUESTS,
                 max_waiting_prompt_tokens: int | None = DEFAULT_MAX_WAITING_PROMPT_TOKENS,
                 max_request_id_length: int = DEFAULT_MAX_REQUEST_ID_LENGTH,
                 compiles: CompilePool | None = None) -> None:
        self.engine = engine
        self.engine_config = engine_config
        self.model_name = model_name
        self.worker = worker
        self.metrics = metrics
        self.max_waiting_requests = max_waiting_requests
        self.max_waiting_prompt_tokens = max_waiting_prompt_tokens
        self.max_request_id_length = max_request_id_length
        self.compiles = compiles or CompilePool()
        self._active: dict[str, ActiveRequest] = {}
        self._pending_requests = 0
        self._pending_tokens = 0
        self._draining = False
        self._loop: asyncio.AbstractEventLoop | None = None
        self._idle: asyncio.Event | None = None

    def bind(self, loop: asyncio.AbstractEventLoop) -> None:
        """Serve on `loop` (the running one: the idle event belongs to it)."""
        self._loop = loop
        self._idle = asyncio.Event()
        self._idle.set()

    def stop_admitting(self) -> None:
        self._draining = True

    @property
    def draining(self) -> bool:
        return self._draining

    @property
    def num_active_requests(self) -> int:
        return len(self._active)

    async def wait_until_idle(self) -> None:
        """Until no request is in flight."""
        assert self._idle is not None, "session not bound to a loop"
        await self._idle.wait()

    def end_all_requests(self) -> int:
        """The drain grace ran out: every request in flight ends at its next `next_output` (RequestError
        UNAVAILABLE, with `state.ended_by_shutdown` set), so that each front end closes its stream in-band.
        Returns how many were ended; each is aborted in the engine when its front end releases it."""
        for state in self._active.values():
            state.ended_by_shutdown = True
            state.queue.put_nowait(None)  # wakes a reader waiting for its next output
        return len(self._active)

    def _request_id(self, request_id: str | None) -> str:
        if request_id is None:
            return uuid.uuid4().hex
        if not request_id:
            raise RequestError(grpc.StatusCode.INVALID_ARGUMENT, "request_id: must not be empty when set", "request_id")
        if len(request_id) > self.max_request_id_length:
            raise RequestError(grpc.StatusCode.INVALID_ARGUMENT,
                               f"request_id: {len(request_id)} characters, more than the limit of "
                               f"{self.max_request_id_length} (--max-request-id-length)", "request_id")
        if request_id in self._active:
            raise RequestError(grpc.StatusCode.ALREADY_EXISTS, f"request_id: {request_id!r} is already in flight",
                               "request_id")
        return request_id

    def _check_capacity(self, num_tokens: int) -> None:
        if self._pending_requests == 0:
            return
        if self.max_waiting_requests is not None and self._pending_requests + 1 > self.max_waiting_requests:
            self.metrics.request_rejected("waiting_requests")
            raise RequestError(
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"server overloaded: {self._pending_requests} requests waiting "
                f"(limit max_waiting_requests={self.max_waiting_requests}); retry later")
        if (self.max_waiting_prompt_tokens is not None
                and self._pending_tokens + num_tokens > self.max_waiting_prompt_tokens):
            self.metrics.request_rejected("waiting_prompt_tokens")
            raise RequestError(
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"server overloaded: {self._pending_tokens} prompt tokens waiting, this request adds {num_tokens} "
                f"(limit max_waiting_prompt_tokens={self.max_waiting_prompt_tokens}); retry later")

    async def admit(self, build: Callable[[Admission], AdmittedRequest], request_id: str | None = None,
                    name: FieldNamer = same_name) -> ActiveRequest:
        """Validate (`build`, in a thread, calls the engine's admission: tokenisation and chat rendering happen
        there, once),
        apply back-pressure, compile a constraint (a refusal's field as `name` gives it) and hand the request to
        the engine thread. Raises RequestError."""
        arrival = time.monotonic()
        try:
            self._check_open()
            try:  # in a thread: a long prompt's tokenisation or a large constraint's validation holds no stream
                admitted = await self.compiles.check(build, self.engine.admission.deferring_grammars())
            except ValueError as exc:  # AdmissionError names its field; any other ValueError is bad input too
                param = exc.param if isinstance(exc, AdmissionError) else None
                raise RequestError(grpc.StatusCode.INVALID_ARGUMENT, str(exc), param) from None
            self._check_open()  # again: a drain may have begun meanwhile
            rid = self._request_id(request_id)
            num_tokens = len(admitted.prompt_token_ids)
            self._check_capacity(num_tokens)
        except RequestError as exc:
            self._count_refusal(exc)
            raise
        loop = self._loop
        assert loop is not None and self._idle is not None, "session not bound to a loop"
        q: asyncio.Queue = asyncio.Queue()
        state = ActiveRequest(rid, arrival, num_tokens, q)
        self._active[rid] = state
        self._idle.clear()
        self._pending_requests += 1
        self._pending_tokens += num_tokens
        try:
            admitted = await self.compiles.with_grammar(self.engine.admission, admitted, name)
        except BaseException as exc:
            state.finished = True  # never reached the engine: nothing to abort
            self.release(state)
            if isinstance(exc, RequestError):
                self._count_refusal(exc)
            raise

        def sink(item: Any, _put=q.put_nowait) -> None:  # engine thread
            loop.call_soon_threadsafe(_put, item)

        self.worker.submit(rid, admitted, arrival, sink)
        return state

    def _check_open(self) -> None:
        if self._draining:
            raise RequestError(grpc.StatusCode.UNAVAILABLE, "server is shutting down")
        if not self.worker.alive:
            raise RequestError(grpc.StatusCode.UNAVAILABLE, "engine stopped")

    def _count_refusal(self, exc: RequestError) -> None:
        if exc.code == grpc.StatusCode.INVALID_ARGUMENT:
            self.metrics.request_rejected("invalid_argument")
        elif exc.code == grpc.StatusCode.UNAVAILABLE:
            self.metrics.request_rejected("shutting_down")

    def _unpend(self, state: ActiveRequest) -> None:
        if state.pending:
            state.pending = False
            self._pending_requests -= 1
            self._pending_tokens -= state.num_prompt_tokens

    def release(self, state: ActiveRequest) -> None:
        """The front end is done with the request: abort it in the engine unless it finished."""
        self._unpend(state)
        if self._active.get(state.request_id) is state:
            del self._active[state.request_id]
        if not state.finished:
            # Cancelled, disconnected or past its deadline (or failed): free its KV blocks in the engine.
            self.worker.abort(state.request_id)
            self.metrics.request_finished("abort")  # as vLLM counts it; the engine's abort output has no reader
            log.debug("request %s ended early: aborted", state.request_id)
        if not self._active and self._idle is not None:
            self._idle.set()

    async def next_output(self, state: ActiveRequest) -> RequestOutput:
        """The request's next RequestOutput; raises RequestError for an engine-side error, or once the server ended
        the request (`end_all_requests`)."""
        item = None if state.ended_by_shutdown else await state.queue.get()
        if state.ended_by_shutdown:
            raise RequestError(grpc.StatusCode.UNAVAILABLE, SHUTDOWN_ABORT_MESSAGE)
        self._unpend(state)
        if isinstance(item, BaseException):
            state.finished = True  # nothing left in the engine to abort
            if isinstance(item, ValueError):
                self.metrics.request_rejected("invalid_argument")
                raise RequestError(grpc.StatusCode.INVALID_ARGUMENT, str(item))
            if isinstance(item, EngineError):
                raise RequestError(grpc.StatusCode.INTERNAL if not self._draining else grpc.StatusCode.UNAVAILABLE,
                                   str(item))
            raise RequestError(grpc.StatusCode.INTERNAL, f"engine error: {item!r}")
        self.metrics.observe_output(state, item)
        if item.finished:
            state.finished = True
        return item

    def model_info(self) -> dict[str, Any]:
        """What GetModelInfo answers (and the HTTP /v1/models card carries)."""
        cfg, mc = self.engine_config, self.engine.model_config
        return dict(
            model_name=self.model_name,
            architecture=mc.architecture,
            max_model_len=int(self.engine.max_model_len),
            vocab_size=int(mc.vocab_size),
            scheduler=str(cfg.scheduler or ""),
            token_budget=int(cfg.token_budget or 0),
            max_num_seqs=int(cfg.max_num_seqs or 0),
            block_size=int(cfg.block_size or 0),
            has_tokenizer=self.engine.admission.tokenizer is not None,
            dtype=str(cfg.dtype or ""),
            attention_backend=str(cfg.attention_backend or ""),
        )

    async def engine_stats(self) -> dict[str, Any]:
        """The engine's `stats()`, read between iterations, plus the session's counters."""
        s = await asyncio.wrap_future(self.worker.call(lambda engine: engine.stats()))
        return dict(s, num_active_requests=len(self._active), num_pending_requests=self._pending_requests,
                    num_pending_prompt_tokens=self._pending_tokens, num_iterations=self.worker.num_iterations,
                    draining=self._draining)


# ----------------------------------------------------------------------------------------- Prometheus

PREFIX = "sarathi:"
SLO_CLASS_LABELS = 16  # distinct SLO target pairs with a label value of their own (bounded cardinality)

# Latency buckets: 2.0 is Sarathi-Serve's median scheduling-delay bound (benchmarks.peer's capacity check reads it;
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
        self.relegations = Counter(PREFIX + "num_relegations", "Requests relegated for missing their TTFT.", labels,
                                   registry=r).labels(model_name)
        self.prompt_tokens = Counter(PREFIX + "prompt_tokens", "Prefilled prompt tokens.", labels,
                                     registry=r).labels(model_name)
        self.generation_tokens = Counter(PREFIX + "generation_tokens", "Generated tokens.", labels,
                                         registry=r).labels(model_name)
        self._success = Counter(PREFIX + "request_success", "Finished requests.", labels + ["finished_reason"],
                                registry=r)
        self._rejected = Counter(PREFIX + "request_rejected", "Refused requests.", labels + ["reason"], registry=r)
        self._slo = Counter(PREFIX + "request_slo", "Finished requests with SLO targets, by class and result.",
                            labels + ["slo", "result"], registry=r)
        self._slo_classes: set[str] = set()
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
        # Prefill/decode disaggregation's KV transfers (engine stat -> counter; 0 colocated).
        self._transfer_counters = {
            stat: Counter(PREFIX + name, text, labels, registry=r).labels(model_name)
            for stat, name, text in (("num_transfers", "kv_transfers", "KV transfers, prefill to decode."),
                                     ("transfer_bytes", "kv_transfer_bytes", "Bytes the KV transfers moved."),
                                     ("transfer_seconds", "kv_transfer_seconds", "Seconds the KV transfers took."))}
        if registry is None:  # a registry given is the caller's (the global one has these already)
            ProcessCollector(registry=r)  # this process's memory, CPU time and open files
        self._last_totals: dict[str, float] = {}  # engine stat -> the cumulative total already counted
        self._http = None

    def request_finished(self, reason: str) -> None:
        self._success.labels(self.model_name, reason).inc()

    def request_slo(self, metrics: Any) -> None:
        """Count a finished request's SLO result under its targets' class (nothing without targets)."""
        if metrics.slo_ttft_s is None and metrics.slo_tbt_s is None:
            return
        met = metrics.slo_met
        if met is None:
            return
        name = ",".join(f"{key}={value:g}" for key, value in (("ttft", metrics.slo_ttft_s), ("tbt", metrics.slo_tbt_s))
                        if value is not None)
        if name not in self._slo_classes:
            if len(self._slo_classes) >= SLO_CLASS_LABELS:
                name = "other"
            else:
                self._slo_classes.add(name)
        self._slo.labels(self.model_name, name, "met" if met else "missed").inc()

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
            self.request_slo(rm)

    def update_engine_stats(self, stats: dict) -> None:
        """Called from the engine thread after each iteration (prometheus_client is thread-safe)."""
        self.num_running.set(stats.get("num_running", 0))
        self.num_waiting.set(stats.get("num_waiting", 0))
        self.kv_usage.set(stats.get("kv_cache_usage", 0.0))
        for key, counter in (("num_preemptions", self.preemptions), ("num_relegations", self.relegations),
                             ("prefix_cache_queries", self.prefix_cache_queries),
                             ("prefix_cache_hits", self.prefix_cache_hits), *self._spec_counters.items(),
                             *self._transfer_counters.items()):
            total, last = float(stats.get(key, 0)), self._last_totals.get(key, 0.0)
            if total > last:  # the engine's totals are cumulative; counters take the increase
                counter.inc(total - last)
            self._last_totals[key] = max(total, last)

    def serve(self, port: int, addr: str = "0.0.0.0", tls: Mapping[str, Any] | None = None) -> int:
        """Start the HTTP /metrics endpoint in a daemon thread; returns the bound port (port 0 picks one). `tls`:
        start_http_server's TLS keywords (`ServerSecurity.metrics_tls_options()`)."""
        httpd, _thread = start_http_server(port, addr=addr, registry=self.registry, **(tls or {}))
        self._http = httpd
        return httpd.server_port

    def close(self) -> None:
        if self._http is not None:
            self._http.shutdown()
            self._http.server_close()
            self._http = None
