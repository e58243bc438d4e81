"""Scheduler API: config validation, registry, abort, the limits admission enforces, preemption details."""

from __future__ import annotations

import dataclasses

import pytest

from sarathi_jax.core.admission import Admission, AdmissionError, KVCapacity
from sarathi_jax.scheduler.block_manager import BlockManager
from sarathi_jax.request.sampling_params import SamplingParams
from sarathi_jax.scheduler import SCHEDULER_POLICIES, SCHEDULERS, SchedulerConfig, make_scheduler
from sarathi_jax.scheduler.base import SchedulerSettings
from sarathi_jax.request.sequence import Sequence, SequenceStatus
from scheduler_harness import complete


def _seq(i: int, prompt_len: int, max_tokens: int = 8) -> Sequence:
    return Sequence(f"s{i}", list(range(prompt_len)), SamplingParams(max_tokens=max_tokens), float(i))


def _make(policy="sarathi", num_blocks=64, block_size=4, **kw):
    kw = {"token_budget": 16, "max_num_seqs": 4, "max_model_len": 128, "watermark": 0.0} | kw
    bm = BlockManager(num_blocks, block_size)
    return make_scheduler(SchedulerConfig(policy=policy, **kw), bm), bm


# ------------------------------------------------------------------------------------------ config, registry


def test_registry_matches_policy_names():
    assert tuple(SCHEDULERS) == SCHEDULER_POLICIES
    for name in SCHEDULER_POLICIES:
        sched, _ = _make(name)
        assert sched.name == name


def test_policy_flags_agree_with_admission():
    """A chunking policy admits by chunk and batches by the token budget; a whole-prompt one does neither."""
    for name, cls in SCHEDULERS.items():
        assert cls.chunks_prompts == (cls.admission == "chunk"), name
        assert cls.uses_token_budget or not cls.chunks_prompts, name
        assert SchedulerConfig(policy=name).scheduler_class is cls


def test_the_config_is_what_a_scheduler_reads():
    """The schedulers read their settings through the `SchedulerSettings` protocol (they sit below the config,
    which validates itself against their registry): every property it names is the config's."""
    cfg = SchedulerConfig(policy="orca", max_model_len=100)
    assert isinstance(cfg, SchedulerSettings)
    names = [n for n, v in vars(SchedulerSettings).items() if isinstance(v, property)]
    assert sorted(names) == sorted(["policy", "token_budget", "max_num_seqs", "max_model_len", "tile_size",
                                    "watermark", "batch_token_limit", "scheduling_policy", "priority_max_wait_s",
                                    "max_prefill_share"])
    sched = make_scheduler(cfg, BlockManager(64))
    assert sched.config is cfg and sched.config.batch_token_limit == 512


def test_unknown_policy_lists_choices():
    with pytest.raises(ValueError, match="sarathi.*vllm"):
        SchedulerConfig(policy="fifo")
    cfg = SchedulerConfig()
    object.__setattr__(cfg, "policy", "fifo")  # bypass validation to reach the registry's own check
    with pytest.raises(ValueError, match="unknown scheduler policy 'fifo'.*orca"):
        make_scheduler(cfg, BlockManager(8))


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"token_budget": 0}, "token_budget"),
        ({"max_num_seqs": -1}, "max_num_seqs"),
        ({"max_model_len": 1.5}, "max_model_len"),
        ({"watermark": 1.0}, "watermark"),
        ({"tile_size": 0}, "tile_size"),
        ({"token_budget": 64, "max_num_seqs": 128}, "token_budget .64. must be >= max_num_seqs"),
        ({"policy": "vllm", "max_model_len": 4096, "max_num_batched_tokens": 2048}, "max_num_batched_tokens"),
    ],
)
def test_config_validation(kwargs, match):
    with pytest.raises(ValueError, match=match):
        SchedulerConfig(**kwargs)


