"""Speculative decoding's host side: the configuration, the n-gram proposer, greedy acceptance, the block
trim and the scheduler's grant of draft tokens under the token budget (no JAX, no model)."""

from __future__ import annotations

import pytest

from sarathi_jax.scheduler.block_manager import BlockManager
from sarathi_jax.spec_decode.ngram_proposer import propose_ngram
from sarathi_jax.request.outputs import RequestMetrics
from sarathi_jax.request.sampling_params import SamplingParams
from sarathi_jax.scheduler import SchedulerConfig, make_scheduler
from sarathi_jax.scheduler.speculation import Speculation, ngram_proposer
from sarathi_jax.request.sequence import ScheduledChunk, Sequence
from sarathi_jax.spec_decode.speculative import SpeculationStats, SpeculativeConfig, emitted_rows, speculates, verify_rows

GREEDY = SamplingParams(temperature=0.0, max_tokens=64, ignore_eos=True)


# ----------------------------------------------------------------------------------------------- config


def test_config_parses_vllm_dict_and_defaults():
    config = SpeculativeConfig.parse({"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 5})
    assert config == SpeculativeConfig("ngram", 3, 2, 5)
    assert SpeculativeConfig.parse(None) is None
    assert SpeculativeConfig.parse(config) is config


@pytest.mark.parametrize("value, words", [
    ({"method": "eagle"}, "method must be one of"),
    ({"draft": "tiny-llama"}, "unknown keys ['draft']"),
    ({"model": 3}, "speculative_config.model must be a preset name or a folder"),
    ({"method": "draft_model"}, "method 'draft_model' goes with a draft model"),
    ({"method": "ngram", "model": "tiny-llama"}, "method 'draft_model' goes with a draft model"),
    ({"num_speculative_tokens": 0}, "num_speculative_tokens must be a positive integer"),
    ({"num_speculative_tokens": True}, "num_speculative_tokens must be a positive integer"),
    ({"num_speculative_tokens": 33}, "at most 32"),
    ({"prompt_lookup_min": 3, "prompt_lookup_max": 2}, "prompt_lookup_min (3) must be <="),
    ("ngram", "must be a dict"),
])
def test_config_refuses_bad_values_with_the_field(value, words):
    with pytest.raises(ValueError) as e:
        SpeculativeConfig.parse(value)
    assert words in str(e.value) and "speculative_config" in str(e.value)


def test_engine_config_refuses_pipeline_parallelism_and_tile_size():
    from sarathi_jax import EngineConfig

    assert EngineConfig(speculative_config={"num_speculative_tokens": 2}).speculative_config.num_speculative_tokens == 2
    for bad in (dict(pipeline_parallel_size=2), dict(tile_size=16)):
        with pytest.raises(ValueError, match="speculative_config is not supported yet"):
            EngineConfig(speculative_config={}, **bad)


def test_greedy_and_sampled_unconstrained_requests_speculate():
    assert speculates(GREEDY)
    assert speculates(SamplingParams(temperature=0.7, top_k=5, top_p=0.9, min_p=0.1, seed=1))
    assert not speculates(SamplingParams(temperature=0.0, structured_outputs={"regex": "[ab]+"}))
    assert not speculates(SamplingParams(temperature=0.7, structured_outputs={"regex": "[ab]+"}))


# ----------------------------------------------------------------------------------------------- proposer


def test_ngram_proposes_the_continuation_of_the_most_recent_match():
    #        0  1  2  3  4  5  6  7  8  9
    tokens = [5, 6, 7, 1, 5, 6, 8, 9, 5, 6]
    # last 2-gram (5, 6): matches at 0 and 4; the most recent (4) continues with 8, 9, 5, 6
    assert propose_ngram(tokens, 3, 2, 2) == [8, 9, 5]
    assert propose_ngram(tokens, 10, 2, 2) == [8, 9, 5, 6]  # cut at the end of the tokens
    assert propose_ngram(tokens, 1, 2, 2) == [8]


def test_ngram_prefers_the_longest_n():
    #        0  1  2  3  4  5  6  7  8  9
    tokens = [1, 2, 3, 4, 9, 2, 3, 7, 1, 2, 3]
    # 3-gram (1, 2, 3) matches at 0 -> 4; the 2-gram (2, 3) alone would take the most recent match, at 5 -> 7
    assert propose_ngram(tokens, 2, 2, 3) == [4, 9]
    assert propose_ngram(tokens, 2, 2, 2) == [7, 1]


def test_ngram_without_a_match_proposes_nothing():
    assert propose_ngram([1, 2, 3, 4, 5], 4, 2, 4) == []
    assert propose_ngram([1, 3, 2, 3], 4, 2, 4) == []  # the 1-gram (3) recurs, but min_n is 2
    assert propose_ngram([1, 3, 2, 3], 4, 1, 4) == [2, 3]  # ... and with min_n 1 it proposes
    assert propose_ngram([7], 4, 1, 1) == []
    assert propose_ngram([7, 7, 7], 0, 1, 1) == []


def test_ngram_match_may_overlap_the_suffix():
    # A run of one token: the 2-gram (7, 7) matched one back continues the run.
    assert propose_ngram([3, 7, 7, 7], 3, 2, 2) == [7]
    assert propose_ngram([7, 7, 7, 7, 7], 2, 2, 3) == [7]


# ----------------------------------------------------------------------------------------------- acceptance


def test_verify_rows_follow_the_chunk_rows_in_chunk_order():
    assert verify_rows(3, [2, 0, 3]) == [3, 5, 5]
    assert verify_rows(2, [0, 0]) == [2, 2]


@pytest.mark.parametrize("targets, rows", [
    ((9, 9, 9), [0]),  # the first draft rejected: the target's own token in its place
    ((1, 9, 9), [0, 1]),  # one accepted, then the target's correction
    ((1, 2, 9), [0, 1, 2]),
    ((1, 2, 3), [0, 1, 2, 4]),  # all accepted: then the bonus token, from the chunk's own row
])
def test_emitted_rows_take_the_longest_matching_prefix_and_one_more(targets, rows):
    # Drafts (1, 2, 3); verification rows 0..2 hold the target's token after each prefix; the chunk's row is 4.
    token_ids = [*targets, -1, 7]
    assert emitted_rows(4, 0, (1, 2, 3), token_ids) == rows


def test_stats_add_to_totals_and_request_metrics():
    stats, metrics = SpeculationStats(), RequestMetrics(arrival_time=0.0)
    stats.add(metrics, 4, 1, 2)
    stats.add(metrics, 2, 2, 3)
    assert (metrics.num_draft_tokens, metrics.num_accepted_tokens, metrics.num_verify_steps) == (6, 3, 2)
    assert metrics.acceptance_rate == 0.5 and metrics.mean_accepted_length == 2.5
    totals = stats.as_dict()
    assert totals["spec_acceptance_rate"] == 0.5 and totals["spec_num_emitted_tokens"] == 5
    assert RequestMetrics(arrival_time=0.0).acceptance_rate is None


# ----------------------------------------------------------------------------------------------- blocks


def test_trim_returns_rejected_blocks_as_a_new_table():
    bm = BlockManager(8, block_size=4, enable_prefix_caching=True)
    seq = Sequence("a", list(range(10, 16)), GREEDY, 0.0)  # 6 tokens
    bm.allocate(seq, 11)  # room for 6 tokens + 5 drafts: 3 blocks
    seq.num_computed_tokens = 6
    table = seq.block_table
    bm.trim(seq, 7)  # the verified tokens and the pending one: 2 blocks
    assert len(seq.block_table) == 2 and seq.block_table is not table and seq.block_table == table[:2]
    assert bm.num_free_blocks == 6
    bm.check_invariants([seq])
    bm.trim(seq, 8)  # nothing past what it holds
    assert len(seq.block_table) == 2
    bm.free(seq)
    bm.check_invariants([])


def test_trim_keeps_registered_blocks():
    bm = BlockManager(8, block_size=4, enable_prefix_caching=True)
    seq = Sequence("a", list(range(10, 19)), GREEDY, 0.0)  # 9 tokens
    bm.allocate(seq, 9)
    seq.num_computed_tokens = 8
    bm.cache_full_blocks(seq)
    assert seq.num_registered_blocks == 2
    bm.trim(seq, 1)
    assert len(seq.block_table) == 2  # registered blocks stay with their sequence
    bm.check_invariants([seq])


# ----------------------------------------------------------------------------------------------- scheduler


def _scheduler(token_budget=16, max_num_seqs=8, num_blocks=64, k=4, proposal=(7, 7, 7, 7, 7, 7), watermark=0.01):
    config = SchedulerConfig("sarathi", token_budget=token_budget, max_num_seqs=max_num_seqs, max_model_len=256,
                             watermark=watermark)
    scheduler = make_scheduler(config, BlockManager(num_blocks, block_size=4))
    proposed = []

    def propose(seq, most):
        proposed.append((seq.seq_id, most))
        return proposal[:most]

    scheduler.speculation = Speculation(k, propose)
    return scheduler, proposed


def _decodings(scheduler, *specs):
    """Sequences (name, prompt length, params) prefilled in one batch, each with one output token: decodes."""
    seqs = [Sequence(name, list(range(3, 3 + n)), params, 0.0) for name, n, params in specs]
    for seq in seqs:
        scheduler.add_sequence(seq)
    out = scheduler.schedule()
    assert [(c.seq, c.num_new_tokens) for c in out.chunks] == [(s, s.num_prompt_tokens) for s in seqs]
    scheduler.on_step_done(out)
    for seq in seqs:
        seq.append_token(5)
    return seqs


def _run(scheduler):
    out = scheduler.schedule()
    scheduler.on_step_done(out)
    return out


def test_every_decode_gets_its_token_before_drafts_and_k_shrinks_with_the_budget():
    scheduler, proposed = _scheduler(token_budget=16, max_num_seqs=16, k=4)
    seqs = _decodings(scheduler, *[(f"s{i}", 3, GREEDY) for i in range(4)])
    out = _run(scheduler)
    # 4 decodes take 4 tokens; 12 left: 4 + 4 + 4 drafts, the last decode none (the room is spent).
    assert [c.num_draft_tokens for c in out.chunks] == [4, 4, 4, 0]
    assert [c.num_new_tokens for c in out.chunks] == [5, 5, 5, 1]
    assert all(c.is_decode and c.needs_sample for c in out.chunks) and [c.seq for c in out.chunks] == seqs
    assert out.num_batched_tokens == 16 and out.num_decode_tokens == 16
    assert [most for _, most in proposed] == [4, 4, 4]
    # K/V of the drafts: a speculating sequence holds blocks for its 4 tokens + 4 drafts.
    assert [len(s.block_table) for s in seqs] == [2, 2, 2, 1]
    # The drafts are not the sequence's tokens; on_step_done counts only the verified one.
    assert all(s.num_computed_tokens == 4 and s.num_tokens == 4 for s in seqs)


def test_prefill_chunks_keep_their_share_and_drafts_take_what_is_left():
    scheduler, _ = _scheduler(token_budget=16, k=4)
    (a,) = _decodings(scheduler, ("a", 3, GREEDY))
    scheduler.add_sequence(Sequence("b", list(range(3, 15)), GREEDY, 0.0))  # a 12-token prompt arrives
    out = _run(scheduler)
    # The decode's token, then the 12 prompt tokens (admitted as without speculation), then 3 drafts.
    assert [(c.seq.seq_id, c.num_new_tokens, c.num_draft_tokens) for c in out.chunks] == [("a", 4, 3), ("b", 12, 0)]
    assert out.num_batched_tokens == 16 and a.num_computed_tokens == 4


def test_drafts_are_capped_by_max_tokens_and_by_the_sampling_rows():
    scheduler, _ = _scheduler(token_budget=32, max_num_seqs=3, k=8)
    short_params = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)
    _decodings(scheduler, ("short", 3, short_params), ("other", 3, GREEDY))
    out = _run(scheduler)
    # short has 1 output and 2 to go: 1 draft (the bonus token is its 3rd). Then the sampling rows:
    # 3 (max_num_seqs) - 2 chunks - 1 draft leaves other none.
    assert [(c.seq.seq_id, c.num_draft_tokens) for c in out.chunks] == [("short", 1), ("other", 0)]


def test_no_drafts_for_constrained_requests_or_without_a_proposal():
    scheduler, proposed = _scheduler(k=4, proposal=())
    sampled = SamplingParams(temperature=0.8, max_tokens=64, ignore_eos=True)
    constrained = SamplingParams(temperature=0.8, max_tokens=64, ignore_eos=True, structured_outputs={"regex": "a+"})
    _decodings(scheduler, ("greedy", 3, GREEDY), ("sampled", 3, sampled), ("constrained", 3, constrained))
    out = _run(scheduler)
    assert [c.num_draft_tokens for c in out.chunks] == [0, 0, 0]
    assert [name for name, _ in proposed] == ["greedy", "sampled"]  # the constrained one is never asked


def test_drafts_never_take_the_watermark_blocks():
    # 4 blocks of 4 tokens, a 25% watermark (1 block). a (7 tokens) holds 2 blocks, b (3 tokens) 1, 1 is free:
    # the watermark's. 4 drafts would need a new block each, so each gets what its own blocks still hold.
    scheduler, _ = _scheduler(num_blocks=4, watermark=0.25, k=4)
    short = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)  # requests that fit the small cache
    a, b = _decodings(scheduler, ("a", 6, short), ("b", 2, short))
    assert (len(a.block_table), len(b.block_table), scheduler.block_manager.num_free_blocks) == (2, 1, 1)
    out = _run(scheduler)
    assert [(c.seq.seq_id, c.num_draft_tokens) for c in out.chunks] == [("a", 1), ("b", 1)]
    assert scheduler.block_manager.num_free_blocks == 1


