"""Sampled requests that speculate, through the real engine core, scheduler, block manager, step inputs
(`InputBatch`, verification rows included) and device sampler, with a bigram "model" of logits over a tiny
vocabulary for an executor: the logits after token t are LOGITS[t] at every position it scores.

Checked: the emitted tokens follow the target's transition probabilities with deliberately bad drafts
(Pearson chi-square per state, significance 0.001, fixed seeds); they are the tokens the same seeds give
without speculation; top-k / top-p / min-p never let a token outside the filtered support through (property
test); mixed batches of greedy-speculating, sampled-speculating and prefilling sequences; no KV block leaks, no
output after finish; acceptance metrics count sampled requests."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st
from scipy import stats

from sarathi_jax.core.admission import Admission, KVCapacity
from sarathi_jax.scheduler.block_manager import BlockManager
from sarathi_jax.core.engine_core import EngineCore, LoopConfig
from sarathi_jax.runner.input_batch import InputBatch
from sarathi_jax.runner.sample.sampler import sample_jit
from sarathi_jax.request.sampling_params import SamplingParams
from sarathi_jax.scheduler import SchedulerConfig, make_scheduler
from sarathi_jax.scheduler.speculation import Speculation
from sarathi_jax.spec_decode.speculative import SpeculativeConfig
from sarathi_jax.runner.step_inputs import BatchLayout, unpack_sampling

VOCAB, MAX_NUM_SEQS, BLOCK_SIZE, MAX_MODEL_LEN, BUCKET = 8, 32, 4, 128, 64
ALPHA = 1e-3  # significance of the chi-square test
LOGITS = np.random.default_rng(5).normal(0.0, 1.5, (VOCAB, VOCAB)).astype(np.float32)
# The prompt follows each token with its least likely successor: prompt lookup proposes bad drafts.
WORST = LOGITS.argmin(axis=1)
BAD_PROMPT = [int(t) for a in range(VOCAB) for t in (a, WORST[a])] * 2


class _Done:
    num_padded_tokens = 0

    def __init__(self, sampled) -> None:
        self._sampled = sampled

    def result(self):
        return self._sampled


class BigramSamplerExecutor:
    """Runs each step's packed inputs as the model runner does, with LOGITS[token] for the model: the token at
    each sampling row's `logits_indices`, then the jitted sampler with the step's sampling arrays and variant."""

    def __init__(self) -> None:
        self.batch = InputBatch(MAX_NUM_SEQS, MAX_MODEL_LEN // BLOCK_SIZE, BLOCK_SIZE, [BUCKET])
        self.steps: list[list[tuple]] = []  # per step: (seq_id, temperature, num drafts, is_decode)
        self.last_tokens = np.zeros(MAX_NUM_SEQS, np.int32)

    def submit(self, chunks, sampling_of, token_bitmask=None) -> _Done:
        packed, variant = self.batch.prepare(chunks, BUCKET, sampling_of)
        layout = BatchLayout.of_packed(packed.batch.size, MAX_NUM_SEQS, MAX_MODEL_LEN // BLOCK_SIZE)
        views = layout.host_views(packed.batch)
        token_ids, src_rows = views["token_ids"].copy(), views["src_rows"]
        pending = src_rows >= 0  # the overlapped loop (no speculation): the previous step's sampled row
        token_ids[pending] = self.last_tokens[src_rows[pending]]
        tokens = token_ids[views["logits_indices"]]  # every row; padding rows' outputs are ignored
        out = sample_jit(jnp.asarray(LOGITS[tokens]), unpack_sampling(jnp.asarray(packed.sampling), MAX_NUM_SEQS),
                         variant=variant)
        self.steps.append([(c.seq.seq_id, c.seq.sampling_params.temperature, c.num_draft_tokens, c.is_decode)
                           for c in chunks])
        out = jax.tree.map(np.asarray, out)
        self.last_tokens = out.token_ids
        return _Done(out)

    def now(self) -> float:
        return 0.0


def make_core(k: int | None = 3, token_budget: int = 32):
    config = SchedulerConfig("sarathi", token_budget=token_budget, max_num_seqs=MAX_NUM_SEQS,
                             max_model_len=MAX_MODEL_LEN)
    bm = BlockManager(256, BLOCK_SIZE)
    scheduler = make_scheduler(config, bm)
    if k:
        scheduler.speculation = Speculation.of(SpeculativeConfig("ngram", k, 1, 3))
    executor = BigramSamplerExecutor()
    core = EngineCore(scheduler, executor, loop=LoopConfig(async_scheduling=True))
    admission = Admission(vocab_size=VOCAB, max_model_len=MAX_MODEL_LEN, kv_cache=KVCapacity.of(bm), tokenizer=None,
                          eos_token_ids=())
    return core, admission, executor


def serve(core, admission, requests: dict, group: int = 8) -> dict[str, list]:
    """Each request's outputs, `group` requests at a time (each draft needs a sampling row: 8 running leave 24)."""
    outs: dict[str, list] = {}
    items = list(requests.items())
    for first in range(0, len(items), group):
        for rid, (prompt, params) in items[first : first + group]:
            core.add_request(rid, admission.admit(prompt, params))
        while core.has_unfinished_requests():
            for out in core.step():
                assert not outs.get(out.request_id) or not outs[out.request_id][-1].finished, "output after finish"
                outs.setdefault(out.request_id, []).append(out)
    bm = core.scheduler.block_manager
    bm.check_invariants([])
    assert bm.num_free_blocks == bm.num_total_blocks
    return outs


