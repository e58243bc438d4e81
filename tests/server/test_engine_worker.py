"""`server.engine_worker.EngineWorker` over the simulator (the real engine core, scheduler and block manager, a
cost model for the model): outputs reach their request's sink in the engine thread, adds/aborts/calls are
applied between iterations, a failed iteration fails every request and the worker goes on, stop fails what is
left, the iteration log stays bounded, and the idle thread blocks."""

from __future__ import annotations

import threading
from typing import Any

import pytest

from grpc_test_utils import assert_parks_when_idle
from sarathi_jax.core.admission import AdmittedRequest
from sarathi_jax.request.outputs import RequestOutput
from sarathi_jax.request.sampling_params import SamplingParams
from sarathi_jax.scheduler import SchedulerConfig
from sarathi_jax.sim.simulator import SimulatedEngine
from server import engine_worker
from server.engine_worker import EngineError, EngineWorker

TIMEOUT = 10.0


class WorkerEngine(SimulatedEngine):
    """A synchronous simulator whose token budget holds every request each step: a request's first step
    prefills its one-token prompt and samples a token, each later step samples one more. It records the
    threads that stepped it and the aborts it was asked for, and fails its next step when told to."""

    def __init__(self) -> None:
        super().__init__(SchedulerConfig(policy="sarathi", token_budget=256, max_num_seqs=16, max_model_len=64),
                         num_blocks=64, block_size=16)
        self.aborted: list[str] = []
        self.step_threads: set[int] = set()
        self.fail_next_step = False

    def abort(self, request_id: str) -> bool:
        self.aborted.append(request_id)
        return super().abort(request_id)

    def step(self) -> list[RequestOutput]:
        self.step_threads.add(threading.get_ident())
        if self.fail_next_step:
            self.fail_next_step = False
            raise RuntimeError("injected failure")
        return super().step()


def tokens(n: int) -> AdmittedRequest:
    """A request that runs for `n` steps: a one-token prompt, exactly n tokens out."""
    return AdmittedRequest((1,), SamplingParams(max_tokens=n, ignore_eos=True), ())


def queued(engine: WorkerEngine) -> list[str]:
    """The requests waiting in the engine's scheduler, in order."""
    return [seq.seq_id for seq in engine.scheduler.waiting]


class Sink:
    """Collects what the worker delivers to one request; `done` is set on its last output or an error."""

    def __init__(self) -> None:
        self.items: list[Any] = []
        self.done = threading.Event()

    def __call__(self, item: Any) -> None:
        self.items.append(item)
        if isinstance(item, BaseException) or item.finished:
            self.done.set()

    def wait(self) -> list[Any]:
        assert self.done.wait(TIMEOUT), self.items
        return self.items


@pytest.fixture
def worker():
    stats: list[dict] = []
    w = EngineWorker(WorkerEngine(), on_stats=stats.append, name="test-engine")
    w.published = stats
    w.start()
    yield w
    w.stop()


def test_outputs_reach_their_sink_from_the_engine_thread(worker):
    a, b = Sink(), Sink()
    worker.submit("a", tokens(3), 0.0, a)
    worker.submit("b", tokens(1), 0.0, b)
    assert [o.finished for o in a.wait()] == [False, False, True]
    assert [o.request_id for o in b.wait()] == ["b"] and b.items[0].finished
    engine_thread = worker.call(lambda engine: threading.get_ident()).result(TIMEOUT)
    assert engine_thread != threading.get_ident() and worker.engine.step_threads == {engine_thread}
    assert worker.num_iterations == 3
    assert worker.published[-1]["num_running"] == 0  # stats are published after every pass


def test_a_refused_add_is_reported_to_its_request_only(worker):
    worker.pause()
    first, dup = Sink(), Sink()
    worker.submit("a", tokens(2), 0.0, first)
    worker.submit("a", tokens(5), 0.0, dup)  # the engine refuses an id in use: the exception reaches dup only
    assert isinstance(dup.wait()[0], AssertionError)
    assert worker.call(queued).result(TIMEOUT) == ["a"]
    worker.resume()
    assert [o.finished for o in first.wait()] == [False, True]


def test_pause_then_abort_frees_the_request_before_any_iteration(worker):
    worker.pause()
    sink = Sink()
    worker.submit("a", tokens(5), 0.0, sink)
    assert worker.call(queued).result(TIMEOUT) == ["a"]
    worker.abort("a")
    assert worker.call(lambda engine: (queued(engine), engine.aborted)).result(TIMEOUT) == ([], ["a"])
    worker.resume()
    assert worker.call(lambda engine: None).result(TIMEOUT) is None
    # One iteration returns the abort's final output, which has no reader: the request's sink hears nothing.
    assert worker.num_iterations == 1 and sink.items == []


def test_a_new_request_that_reuses_an_aborted_id_gets_only_its_own_outputs(worker):
    worker.pause()
    old, new = Sink(), Sink()
    worker.submit("dup", tokens(5), 0.0, old)
    worker.abort("dup")  # its "abort" output comes out of the next step, after the new request is added
    worker.submit("dup", tokens(2), 0.0, new)
    worker.resume()
    assert [(o.finished, o.finish_reason) for o in new.wait()] == [(False, None), (True, "length")]
    assert old.items == []


def test_a_failed_iteration_fails_every_request_and_the_worker_goes_on(worker):
    worker.pause()
    worker.call(lambda engine: setattr(engine, "fail_next_step", True)).result(TIMEOUT)
    a, b = Sink(), Sink()
    worker.submit("a", tokens(3), 0.0, a)
    worker.submit("b", tokens(3), 0.0, b)
    worker.resume()
    for sink in (a, b):
        (err,) = sink.wait()
        assert isinstance(err, EngineError) and "injected failure" in str(err)
    assert sorted(worker.engine.aborted) == ["a", "b"] and worker.alive
    again = Sink()
    worker.submit("c", tokens(2), 0.0, again)
    assert [o.finished for o in again.wait()] == [False, True]


def test_stop_fails_what_is_left_and_ends_the_thread(worker):
    worker.pause()
    sink = Sink()
    worker.submit("a", tokens(4), 0.0, sink)
    worker.stop()
    (err,) = sink.wait()
    assert isinstance(err, EngineError) and "stopped" in str(err)
    assert not worker.alive and worker.engine.aborted == ["a"]


def test_the_iteration_log_stays_bounded(worker, monkeypatch):
    monkeypatch.setattr(engine_worker, "_MAX_ITERATION_LOG", 5)
    monkeypatch.setattr(engine_worker, "_KEEP_ITERATION_LOG", 2)
    sink = Sink()
    worker.submit("a", tokens(6), 0.0, sink)
    sink.wait()
    assert worker.call(lambda engine: len(engine.iteration_log)).result(TIMEOUT) == 2  # 6 steps: trimmed at the 6th


def test_the_idle_thread_blocks_on_its_queue(worker):
    sink = Sink()
    worker.submit("a", tokens(2), 0.0, sink)
    sink.wait()
    assert_parks_when_idle(worker)