def test_a_pending_decode_gets_a_lookups_drafts_but_no_draft_models():
    # The overlapped loop schedules a decode whose last token is still on the device. Lookup continues the
    # known tokens: its first token guesses the pending one, the rest are the drafts. A draft model would read
    # that token on the host: it is not asked (the engine core keeps its requests synchronous).
    seq = Sequence("a", [1, 2, 3, 4, 5, 1, 2], GREEDY, 0.0)
    seq.append_pending_token()
    propose = ngram_proposer(SpeculativeConfig("ngram", 4, 2, 2))
    assert propose(seq, 2) == [4, 5]  # "1 2" recurs: 3 (the guess of the pending token), then 4 5
    assert propose(Sequence("b", [1, 2, 3, 4, 5, 1, 2], GREEDY, 0.0), 2) == [3, 4]  # nothing pending
    asked = []
    lookup = Speculation(2, lambda seq, k: asked.append(("lookup", seq.num_pending_tokens)) or (7,) * k)
    model = Speculation(2, draft=lambda granted: asked.append(("model", len(granted))) or [[7] * n for _, n in granted])
    for speculation, drafts in ((lookup, (7, 7)), (model, ())):
        scheduler, _ = _scheduler(k=2, proposal=())
        (a,) = _decodings(scheduler, ("a", 3, GREEDY))
        _run(scheduler)  # a plain decode (no proposal) dispatched: its token is pending
        a.append_pending_token()
        scheduler.speculation = speculation
        asked.clear()
        out = _run(scheduler)
        chunks = [(c.seq.seq_id, c.num_new_tokens, c.draft_token_ids) for c in out.chunks]
        assert chunks == [("a", 1 + len(drafts), drafts)]
        assert asked == ([("lookup", 1)] if drafts else [])


