"""`BucketCostModel`: a simulator cost model calibrated on the real model runner.

`sarathi_jax.sim.simulator.CostModel` is the simulator's default, a hand-set linear model; this one is fitted
to iteration times measured on this machine (`python -m sarathi_jax.bench.step_cost --mode calibrate
--cost-model-out PATH`) and pads batches to the engine's token buckets, as the runner does. Load it with
`BucketCostModel.load(PATH)` and pass it as `SimulatedEngine(cost_model=...)`, or use
`python -m sarathi_jax.bench --simulate --cost-model PATH`. No JAX.

A batch is priced as a list of `Chunk`s; the bench's roofline (`sarathi_jax.bench.roofline`) counts the FLOPs
and bytes of the same `Chunk`s, above this module.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from sarathi_jax.config.sizing import bucket_for


@dataclass(frozen=True)
class Chunk:
    """One sequence's part of a batch: `num_new_tokens` query tokens after `start` tokens already cached."""

    start: int
    num_new_tokens: int
    seq_len: int | None = None  # the sequence's length (prompt); None: the chunk ends it

    @property
    def end(self) -> int:
        return self.start + self.num_new_tokens

    @property
    def sample(self) -> bool:
        """The chunk reaches the sequence's end, so the step samples a token for it (decodes, last chunks)."""
        return self.seq_len is None or self.end >= self.seq_len

    @property
    def length(self) -> int:
        return self.end if self.seq_len is None else max(self.seq_len, self.end)


