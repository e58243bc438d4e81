"""`sarathi_jax.runner.precompile`: how many threads compile at warm-up, the background build (order, cancelling,
errors) and the table of what is ready. (Building itself, compiled and loaded from the executable cache, is
checked end to end by `test_compile_cache.test_second_engine_in_a_fresh_process_hits_the_cache`, and serving
while the background build runs by `test_engine.test_background_compile_gives_the_same_tokens_...`.)"""

from __future__ import annotations

import functools
import gc
import os
import threading

import pytest

from sarathi_jax.runner.precompile import COMPILE_THREADS_ENV, BackgroundBuild, ExecutableTable, compile_threads
from sarathi_jax.runner.sample.sampler import FULL_VARIANT, SAMPLER_VARIANTS


def test_compile_threads_env_wins_and_is_at_least_one(monkeypatch):
    monkeypatch.setenv(COMPILE_THREADS_ENV, "3")
    assert compile_threads() == 3
    monkeypatch.setenv(COMPILE_THREADS_ENV, "0")
    assert compile_threads() == 1


@pytest.mark.parametrize("cores, threads", [(1, 1), (2, 1), (4, 1), (6, 3), (16, 8), (64, 8)])
def test_compile_threads_default_follows_this_process_cores(monkeypatch, cores, threads):
    monkeypatch.delenv(COMPILE_THREADS_ENV, raising=False)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(cores)), raising=False)
    assert compile_threads() == threads


class _Owner:
    """Something a `BackgroundBuild` belongs to (a runner, in the engine)."""


def _gated_builds(n: int, ran: list[int], gate: threading.Event | None = None) -> list:
    def build(i: int) -> None:
        if gate is not None:
            assert gate.wait(timeout=30)
        ran.append(i)

    return [functools.partial(build, i) for i in range(n)]


def test_background_build_runs_every_build_in_order():
    ran: list[int] = []
    owner = _Owner()
    background = BackgroundBuild(_gated_builds(5, ran), threads=1, owner=owner)
    assert background.num_builds == 5 and not background.done and background.seconds is None
    background.start()
    assert background.wait(timeout=30) and background.done
    assert ran == [0, 1, 2, 3, 4] and background.seconds >= 0


def test_background_build_on_several_threads_runs_each_build_once():
    ran: list[int] = []
    owner = _Owner()
    assert BackgroundBuild(_gated_builds(20, ran), threads=3, owner=owner).start().wait(timeout=30)
    assert sorted(ran) == list(range(20))


def test_cancel_stops_between_builds():
    ran: list[int] = []
    gate = threading.Event()
    owner = _Owner()
    background = BackgroundBuild(_gated_builds(5, ran, gate), threads=1, owner=owner).start()
    background.cancel()  # the first build is waiting on the gate: it finishes, no other starts
    gate.set()
    assert background.wait(timeout=30)
    assert ran in ([], [0])


def test_collecting_the_owner_cancels_the_build():
    ran: list[int] = []
    gate = threading.Event()
    owner = _Owner()
    background = BackgroundBuild(_gated_builds(5, ran, gate), threads=1, owner=owner).start()
    del owner
    gc.collect()
    gate.set()
    assert background.wait(timeout=30)
    assert ran in ([], [0])


def test_a_failed_build_is_reraised_by_wait_and_the_others_still_run():
    ran: list[int] = []
    builds = _gated_builds(3, ran)

    def fail() -> None:
        raise ValueError("no such executable")

    owner = _Owner()
    background = BackgroundBuild([builds[0], fail, *builds[1:]], threads=1, owner=owner).start()
    with pytest.raises(RuntimeError, match="in the background failed") as info:
        background.wait(timeout=30)
    assert isinstance(info.value.__cause__, ValueError)
    assert background.done and ran == [0, 1, 2]


def test_no_builds_is_done_at_once():
    owner = _Owner()
    assert BackgroundBuild([], threads=2, owner=owner).start().wait(timeout=0)


def test_executable_table_tracks_what_is_ready():
    table = ExecutableTable((16, 32, 64), num_stages=2, ladder=(4, 8, 16))
    assert table.buckets == (16, 32, 64) and table.variants is None  # before warm-up: everything, on demand
    assert [table.bucket_of[n] for n in (0, 16, 17, 40, 64)] == [16, 16, 32, 64, 64]
    table.only([64], [(FULL_VARIANT, 8)])
    greedy = SAMPLER_VARIANTS[0]
    assert table.buckets == (64,) and table.variants == {(FULL_VARIANT, 8)}
    assert [table.bucket_of[n] for n in (0, 16, 17, 64)] == [64] * 4  # what dispatch reads follows
    table.bucket_ready(16)
    assert table.buckets == (16, 64) and [table.bucket_of[n] for n in (16, 17)] == [16, 64]
    step, sampler = object(), object()
    table.add((1, 40), step, loaded=True)  # a model step loaded from the executable cache counts as compiled
    table.add((0, 40), step, loaded=False)  # a compiled one was counted when it was traced
    table.traced(0)
    table.add((greedy, 4), sampler, loaded=False)  # a sampler: (variant, rows R)
    assert table.variants == {(FULL_VARIANT, 8), (greedy, 4)} and table.executables[(greedy, 4)] is sampler
    assert table.stage_traces == [1, 1] and table.sampler_builds == 1


def test_a_step_samples_the_fewest_rows_built_that_hold_its_sequences():
    # Row ladder (4, 8, 16); a 64-token bucket samples up to 16 rows. The step's variant on the fewest rows
    # that hold its sequences, else the general one there, else more rows, up to its bucket's. What dispatch
    # reads (`samplers`) is that choice, resolved again after each change.
    table, greedy = ExecutableTable((64,), num_stages=1, ladder=(4, 8, 16)), SAMPLER_VARIANTS[0]

    def choice(variant, rows, bucket_rows):
        picked = table.sampler_for(variant, rows, bucket_rows)
        assert table.samplers[variant, rows, bucket_rows] == picked
        return picked

    assert choice(greedy, 4, 16) == (greedy, 4)  # not warmed up: whatever is asked for
    table.only([64], [(FULL_VARIANT, 16), (greedy, 16)])
    assert choice(greedy, 4, 16) == (greedy, 16)
    table.add((FULL_VARIANT, 8), object(), loaded=False)
    assert choice(greedy, 4, 16) == (FULL_VARIANT, 8)
    assert choice(greedy, 4, 8) == (FULL_VARIANT, 8)
    table.add((greedy, 4), object(), loaded=False)
    assert choice(greedy, 4, 16) == (greedy, 4)
    assert choice(SAMPLER_VARIANTS[1], 4, 16) == (FULL_VARIANT, 8)
    assert choice(SAMPLER_VARIANTS[1], 16, 16) == (FULL_VARIANT, 16)