def test_no_drafts_in_a_schedule_that_preempted():
    # 3 blocks of 4 tokens: a at 9 tokens needs a third block for its decode, which b holds: b is
    # preempted, and a gets no drafts in that batch (memory pressure).
    scheduler, _ = _scheduler(num_blocks=3, watermark=0.0, k=4)
    short = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)  # requests that fit the small cache
    a, b = _decodings(scheduler, ("a", 8, short), ("b", 3, short))
    out = scheduler.schedule()
    assert out.preempted == (b,)
    assert [(c.seq.seq_id, c.num_draft_tokens) for c in out.chunks] == [("a", 0)]


def test_chunk_with_drafts_is_validated():
    seq = Sequence("a", [1, 2, 3], GREEDY, 0.0)
    seq.num_computed_tokens = 2
    chunk = ScheduledChunk(seq, 3, 2, True, (4, 5))
    assert chunk.needs_sample and chunk.is_decode and chunk.num_draft_tokens == 2
    with pytest.raises(ValueError):
        ScheduledChunk(seq, 2, 1, True, (4, 5))  # drafts must follow the sequence's last token
    with pytest.raises(ValueError):
        ScheduledChunk(seq, 3, 2, False, (4, 5))  # only a decode carries drafts


# ----------------------------------------------------------------------------------------------- verification rows