def test_config_defaults_and_frozen():
    cfg = SchedulerConfig(token_budget=256, max_model_len=1024)
    assert cfg.max_num_batched_tokens == 1024 and cfg.batch_token_limit == 256
    assert SchedulerConfig(policy="orca", max_model_len=100).batch_token_limit == 512
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.token_budget = 1


def test_watermark_fraction_reaches_block_manager():
    sched, bm = _make(num_blocks=200, watermark=0.05)
    assert bm.watermark_blocks == 10


# ------------------------------------------------------------------------------------------ rejection


@pytest.mark.parametrize("policy", SCHEDULER_POLICIES)
def test_never_fitting_requests_are_refused_by_admission(policy):
    """The scheduler's limits (max_model_len, KV blocks above its watermark) are admission's rules: a request
    that could never run is refused before it reaches the scheduler, which only asserts it."""
    sched, bm = _make(policy, num_blocks=11, block_size=4, max_model_len=128, watermark=0.1)  # 40 usable tokens
    admission = Admission(vocab_size=1000, max_model_len=128, kv_cache=KVCapacity.of(bm))
    assert admission.kv_cache == KVCapacity(block_size=4, num_blocks=11, watermark_blocks=1)  # the scheduler's
    with pytest.raises(AdmissionError) as too_long:  # 129 > 128
        admission.check(list(range(100)), SamplingParams(max_tokens=29))
    assert too_long.value.param == "max_tokens" and "max_model_len (128)" in str(too_long.value)
    with pytest.raises(AdmissionError) as too_big:  # 44 tokens: 11 blocks > 10 usable
        admission.check(list(range(30)), SamplingParams(max_tokens=14))
    assert too_big.value.param == "max_tokens" and "11 KV blocks" in str(too_big.value)
    admission.check(list(range(30)), SamplingParams(max_tokens=10))  # 40 tokens: 10 blocks fit
    with pytest.raises(AssertionError):
        sched.add_sequence(Sequence("long", list(range(100)), SamplingParams(max_tokens=29), 0.0))
    assert not sched.has_unfinished()


def test_duplicate_id_raises():
    sched, _ = _make()
    sched.add_sequence(_seq(0, 4))
    with pytest.raises(ValueError, match="already"):
        sched.add_sequence(_seq(0, 4))


# ------------------------------------------------------------------------------------------ abort


def _step(sched):
    out = sched.schedule()
    complete(sched, out)
    return out


@pytest.mark.parametrize("policy", SCHEDULER_POLICIES)
def test_abort_frees_blocks_in_every_state(policy):
    sched, bm = _make(policy, num_blocks=64, block_size=4, token_budget=16, max_model_len=128)
    waiting, prefilling, decoding = _seq(0, 12, 50), _seq(1, 40, 50), _seq(2, 6, 50)
    # waiting: never scheduled
    sched.add_sequence(waiting)
    assert sched.abort_sequence("s0") is waiting
    assert waiting.status is SequenceStatus.FINISHED and waiting.finish_reason == "abort"
    assert sched.num_waiting == 0 and not sched.has_unfinished()
    assert sched.abort_sequence("s0") is None and sched.abort_sequence("nope") is None

    # decode state
    sched.add_sequence(decoding)
    while not decoding.is_decode:
        _step(sched)
    used = bm.num_used_blocks
    assert used > 0
    sched.add_sequence(prefilling)
    # running prefill: partly computed (chunking policies) or in flight (whole-prompt policies)
    for _ in range(10):
        out = sched.schedule()
        if prefilling in [c.seq for c in out.chunks]:
            break
        complete(sched, out)
    if policy == "faster_transformer":  # request-level: s1 waits for s2's batch to finish
        assert prefilling.status is SequenceStatus.WAITING
        assert sched.abort_sequence("s1") is prefilling
    elif policy in ("sarathi", "simple_chunking", "chunked_prefills_only"):
        complete(sched, out)
        assert prefilling.status is SequenceStatus.RUNNING and 0 < prefilling.num_computed_tokens < 40
        before, held = bm.num_used_blocks, len(prefilling.block_table)
        assert held > 0 and sched.abort_sequence("s1") is prefilling
        assert bm.num_used_blocks == before - held
    else:
        before, held = bm.num_used_blocks, len(prefilling.block_table)
        assert held >= 10 and sched.abort_sequence("s1") is prefilling  # aborted while its prefill is in flight
        assert bm.num_used_blocks == before - held  # its blocks are back at once
        complete(sched, out)  # the in-flight step ends: the aborted sequence is left alone
        assert prefilling.num_computed_tokens == 0
    assert prefilling.status is SequenceStatus.FINISHED and not prefilling.block_table
    bm.check_invariants(sched.running + sched.waiting)

    assert decoding.is_decode
    sched.abort_sequence("s2")
    assert bm.num_used_blocks == 0 and bm.num_free_blocks == 64 and not sched.has_unfinished()
    assert sched.schedule().is_empty


