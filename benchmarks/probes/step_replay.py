"""Capturing the steps an engine dispatches and replaying them on the live engine, for their device time.

`StepRecorder` observes the runner's steps (`ModelRunner.observe_steps`) to keep the packed int32 inputs, the
sampler variant and the chunk layout of the last K dispatched steps. `ShadowReplayer.replay` then runs M of
them back to back through `ModelRunner.dispatch_outside_loop`, one wait at the end. A plain replay would write
stale K/V into live sequences' slots, so the replays are shadowed: the copies' K/V writes go to scratch blocks
reserved from the engine's block manager (the attention still reads the real block tables, so the work is the
same); the runner keeps the next real step's pending tokens reading the last real step's samples. Used by
`python -m benchmarks.probes.loop_cost`.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from sarathi_jax.bench.roofline import Chunk

if TYPE_CHECKING:
    from sarathi_jax.engine.llm_engine import LLMEngine
    from sarathi_jax.runner.model_runner import ModelRunner
    from sarathi_jax.runner.sample.sampler import SamplerVariant
    from sarathi_jax.scheduler import ScheduledChunk
    from sarathi_jax.runner.step_inputs import PackedStep


@dataclass(frozen=True)
class CapturedStep:
    """One dispatched step, enough to replay it (`packed`, `variant`) and to count its work (`chunks`)."""

    packed: PackedStep  # host arrays
    variant: SamplerVariant
    chunks: tuple[Chunk, ...]

    @property
    def num_tokens(self) -> int:
        return sum(c.num_new_tokens for c in self.chunks)

    @property
    def num_decodes(self) -> int:
        return sum(1 for c in self.chunks if c.num_new_tokens == 1 and c.start > 0 and c.sample)

    @property
    def prefill_tokens(self) -> int:
        return self.num_tokens - self.num_decodes


class StepRecorder:
    """Keeps the last `keep` steps the runner dispatches (`ModelRunner.observe_steps`)."""

    def __init__(self, runner: ModelRunner, keep: int) -> None:
        self.runner = runner
        self.steps: deque[CapturedStep] = deque(maxlen=keep)
        runner.observe_steps(self._record)

    def _record(self, chunks: Sequence[ScheduledChunk], packed: PackedStep, variant: SamplerVariant) -> None:
        layout = tuple(Chunk(c.start_position, c.num_new_tokens, None if c.needs_sample else c.seq.num_tokens)
                       for c in chunks)
        self.steps.append(CapturedStep(packed, variant, layout))

    def snapshot(self) -> list[CapturedStep]:
        return list(self.steps)


class ShadowReplayer:
    """Replays captured steps on a live engine without disturbing it: each replayed step's K/V writes go to
    scratch KV blocks reserved from the engine's block manager (the reads, the attention over the real
    block tables, are unchanged), and the runner's previous sampled tokens, which a pending input token
    reads, are restored afterwards. So the work per step is the captured step's, and the engine can go on."""

    def __init__(self, engine: LLMEngine, num_tokens: int) -> None:
        from sarathi_jax.request.sampling_params import SamplingParams
        from sarathi_jax.request.sequence import Sequence as Seq

        self.runner = engine.runner
        bm = engine.block_manager
        self._scratch = Seq("loop-cost-scratch", [0] * num_tokens, SamplingParams(max_tokens=1), 0.0)
        if not bm.can_allocate(bm.blocks_needed(self._scratch, num_tokens), use_watermark=False):
            raise RuntimeError("no KV blocks left for the replay scratch area")
        bm.allocate(self._scratch, num_tokens)  # never freed: the scratch blocks live as long as the engine
        bs = bm.block_size
        self.slots = np.asarray([b * bs + j for b in self._scratch.block_table for j in range(bs)], np.int32)

    def shadow(self, packed: PackedStep) -> PackedStep:
        """A copy of `packed` (a `PackedStep`) whose real tokens write their K/V to distinct scratch slots."""
        from sarathi_jax.runner.step_inputs import BatchLayout

        r = self.runner
        batch = packed.batch.copy()
        slot_mapping = BatchLayout.of_packed(batch.size, r.max_num_seqs, r.max_blocks_per_seq).host_views(batch)[
            "slot_mapping"]
        real = slot_mapping >= 0
        slot_mapping[real] = self.slots[: int(real.sum())]
        return packed._replace(batch=batch)

    def replay(self, steps: Sequence[CapturedStep], count: int) -> float:
        """Seconds for `count` back-to-back dispatches cycling over `steps`, one wait at the end. The work
        already queued is waited for first, so it is not counted."""
        import jax

        shadows = [(self.shadow(s.packed), s.variant) for s in steps]
        jax.block_until_ready(self.runner.kv_caches)
        with self.runner.dispatch_outside_loop() as dispatch:
            start = time.perf_counter()
            pending = None
            for i in range(count):
                packed, variant = shadows[i % len(shadows)]
                pending = dispatch(packed, variant)
            assert pending is not None
            pending.result()
            jax.block_until_ready(self.runner.kv_caches)
            elapsed = time.perf_counter() - start
        return elapsed