def test_verify_rows_in_the_packed_step():
    from sarathi_jax.runner.input_batch import InputBatch
    from sarathi_jax.runner.step_inputs import BatchLayout, sampling_views

    s, block, buckets = 8, 4, (8, 16)
    bm = BlockManager(16, block_size=block)
    under_min = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True, stop_token_ids=(4,), min_tokens=3)
    a = Sequence("a", [11, 12, 13, 14, 15], under_min, 0.0)
    b = Sequence("b", [21, 22], GREEDY, 0.0)
    for seq, out in ((a, 16), (b, 23)):
        bm.allocate(seq, seq.num_tokens + 4)
        seq.num_computed_tokens = seq.num_tokens
        seq.append_token(out)
    chunks = [ScheduledChunk(a, 4, 5, True, (31, 32, 33)), ScheduledChunk(b, 1, 2, True)]
    banned = {"a": (4,), "b": ()}
    batch = InputBatch(s, 8, block, buckets)
    packed, _ = batch.prepare(chunks, 8, lambda seq: (seq.sampling_params, 7, banned[seq.seq_id]))
    v = BatchLayout(8, s, 8).host_views(packed.batch)
    assert v["token_ids"][:5].tolist() == [16, 31, 32, 33, 23]
    assert v["positions"][:5].tolist() == [5, 6, 7, 8, 2]
    # Chunk rows read their last token; a's verification rows 2..4 read its tokens 0..2.
    assert v["logits_indices"][:5].tolist() == [3, 4, 0, 1, 2]
    sv = sampling_views(packed.sampling, s)
    # a has 1 output: its verification rows sample outputs 2, 3, 4 (steps 1, 2, 3), its own row output 5.
    assert sv.steps[:5].tolist() == [4, 1, 1, 2, 3]
    # min_tokens 3 bans stop id 4 at steps 1 and 2 only.
    assert sv.banned_token_ids[:5, 0].tolist() == [-1, -1, 4, 4, -1]
    assert (sv.keys[2:5] == sv.keys[0]).all() and (sv.temperature[2:5] == sv.temperature[0]).all()
    assert (sv.temperature[5:] == -1).all()  # padding rows
    # The persistent rows are untouched: the next step without drafts has no verification rows.
    a.append_token(17)
    a.num_computed_tokens = 6
    packed, _ = batch.prepare([ScheduledChunk(a, 1, 6, True), ScheduledChunk(b, 1, 2, True)], 8,
                              lambda seq: (seq.sampling_params, 7, banned[seq.seq_id]))
    sv = sampling_views(packed.sampling, s)
    assert (sv.temperature[2:] == -1).all() and sv.steps[0] == 2


