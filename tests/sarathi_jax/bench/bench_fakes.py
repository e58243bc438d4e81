"""The bench tests' engine: the simulator (the real engine core, scheduler and block manager on a virtual
clock) with a step cost that grows with load in a way the tests can compute by hand.

`sim_engine()` is a synchronous `SimulatedEngine` whose scheduler runs every admitted request each step: a
new request gets its whole prompt (and samples its first token) in its first step, the others one decode
token each (sarathi with a token budget no batch reaches, and a KV cache no run fills). At most
`max_num_seqs` run at once; the rest wait (FCFS). A step lasts `base + per_seq * num_seqs +
per_prefill_token * prefill_tokens` virtual seconds (`LoadCostModel`). The clock starts at 100 s, not 0, so
that tests catch missing rebasing.
"""

from __future__ import annotations

from dataclasses import dataclass

from sarathi_jax.scheduler import SchedulerConfig, SchedulerOutput
from sarathi_jax.sim.simulator import SimulatedEngine

CLOCK_START = 100.0
BLOCK_SIZE = 16
NUM_BLOCKS = 1 << 16  # a million tokens of KV cache: never full in these tests
TOKEN_BUDGET = 1 << 20  # never reached: prompts are never chunked and nothing waits for room in a batch


@dataclass(frozen=True)
class LoadCostModel:
    """Iteration time = base + per_seq * sequences in the batch + per_prefill_token * prefill tokens."""

    base: float = 0.01
    per_seq: float = 0.0001
    per_prefill_token: float = 0.0

    def iteration_time(self, output: SchedulerOutput) -> float:
        return self.base + self.per_seq * len(output.chunks) + self.per_prefill_token * output.num_prefill_tokens

    def padded(self, num_tokens: int) -> int:
        return num_tokens


def sim_engine(*, base: float = 0.01, per_seq: float = 0.0001, per_prefill_token: float = 0.0,
               max_num_seqs: int = 10_000, max_model_len: int = 4096) -> SimulatedEngine:
    """A `SimulatedEngine` that runs every admitted request each step, on `LoadCostModel`'s clock (from 100 s).
    A request whose prompt + max_tokens exceeds max_model_len is refused (add_request raises AdmissionError)."""
    config = SchedulerConfig(policy="sarathi", token_budget=max(TOKEN_BUDGET, max_num_seqs), max_num_seqs=max_num_seqs,
                             max_model_len=max_model_len, watermark=0.0)
    engine = SimulatedEngine(config, NUM_BLOCKS, BLOCK_SIZE, LoadCostModel(base, per_seq, per_prefill_token))
    engine.clock.wait_until(CLOCK_START)
    return engine
