"""`ModelRunner`'s host batch building (`runner.input_batch`): a scheduled batch becomes the packed int32 step
inputs of `sarathi_jax.runner.step_inputs`, padded to its bucket. Checked field by field on a hand-made batch; nothing runs
on the device (the runner's steps are exercised by the engine tests)."""

from __future__ import annotations

import jax
import numpy as np
import pytest

from sarathi_jax import EngineConfig, LLMEngine, SamplingParams
from sarathi_jax.runner.model_runner import ModelRunner
from sarathi_jax.runner.precompile import is_sampler
from sarathi_jax.runner.input_batch import make_sampling_arrays
from sarathi_jax.scheduler import ScheduledChunk
from sarathi_jax.request.sequence import Sequence
from sarathi_jax.runner.step_inputs import BatchLayout, pack_sampling

S, BLOCK = 4, 16


@pytest.fixture(scope="module")
def runner():
    engine = LLMEngine(EngineConfig(model="tiny-llama", dtype="float32", token_budget=32, max_num_seqs=S,
                                    block_size=BLOCK, num_blocks=16, max_model_len=64), warmup=False)
    return engine.runner


def _seq(seq_id: str, num_tokens: int, table: list[int]) -> Sequence:
    seq = Sequence(seq_id, list(range(100, 100 + num_tokens)), SamplingParams(max_tokens=8), 0.0)
    seq.block_table = list(table)  # the block manager's job; any blocks will do for packing
    return seq


def _views(runner, packed) -> dict[str, np.ndarray]:
    return BatchLayout.of_packed(packed.batch.size, S, runner.max_blocks_per_seq).host_views(packed.batch)


def _pack(runner, chunks, rows):
    """The runner's packed inputs for `chunks`; rows[i] = (params, seed, banned) of chunk i's sequence."""
    by_seq = {c.seq.seq_id: row for c, row in zip(chunks, rows)}
    num_tokens = sum(c.num_new_tokens for c in chunks)
    packed, _ = runner.input_batch.prepare(chunks, runner.bucket_for(num_tokens), lambda seq: by_seq[seq.seq_id])
    return packed


def test_without_a_plan_the_runner_is_one_stage_on_one_device(runner):
    assert isinstance(runner, ModelRunner)
    assert runner.plan is None and runner.timeline is None and len(runner.stages) == 1
    (stage,) = runner.stages
    assert stage.mesh is None and stage.is_last and stage.layer_range == (0, runner.model_config.num_hidden_layers)
    assert runner.params is stage.params and len(runner.kv_caches) == 1 and runner.kv_caches[0] is stage.kv_cache
    assert runner.max_blocks_per_seq == 64 // BLOCK
    assert runner.num_compilations == 0  # built without warm-up, and packing compiles nothing


def test_a_decode_and_a_prompt_chunk(runner):
    a = _seq("a", 21, [5, 7])  # a decode at position 20: block 7, offset 4
    b = _seq("b", 12, [3])  # the first 10 tokens of a 12-token prompt (no sample)
    chunks = [ScheduledChunk(a, 1, 20), ScheduledChunk(b, 10, 0)]
    rows = [(SamplingParams(temperature=0.0), 0, ()), (SamplingParams(temperature=0.7, top_k=5), 9, ())]
    packed = _pack(runner, chunks, rows)
    v = _views(runner, packed)
    assert v["token_ids"].size == 16  # 11 tokens: the 16-token bucket
    assert v["token_ids"][:11].tolist() == [120] + list(range(100, 110))
    assert v["positions"][:11].tolist() == [20] + list(range(10))
    assert v["slot_mapping"].tolist() == [7 * BLOCK + 4] + list(range(3 * BLOCK, 3 * BLOCK + 10)) + [-1] * 5
    assert (v["src_rows"] == -1).all()  # every input token is on the host
    assert v["kv_lens"][:2].tolist() == [21, 10]
    assert v["cu_q_lens"].tolist() == [0, 1, 11, 11, 11]
    assert v["num_seqs"].tolist() == [2]
    assert v["logits_indices"][:2].tolist() == [0, 10]
    assert v["block_tables"][0, :2].tolist() == [5, 7] and v["block_tables"][1, :1].tolist() == [3]
    want = make_sampling_arrays([(p, seed, 0, banned) for p, seed, banned in rows], S)
    np.testing.assert_array_equal(packed.sampling, pack_sampling(want))


def test_batches_pad_to_their_bucket(runner):
    assert runner.buckets == ((4, 8, 16, 24, 32) if jax.default_backend() == "cpu" else (16, 32))
    packed = _pack(runner, [ScheduledChunk(_seq("c", 17, [1, 2]), 17, 0)], [(SamplingParams(), 0, ())])
    assert _views(runner, packed)["token_ids"].size == (24 if jax.default_backend() == "cpu" else 32)
    assert runner.bucket_for(32) == 32
    with pytest.raises(ValueError, match="exceeds the largest bucket"):
        runner.bucket_for(33)