def test_a_verified_chunk_may_start_with_a_pending_token_but_is_never_read_as_one():
    from sarathi_jax.runner.input_batch import InputBatch
    from sarathi_jax.runner.step_inputs import BatchLayout

    s, block = 8, 4
    bm = BlockManager(16, block_size=block)
    a = Sequence("a", [11, 12, 13, 14, 15], GREEDY, 0.0)
    bm.allocate(a, 12)
    batch = InputBatch(s, 8, block, (8, 16))

    def sampling(seq):
        return seq.sampling_params, 7, ()

    batch.prepare([ScheduledChunk(a, 5, 0)], 8, sampling)  # step 1: the prompt, sampling output 1 (pending)
    a.num_computed_tokens = 5
    a.append_pending_token()
    # Step 2, overlapped: the pending token then 2 drafts; the pending one is read from step 1's row 0.
    packed, _ = batch.prepare([ScheduledChunk(a, 3, 5, True, (31, 32))], 8, sampling)
    v = BatchLayout(8, s, 8).host_views(packed.batch)
    assert v["token_ids"][:3].tolist() == [0, 31, 32] and v["src_rows"][:3].tolist() == [0, -1, -1]
    assert v["positions"][:3].tolist() == [5, 6, 7]
    # Step 1 retires; a step 3 scheduled before step 2 retires would read a's next token from a verified
    # chunk's row (its bonus token, if every draft was accepted): refused.
    a.resolve_pending_token(16)
    a.num_computed_tokens = 6
    a.append_pending_token()
    with pytest.raises(RuntimeError, match="did not sample"):
        batch.prepare([ScheduledChunk(a, 1, 6, True)], 8, sampling)
