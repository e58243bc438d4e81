"""`python -m sarathi_jax.bench.step_cost`: the model runner's iteration time for chosen batch compositions,
beside this machine's compute and memory floors.

It builds the real engine (`LLMEngine(EngineConfig(...), warmup=False)`), makes fake sequences whose KV blocks
come from the engine's own `block_manager`, and drives `engine.runner.execute(chunks, sampling_rows)` with
synthetic `ScheduledChunk`s: the same jitted step, bucket padding and host-side batch building as serving
(the scheduler and the engine's bookkeeping are not timed). Every composition is run `--warmup` times untimed
(the first compiles its bucket), then the timed repeats go round-robin over all compositions of the run, so
that load from other processes falls on all of them alike; the median is reported.

Machine rates: a large jitted matmul in the model's dtype (FLOP/s) and a large array reduction and copy
(bytes/s, the faster of the two), each the best of `--repeats` runs, measured before and after the timed
rounds with the better kept (on a shared machine the best run is the least disturbed one, so the floors stay
lower bounds; the batch times are medians). Per batch:

* FLOPs = 2 x (per-layer matmul parameters) x tokens + 2 x (LM head parameters) x sampled rows
          + attention (4 x layers x query heads x head_dim x visible (query, key) pairs).
  This is the paper's "2 x params x tokens" counted for what the runner really multiplies: the embedding is a
  lookup (no FLOPs) and logits are computed only for the rows that sample.
* minimal bytes = every weight read once + the embedding rows gathered + the KV cache read (the context
  before this step's tokens) + the new tokens' K/V written.
* floors: FLOPs / matmul rate and bytes / bandwidth; `x floor` = time / max(floors).

Modes (comma-separate several to measure them side by side in one run):
  decode    --batch-sizes 1,8,32 --context 512      decode batches (per-token cost = time / batch size)
  prefill   --tokens 16,64,256,512                  one fresh prefill of N tokens (per-token = time / N)
  hybrid    --decodes 32 --context 512 --chunks 64,128,256,512 --whole-prompt 1024
            the decode batch alone, with a prompt chunk of each size added, and with a whole prompt added
  chunking  --prompt-len 1024 --chunks 64,128,256,512,1024 --tile-probe 256
            total time to prefill one prompt in chunks of each size vs unchunked, plus chunk N vs N+1
  calibrate --token-budget 1024 --cost-model-out PATH
            fill every bucket several ways and fit `BucketCostModel`, a simulator cost model for
            `python -m sarathi_jax.bench --simulate --cost-model PATH`
The runner pads every batch to a bucket (powers of two from 16, then the token budget), so e.g. a 257-token
chunk costs the 512 bucket: that is this engine's bucketing, reported as such.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
from dataclasses import dataclass, field
from typing import Any, Sequence

import numpy as np

MODES = ("decode", "prefill", "hybrid", "chunking", "calibrate")
DEFAULT_MODEL = "tiny-llama"  # the bench's default model
DEFAULT_MAX_NUM_SEQS = 32  # the bench's defaults (sarathi_jax.bench.__main__)
DEFAULT_MAX_MODEL_LEN = 1024
DEFAULT_TOKEN_BUDGET = 128
_DTYPE_BYTES = {"float32": 4, "bfloat16": 2}


# ----------------------------------------------------------------------------------------------- work model


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


def decode_chunks(batch_size: int, context: int) -> list[Chunk]:
    return [Chunk(context, 1) for _ in range(batch_size)]


@dataclass(frozen=True)
class ModelShape:
    """What the FLOP and byte counts need to know about a model."""

    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    gated_mlp: bool = True  # SwiGLU (3 matrices) vs a plain 2-matrix MLP
    tied_embeddings: bool = False
    itemsize: int = 4

    @classmethod
    def from_model_config(cls, mc: Any, dtype: str = "float32") -> "ModelShape":
        return cls(
            hidden_size=mc.hidden_size,
            intermediate_size=mc.intermediate_size,
            num_layers=mc.num_hidden_layers,
            num_heads=mc.num_attention_heads,
            num_kv_heads=mc.num_key_value_heads,
            head_dim=mc.head_dim,
            vocab_size=mc.vocab_size,
            gated_mlp=getattr(mc, "hidden_act", "silu") == "silu",
            tied_embeddings=bool(mc.tie_word_embeddings),
            itemsize=_DTYPE_BYTES[dtype],
        )

    @property
    def layer_matmul_params(self) -> int:
        """Matmul weights every token goes through, all layers (q, k, v, o, MLP; norms and biases left out)."""
        h, qd, kvd = self.hidden_size, self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        attn = h * qd + 2 * h * kvd + qd * h
        mlp = (3 if self.gated_mlp else 2) * h * self.intermediate_size
        return self.num_layers * (attn + mlp)

    @property
    def head_params(self) -> int:
        return self.vocab_size * self.hidden_size

    @property
    def weight_bytes(self) -> int:
        """Every weight read once: layers, LM head, the norms (the embedding table too when it is untied it is
        only gathered, see `work`)."""
        norms = (2 * self.num_layers + 1) * self.hidden_size
        return (self.layer_matmul_params + self.head_params + norms) * self.itemsize

    @property
    def kv_bytes_per_token(self) -> int:
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * self.itemsize


@dataclass(frozen=True)
class Work:
    flops: float
    linear_flops: float
    head_flops: float
    attention_flops: float
    bytes: float
    weight_bytes: float
    kv_read_bytes: float
    kv_write_bytes: float
    num_tokens: int
    num_sampled: int
    attention_pairs: int  # visible (query, key) pairs, summed over sequences (one layer, one head)

    def to_dict(self) -> dict:
        return dict(self.__dict__)


def attention_pairs(chunks: Sequence[Chunk]) -> int:
    """Sum over query rows of the keys each row sees: row j of a chunk sees start + j + 1 positions."""
    return sum(c.num_new_tokens * c.start + c.num_new_tokens * (c.num_new_tokens + 1) // 2 for c in chunks)


def work(shape: ModelShape, chunks: Sequence[Chunk]) -> Work:
    """FLOPs and minimal bytes of one iteration over `chunks` (see the module docstring)."""
    tokens = sum(c.num_new_tokens for c in chunks)
    sampled = sum(1 for c in chunks if c.sample)
    pairs = attention_pairs(chunks)
    linear = 2.0 * shape.layer_matmul_params * tokens
    head = 2.0 * shape.head_params * sampled
    attn = 4.0 * shape.num_layers * shape.num_heads * shape.head_dim * pairs
    embed_bytes = 0 if shape.tied_embeddings else tokens * shape.hidden_size * shape.itemsize
    w_bytes = shape.weight_bytes + embed_bytes
    kv_read = sum(c.start for c in chunks) * shape.kv_bytes_per_token
    kv_write = tokens * shape.kv_bytes_per_token
    return Work(
        flops=linear + head + attn, linear_flops=linear, head_flops=head, attention_flops=attn,
        bytes=float(w_bytes + kv_read + kv_write), weight_bytes=float(w_bytes), kv_read_bytes=float(kv_read),
        kv_write_bytes=float(kv_write), num_tokens=tokens, num_sampled=sampled, attention_pairs=pairs,
    )


@dataclass(frozen=True)
class Rates:
    matmul_flops: float  # FLOP/s
    bandwidth: float  # bytes/s
    details: dict = field(default_factory=dict)


def floors(w: Work, rates: Rates) -> tuple[float, float]:
    """(compute floor, memory floor) in seconds."""
    return w.flops / rates.matmul_flops, w.bytes / rates.bandwidth


# ----------------------------------------------------------------------------------------------- machine rates


def _best_time(fn, repeats: int) -> float:
    """Fastest of `repeats` runs: the machine's rate with the least interference from other processes, so
    that the floors are lower bounds."""
    fn()  # compile / warm
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)


def measure_matmul_rate(n: int = 2048, dtype: str = "float32", repeats: int = 5) -> float:
    """FLOP/s of a jitted n x n x n matmul in `dtype` (best of `repeats`)."""
    import jax
    import jax.numpy as jnp

    k1, k2 = jax.random.split(jax.random.PRNGKey(0))
    a = jax.random.normal(k1, (n, n), jnp.float32).astype(dtype)
    b = jax.random.normal(k2, (n, n), jnp.float32).astype(dtype)
    f = jax.jit(lambda x, y: x @ y)
    t = _best_time(lambda: f(a, b).block_until_ready(), repeats)
    return 2.0 * n**3 / t


def measure_bandwidth(mbytes: int = 256, repeats: int = 5) -> dict:
    """Bytes/s of a jitted float32 reduction (reads the array) and of a scaled copy (reads and writes it),
    best of `repeats` each."""
    import jax
    import jax.numpy as jnp

    n = mbytes * (1 << 20) // 4
    x = jnp.arange(n, dtype=jnp.float32)
    read = jax.jit(jnp.sum)
    copy = jax.jit(lambda v: v * 1.5)
    t_read = _best_time(lambda: read(x).block_until_ready(), repeats)
    t_copy = _best_time(lambda: copy(x).block_until_ready(), repeats)
    nbytes = 4.0 * n
    return {"read_bytes_per_s": nbytes / t_read, "copy_bytes_per_s": 2 * nbytes / t_copy, "array_mbytes": mbytes}


def measure_rates(dtype: str, matmul_n: int = 2048, bandwidth_mb: int = 256, repeats: int = 5,
                  matmul_rate: float | None = None, bandwidth: float | None = None) -> Rates:
    details: dict = {}
    if matmul_rate is None:
        matmul_rate = measure_matmul_rate(matmul_n, dtype, repeats)
        details["matmul"] = {"n": matmul_n, "dtype": dtype, "flops_per_s": matmul_rate}
        if dtype != "bfloat16":
            details["matmul_bf16_flops_per_s"] = measure_matmul_rate(matmul_n, "bfloat16", repeats)
    else:
        details["matmul"] = {"given": True, "flops_per_s": matmul_rate}
    if bandwidth is None:
        bw = measure_bandwidth(bandwidth_mb, repeats)
        bandwidth = max(bw["read_bytes_per_s"], bw["copy_bytes_per_s"])
        details["bandwidth"] = bw
    else:
        details["bandwidth"] = {"given": True, "bytes_per_s": bandwidth}
    return Rates(float(matmul_rate), float(bandwidth), details)


# ----------------------------------------------------------------------------------------------- compositions


@dataclass
class Composition:
    """A named thing to time: one iteration (`steps` has one batch) or several in a row (a chunked prefill)."""

    mode: str
    label: str
    steps: list[list[Chunk]]
    x: float  # the plotted quantity (batch size, tokens, chunk size, ...)
    info: dict = field(default_factory=dict)


def _prefill_steps(prompt_len: int, chunk: int) -> list[list[Chunk]]:
    steps, start = [], 0
    while start < prompt_len:
        n = min(chunk, prompt_len - start)
        steps.append([Chunk(start, n, prompt_len)])
        start += n
    return steps


def compositions(mode: str, args: argparse.Namespace) -> list[Composition]:
    if mode == "decode":
        return [Composition("decode", f"decode x{b} @ctx {args.context}", [decode_chunks(b, args.context)], b,
                            {"batch_size": b, "context": args.context}) for b in args.batch_sizes]
    if mode == "prefill":
        return [Composition("prefill", f"prefill {n}", [[Chunk(0, n)]], n, {"tokens": n}) for n in args.tokens]
    if mode == "hybrid":
        d, ctx = args.decodes, args.context
        out = [Composition("hybrid", f"{d} decodes alone", [decode_chunks(d, ctx)], 0, {"added": "none", "prefill_tokens": 0})]
        for c in args.hybrid_chunks:
            out.append(Composition("hybrid", f"{d} decodes + chunk {c}", [decode_chunks(d, ctx) + [Chunk(0, c, max(c, args.whole_prompt))]],
                                   c, {"added": "chunk", "prefill_tokens": c}))
        p = args.whole_prompt
        out.append(Composition("hybrid", f"{d} decodes + whole prompt {p}", [decode_chunks(d, ctx) + [Chunk(0, p)]],
                               p, {"added": "whole prompt", "prefill_tokens": p}))
        return out
    if mode == "chunking":
        p = args.prompt_len
        out = []
        for c in args.chunking_chunks:
            c = min(c, p)
            label = f"prompt {p} unchunked" if c == p else f"prompt {p} in chunks of {c}"
            out.append(Composition("chunking", label, _prefill_steps(p, c), c,
                                   {"chunk": c, "prompt_len": p, "probe": False}))
        if args.tile_probe:
            t = args.tile_probe
            for c in (t, t + 1):
                if c < p:
                    out.append(Composition("chunking", f"probe: prompt {p} in chunks of {c}", _prefill_steps(p, c), c,
                                           {"chunk": c, "prompt_len": p, "probe": "prompt"}))
            for c in (t, t + 1):
                out.append(Composition("chunking", f"probe: one chunk of {c}", [[Chunk(0, c)]], c,
                                       {"chunk": c, "probe": "iteration"}))
        return out
    if mode == "calibrate":
        return calibration_compositions(args.calib_buckets, args.calib_contexts, args.calib_decodes,
                                        max_len=args.max_model_len)
    raise ValueError(f"unknown mode {mode!r}; modes: {', '.join(MODES)}")


def calibration_compositions(buckets: Sequence[int], contexts: Sequence[int], max_decodes: int,
                             max_len: int | None = None) -> list[Composition]:
    """Single iterations that fill each bucket in different ways, for fitting `BucketCostModel`: a fresh
    prefill, a chunk late in a prompt, and decodes at each context (alone when they fill the bucket, else
    with a prompt chunk making up the rest). Sequences stay within `max_len` tokens when it is given."""
    out = []
    for b in buckets:
        out.append(Composition("calibrate", f"b{b}: prefill {b}", [[Chunk(0, b)]], b, {"bucket": b}))
        late = min(max(contexts), max_len - b) if max_len else max(contexts)
        if late > 0:
            out.append(Composition("calibrate", f"b{b}: chunk {b} @ {late}", [[Chunk(late, b)]], b, {"bucket": b}))
        d = min(max_decodes, b)
        for ctx in contexts:
            if max_len and ctx >= max_len:
                continue
            rest = b - d
            chunks = decode_chunks(d, ctx) + ([Chunk(0, rest)] if rest else [])
            label = f"b{b}: {d} decodes @ {ctx}" + (f" + prefill {rest}" if rest else "")
            out.append(Composition("calibrate", label, [chunks], b, {"bucket": b}))
        if d > 1:  # one decode instead of d: a decode group costs its longest row, not its row count
            ctx = max(c for c in contexts if not max_len or c < max_len)
            out.append(Composition("calibrate", f"b{b}: 1 decode @ {ctx} + prefill {b - 1}",
                                   [decode_chunks(1, ctx) + [Chunk(0, b - 1)]], b, {"bucket": b}))
    return out


def engine_needs(comps: Sequence[Composition]) -> dict:
    """Largest batch (tokens and sequences) and longest sequence the compositions need."""
    max_tokens = max(sum(c.num_new_tokens for c in step) for comp in comps for step in comp.steps)
    max_seqs = max(len(step) for comp in comps for step in comp.steps)
    max_len = max(c.length for comp in comps for step in comp.steps for c in step)
    return {"max_tokens": max_tokens, "max_seqs": max_seqs, "max_len": max_len}


# ----------------------------------------------------------------------------------------------- the timer


class StepTimer:
    """Times batches on a real LLMEngine's model runner, with fake sequences holding real KV blocks."""

    def __init__(self, engine: Any, seed: int = 0) -> None:
        from sarathi_jax.sampling_params import SamplingParams

        self.engine = engine
        self.runner = engine.runner
        self._rng = np.random.default_rng(seed)
        self._params = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
        self._decode_pool: dict[int, list] = {}  # context -> sequences with context + 1 tokens
        self._prompts: dict[tuple[int, int], Any] = {}  # (length, index) -> sequence
        self._n = 0

    def _new_seq(self, num_tokens: int):
        from sarathi_jax.sequence import Sequence

        vocab = self.engine.model_config.vocab_size
        ids = self._rng.integers(3, vocab, size=num_tokens).tolist()
        self._n += 1
        seq = Sequence(f"step-cost-{self._n}", ids, self._params, 0.0)
        bm = self.engine.block_manager
        if not bm.can_allocate(bm.blocks_needed(seq, num_tokens), use_watermark=False):
            raise RuntimeError(f"out of KV blocks ({bm.num_free_blocks} free) for a {num_tokens}-token sequence: "
                               "pass a larger --num-blocks / --kv-cache-bytes")
        bm.allocate(seq, num_tokens)
        return seq

    def scheduled(self, step: Sequence[Chunk]) -> list:
        """ScheduledChunks for one batch. Decodes at the same context share a pool of sequences; prefill
        chunks of one batch get distinct sequences (reused across batches)."""
        from sarathi_jax.scheduler import ScheduledChunk

        out = []
        used_decode: dict[int, int] = {}
        used_prompt: dict[int, int] = {}
        for c in step:
            if c.num_new_tokens == 1 and c.sample and c.start > 0:
                k = used_decode.get(c.start, 0)
                pool = self._decode_pool.setdefault(c.start, [])
                while len(pool) <= k:
                    pool.append(self._new_seq(c.start + 1))
                used_decode[c.start] = k + 1
                seq = pool[k]
            else:
                length = c.length  # the chunk samples iff it reaches the end of its sequence
                k = used_prompt.get(length, 0)
                key = (length, k)
                if key not in self._prompts:
                    self._prompts[key] = self._new_seq(length)
                used_prompt[length] = k + 1
                seq = self._prompts[key]
            out.append(ScheduledChunk(seq, c.num_new_tokens, c.start))
        return out

    def prepare(self, steps: Sequence[Sequence[Chunk]]) -> list[tuple[list, list]]:
        prepared = []
        for step in steps:
            sc = self.scheduled(step)
            rows = [(self._params, 0, 0, ())] * len(sc)
            prepared.append((sc, rows))
        return prepared

    def run(self, prepared: Sequence[tuple[list, list]]) -> float:
        t0 = time.perf_counter()
        for sc, rows in prepared:
            self.runner.execute(sc, rows)  # waits for the sampled tokens on the host
        return time.perf_counter() - t0