def attention_pairs(chunks: Sequence[Chunk]) -> int:
    """Sum over query rows of the keys each row sees: row j of a chunk sees start + j + 1 positions."""
    return sum(c.num_new_tokens * c.start + c.num_new_tokens * (c.num_new_tokens + 1) // 2 for c in chunks)


def attention_row_group(default: int = 32) -> int:
    """Rows per group of the XLA attention's per-row (decode) path."""
    try:
        from pallas_kernels import ragged_paged_attention_xla as rpa

        return int(getattr(rpa, "_ROW_GROUP", default))
    except Exception:  # noqa: BLE001 - the kernels package is optional for the simulator
        return default


class BucketCostModel:
    """A simulator cost model (`SimulatedEngine(cost_model=...)`) calibrated on the real runner:

        iteration time = base[bucket(tokens)] + decode_kv_s x (decode row-tokens)
                         + prefill_pair_s x (visible (query, key) pairs of the prompt chunks)

    `base` is per padded bucket, since the runner pays for the whole bucket (linear layers over every padded
    row, logits and sampling over max_num_seqs rows). The attention terms follow how the XLA attention
    (`pallas_kernels.ragged_paged_attention_xla`) spends its time: prompt chunks by query tiles over their
    real KV pages (about the number of visible pairs), decodes on the per-row path, sorted by KV length
    (longest first) in groups of g = min(`row_group`, bucket) rows whose KV loop runs to the group's longest
    row for all g rows. So a decode group costs g x its longest context whether it holds 1 decode or g: the
    decode row-tokens are g x (the sum over groups of the longest KV length in each). Buckets that were not measured are interpolated linearly in the token
    count (and extrapolated from the two largest). `buckets`: the engine's bucket list, so that the
    simulator pads like the engine it stands for (None: pad to the measured buckets).
    """

    def __init__(self, base_s: dict, decode_kv_s: float, prefill_pair_s: float, *,
                 buckets: Sequence[int] | None = None, row_group: int = 32, source: dict | None = None) -> None:
        self.base_s = {int(k): float(v) for k, v in base_s.items()}
        if not self.base_s:
            raise ValueError("base_s: no buckets")
        self.decode_kv_s = float(decode_kv_s)
        self.prefill_pair_s = float(prefill_pair_s)
        self.buckets = tuple(sorted(int(b) for b in buckets)) if buckets else tuple(sorted(self.base_s))
        self.row_group = int(row_group)
        self.source = dict(source or {})

    def with_buckets(self, buckets: Sequence[int]) -> "BucketCostModel":
        return BucketCostModel(self.base_s, self.decode_kv_s, self.prefill_pair_s, buckets=buckets,
                               row_group=self.row_group, source=self.source)

    def padded(self, num_tokens: int) -> int:
        bucket = bucket_for(self.buckets, num_tokens)
        return num_tokens if bucket is None else bucket  # past the largest bucket (the engine refuses): as is

    def base(self, bucket: int) -> float:
        xs = sorted(self.base_s)
        if bucket in self.base_s:
            return self.base_s[bucket]
        if bucket < xs[0]:
            return self.base_s[xs[0]]
        if len(xs) == 1:
            return self.base_s[xs[0]] * bucket / xs[0]
        lo = max((x for x in xs if x < bucket), default=xs[0])
        hi = min((x for x in xs if x > bucket), default=None)
        if hi is None:
            lo, hi = xs[-2], xs[-1]
        y0, y1 = self.base_s[lo], self.base_s[hi]
        return y0 + (y1 - y0) * (bucket - lo) / (hi - lo)

    def features(self, chunks: Sequence[Chunk]) -> tuple[int, int, int]:
        """(padded bucket, decode row-tokens, prefill visible pairs). Decode row-tokens: the decodes sorted
        by KV length in groups of g = min(row_group, bucket) rows (the kernel's group size), each group
        counted as g rows x its longest KV length."""
        tokens = sum(c.num_new_tokens for c in chunks)
        bucket = self.padded(tokens)
        g = max(1, min(self.row_group, bucket))
        is_dec = [c.num_new_tokens == 1 and c.start > 0 and c.sample for c in chunks]
        kv = sorted((c.start + 1 for c, d in zip(chunks, is_dec) if d), reverse=True)
        dec = g * sum(kv[i] for i in range(0, len(kv), g))
        pre = attention_pairs([c for c, d in zip(chunks, is_dec) if not d])
        return bucket, dec, pre

    def chunks_time(self, chunks: Sequence[Chunk]) -> float:
        bucket, dec, pre = self.features(chunks)
        return self.base(bucket) + self.decode_kv_s * dec + self.prefill_pair_s * pre

    def mixed_batch_time(self, decode_positions: Sequence[int], prefill_start: int, prefill_tokens: int) -> float:
        """Seconds for decodes at `decode_positions` and one prefill chunk (the token budgets' predictor,
        `scheduler.budget.IterationPredictor`)."""
        chunks = [Chunk(p, 1) for p in decode_positions]
        if prefill_tokens > 0:
            chunks.append(Chunk(prefill_start, prefill_tokens, prefill_start + prefill_tokens + 1))
        return self.chunks_time(chunks)

    def iteration_time(self, output: Any) -> float:
        """Seconds for a `SchedulerOutput` (the simulator's cost-model interface)."""
        chunks = [Chunk(c.start_position, c.num_new_tokens, None if c.needs_sample else c.seq.num_tokens)
                  for c in output.chunks]
        return self.chunks_time(chunks)

    @classmethod
    def fit(cls, batches: Sequence[Sequence[Chunk]], times: Sequence[float], buckets: Sequence[int],
            row_group: int | None = None, source: dict | None = None) -> "BucketCostModel":
        """Least squares over per-bucket intercepts and the two attention slopes (slopes kept >= 0)."""
        row_group = row_group or attention_row_group()
        shape = cls({1: 0.0}, 0.0, 0.0, buckets=buckets, row_group=row_group)
        feats = [shape.features(chunks) for chunks in batches]
        used = sorted({f[0] for f in feats})
        cols = {b: i for i, b in enumerate(used)}
        k = len(used)
        a = np.zeros((len(batches), k + 2))
        for row, (b, dec, pre) in enumerate(feats):
            a[row, cols[b]] = 1.0
            a[row, k] = dec
            a[row, k + 1] = pre
        y = np.asarray(times, dtype=np.float64)
        active = list(range(k + 2))
        coef = np.zeros(k + 2)
        for _ in range(3):  # drop a negative slope and refit (a two-variable NNLS)
            sol, *_ = np.linalg.lstsq(a[:, active], y, rcond=None)
            coef[:] = 0.0
            coef[active] = sol
            neg = [j for j in (k, k + 1) if j in active and coef[j] < 0]
            if not neg:
                break
            active = [j for j in active if j not in neg]
        base = {b: max(float(coef[cols[b]]), 0.0) for b in used}
        return cls(base, coef[k], coef[k + 1], buckets=buckets, row_group=row_group, source=source)

    def to_dict(self) -> dict:
        return {"type": "bucket", "base_s": {str(b): v for b, v in sorted(self.base_s.items())},
                "decode_kv_s": self.decode_kv_s, "prefill_pair_s": self.prefill_pair_s,
                "row_group": self.row_group, "buckets": list(self.buckets), "source": self.source}

    @classmethod
    def from_dict(cls, d: dict) -> "BucketCostModel":
        if "cost_model" in d:  # a whole step_cost JSON document
            d = d["cost_model"]
        return cls(d["base_s"], d["decode_kv_s"], d["prefill_pair_s"], buckets=d.get("buckets"),
                   row_group=d.get("row_group", 32), source=d.get("source"))

    @classmethod
    def load(cls, path: str) -> "BucketCostModel":
        with open(path) as f:
            return cls.from_dict(json.load(f))
