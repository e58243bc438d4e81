"""Speculative decoding through the real engine core, scheduler and block manager, with a bigram "model" for an
executor: the token after t is `succ[t]`, at every position it scores. So we know exactly which drafts it
accepts, and can put stop ids, EOS and max_tokens inside accepted runs, abort during a verification, and
check every block and counter."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pytest

from sarathi_jax.core.admission import Admission, KVCapacity
from sarathi_jax.scheduler.block_manager import BlockManager
from sarathi_jax.core.engine_core import EngineCore, LoopConfig
from sarathi_jax.request.sampling_params import SamplingParams
from sarathi_jax.scheduler import SchedulerConfig, make_scheduler
from sarathi_jax.scheduler.speculation import Speculation
from sarathi_jax.request.sequence import PENDING_TOKEN
from sarathi_jax.spec_decode.speculative import SpeculativeConfig, verify_rows

VOCAB, MAX_NUM_SEQS, EOS = 64, 16, 2


@dataclass
class _Sampled:
    token_ids: np.ndarray
    logprobs: None = None
    top_token_ids: None = None
    top_logprobs: None = None


class _Done:
    num_padded_tokens = 0

    def __init__(self, token_ids: np.ndarray, step: int, events: list) -> None:
        self._sampled, self._step, self._events = _Sampled(token_ids), step, events

    def result(self) -> _Sampled:
        self._events.append(("result", self._step))
        return self._sampled


class BigramExecutor:
    """Scores each chunk as a bigram model would: row i (the chunk's last token) and each verification row
    (`speculative.verify_rows`) hold succ[token at that position]. A pending input token (the overlapped loop)
    is read from the previous step's row of its sequence, as the runner reads it on the device; a verified
    chunk's row is not readable (its sequence's next token is known only at retirement, `input_batch`), so a
    sequence scheduled while its verification is in flight fails here. `events`: submits and fetches, in order."""

    def __init__(self, succ: dict[int, int]) -> None:
        self.succ = succ
        self.num_steps = 0
        self.events: list[tuple[str, int]] = []
        self.pending_drafts = 0  # verified chunks whose first token was pending (a lookup guessed it)
        self._sampled_rows: dict[str, int] = {}  # the previous step: seq_id -> its token there
        self.drafted: list[bool] = []  # per step: whether a chunk carried drafts

    def next_token(self, t: int) -> int:
        return self.succ.get(t, (t + 1) % VOCAB)

    def submit(self, chunks, sampling_of, token_bitmask=None) -> _Done:
        self.num_steps += 1
        self.events.append(("submit", self.num_steps))
        self.drafted.append(any(c.draft_token_ids for c in chunks))
        tokens = np.full(MAX_NUM_SEQS, -1, np.int64)
        verify = verify_rows(len(chunks), [c.num_draft_tokens for c in chunks])
        sampled_rows = {}
        for i, c in enumerate(chunks):
            known = list(c.seq.token_ids[c.start_position : c.start_position + c.num_new_tokens - c.num_draft_tokens])
            if known[-1] == PENDING_TOKEN:
                assert c.seq.seq_id in self._sampled_rows, f"{c.seq!r} reads a token the previous step did not sample"
                known[-1] = self._sampled_rows[c.seq.seq_id]
                self.pending_drafts += bool(c.draft_token_ids)
            assert PENDING_TOKEN not in known, c
            run = known + list(c.draft_token_ids)
            tokens[i] = self.next_token(run[-1])
            for j in range(c.num_draft_tokens):
                tokens[verify[i] + j] = self.next_token(run[len(run) - 1 - c.num_draft_tokens + j])
            if c.needs_sample and not c.draft_token_ids:
                sampled_rows[c.seq.seq_id] = int(tokens[i])
        self._sampled_rows = sampled_rows
        return _Done(tokens, self.num_steps, self.events)

    def now(self) -> float:
        return 0.0


def make_core(succ, *, k=4, num_blocks=64, block_size=4, async_scheduling=True, prefix_caching=False):
    config = SchedulerConfig("sarathi", token_budget=32, max_num_seqs=MAX_NUM_SEQS, max_model_len=128)
    bm = BlockManager(num_blocks, block_size, enable_prefix_caching=prefix_caching)
    scheduler = make_scheduler(config, bm)
    scheduler.speculation = Speculation.of(SpeculativeConfig("ngram", k, 1, 3))
    executor = BigramExecutor(succ)
    core = EngineCore(scheduler, executor, loop=LoopConfig(async_scheduling), eos_token_ids=(EOS,))
    admission = Admission(vocab_size=VOCAB, max_model_len=128, kv_cache=KVCapacity.of(bm), tokenizer=None,
                          eos_token_ids=(EOS,))
    return core, admission, executor


CYCLE = [10, 11, 12, 13, 14, 15]
SUCC = {t: CYCLE[(i + 1) % len(CYCLE)] for i, t in enumerate(CYCLE)}  # the model continues the cycle
PROMPT = CYCLE * 2 + CYCLE[:2]  # ... which its prompt holds, so lookup proposes the model's tokens


def serve(core, admission, requests):
    outs = {}
    for rid, (prompt, params) in requests.items():
        core.add_request(rid, admission.admit(prompt, params))
    while core.has_unfinished_requests():
        for out in core.step():
            assert not outs.get(out.request_id) or not outs[out.request_id][-1].finished, "output after finish"
            outs.setdefault(out.request_id, []).append(out)
    return outs


def expected(prompt, n, succ=SUCC):
    tokens, t = [], prompt[-1]
    for _ in range(n):
        t = succ.get(t, (t + 1) % VOCAB)
        tokens.append(t)
    return tokens


@pytest.mark.parametrize("async_scheduling", [True, False])
def test_every_draft_accepted_when_the_model_continues_the_prompt(async_scheduling):
    core, admission, executor = make_core(SUCC, async_scheduling=async_scheduling)
    params = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
    outs = serve(core, admission, {"a": (PROMPT, params)})
    final = outs["a"][-1]
    assert list(final.token_ids) == expected(PROMPT, 20) and final.finish_reason == "length"
    # 1 + 4 tokens a step after the prefill: 20 tokens in 1 (prefill) + 4 verification steps (5, 5, 5, 4).
    assert [len(o.new_token_ids) for o in outs["a"]] == [1, 5, 5, 5, 4]
    assert final.metrics.acceptance_rate == 1.0 and final.metrics.num_draft_tokens == 15
    assert core.stats()["spec_mean_accepted_length"] == 19 / 4
    core.scheduler.block_manager.check_invariants([])
    assert core.scheduler.block_manager.num_free_blocks == 64


def test_rejected_drafts_give_the_model_tokens_and_their_blocks_back():
    # The model's cycle runs the other way round from its prompt's: every draft is rejected.
    succ = {t: CYCLE[(i - 1) % len(CYCLE)] for i, t in enumerate(CYCLE)}
    core, admission, _ = make_core(succ, block_size=2, async_scheduling=False)  # retired when step() returns
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    core.add_request("a", admission.admit(PROMPT, params))
    bm, seen, checked = core.scheduler.block_manager, [], 0
    while core.has_unfinished_requests():
        for out in core.step():
            seen.append(out)
        if core.scheduler.running:
            # Between steps, a sequence holds blocks for its known tokens, none for rejected drafts.
            seq = core.scheduler.running[0]
            assert bm.blocks_for_tokens(seq.num_computed_tokens) <= len(seq.block_table) <= bm.blocks_for_tokens(seq.num_tokens)
            checked += 1
    assert checked >= 3
    assert list(seen[-1].token_ids) == expected(PROMPT, 8, succ)
    stats = core.stats()
    assert stats["spec_num_draft_tokens"] > 0 and stats["spec_num_accepted_tokens"] < stats["spec_num_draft_tokens"]
    bm.check_invariants([])
    assert bm.num_free_blocks == bm.num_total_blocks


@pytest.mark.parametrize("stop", ["stop_id", "eos"])
def test_a_stop_inside_an_accepted_run_ends_it_there(stop):
    # Output: 12 13 14 15 10 11 12 ...; the stop (13's successor 14) is the 3rd output, inside the first run
    # of 5; as EOS id 14 is given to the core as its EOS.
    core, admission, _ = make_core(SUCC)
    if stop == "eos":
        core.eos_token_ids = (14,)
        params = SamplingParams(temperature=0.0, max_tokens=20)
    else:
        params = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True, stop_token_ids=(14,))
    outs = serve(core, admission, {"a": (PROMPT, params)})
    final = outs["a"][-1]
    assert list(final.token_ids) == [12, 13, 14] and final.finish_reason == "stop"
    assert [len(o.new_token_ids) for o in outs["a"]] == [1, 2]  # the run's last 3 tokens were dropped
    stats = core.stats()
    assert stats["spec_num_accepted_tokens"] == 4 and stats["spec_num_emitted_tokens"] == 2
    core.scheduler.block_manager.check_invariants([])


def test_min_tokens_defers_a_stop_inside_a_run():
    core, admission, _ = make_core(SUCC)
    params = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True, stop_token_ids=(14,), min_tokens=5)
    final = serve(core, admission, {"a": (PROMPT, params)})["a"][-1]
    # 14 at output 3 is below min_tokens (the bigram model ignores the ban, the stop check does not); the
    # next 14, output 9, stops it.
    assert list(final.token_ids) == expected(PROMPT, 9) and final.finish_reason == "stop"


def test_abort_while_a_verification_is_in_flight():
    core, admission, _ = make_core(SUCC)
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    core.add_request("a", admission.admit(PROMPT, params))
    core.add_request("b", admission.admit(PROMPT[1:], params))
    outs = {"a": [], "b": []}
    aborted = False
    while core.has_unfinished_requests():
        for out in core.step():
            assert not outs[out.request_id] or not outs[out.request_id][-1].finished
            outs[out.request_id].append(out)
        if not aborted and core.num_in_flight and core.speculation_stats.num_verify_steps >= 1:
            assert core.abort("a")
            aborted = True
    assert outs["a"][-1].finish_reason == "abort"
    assert list(outs["b"][-1].token_ids) == expected(PROMPT[1:], 40)
    bm = core.scheduler.block_manager
    bm.check_invariants([])
    assert bm.num_free_blocks == bm.num_total_blocks


@pytest.mark.parametrize("succ", [SUCC, {t: CYCLE[(i - 1) % len(CYCLE)] for i, t in enumerate(CYCLE)}],
                         ids=["accepting", "rejecting"])
def test_prefix_cache_registers_only_verified_tokens(succ):
    from sarathi_jax.scheduler.block_manager import _ROOT_HASH, block_hash

    core, admission, _ = make_core(succ, prefix_caching=True, block_size=2)
    bm = core.scheduler.block_manager
    params = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
    core.add_request("a", admission.admit(PROMPT, params))
    checked = 0
    while core.has_unfinished_requests():
        core.step()
        for seq in core.scheduler.running:
            # Each registered block's hash names its sequence's own known, computed tokens.
            assert seq.num_registered_blocks * 2 <= min(seq.num_computed_tokens, seq.num_tokens - seq.num_pending_tokens)
            parent = _ROOT_HASH
            for i in range(seq.num_registered_blocks):
                parent = block_hash(parent, seq.token_ids[2 * i : 2 * i + 2])
                if bm.is_cached(seq.block_table[i]):
                    assert bm._hash_of[seq.block_table[i]] == parent
                    checked += 1
    assert checked > 0 and core.stats()["spec_num_draft_tokens"] > 0
    # The prompt + its output again: cached blocks are hit, and the same tokens follow.
    first = list(PROMPT) + expected(PROMPT, 20, succ)
    outs = serve(core, admission, {"b": (first, SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))})
    assert core.stats()["prefix_cache_hits"] >= 30
    assert list(outs["b"][-1].token_ids) == expected(first, 4, succ)
    bm.check_invariants([])


def test_the_loop_overlaps_unless_a_verification_is_in_flight():
    # "copy" speculates from the start (its prompt holds the model's cycle); "plain" has no match for its first
    # outputs, so it decodes plainly; "late" arrives while both run. Each step() call that found a batch in
    # flight either fetched it before it scheduled (that batch verified drafts: its sequences' lengths were
    # unknown) or scheduled first and fetched it after (the overlap), or scheduled nothing.
    core, admission, executor = make_core(SUCC)
    requests = {"copy": (PROMPT, 10), "plain": (list(range(40, 52)), 30), "late": (PROMPT[2:], 12)}
    outs: dict[str, list] = {}
    calls = []  # (the step in flight when step() was called, or None; the executor events of that call)
    for rid in ("copy", "plain"):
        prompt, n = requests[rid]
        core.add_request(rid, admission.admit(prompt, SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)))
    while core.has_unfinished_requests():
        if len(calls) == 4:
            prompt, n = requests["late"]
            core.add_request("late", admission.admit(prompt, SamplingParams(temperature=0.0, max_tokens=n,
                                                                            ignore_eos=True)))
        in_flight, first = (executor.num_steps if core.num_in_flight else None), len(executor.events)
        for out in core.step():
            outs.setdefault(out.request_id, []).append(out)
        calls.append((in_flight, executor.events[first:]))
    overlapped = retired_first = 0
    for in_flight, events in calls:
        if in_flight is None or not any(kind == "submit" for kind, _ in events):
            continue
        submitted = next(i for i, (kind, _) in enumerate(events) if kind == "submit")
        fetched = events.index(("result", in_flight))
        if executor.drafted[in_flight - 1]:
            assert fetched < submitted, (in_flight, events)
            retired_first += 1
        else:
            assert submitted < fetched, (in_flight, events)
            overlapped += 1
    assert overlapped >= 10 and retired_first >= 2
    assert executor.pending_drafts > 0  # some verified chunks read their first token on the device
    for rid, (prompt, n) in requests.items():
        assert list(outs[rid][-1].token_ids) == expected(prompt, n), rid
    assert core.stats()["spec_num_accepted_tokens"] > 0
    bm = core.scheduler.block_manager
    bm.check_invariants([])
    assert bm.num_free_blocks == bm.num_total_blocks