def build_engine(args: argparse.Namespace, needs: dict) -> Any:
    from sarathi_jax.config import EngineConfig
    from sarathi_jax.engine import LLMEngine

    budget = args.token_budget or DEFAULT_TOKEN_BUDGET
    budget = max(budget, -(-needs["max_tokens"] // 16) * 16)
    max_seqs = max(args.max_num_seqs, needs["max_seqs"])
    max_len = max(args.max_model_len, needs["max_len"] + 1)
    kw = dict(model=args.model, dtype=args.dtype, token_budget=budget, max_num_seqs=max_seqs,
              max_model_len=max_len, scheduler="sarathi", attention_backend=args.attention_backend,
              block_size=args.block_size, seed=args.engine_seed)
    if args.num_blocks:
        kw["num_blocks"] = args.num_blocks
    if args.kv_cache_bytes:
        kw["kv_cache_bytes"] = args.kv_cache_bytes
    return LLMEngine(EngineConfig(**kw), warmup=False)


def measure(args: argparse.Namespace, log=print) -> dict:
    """Run every requested mode's compositions on one engine, side by side; returns the JSON document."""
    modes = args.modes
    comps = [c for m in modes for c in compositions(m, args)]
    needs = engine_needs(comps)
    t_build = time.perf_counter()
    engine = build_engine(args, needs)
    runner = engine.runner
    cfg = engine.config
    log(f"engine: {cfg.model} {cfg.dtype}, token_budget {cfg.token_budget} (buckets {list(runner.buckets)}), "
        f"max_num_seqs {cfg.max_num_seqs}, max_model_len {engine.max_model_len}, "
        f"{engine.block_manager.num_total_blocks} KV blocks of {cfg.block_size}, {cfg.attention_backend} attention "
        f"(built in {time.perf_counter() - t_build:.1f} s)")
    shape = ModelShape.from_model_config(engine.model_config, cfg.dtype)
    num_params = int(sum(x.size for x in _leaves(runner.params)))

    timer = StepTimer(engine, seed=args.seed)
    prepared = [timer.prepare(c.steps) for c in comps]
    t_warm = time.perf_counter()
    for p in prepared:
        for _ in range(max(1, args.warmup)):
            timer.run(p)
    log(f"warm-up (compiling {runner.num_compilations} buckets): {time.perf_counter() - t_warm:.1f} s")

    def rates_now() -> Rates:
        r = measure_rates(cfg.dtype, args.matmul_n, args.bandwidth_mb, repeats=args.repeats,
                          matmul_rate=args.matmul_rate, bandwidth=args.bandwidth)
        log(f"matmul {r.matmul_flops / 1e9:.1f} GFLOP/s ({cfg.dtype}), bandwidth {r.bandwidth / 1e9:.2f} GB/s")
        return r

    log("measuring machine rates (before and after the timed rounds; the best is kept) ...")
    before = rates_now()

    times: list[list[float]] = [[] for _ in comps]
    t_meas = time.perf_counter()
    for _ in range(args.repeats):
        for i, p in enumerate(prepared):  # round-robin: background load hits every composition alike
            times[i].append(timer.run(p))
    log(f"timed {args.repeats} rounds of {len(comps)} compositions: {time.perf_counter() - t_meas:.1f} s")
    after = rates_now()
    rates = Rates(max(before.matmul_flops, after.matmul_flops), max(before.bandwidth, after.bandwidth),
                  {"before": before.details, "after": after.details,
                   "rule": "best of repeats, before and after the timed rounds"})

    rows = []
    for comp, ts in zip(comps, times):
        step_work = [work(shape, s) for s in comp.steps]
        step_floors = [floors(w, rates) for w in step_work]
        t = statistics.median(ts)
        cf = sum(f[0] for f in step_floors)
        mf = sum(f[1] for f in step_floors)
        bound = sum(max(f) for f in step_floors)
        tokens = sum(w.num_tokens for w in step_work)
        rows.append({
            "mode": comp.mode,
            "label": comp.label,
            "x": comp.x,
            **comp.info,
            "num_steps": len(comp.steps),
            "num_seqs": max(len(s) for s in comp.steps),
            "num_tokens": tokens,
            "buckets": [runner.bucket_for(w.num_tokens) for w in step_work],
            "time_s": t,
            "min_time_s": min(ts),
            "times_s": ts,
            "per_token_s": t / tokens,
            "flops": sum(w.flops for w in step_work),
            "attention_flops": sum(w.attention_flops for w in step_work),
            "bytes": sum(w.bytes for w in step_work),
            "compute_floor_s": cf,
            "memory_floor_s": mf,
            "floor_s": bound,
            "x_floor": t / bound if bound > 0 else math.inf,
            "achieved_flops_per_s": sum(w.flops for w in step_work) / t,
        })
    _add_relative(rows)
    doc_fit = None
    calib = [(c, r) for c, r in zip(comps, rows) if c.mode == "calibrate"]
    if calib:
        model = BucketCostModel.fit([c.steps[0] for c, _ in calib], [r["time_s"] for _, r in calib],
                                    runner.buckets, source={"model": cfg.model, "dtype": cfg.dtype,
                                                            "max_num_seqs": cfg.max_num_seqs,
                                                            "attention_backend": cfg.attention_backend})
        for (c, r) in calib:
            r["fit_s"] = model.chunks_time(c.steps[0])
        doc_fit = model.to_dict()
    return {
        "tool": "sarathi_jax.bench.step_cost",
        "argv": list(args.argv) if args.argv is not None else sys.argv[1:],
        "engine": {"model": cfg.model, "dtype": cfg.dtype, "token_budget": cfg.token_budget,
                   "buckets": list(runner.buckets), "max_num_seqs": cfg.max_num_seqs,
                   "max_model_len": engine.max_model_len, "block_size": cfg.block_size,
                   "num_blocks": engine.block_manager.num_total_blocks,
                   "attention_backend": cfg.attention_backend, "num_params": num_params,
                   "layer_matmul_params": shape.layer_matmul_params, "head_params": shape.head_params},
        "rates": {"matmul_flops_per_s": rates.matmul_flops, "bandwidth_bytes_per_s": rates.bandwidth,
                  **rates.details},
        "repeats": args.repeats,
        "timing": "median of the repeats, round-robin over all compositions in one process",
        "rows": rows,
        **({"cost_model": doc_fit} if doc_fit else {}),
    }


def _leaves(tree: Any) -> list:
    import jax

    return jax.tree_util.tree_leaves(tree)


def _add_relative(rows: list[dict]) -> None:
    """Hybrid: slowdown over the decode batch alone; chunking: overhead over the unchunked prefill."""
    base = next((r for r in rows if r["mode"] == "hybrid" and r.get("added") == "none"), None)
    for r in rows:
        if r["mode"] == "hybrid" and base is not None:
            r["vs_decode_alone"] = r["time_s"] / base["time_s"]
    for r in rows:
        if r["mode"] != "chunking" or r.get("probe") == "iteration":
            continue
        ref = next((u for u in rows if u["mode"] == "chunking" and not u.get("probe")
                    and u.get("chunk") == u.get("prompt_len") == r.get("prompt_len")), None)
        if ref is not None:
            r["overhead"] = r["time_s"] / ref["time_s"] - 1.0


# ----------------------------------------------------------------------------------------------- cost model


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
        for b in self.buckets:
            if num_tokens <= b:
                return b
        return num_tokens  # past the largest bucket (the engine would refuse): no padding

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


# ----------------------------------------------------------------------------------------------- output


def fmt_ms(s: float) -> str:
    ms = s * 1e3
    return f"{ms:.3g}" if ms < 100 else f"{ms:.0f}"


def format_rows(doc: dict) -> str:
    lines = []
    r_ = doc["rates"]
    lines.append(f"model {doc['engine']['model']} ({doc['engine']['num_params'] / 1e6:.1f}M params, {doc['engine']['dtype']}), "
                 f"matmul {r_['matmul_flops_per_s'] / 1e9:.1f} GFLOP/s, bandwidth {r_['bandwidth_bytes_per_s'] / 1e9:.2f} GB/s; "
                 f"median of {doc['repeats']} round-robin repeats")
    header = ["composition", "tokens", "bucket", "ms", "ms/token", "GFLOP", "MB", "compute floor ms",
              "memory floor ms", "x floor", "note"]
    table = []
    for r in doc["rows"]:
        note = ""
        if "vs_decode_alone" in r:
            note = f"{r['vs_decode_alone']:.2f}x decode alone"
        if "overhead" in r:
            note = f"overhead {r['overhead']:+.0%}"
        buckets = r["buckets"]
        bucket = str(buckets[0]) if len(set(buckets)) == 1 and len(buckets) == 1 else \
            "+".join(str(b) for b in buckets) if len(buckets) <= 4 else f"{len(buckets)} steps: {'+'.join(str(b) for b in buckets[:3])}+..."
        table.append([r["label"], str(r["num_tokens"]), bucket, fmt_ms(r["time_s"]), f"{r['per_token_s'] * 1e3:.3g}",
                      f"{r['flops'] / 1e9:.3g}", f"{r['bytes'] / 1e6:.3g}", f"{r['compute_floor_s'] * 1e3:.3g}",
                      f"{r['memory_floor_s'] * 1e3:.3g}", f"{r['x_floor']:.1f}", note])
    widths = [max(len(h), *(len(t[i]) for t in table)) for i, h in enumerate(header)]
    lines.append("  ".join(h.ljust(w) if i == 0 else h.rjust(w) for i, (h, w) in enumerate(zip(header, widths))))
    lines.append("  ".join("-" * w for w in widths))
    for t in table:
        lines.append("  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(t, widths))))
    return "\n".join(lines)


def write_plot(doc: dict, path: str) -> str:
    import matplotlib

    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt

    rows = doc["rows"]
    modes = list(dict.fromkeys(r["mode"] for r in rows))
    panels = []
    if "decode" in modes or "prefill" in modes:
        panels.append("per_token")
    panels += [m for m in modes if m in ("hybrid", "chunking")]
    fig, axes = plt.subplots(1, len(panels), figsize=(5.2 * len(panels), 3.8), squeeze=False)
    model = doc["engine"]["model"]
    for ax, panel in zip(axes[0], panels):
        if panel == "per_token":
            for mode, color, xl in (("prefill", "C1", "prompt tokens"), ("decode", "C0", "decode batch size")):
                rs = [r for r in rows if r["mode"] == mode]
                if not rs:
                    continue
                x = [r["x"] for r in rs]
                ax.plot(x, [r["per_token_s"] * 1e3 for r in rs], "o-", color=color, label=f"{mode} (measured)")
                ax.plot(x, [r["floor_s"] / r["num_tokens"] * 1e3 for r in rs], ":", color=color,
                        label=f"{mode} floor (max of compute, memory)")
            ctx = next((r.get("context") for r in rows if r["mode"] == "decode"), None)
            ax.set_xscale("log", base=2)
            ax.set_yscale("log")
            ax.set_xlabel("batch size (decode: sequences" + (f" at context {ctx}" if ctx else "") + "; prefill: tokens)")
            ax.set_ylabel("time per token (ms, log)")
            ax.set_title(f"per-token cost, {model}")
            ax.legend(fontsize=7)
        elif panel == "hybrid":
            rs = [r for r in rows if r["mode"] == "hybrid"]
            labels = [(r["label"].split(" + ")[-1] if " + " in r["label"] else "decodes alone")
                      + f"\n({r['num_tokens']} tok, bucket {r['buckets'][0]})" for r in rs]
            colors = ["C0" if r.get("added") == "none" else "C3" if r.get("added") == "whole prompt" else "C2" for r in rs]
            ys = [r["time_s"] * 1e3 for r in rs]
            ax.bar(range(len(rs)), ys, color=colors)
            for i, r in enumerate(rs):
                ax.text(i, ys[i], f"{r['time_s'] * 1e3:.0f}\n({r['vs_decode_alone']:.1f}x)", ha="center", va="bottom", fontsize=7)
            ax.set_xticks(range(len(rs)), labels, rotation=25, ha="right", fontsize=7)
            ax.set_ylabel("iteration time (ms)")
            d = rs[0].get("num_seqs")
            ax.set_title(f"{d} decodes + prefill: whole prompt vs chunk, {model}", fontsize=9)
            ax.set_ylim(0, max(ys) * 1.25)
        elif panel == "chunking":
            rs = [r for r in rows if r["mode"] == "chunking" and r.get("probe") != "iteration"]
            labels = [("probe " if r.get("probe") else "") + (f"chunk {r['chunk']}" if r["chunk"] != r["prompt_len"] else "unchunked")
                      for r in rs]
            ys = [r["time_s"] * 1e3 for r in rs]
            ax.bar(range(len(rs)), ys, color=["C4" if r.get("probe") else "C0" if r["chunk"] == r["prompt_len"] else "C2" for r in rs])
            for i, r in enumerate(rs):
                ax.text(i, ys[i], f"{ys[i]:.0f}\n{r.get('overhead', 0):+.0%}", ha="center", va="bottom", fontsize=7)
            ax.set_xticks(range(len(rs)), labels, rotation=25, ha="right", fontsize=7)
            ax.set_ylabel("total prefill time (ms)")
            p = rs[0]["prompt_len"] if rs else "?"
            ax.set_title(f"prefilling a {p}-token prompt in chunks, {model}", fontsize=9)
            ax.set_ylim(0, max(ys) * 1.25)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return path


# ----------------------------------------------------------------------------------------------- CLI


def _ints(text: str) -> list[int]:
    try:
        vals = [int(x) for x in str(text).split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not vals or any(v < 1 for v in vals):
        raise argparse.ArgumentTypeError(f"expected positive integers, got {text!r}")
    return vals


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m sarathi_jax.bench.step_cost",
        description="Iteration time of the model runner for chosen batch compositions, beside the machine's "
                    "compute and memory floors.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument("--mode", default="decode,prefill", help=f"comma-separated, from {', '.join(MODES)}")
    p.add_argument("--model", default=DEFAULT_MODEL)
    p.add_argument("--dtype", default="float32", choices=tuple(_DTYPE_BYTES))
    p.add_argument("--attention-backend", default="xla", choices=("xla", "pallas"))
    p.add_argument("--token-budget", type=int, default=None,
                   help=f"largest bucket (default {DEFAULT_TOKEN_BUDGET}, the bench's, raised to fit the largest batch)")
    p.add_argument("--max-num-seqs", type=int, default=DEFAULT_MAX_NUM_SEQS, help="raised to fit the largest batch")
    p.add_argument("--max-model-len", type=int, default=DEFAULT_MAX_MODEL_LEN, help="raised to fit the longest sequence")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--num-blocks", type=int, default=None)
    p.add_argument("--kv-cache-bytes", type=int, default=None)
    p.add_argument("--engine-seed", type=int, default=0)
    p.add_argument("--seed", type=int, default=0, help="fake prompt token ids")

    p.add_argument("--batch-sizes", type=_ints, default=[1, 2, 4, 8, 16, 32], help="decode mode")
    p.add_argument("--context", type=int, default=512, help="decode and hybrid modes: tokens already cached per decode")
    p.add_argument("--tokens", type=_ints, default=[16, 32, 64, 128], help="prefill mode")
    p.add_argument("--decodes", type=int, default=32, help="hybrid mode: decode batch size")
    p.add_argument("--chunks", type=_ints, default=None,
                   help="hybrid (default 64,128,256,512) and chunking (default 64,128,256,512,1024) chunk sizes")
    p.add_argument("--whole-prompt", type=int, default=1024, help="hybrid mode")
    p.add_argument("--prompt-len", type=int, default=1024, help="chunking mode")
    p.add_argument("--tile-probe", type=int, default=256, help="chunking mode: also chunk N vs N+1 (0: off)")

    p.add_argument("--calib-buckets", type=_ints, default=None,
                   help="calibrate mode: buckets to fill (default: every bucket up to the token budget)")
    p.add_argument("--calib-contexts", type=_ints, default=[128, 512], help="calibrate mode: decode contexts")
    p.add_argument("--calib-decodes", type=int, default=32, help="calibrate mode: most decodes in a batch")
    p.add_argument("--cost-model-out", default=None, metavar="PATH",
                   help="calibrate mode: write the fitted simulator cost model (JSON) here; "
                        "use it with `python -m sarathi_jax.bench --simulate --cost-model PATH`")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--warmup", type=int, default=1, help="untimed runs per composition (the first compiles)")
    p.add_argument("--matmul-n", type=int, default=2048)
    p.add_argument("--bandwidth-mb", type=int, default=256)
    p.add_argument("--matmul-rate", type=float, default=None, help="FLOP/s to use instead of measuring")
    p.add_argument("--bandwidth", type=float, default=None, help="bytes/s to use instead of measuring")
    p.add_argument("--json", default=None, metavar="PATH")
    p.add_argument("--plot", default=None, metavar="PATH")
    p.add_argument("--quiet", action="store_true")
    return p


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = build_parser()
    args = parser.parse_args(argv)
    args.argv = list(argv) if argv is not None else None
    modes = [m.strip() for m in args.mode.split(",") if m.strip()]
    bad = [m for m in modes if m not in MODES]
    if bad or not modes:
        parser.error(f"--mode: unknown {bad}; choose from {', '.join(MODES)}")
    args.modes = list(dict.fromkeys(modes))
    args.hybrid_chunks = args.chunks or [64, 128, 256, 512]
    args.chunking_chunks = args.chunks or [64, 128, 256, 512, 1024]
    if args.context < 1 or args.decodes < 1 or args.whole_prompt < 1 or args.prompt_len < 1:
        parser.error("--context, --decodes, --whole-prompt and --prompt-len must be positive")
    if args.repeats < 1:
        parser.error("--repeats must be >= 1")
    if "calibrate" in args.modes and args.calib_buckets is None:
        from sarathi_jax.model_runner import token_buckets

        args.calib_buckets = list(token_buckets(args.token_budget or DEFAULT_TOKEN_BUDGET))
    if "chunking" in args.modes and args.prompt_len not in args.chunking_chunks:
        args.chunking_chunks = [*args.chunking_chunks, args.prompt_len]  # the unchunked reference
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    log = (lambda *a, **k: None) if args.quiet else (lambda msg: print(msg, file=sys.stderr, flush=True))
    doc = measure(args, log)
    print(format_rows(doc))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(doc, f, indent=1)
        print(f"wrote {args.json}")
    if doc.get("cost_model"):
        cm = doc["cost_model"]
        errs = [abs(r["fit_s"] / r["time_s"] - 1) for r in doc["rows"] if "fit_s" in r]
        print(f"cost model: base per bucket (ms) {', '.join(f'{b}: {v * 1e3:.1f}' for b, v in cm['base_s'].items())}; "
              f"decode {cm['decode_kv_s'] * 1e9:.1f} ns per decode row-token (groups of {cm['row_group']} rows), prefill {cm['prefill_pair_s'] * 1e9:.2f} ns "
              f"per (query, key) pair; fit error median {statistics.median(errs):.1%}, max {max(errs):.1%}")
        if args.cost_model_out:
            with open(args.cost_model_out, "w") as f:
                json.dump(cm, f, indent=1)
            print(f"wrote {args.cost_model_out}")
    if args.plot:
        write_plot(doc, args.plot)
        print(f"wrote {args.plot}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