def test_abort_mid_prefill_under_sarathi_frees_partial_blocks():
    sched, bm = _make("sarathi", num_blocks=64, block_size=4, token_budget=16)
    seq = _seq(0, 40)
    sched.add_sequence(seq)
    _step(sched)
    assert seq.num_computed_tokens == 16 and len(seq.block_table) == 4  # only the first chunk's blocks
    sched.abort_sequence("s0")
    assert bm.num_used_blocks == 0


# ------------------------------------------------------------------------------------------ preemption


def test_preemption_evicts_latest_arrival_and_requeues_it_first():
    # 4-token blocks, 8 blocks. s0 and s1 each hold 3 blocks after prefill; growth needs more.
    sched, bm = _make("sarathi", num_blocks=8, block_size=4, token_budget=32, max_model_len=32)
    s0, s1, s2 = _seq(0, 12, 12), _seq(1, 12, 12), _seq(2, 4, 2)
    for s in (s0, s1):
        sched.add_sequence(s)
    _step(sched)
    assert s0.is_decode and s1.is_decode and bm.num_free_blocks == 2
    sched.add_sequence(s2)  # needs 1 block + nothing committed: admitted alongside
    preempted = []
    for _ in range(20):
        out = _step(sched)
        preempted += out.preempted
        if preempted:
            break
    victim = preempted[0]
    assert victim is not s0  # the earliest arrival is never evicted for a later one
    assert victim.status is SequenceStatus.WAITING and victim.num_computed_tokens == 0 and not victim.block_table
    assert victim.metrics.num_preemptions == 1 and sched.num_preemptions >= 1
    assert sched.waiting[0] is victim
    outputs_kept = victim.num_output_tokens
    assert outputs_kept > 0
    # Resume: the victim re-prefills prompt + outputs (in chunks), then keeps decoding to max_tokens.
    resumed_chunks = []
    for _ in range(200):
        if not sched.has_unfinished():
            break
        out = _step(sched)
        resumed_chunks += [c for c in out.chunks if c.seq is victim and c.start_position == 0]
    assert not sched.has_unfinished(), "no completion after 200 steps"
    assert resumed_chunks and resumed_chunks[0].seq is victim
    assert victim.num_output_tokens == 12 and victim.finish_reason == "length"
    assert bm.num_used_blocks == 0


def test_in_flight_sequences_are_never_scheduled_or_preempted():
    sched, bm = _make("sarathi", num_blocks=8, block_size=4, token_budget=32, max_model_len=32)
    s0, s1 = _seq(0, 12, 20), _seq(1, 12, 20)
    sched.add_sequence(s0)
    sched.add_sequence(s1)
    _step(sched)
    a = sched.schedule()  # both decode, in flight
    assert {c.seq for c in a.chunks} == {s0, s1}
    b = sched.schedule()  # nothing else can run: both are in flight
    assert b.is_empty and not b.preempted
    complete(sched, a)
    assert not sched.is_in_flight(s0)
