"""`TensorParallelCost`: a simulator cost model for an instance of `tp` devices, from a single-device one (for
each side of a disaggregated engine, and a colocated engine at equal devices, priced from the same measured
single-device step costs). No JAX.

The model, stated (not measured on several devices here: this machine has one CPU device):

    iteration time on tp devices = serial_fraction x t1 + (1 - serial_fraction) x t1 / tp
                                   + 2 x num_layers x all-reduce([padded tokens, hidden] in the model's dtype)

t1 is the single-device cost model's time for the same batch. Megatron-style tensor parallelism splits every
layer's heads and MLP columns, so each device reads 1/tp of the weights and of the KV cache and does 1/tp of
the FLOPs; `serial_fraction` is the part of an iteration that does not split (the host's scheduling, launches,
sampling). 0 is the ideal split: an upper bound on what tp devices gain, and it makes a colocated engine of N
devices exactly as fast as one device N times faster. The all-reduces (after attention and after the MLP, as
Megatron-LM) are ring all-reduces over `link`: 2 (tp - 1) / tp x bytes / bandwidth + the link's latency.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from sarathi_jax.config.disaggregation import KVLink
from sarathi_jax.sim.simulator import IterationCost


class TensorParallelCost:
    """`base` (a single-device cost model) scaled to `tp` devices joined by `link` (module docstring)."""

    def __init__(self, base: IterationCost, tp: int, link: KVLink, *, num_layers: int, hidden_size: int,
                 bytes_per_value: int, serial_fraction: float = 0.0) -> None:
        if not isinstance(tp, int) or tp < 1:
            raise ValueError(f"tp must be a positive integer, got {tp!r}")
        if not 0.0 <= serial_fraction <= 1.0:
            raise ValueError(f"serial_fraction must be in [0, 1], got {serial_fraction!r}")
        self.base, self.tp, self.link = base, tp, link
        self.num_layers, self.hidden_size, self.bytes_per_value = num_layers, hidden_size, bytes_per_value
        self.serial_fraction = serial_fraction

    def padded(self, num_tokens: int) -> int:
        return self.base.padded(num_tokens)

    def allreduce_time(self, padded_tokens: int) -> float:
        """Seconds of one iteration's all-reduces (none on one device)."""
        if self.tp == 1:
            return 0.0
        num_bytes = padded_tokens * self.hidden_size * self.bytes_per_value
        ring = 2 * (self.tp - 1) / self.tp * num_bytes / self.link.bandwidth + self.link.latency_s
        return 2 * self.num_layers * ring

    def _scaled(self, t1: float, tokens: int) -> float:
        f = self.serial_fraction
        return f * t1 + (1.0 - f) * t1 / self.tp + self.allreduce_time(self.padded(tokens))

    def iteration_time(self, output: Any) -> float:
        """Seconds for a `SchedulerOutput` on this instance."""
        return self._scaled(self.base.iteration_time(output), sum(c.num_new_tokens for c in output.chunks))

    def mixed_batch_time(self, decode_positions: Sequence[int], prefill_start: int, prefill_tokens: int) -> float:
        """The token budgets' predictor (`scheduler.budget.IterationPredictor`), scaled the same way."""
        t1 = self.base.mixed_batch_time(decode_positions, prefill_start, prefill_tokens)  # type: ignore[attr-defined]
        return self._scaled(t1, len(decode_positions) + prefill_tokens)
