"""`benchmarks.bubble_demo`: the seeded workload, the replay loop (arrivals on the wall clock,
greedy requests added in order), and the report's table, with a fake engine in place of a pipelined one (a real
pp=2 run of the CLI takes about half a minute on a small CPU host)."""

from __future__ import annotations

import time

import pytest

from benchmarks import bubble_demo
from sarathi_jax.scheduler import SchedulerConfig
from sarathi_jax.sim.simulator import SimulatedEngine


def test_make_requests_is_seeded_and_within_the_ranges():
    a = bubble_demo.make_requests(20, 10.0, (4, 8), (2, 5), seed=1)
    assert a == bubble_demo.make_requests(20, 10.0, (4, 8), (2, 5), seed=1)
    assert a != bubble_demo.make_requests(20, 10.0, (4, 8), (2, 5), seed=2)
    arrivals = [t for t, _, _ in a]
    assert arrivals == sorted(arrivals) and arrivals[0] > 0  # Poisson: cumulative exponential gaps
    assert all(4 <= len(p) <= 8 and all(3 <= tok < 1000 for tok in p) for _, p, _ in a)
    assert all(2 <= m <= 5 and isinstance(m, int) for _, _, m in a)
    at_once = bubble_demo.make_requests(5, 0.0, (4, 4), (3, 3), seed=0)
    assert [t for t, _, _ in at_once] == [0.0] * 5 and all(len(p) == 4 and m == 3 for _, p, m in at_once)


class FakeEngine(SimulatedEngine):
    """The simulator (the real engine core, scheduler and block manager; synchronous, a token budget that holds
    every request each step) standing in for a pipelined LLMEngine: it records the config it was built with, the
    requests it was given, its steps and resets, and reports a fixed pipeline timeline (it has no pipeline)."""

    def __init__(self, config=None, warmup=False) -> None:
        super().__init__(SchedulerConfig(policy="sarathi", token_budget=4096, max_num_seqs=16, max_model_len=512),
                         num_blocks=256, block_size=16)
        self.config, self.warmup = config, warmup
        self.added: list[tuple[float, str, list[int], object]] = []
        self.resets = 0
        self.steps = 0
        self.start = time.monotonic()

    def reset_pipeline_stats(self) -> None:
        self.resets += 1

    def add_request(self, request_id, prompt, params=None, arrival_time=None, priority=0) -> None:
        self.added.append((time.monotonic() - self.start, request_id, prompt, params))
        super().add_request(request_id, prompt, params, arrival_time)

    def step(self):
        self.steps += 1
        return super().step()

    def pipeline_stats(self) -> dict:
        return {"bubble_fraction": 0.25, "num_microbatches": 4, "max_in_flight": 2, "max_overlap": 2,
                "stage_busy_s": [0.5, 0.75], "wall_s": 1.0}


def test_run_adds_requests_at_their_arrival_times_and_steps_until_done():
    engine = FakeEngine()
    requests = [(0.0, [5, 6], 2), (0.0, [7], 1), (0.3, [8, 9, 10], 3)]
    elapsed = bubble_demo.run(engine, requests)
    assert engine.resets == 1 and not engine.has_unfinished_requests()
    assert [r[1] for r in engine.added] == ["r0", "r1", "r2"]
    assert [r[2] for r in engine.added] == [[5, 6], [7], [8, 9, 10]]
    assert engine.added[2][0] >= 0.3  # not before its arrival
    params = engine.added[0][3]
    assert params.temperature == 0.0 and params.ignore_eos and params.max_tokens == 2
    # r0 and r1 prefill together (r1 done), r0 decodes its second token; r2 arrives after they finished.
    assert engine.steps == 2 + 3 and [r.num_seqs for r in engine.iteration_log] == [2, 1, 1, 1, 1]
    assert elapsed >= 0.3


def test_main_builds_one_engine_per_policy_and_prints_the_table(monkeypatch, capsys):
    built = []

    def make(config, warmup):
        built.append(FakeEngine(config, warmup))
        return built[-1]

    monkeypatch.setattr(bubble_demo, "LLMEngine", make)
    bubble_demo.main(["--pp", "2", "--tp", "2", "--policies", "sarathi", "vllm", "--num-requests", "3", "--qps", "0",
                      "--token-budget", "32", "--max-model-len", "128"])
    assert [e.config.scheduler for e in built] == ["sarathi", "vllm"]
    for e in built:
        c = e.config
        assert e.warmup and (c.pipeline_parallel_size, c.tensor_parallel_size) == (2, 2)
        assert (c.token_budget, c.max_model_len, c.max_num_batched_tokens) == (32, 128, 128)
        assert [r[1] for r in e.added] == ["r0", "r1", "r2"]
    assert built[0].added[0][2] == built[1].added[0][2]  # the same workload for every policy
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("model=tiny-llama tp=2 pp=2 requests=3 qps=0.0")
    assert lines[1].split()[:2] == ["policy", "bubble"]
    # tokens: every prompt token once and max_tokens - 1 decodes per request (its first token comes with the prompt)
    workload = bubble_demo.make_requests(3, 0.0, (32, 192), (8, 32), seed=0)
    tokens = sum(len(prompt) + max_tokens - 1 for _, prompt, max_tokens in workload)
    for line, policy, e in zip(lines[2:], ["sarathi", "vllm"], built):
        assert sum(r.num_prefill_tokens + r.num_decode_tokens for r in e.iteration_log) == tokens
        assert line.split() == [policy, "0.250", "4", f"{tokens / 4:.1f}", "2", "2", "0.50", "0.75", "1.00"]
    assert len(lines) == 4


def test_main_rejects_bad_arguments():
    with pytest.raises(SystemExit):
        bubble_demo.main(["--prompt-len", "8"])  # needs two numbers
    with pytest.raises(SystemExit):
        bubble_demo.main(["--pp", "two"])