def test_a_pending_token_is_read_from_the_previous_step(runner):
    b, c = _seq("b", 5, [1]), _seq("c", 30, [2, 4])
    a = _seq("a", 21, [5, 7])
    rows = [(SamplingParams(temperature=0.0), 0, ())] * 3
    _pack(runner, [ScheduledChunk(b, 5, 0), ScheduledChunk(c, 1, 29), ScheduledChunk(a, 1, 20)], rows)
    a.append_pending_token()  # the token that step sampled in its row 2 is not on the host yet
    v = _views(runner, _pack(runner, [ScheduledChunk(a, 1, 21)], rows[:1]))
    assert (v["token_ids"][0], v["src_rows"][0], v["positions"][0]) == (0, 2, 21)
    assert (v["src_rows"][1:] == -1).all()
    a.append_pending_token()  # the previous step (row 0) sampled it, but a second pending token was never sampled
    with pytest.raises(RuntimeError, match="previous step did not sample"):
        _pack(runner, [ScheduledChunk(a, 2, 21)], rows[:1])


@pytest.mark.parametrize("backend", ["cpu", "xla"])
def test_no_step_copies_the_kv_cache(backend):
    """The cache is donated and updated in place: no bucket's optimised step may copy it (a copy is a whole
    cache's bytes every step; XLA inserts one when the attention call's read of the cache cannot be ordered
    before the in-place write, as it did for 1- and 2-token buckets with the CPU kernel)."""
    import re

    engine = LLMEngine(EngineConfig(model="tiny-llama", dtype="float32", token_budget=64, max_num_seqs=S,
                                    block_size=BLOCK, num_blocks=16, max_model_len=64, attention_backend=backend,
                                    compilation_cache_dir=None, background_compile=False))
    runner = engine.runner
    assert engine.config.attention_backend == backend
    kv = runner.kv_caches[0][0]
    shape = "f32[" + ",".join(map(str, kv.shape)) + "]"
    steps = {e: exe for e, exe in runner._table.executables.items() if not is_sampler(e)}
    assert len(steps) == len(runner.buckets) >= 3  # 4 (on a CPU), 8, 16, 32, 64
    for entry, exe in steps.items():
        text = exe.as_text()
        assert shape in text
        copies = [line for line in text.splitlines() if re.search(r"=\s*" + re.escape(shape) + r"\S*\s+copy\(", line)]
        assert not copies, f"{entry}: {copies[:2]}"


def test_a_small_bucket_samples_its_rows_as_the_full_sampler_does():
    # The LM head and sampler on R < S rows: the same tokens and logprobs as those rows of an S-row run (every
    # row is sampled on its own), with the token ids padded to S for the next step.
    from sarathi_jax.runner.sample.sampler import sample_packed_jit
    from sarathi_jax.parallel.stages import LMHead
    from sarathi_jax.runner.sample.sampler import FULL_VARIANT

    s, embed, vocab = 8, 16, 300
    rng = np.random.default_rng(4)
    hidden = jax.numpy.asarray(rng.normal(size=(s, embed)).astype(np.float32))
    weight = jax.numpy.asarray(rng.normal(size=(vocab, embed)).astype(np.float32))  # [vocab, embed], tied or not
    head = LMHead(dtype=np.dtype(np.float32))
    rows = [(SamplingParams(temperature=0.0, logprobs=2), 0, 0, ()),
            (SamplingParams(temperature=0.8, top_p=0.9, seed=3), 3, 5, ()),
            (SamplingParams(temperature=1.1, top_k=7, min_p=0.01, seed=11), 11, 2, (4, 9))]
    part = pack_sampling(make_sampling_arrays(rows, s))
    full = jax.device_get(sample_packed_jit(hidden, weight, part, variant=FULL_VARIANT, rows=s, head=head))
    np.testing.assert_allclose(np.asarray(head.logits(hidden, weight)), np.asarray(hidden) @ np.asarray(weight).T,
                               rtol=1e-5, atol=1e-5)
    for r in (3, 4):
        got = jax.device_get(sample_packed_jit(hidden, weight, part, variant=FULL_VARIANT, rows=r, head=head))
        assert got.token_ids.shape == (s,) and (got.token_ids[r:] == 0).all()
        np.testing.assert_array_equal(got.token_ids[:3], full.token_ids[:3])
        for name in ("logprobs", "top_token_ids", "top_logprobs"):
            np.testing.assert_array_equal(getattr(got, name)[:3], getattr(full, name)[:3], err_msg=name)