def filtered_probs(temperature: float, top_k: int = 0, top_p: float = 1.0, min_p: float = 0.0, slack: float = 0.0):
    """The target's processed transition probabilities [VOCAB, VOCAB] (float64; vLLM's order: temperature,
    top-k with ties kept, top-p of the renormalised top-k, min-p). `slack` widens top-p and min-p for float32
    rounding at their boundaries."""
    scaled = LOGITS.astype(np.float64) / temperature
    p = np.exp(scaled - scaled.max(axis=1, keepdims=True))
    if 0 < top_k < VOCAB:
        p[scaled < np.sort(scaled, axis=1)[:, -top_k][:, None]] = 0.0
    p /= p.sum(axis=1, keepdims=True)
    for row in p:
        order = np.argsort(-row, kind="stable")
        before = np.cumsum(row[order]) - row[order]
        row[order[before >= top_p * (1 + slack)]] = 0.0
        row[row < min_p * row.max() * (1 - slack)] = 0.0
    return p / p.sum(axis=1, keepdims=True)


def transitions(prompt, tokens) -> list[tuple[int, int]]:
    chain = [prompt[-1], *tokens]
    return list(zip(chain[:-1], chain[1:]))


def test_bad_drafts_keep_the_target_distribution_and_the_plain_tokens():
    params = SamplingParams(temperature=0.7, max_tokens=24, ignore_eos=True)
    requests = {f"r{i}": (BAD_PROMPT, params.replace(seed=i)) for i in range(96)}
    core, admission, executor = make_core()
    outs = serve(core, admission, requests)
    tokens = {rid: list(o[-1].token_ids) for rid, o in outs.items()}
    assert all(len(t) == 24 for t in tokens.values())

    # Pearson chi-square per state: the transitions out of state s are draws from p(. | s).
    p = filtered_probs(0.7)
    counts = np.zeros((VOCAB, VOCAB))
    for t in tokens.values():
        for a, b in transitions(BAD_PROMPT, t):
            counts[a, b] += 1
    stat, dof = 0.0, 0
    for s in range(VOCAB):
        n = counts[s].sum()
        expected = n * p[s]
        big = expected >= 5  # the rest merged into one cell
        obs, exp = np.append(counts[s][big], counts[s][~big].sum()), np.append(expected[big], expected[~big].sum())
        keep = exp > 0
        stat += float(((obs[keep] - exp[keep]) ** 2 / exp[keep]).sum())
        dof += int(keep.sum()) - 1
    assert stats.chi2.sf(stat, dof) > ALPHA, (stat, dof)

    # The drafts were bad, and some were accepted all the same; the metrics count them.
    totals = core.stats()
    assert 0 < totals["spec_num_accepted_tokens"] < 0.5 * totals["spec_num_draft_tokens"], totals
    assert sum(o[-1].metrics.num_draft_tokens for o in outs.values()) == totals["spec_num_draft_tokens"]
    assert sum(o[-1].metrics.num_accepted_tokens for o in outs.values()) == totals["spec_num_accepted_tokens"]
    assert any(len(out.new_token_ids) > 1 for o in outs.values() for out in o)

    # The same seeds without speculation give the same tokens (the engine's point-mass rejection sampler
    # samples each position with that position's own uniform).
    plain_core, plain_admission, _ = make_core(k=None)
    plain = serve(plain_core, plain_admission, requests)
    assert {rid: list(o[-1].token_ids) for rid, o in plain.items()} == tokens


