"""The one thread that drives the engine.

The engine is not thread-safe, so everything that touches it (add, abort, stats, step) runs here. Other threads
hand it work through a thread-safe queue; while the engine has nothing to do the thread blocks on that queue
(no busy spin). Between two iterations it drains the whole queue, so an abort frees its request's KV blocks
before the next iteration runs.
"""

from __future__ import annotations

import collections
import concurrent.futures
import logging
import queue
import threading
import traceback
from typing import Any, Callable, Protocol

from sarathi_jax.core.admission import AdmittedRequest
from sarathi_jax.config.engine_config import EngineConfig
from sarathi_jax.core.engine_api import Engine
from sarathi_jax.models import ModelConfig

log = logging.getLogger(__name__)

# A sink receives, in the engine thread, each RequestOutput of its request, or an exception: what add_admitted
# raised (a broken contract), or EngineError when an iteration failed. It must not block.
Sink = Callable[[Any], None]


class ServingEngine(Engine, Protocol):
    """What the front ends need of an engine (`LLMEngine` is one): the engine API (`sarathi_jax.core.engine_api.Engine`;
    requests are admitted by its `admission` in the front end's thread, everything else runs in the engine
    thread), and the configuration and model they describe."""

    @property
    def config(self) -> EngineConfig: ...

    @property
    def model_config(self) -> ModelConfig: ...


# Keep the engine's iteration_log bounded in a long-running server.
_MAX_ITERATION_LOG = 100_000
_KEEP_ITERATION_LOG = 10_000


class EngineError(RuntimeError):
    """An engine iteration raised; the requests it was serving were aborted."""


class EngineWorker:
    def __init__(self, engine: Engine, on_stats: Callable[[dict], None] | None = None,
                 name: str = "sarathi-engine") -> None:
        self.engine = engine
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._sinks: dict[str, Sink] = {}
        # Request ids aborted in the engine whose final "abort" output has not come out of a step yet. It has
        # no reader, and a new request may take the same id before it comes: it must not reach that one.
        self._unread_aborts: collections.Counter[str] = collections.Counter()
        self._on_stats = on_stats
        self._paused = False
        self._stopped = threading.Event()
        self.num_iterations = 0  # engine steps taken
        self.num_wakeups = 0  # passes through the loop: stays put while idle (the thread blocks, no spin)
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)

    # --- called from any thread --------------------------------------------------------------------------
    def start(self) -> None:
        self._thread.start()

    def submit(self, request_id: str, request: AdmittedRequest, arrival_time: float, sink: Sink) -> None:
        self._queue.put(("add", request_id, request, arrival_time, sink))

    def abort(self, request_id: str) -> None:
        self._queue.put(("abort", request_id))

    def call(self, fn: Callable[[Any], Any]) -> concurrent.futures.Future:
        """Run fn(engine) in the engine thread between iterations; returns a Future with its result."""
        fut: concurrent.futures.Future = concurrent.futures.Future()
        self._queue.put(("call", fn, fut))
        return fut

    def pause(self) -> None:
        """Stop taking iterations (adds and aborts are still applied). Admin / test hook."""
        self._queue.put(("pause",))

    def resume(self) -> None:
        self._queue.put(("resume",))

    def stop(self, timeout: float | None = 30.0) -> None:
        """Abort everything still in the engine and end the thread."""
        if self._thread.is_alive():
            self._queue.put(("stop",))
            self._thread.join(timeout)

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    # --- engine thread -----------------------------------------------------------------------------------
    def _run(self) -> None:
        engine = self.engine
        try:
            while True:
                self.num_wakeups += 1
                busy = not self._paused and engine.has_unfinished_requests()
                try:
                    cmd = self._queue.get(block=not busy)
                except queue.Empty:
                    cmd = None
                while cmd is not None:
                    if not self._handle(cmd):
                        return
                    try:
                        cmd = self._queue.get_nowait()
                    except queue.Empty:
                        cmd = None
                if not self._paused and engine.has_unfinished_requests():
                    self._step()
                self._publish_stats()
        except BaseException:  # pragma: no cover - defensive: keep callers from hanging
            log.exception("engine thread crashed")
            self._fail_all(EngineError("engine thread crashed"))
            raise
        finally:
            self._stopped.set()

    def _handle(self, cmd: tuple) -> bool:
        kind = cmd[0]
        if kind == "add":
            _, rid, request, arrival, sink = cmd
            try:
                self.engine.add_admitted(rid, request, arrival_time=arrival)
            except Exception as exc:  # a broken contract: reported to the request, the engine is unchanged
                self._deliver(sink, exc)
            else:
                self._sinks[rid] = sink
        elif kind == "abort":
            rid = cmd[1]
            self._sinks.pop(rid, None)
            try:
                if self.engine.abort(rid):
                    self._unread_aborts[rid] += 1
            except Exception:
                log.exception("engine.abort(%r) failed", rid)
        elif kind == "call":
            _, fn, fut = cmd
            if fut.set_running_or_notify_cancel():
                try:
                    fut.set_result(fn(self.engine))
                except BaseException as exc:
                    fut.set_exception(exc)
        elif kind == "pause":
            self._paused = True
        elif kind == "resume":
            self._paused = False
        elif kind == "stop":
            self._abort_all()
            return False
        return True

    def _step(self) -> None:
        try:
            outputs = self.engine.step()
        except Exception as exc:
            log.error("engine step failed:\n%s", traceback.format_exc())
            self._fail_all(EngineError(f"engine step failed: {exc!r}"))
            return
        self.num_iterations += 1
        for out in outputs:
            if out.finish_reason == "abort" and self._unread_aborts[out.request_id] > 0:
                self._unread_aborts[out.request_id] -= 1  # the final output of an abort the worker applied
                if not self._unread_aborts[out.request_id]:
                    del self._unread_aborts[out.request_id]
                continue
            sink = self._sinks.get(out.request_id)
            if out.finished:
                self._sinks.pop(out.request_id, None)
            if sink is not None:
                self._deliver(sink, out)
        log_ = self.engine.iteration_log
        if len(log_) > _MAX_ITERATION_LOG:
            del log_[:-_KEEP_ITERATION_LOG]

    def _publish_stats(self) -> None:
        if self._on_stats is None:
            return
        try:
            self._on_stats(self.engine.stats())
        except Exception:
            log.exception("publishing engine stats failed")

    def _abort_all(self) -> None:
        self._fail_all(EngineError("engine stopped"))

    def _fail_all(self, exc: BaseException) -> None:
        sinks, self._sinks = self._sinks, {}
        for rid, sink in sinks.items():
            try:
                self.engine.abort(rid)
            except Exception:
                pass
            self._deliver(sink, exc)

    @staticmethod
    def _deliver(sink: Sink, item: Any) -> None:
        try:
            sink(item)
        except Exception:  # the front end's loop may be closed already
            log.debug("dropping an output: sink failed", exc_info=True)