@pytest.mark.parametrize("num_tokens", [(50,), (25, 15, 10)])
def test_few_sequences_in_a_large_bucket_sample_the_smallest_row_count_that_holds_them(num_tokens):
    """A 64-token step holds up to 16 sequences, but one of 1 or 3 runs the LM head and the sampler on the
    smallest row count of the buckets' (the row ladder) that holds them: 4 rows. Its tokens and logprobs are
    those of the path before the ladder: the LM head inside the step on the bucket's 16 rows, then the sampler
    on those 16 rows. Nothing compiles: the warm-up built that sampler."""
    from sarathi_jax.models import init_kv_cache
    from sarathi_jax.runner.sample.sampler import sample
    from sarathi_jax.runner.step_inputs import sample_rows, unpack_sampling

    s = 16
    engine = LLMEngine(EngineConfig(model="tiny-llama", dtype="float32", token_budget=64, max_num_seqs=s,
                                    block_size=BLOCK, num_blocks=32, max_model_len=64, compilation_cache_dir=None,
                                    background_compile=False))
    runner = engine.runner
    assert runner.row_ladder == tuple(sorted({min(b, s) for b in runner.buckets}))
    params = [SamplingParams(temperature=0.0, logprobs=2), SamplingParams(temperature=0.8, top_p=0.9, seed=3),
              SamplingParams(temperature=1.1, top_k=7, seed=11, logprobs=1)]
    seqs = [_seq(f"s{i}", n, [2 * i, 2 * i + 1]) for i, n in enumerate(num_tokens)]
    by_seq = {seq.seq_id: (p, 5, ()) for seq, p in zip(seqs, params)}
    chunks = [ScheduledChunk(seq, n, 0) for seq, n in zip(seqs, num_tokens)]
    bucket = runner.bucket_for(sum(num_tokens))
    packed, variant = runner.input_batch.prepare(chunks, bucket, lambda seq: by_seq[seq.seq_id])
    layout = runner._layout(bucket)
    rows = sample_rows(runner.row_ladder, len(chunks))
    assert bucket == 64 and layout.num_rows == s and (rows < s if jax.default_backend() == "cpu" else rows == s)

    # Before the row ladder: logits for the bucket's rows inside the step, sampled on all of them.
    model, stage_params = runner.stages[0].model, runner.stages[0].params
    kv_cache = init_kv_cache(runner.model_config, runner.num_blocks, BLOCK, jax.numpy.float32)

    @jax.jit
    def before(batch, sampling):
        token_ids, _, positions, metadata, logits_indices = layout.unpack_batch(batch)
        logits, _ = model.apply({"params": stage_params}, token_ids, positions, kv_cache, metadata,
                                logits_indices[: layout.num_rows])
        return logits, sample(logits, unpack_sampling(sampling, s, layout.num_rows), variant)

    with jax.transfer_guard_host_to_device("allow"):
        want_logits, want = jax.device_get(before(packed.batch, packed.sampling))
    compiled = runner.num_compilations
    runner.capture_logits(True)
    step = runner._dispatch(packed, variant)
    got = step.result()
    assert runner.num_compilations == compiled
    assert step.sampler[1] == rows and step.sampler in runner._table.variants
    assert step.logits.shape == (rows, runner.model_config.vocab_size)
    n = len(chunks)
    np.testing.assert_allclose(step.logits[:n], want_logits[:n], rtol=0, atol=1e-5)
    np.testing.assert_array_equal(got.token_ids[:n], want.token_ids[:n])
    for name in ("logprobs", "top_token_ids", "top_logprobs"):
        np.testing.assert_allclose(getattr(got, name)[:n], getattr(want, name)[:n], rtol=0, atol=1e-5, err_msg=name)


def test_a_step_that_samples_nothing_runs_no_lm_head_and_changes_no_token():
    """A 40-token prompt in 16-token chunks: the first two steps end no prompt, so they skip the LM head and
    the sampler (`_no_samples`), the third samples. Tokens equal one unchunked step's, and nothing compiles
    after warm-up (the skip was built there)."""
    from tests.sarathi_jax.engine_helpers import run_staggered

    prompt = [list(range(7, 47))]
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    outputs, skipped = [], []
    for budget in (16, 64):
        engine = LLMEngine(EngineConfig(model="tiny-llama", dtype="float32", token_budget=budget, max_num_seqs=S,
                                        block_size=BLOCK, num_blocks=16, max_model_len=64, background_compile=False))
        runner = engine.runner
        compiled, no_samples, calls = runner.num_compilations, runner._no_samples, []
        runner._no_samples = lambda hidden: calls.append(1) or no_samples(hidden)
        outputs.append(run_staggered(engine, prompt, params)["r0"])
        assert runner.num_compilations == compiled
        skipped.append(len(calls))
    assert skipped == [2, 0]
    assert outputs[0] == outputs[1] and len(outputs[0]) == 4