@settings(max_examples=20, deadline=None)
@given(temperature=st.sampled_from([0.5, 1.0, 2.0]), top_k=st.integers(0, VOCAB),
       top_p=st.sampled_from([1.0, 0.9, 0.6, 0.3]), min_p=st.sampled_from([0.0, 0.1, 0.3]),
       seed=st.integers(0, 2**31 - 1))
def test_filters_keep_accepted_tokens_inside_the_support(temperature, top_k, top_p, min_p, seed):
    params = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p, max_tokens=16,
                            ignore_eos=True)
    requests = {f"r{i}": (BAD_PROMPT, params.replace(seed=seed + i)) for i in range(8)}
    core, admission, _ = make_core()
    outs = serve(core, admission, requests)
    support = filtered_probs(temperature, top_k, top_p, min_p, slack=1e-4) > 0
    for rid, o in outs.items():
        for a, b in transitions(BAD_PROMPT, o[-1].token_ids):
            assert support[a, b], (rid, a, b)
    assert core.stats()["spec_num_draft_tokens"] > 0


def test_mixed_batches_of_greedy_sampled_and_prefilling_sequences():
    greedy = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
    sampled = SamplingParams(temperature=0.9, top_p=0.9, max_tokens=20, ignore_eos=True)
    rng = np.random.default_rng(0)
    long_prompt = rng.integers(0, VOCAB, 60).tolist()  # chunks of 28, 28, 4 beside 4 decodes: the last leaves room
    requests = {"g0": (BAD_PROMPT, greedy), "s0": (BAD_PROMPT, sampled.replace(seed=1)),
                "g1": (BAD_PROMPT[3:], greedy), "s1": (BAD_PROMPT[5:], sampled.replace(seed=2, top_k=3))}
    core, admission, executor = make_core(k=3)
    for rid, (prompt, params) in requests.items():
        core.add_request(rid, admission.admit(prompt, params))
    outs: dict[str, list] = {}
    step = 0
    while core.has_unfinished_requests():
        if step in (5, 9):  # prompts arrive while the others speculate
            rid = f"long{step}"
            requests[rid] = (long_prompt, sampled.replace(seed=step))
            core.add_request(rid, admission.admit(long_prompt, sampled.replace(seed=step)))
        for out in core.step():
            assert not outs.get(out.request_id) or not outs[out.request_id][-1].finished, "output after finish"
            outs.setdefault(out.request_id, []).append(out)
        step += 1
    # One batch held a greedy decode with drafts, a sampled decode with drafts and a prefill chunk.
    assert any(any(t == 0.0 and d for _, t, d, _ in s) and any(t > 0 and d for _, t, d, _ in s)
               and any(not dec for *_, dec in s) for s in executor.steps)
    bm = core.scheduler.block_manager
    bm.check_invariants([])
    assert bm.num_free_blocks == bm.num_total_blocks
    for rid in ("g0", "g1"):  # greedy: the bigram's argmax chain
        chain = [requests[rid][0][-1]]
        for _ in range(20):
            chain.append(int(LOGITS[chain[-1]].argmax()))
        assert list(outs[rid][-1].token_ids) == chain[1:]
    assert all(outs[rid][-1].metrics.num_draft_tokens > 0 for rid in ("g0", "s0", "g1", "s1"))
    plain_core, plain_admission, _ = make_core(k=None)
    plain = serve(plain_core, plain_admission, requests)
    assert {rid: o[-1].token_ids for rid, o in plain.items()} == {rid: o[-1].token_ids for rid, o in outs.items()}
