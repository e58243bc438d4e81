"""The in-place `InputBatch` against a fresh build of every step's inputs, over random runs of the real engine
core (scheduler, block manager, postprocessing) with preemption, aborts, prefix-cache hits, pending tokens,
min_tokens bans and bucket changes. The fresh build below is the runner's former per-step packing: every
field written from the chunks alone, nothing kept between steps."""

from __future__ import annotations

import random

import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from sarathi_jax.core.admission import Admission, AdmissionError, KVCapacity
from sarathi_jax.scheduler.block_manager import BlockManager
from sarathi_jax.core.engine_core import EngineCore, LoopConfig, RequestState
from sarathi_jax.runner.input_batch import InputBatch, make_sampling_arrays, sampler_variant
from sarathi_jax.request.sampling_params import SamplingParams
from sarathi_jax.scheduler import SchedulerConfig, make_scheduler
from sarathi_jax.request.sequence import Sequence
from sarathi_jax.config.sizing import bucket_for, token_buckets
from sarathi_jax.runner.step_inputs import BatchLayout, PackedStep, pack_sampling
from sarathi_jax.request.tokenizer import StopStringChecker

S, BLOCK, BUDGET, MAX_LEN = 6, 4, 32, 96
B = MAX_LEN // BLOCK
BUCKETS = token_buckets(BUDGET, 4)


