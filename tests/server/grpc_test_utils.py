"""Helpers for the server tests: engine construction, greedy sampling keywords, polling, stubs."""

from __future__ import annotations

import contextlib
import queue
import threading
import time
from collections.abc import Iterator
from typing import Any, Callable

import grpc

from server.proto.sarathi.v1 import generation_pb2 as pb
from server.proto.sarathi.v1 import generation_pb2_grpc as pb_grpc

# Small and quick to compile: 4 buckets (16..64 tokens), 16 sequences per step.
ENGINE_KW: dict[str, Any] = dict(token_budget=64, max_num_seqs=16, block_size=16, num_blocks=160, max_model_len=256)


def make_engine(model: Any, **overrides: Any):
    from sarathi_jax import EngineConfig, LLMEngine

    config = EngineConfig(model=str(model), **{**ENGINE_KW, **overrides})
    return LLMEngine(config), config


# A chat template for engines whose test checkpoint has none: one "role: content" line per message.
PLAIN_CHAT_TEMPLATE = "{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}"


@contextlib.contextmanager
def serving(llama_engine: tuple[Any, Any], chat_template: str | None = None, **server_kwargs: Any) -> Iterator[Any]:
    """A GenerationServer on 127.0.0.1 over the shared `(engine, config)`, started in a thread and stopped
    (grace 0) on exit; `chat_template`, when given, is the engine's for that long. `server_kwargs` go to
    GenerationServer (ports default to free ones: port=0, no HTTP)."""
    from sarathi_jax.request.chat_template import ChatTemplate
    from server.service import GenerationServer

    engine, config = llama_engine
    saved = engine.admission.chat_template
    if chat_template is not None:
        engine.admission.chat_template = ChatTemplate(chat_template)
    srv = GenerationServer(engine, engine_config=config, **{"host": "127.0.0.1", "port": 0, **server_kwargs})
    srv.start_in_thread()
    try:
        yield srv
    finally:
        srv.stop(grace=0, timeout=60)
        engine.admission.chat_template = saved


def greedy(**kw: Any) -> dict[str, Any]:
    """Sampling keywords for `make_request`: greedy, generating `max_tokens` whatever the EOS."""
    return dict(temperature=0.0, ignore_eos=True, **kw)


def wait_until(pred: Callable[[], Any], timeout: float = 10.0, interval: float = 0.01, what: str = "condition") -> Any:
    """Poll pred() until truthy (returned) or fail after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        value = pred()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        time.sleep(interval)


def stub_for(target: str) -> tuple[grpc.Channel, pb_grpc.GenerationStub]:
    channel = grpc.insecure_channel(target)
    return channel, pb_grpc.GenerationStub(channel)


def get_stats(stub: pb_grpc.GenerationStub) -> pb.Stats:
    return stub.GetStats(pb.GetStatsRequest(), timeout=10)


def all_blocks_free(stub: pb_grpc.GenerationStub) -> bool:
    s = get_stats(stub)
    return s.num_free_blocks == s.num_total_blocks and s.num_running == 0 and s.num_waiting == 0


class RecordingQueue:
    """Stands in for an `EngineWorker`'s queue (`worker._queue = RecordingQueue(worker._queue)`): the same items,
    plus a record of the thread's `get(block=...)` calls and an event set when it enters a blocking one, so a
    test can wait for the idle engine thread to park on its queue instead of sleeping."""

    def __init__(self, inner: queue.SimpleQueue) -> None:
        self.inner = inner
        self.gets: list[bool] = []  # the `block` argument of each get
        self.parked = threading.Event()

    def put(self, item: Any) -> None:
        self.inner.put(item)

    def get(self, block: bool = True) -> Any:
        self.gets.append(block)
        if block:
            self.parked.set()
        return self.inner.get(block)

    def get_nowait(self) -> Any:
        return self.inner.get_nowait()


def assert_parks_when_idle(worker: Any, timeout: float = 10.0) -> None:
    """Wake the idle engine thread once (a call) and check, without sleeping, that it goes straight back to a
    blocking get on its queue: one more wakeup, no iteration, no polling get. The queue is restored."""
    recording = RecordingQueue(worker._queue)
    worker._queue = recording

    def in_thread(engine: Any) -> tuple[int, int]:  # runs in the engine thread: earlier gets are forgotten
        recording.gets.clear()
        recording.parked.clear()
        return worker.num_wakeups, worker.num_iterations

    try:
        wakeups, iterations = worker.call(in_thread).result(timeout=timeout)
        assert recording.parked.wait(timeout), "the engine thread never went back to a blocking get"
        assert recording.gets == [True], recording.gets  # idle: a blocking get, no polling
        assert (worker.num_wakeups, worker.num_iterations) == (wakeups + 1, iterations)
    finally:
        worker._queue = recording.inner


def fail_next_step(server: Any) -> None:
    """Make the server engine's next `step()` raise once (in the engine thread, between iterations)."""
    engine = server.engine

    def failing_step():
        del engine.step  # fail once, then the class's step is back
        raise RuntimeError("injected step failure")

    server.worker.call(lambda e: setattr(e, "step", failing_step)).result(timeout=10)
