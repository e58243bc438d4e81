"""`sarathi_jax.precompile`: how many threads compile at warm-up, and when building ahead of time is skipped.
(Building itself, compiled and loaded from the executable cache, is checked end to end by
`test_compile_cache.test_second_engine_in_a_fresh_process_hits_the_cache`.)"""

from __future__ import annotations

import os

import pytest

from sarathi_jax.precompile import COMPILE_THREADS_ENV, build_executables, compile_threads


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


def test_one_thread_without_a_cache_builds_nothing(monkeypatch):
    def no_inputs(bucket):
        raise AssertionError("nothing is built with one thread and no executable cache")

    loaded = []
    build_executables([], [16, 32], no_inputs, no_tokens=None, max_num_seqs=4, max_blocks_per_seq=4, sampler=None,
                      cache=None, threads=1, on_loaded=lambda entry, exe: loaded.append(entry))
    monkeypatch.setenv(COMPILE_THREADS_ENV, "1")  # the default thread count, here from the environment
    build_executables([], [16, 32], no_inputs, no_tokens=None, max_num_seqs=4, max_blocks_per_seq=4, sampler=None,
                      cache=None, threads=None, on_loaded=lambda entry, exe: loaded.append(entry))
    assert loaded == []