def fresh_build(chunks, rows, bucket: int, prev_rows: dict[str, int]) -> PackedStep:
    """Every field from the chunks and the per-row (params, seed, step, banned) alone."""
    layout = BatchLayout(bucket, S, B)
    batch = layout.empty_batch()
    v = layout.host_views(batch)
    offset = 0
    for i, chunk in enumerate(chunks):
        seq, start, n = chunk.seq, chunk.start_position, chunk.num_new_tokens
        end = offset + n
        pos = np.arange(start, start + n)
        v["token_ids"][offset:end] = seq.token_ids[start : start + n]
        v["positions"][offset:end] = pos
        v["slot_mapping"][offset:end] = np.asarray(seq.block_table)[pos // BLOCK] * BLOCK + pos % BLOCK
        if seq.num_pending_tokens and start + n > seq.num_tokens - seq.num_pending_tokens:
            v["token_ids"][end - 1] = 0
            v["src_rows"][end - 1] = prev_rows[seq.seq_id]
        v["kv_lens"][i] = start + n
        v["block_tables"][i, : len(seq.block_table)] = seq.block_table
        v["cu_q_lens"][i + 1] = end
        v["logits_indices"][i] = end - 1
        offset = end
    v["cu_q_lens"][len(chunks) + 1 :] = offset
    v["num_seqs"][0] = len(chunks)
    return PackedStep(batch, pack_sampling(make_sampling_arrays(rows, S)))


class ComparingExecutor:
    """Builds each step both ways, asserts they are equal byte for byte, and samples random tokens."""

    def __init__(self, rng: random.Random, vocab: int) -> None:
        self.batch = InputBatch(S, B, BLOCK, BUCKETS)
        self.rng, self.vocab = rng, vocab
        self.prev_rows: dict[str, int] = {}
        self.steps = 0
        self.buckets_seen: set[int] = set()

    def submit(self, chunks, sampling_of, token_bitmask=None):
        bucket = bucket_for(BUCKETS, sum(c.num_new_tokens for c in chunks))
        got, variant = self.batch.prepare(chunks, bucket, sampling_of)
        rows = []
        for c in chunks:
            params, seed, banned = sampling_of(c.seq)
            step = c.seq.num_generated_tokens
            rows.append((params, seed, step, banned if step < params.min_tokens else ()))
        want = fresh_build(chunks, rows, bucket, self.prev_rows)
        np.testing.assert_array_equal(got.batch, want.batch)
        np.testing.assert_array_equal(got.sampling, want.sampling)
        assert variant == sampler_variant(rows)
        self.prev_rows = {c.seq.seq_id: i for i, c in enumerate(chunks) if c.needs_sample}
        self.steps += 1
        self.buckets_seen.add(bucket)
        return _Step(np.array([self.rng.randrange(self.vocab) for _ in range(S)]), bucket)

    def now(self) -> float:
        return 0.0


class _Step:
    def __init__(self, tokens, bucket):
        self.token_ids, self.num_padded_tokens = tokens, bucket
        self.logprobs = np.zeros(S)
        self.top_token_ids, self.top_logprobs = np.zeros((S, 2), np.int64), np.zeros((S, 2))

    def result(self):
        return self


def _params(rng: random.Random) -> SamplingParams:
    kind = rng.randrange(4)
    if kind == 0:
        return SamplingParams(temperature=0.0, max_tokens=rng.randint(1, 12))
    if kind == 1:
        return SamplingParams(temperature=0.8, top_k=rng.choice([0, 5, 500]), top_p=rng.choice([1.0, 0.9]),
                              seed=rng.randrange(2**40), max_tokens=rng.randint(1, 12))
    if kind == 2:  # EOS and stop ids banned until min_tokens
        return SamplingParams(temperature=0.0, min_tokens=rng.randint(1, 6), stop_token_ids=[3, 4],
                              max_tokens=rng.randint(6, 12))
    return SamplingParams(temperature=0.5, logprobs=2, max_tokens=rng.randint(1, 12))


def _run(seed: int, overlapped: bool, num_blocks: int) -> dict:
    """A random run of the engine core on the comparing executor; what it went through."""
    rng = random.Random(seed)
    vocab = 8  # small: random tokens often hit the stop ids and the shared prefixes repeat
    bm = BlockManager(num_blocks, BLOCK, enable_prefix_caching=True)
    scheduler = make_scheduler(SchedulerConfig(policy="sarathi", token_budget=BUDGET, max_num_seqs=S,
                                               max_model_len=MAX_LEN, watermark=0.0), bm)
    executor = ComparingExecutor(rng, vocab)
    core = EngineCore(scheduler, executor, loop=LoopConfig(async_scheduling=overlapped), eos_token_ids=(2,))
    admission = Admission(vocab_size=vocab, max_model_len=MAX_LEN, kv_cache=KVCapacity.of(bm))
    prefixes = [[rng.randrange(vocab) for _ in range(rng.randint(4, 24))] for _ in range(3)]
    live: list[str] = []
    aborts = 0
    for step in range(60):
        if rng.random() < 0.5:
            rid = f"r{step}"
            prompt = rng.choice(prefixes) + [rng.randrange(vocab) for _ in range(rng.randint(1, 30))]
            params = _params(rng)
            try:  # as in the engines: a request that could never run is refused before the core
                admission.check(prompt, params)
            except AdmissionError:
                pass
            else:
                seq = Sequence(rid, prompt, params, 0.0)
                banned = tuple(params.stop_token_ids) + (2,) if params.min_tokens else ()
                core.add(RequestState(seq, rng.randrange(2**63), banned, None, StopStringChecker(())))
                live.append(rid)
        if live and rng.random() < 0.1:
            aborts += core.abort(live.pop(rng.randrange(len(live))))
        core.step()
    while core.has_unfinished_requests():
        core.step()
    assert bm.num_free_blocks == num_blocks, "a KV block leaked"
    return {"preemptions": scheduler.num_preemptions, "prefix_hits": bm.num_prefix_hits, "aborts": aborts,
            "buckets": len(executor.buckets_seen), "steps": executor.steps}


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 2**32 - 1), overlapped=st.booleans(), num_blocks=st.sampled_from([14, 24, 60]))
def test_in_place_inputs_equal_a_fresh_build(seed, overlapped, num_blocks):
    assert _run(seed, overlapped, num_blocks)["steps"] > 0


def test_the_random_runs_cover_what_moves_rows():
    """Fixed seeds: the runs above do meet preemption, prefix-cache hits, aborts and bucket changes."""
    runs = [_run(seed, overlapped, blocks) for seed in range(4) for overlapped in (False, True) for blocks in (14, 60)]
    assert sum(r["preemptions"] for r in runs) > 0
    assert sum(r["prefix_hits"] for r in runs) > 0
    assert sum(r["aborts"] for r in runs) > 0
    assert min(r["buckets"] for r in runs) > 1
