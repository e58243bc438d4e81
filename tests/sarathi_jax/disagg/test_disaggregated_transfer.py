"""The real disaggregated engine's KV copy, not waited for, and aborts of a decode-side recompute on
the real engine, on 8 virtual CPU devices (XLA_FLAGS set in tests/conftest.py).

`KVBlockMover.move` dispatches the gather, the device-to-device copy and the scatter and returns at once; the
transfer's time is from the gather's dispatch to when a thread saw the copy done. The prefill blocks are freed
at once: a later write to them is ordered after the gather by the runtime (donation waits for earlier readers).
The tokens of the async copy against HF's: tests/sarathi_jax/disagg/test_disaggregated_engine.py.
"""

from __future__ import annotations

import time
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from sarathi_jax.disagg.kv_transfer import KVBlockMover, PendingCopy
from tests.sarathi_jax.engine_helpers import hf_generate, run_staggered
from tests.sarathi_jax.disagg.test_disaggregated_engine import GREEDY, PREEMPTION_FIELDS, PREEMPTION_PARAMS, make_engine


@pytest.fixture(scope="module")
def model_dir(tiny_checkpoint):
    return tiny_checkpoint()  # Llama, 8 heads, 4 KV heads, 4 layers


@pytest.fixture(scope="module")
def mover(model_dir) -> KVBlockMover:
    """The "1:1" engine's mover, its bucket of one block compiled."""
    engine = make_engine(model_dir, "1:1")
    mover = engine.movers[("prefill0", "decode0")]
    # Committed to its device, as a step's output is (this engine has not stepped: its cache is still the
    # uncommitted zeros). `_busy` commits it too; an uncommitted cache here would make the timed move compile
    # its gather again (a new jit cache key), which it must not time.
    source = mover.source
    source.kv_cache = jax.device_put(source.kv_cache, source.kv_cache[0].sharding)
    mover.move([0], [0]).done_at(wait=True)
    return mover


@partial(jax.jit, donate_argnums=(0,))
def _busy(kv_cache, x):
    """Device work that the source cache's next reader waits for: x @ x 192 times, the cache unchanged. About
    0.75 s on 2 cores: each host call made while it runs (the move's dispatches) can wait tens of ms for the
    CPU client's busy workers, and `move`'s return must still be well inside it."""
    y = jax.lax.fori_loop(0, 192, lambda _, y: jnp.tanh(y @ x), x)
    k, v = kv_cache
    return k + (y[0, 0] * 0).astype(k.dtype), v


@partial(jax.jit, donate_argnums=(0,), static_argnums=(1,))
def _fill(kv_cache, block, value):
    """Write `value` into every K and V entry of `block` (a prefill step reusing the block, as far as it goes)."""
    return tuple(pages.at[:, block].set(value) for pages in kv_cache)


def _busy_input(stage, size=768):
    x = np.random.default_rng(0).standard_normal((size, size), np.float32) / size ** 0.5
    (device,) = stage.kv_cache[0].devices()  # "1:1": one device a side
    return jax.device_put(x, device)


def _busy_seconds(stage, x) -> float:
    """How long `_busy` takes on `stage`'s devices (compiled first; the faster of two runs)."""
    stage.kv_cache = jax.block_until_ready(_busy(stage.kv_cache, x))
    times = []
    for _ in range(2):
        start = time.perf_counter()
        stage.kv_cache = jax.block_until_ready(_busy(stage.kv_cache, x))
        times.append(time.perf_counter() - start)
    return min(times)


def test_move_returns_before_the_copy_and_times_it_from_dispatch(mover):
    """With the source devices busy, `move` returns at once (the engine thread goes on dispatching), the copy
    is not done then, and its time, from the gather's dispatch to the copy seen done, spans the work queued
    before it. Waiting inside `move` (as before) fails the first assertion."""
    source = mover.source
    x = _busy_input(source)
    busy_s = _busy_seconds(source, x)
    start = time.perf_counter()
    source.kv_cache = _busy(source.kv_cache, x)
    copy = mover.move([1], [2])
    returned = time.perf_counter() - start
    assert isinstance(copy, PendingCopy) and copy.done_at() is None
    end = copy.done_at(wait=True)
    assert returned < 0.5 * busy_s < end - copy.start, (returned, busy_s, end - copy.start)
    assert copy.num_bytes == 2 * mover.target.kv_cache[0][:, :1].nbytes  # one block, K and V


def test_source_blocks_reused_right_after_the_move(mover):
    """The engine frees a request's prefill blocks as soon as its move is dispatched, and the next prefill may
    write them at once: dispatched right after `move`, behind device work that holds the gather back, an
    overwrite of the source blocks does not reach the target. A move that read the source blocks later than it
    was dispatched (after the blocks were free) fails it."""
    source, target = mover.source, mover.target
    x = _busy_input(source)
    _busy_seconds(source, x)  # compiled
    for block, value in ((3, 1.5), (4, -2.0)):
        source.kv_cache = _fill(source.kv_cache, block, value)
    source.kv_cache = _busy(source.kv_cache, x)
    copy = mover.move([3, 4], [5, 6])
    for block in (3, 4):  # a new prompt's prefill writing the freed blocks
        source.kv_cache = _fill(source.kv_cache, block, 0.0)
    copy.done_at(wait=True)
    for pages in target.kv_cache:
        got = np.asarray(pages[:, 5:7])
        np.testing.assert_array_equal(got[:, 0], 1.5)
        np.testing.assert_array_equal(got[:, 1], -2.0)
    for pages in source.kv_cache:
        np.testing.assert_array_equal(np.asarray(pages[:, 3:5]), 0.0)


class _Unseen:
    """A copy the engine sees as in flight until `gate["open"]`: holds the stage "moving" open for a test."""

    def __init__(self, copy: PendingCopy, gate: dict) -> None:
        self.copy, self.gate = copy, gate
        self.start, self.num_bytes = copy.start, copy.num_bytes

    def done_at(self, *, wait: bool = False) -> float | None:
        return self.copy.done_at(wait=True) if wait or self.gate["open"] else None


@pytest.fixture(scope="module")
def recompute_case(model_dir):
    """Three 40-token prompts, arriving one step apart, on caches of 8 blocks (the decode side preempts as the
    requests grow), HF's tokens, and one "1:1" engine reused by each stage."""
    rng = np.random.default_rng(11)
    prompts = [rng.integers(3, 256, size=40).tolist() for _ in range(3)]
    hf = {f"r{i}": t for i, t in enumerate(hf_generate(model_dir, prompts, 40))}
    return prompts, hf, make_engine(model_dir, "1:1", **PREEMPTION_FIELDS)


@pytest.mark.parametrize("stage", ["queued", "prefill", "held", "moving"])
def test_abort_of_a_recompute_on_the_real_engine(recompute_case, monkeypatch, stage):
    """A request preempted on the decode side is aborted while its recompute is queued at the prefill side,
    re-prefilling, held for decode room, or moving (its copy dispatched, not yet seen done: held unseen by the
    test): its last output says abort with the tokens it had (HF's so far), nothing follows, the other
    requests' tokens are HF's, no block is left on either side and every transfer is recorded."""
    prompts, hf, engine = recompute_case
    engine.reset_prefix_cache()
    recomputed: list[str] = []
    queue_recompute = engine.recompute
    monkeypatch.setattr(engine, "recompute", lambda state, now: (recomputed.append(state.seq.seq_id),
                                                                   queue_recompute(state, now)))
    gate, moves = {"open": stage != "moving"}, []

    def move(source_blocks, target_blocks, real=engine.movers[("prefill0", "decode0")].move):
        moves.append(real(source_blocks, target_blocks))  # copies dispatched after a recompute stay unseen
        return _Unseen(moves[-1], gate) if recomputed else moves[-1]

    monkeypatch.setattr(engine.movers[("prefill0", "decode0")], "move", move)
    transfers_before = engine.stats()["num_transfers"]
    outputs: dict[str, list] = {f"r{i}": [] for i in range(3)}
    steps, victim = 0, None
    while victim is None or engine.stage_of(victim) != stage:
        if steps < len(prompts):
            engine.add_request(f"r{steps}", prompts[steps], PREEMPTION_PARAMS)
        for out in engine.step():
            outputs[out.request_id].append(out)
        victim = victim or next(iter(recomputed), None)
        steps += 1
        assert steps < 2000 and engine.has_unfinished_requests(), f"never reached {stage}"
    assert engine.abort(victim) and not engine.abort(victim) and engine.stage_of(victim) is None
    gate["open"] = True
    seen = len(outputs[victim])
    while engine.has_unfinished_requests():
        for out in engine.step():
            outputs[out.request_id].append(out)
        steps += 1
        assert steps < 4000
    after = outputs[victim][seen:]
    assert [o.finish_reason for o in after] == ["abort"] and after[0].new_token_ids == ()
    emitted = [t for o in outputs[victim] for t in o.new_token_ids]
    assert list(after[0].token_ids) == emitted == hf[victim][:len(emitted)] and emitted
    assert {r: list(o[-1].token_ids) for r, o in outputs.items() if r != victim} == {
        r: t for r, t in hf.items() if r != victim}
    assert all(i.block_manager.num_used_blocks == 0 and i.incoming == 0 for i in engine.instances)
    # Every move dispatched is recorded, with its bytes and time (a landing whose blocks the decode side's
    # prefix cache all held copies nothing); each request moved at least once.
    s, records = engine.stats(), engine.transfer_log[transfers_before:]
    copied = [t for t in records if t.num_blocks]
    assert s["num_moving"] == 0 and s["num_transfers"] - transfers_before == len(records) >= 3
    assert len(copied) == len(moves) and all(t.seconds > 0 and t.num_bytes > 0 for t in copied)


def test_decode_side_prefix_cache_moves_only_the_rest(model_dir):
    """Prefix caching on both sides: r1 (the 40 tokens r0 began with, then its own 12) arrives after r0 is done
    and moves only its blocks past the two full ones that r0 left in the decode side's cache; tokens are HF's.
    r2 (r1's prompt again) shares three blocks there: zeroed, its decode steps read them and its tokens differ
    (so the shared blocks are what it decodes on, not a copy)."""
    rng = np.random.default_rng(5)
    shared = rng.integers(3, 256, size=40).tolist()
    prompts = [shared + rng.integers(3, 256, size=n).tolist() for n in (5, 12)]
    hf = {f"r{i}": t for i, t in enumerate(hf_generate(model_dir, prompts, GREEDY.max_tokens))}
    engine = make_engine(model_dir, "1:1", enable_prefix_caching=True)
    assert run_staggered(engine, prompts, GREEDY, arrive_every=40) == hf
    assert [(t.request_id, t.num_blocks) for t in engine.transfer_log] == [("r0", 3), ("r1", 2)]  # 4 - 2 shared
    decode = engine.decode[0]
    assert decode.core.stats()["prefix_cache_hits"] == 32
    assert engine.stats()["prefix_cache_hits"] == engine.prefill[0].block_manager.num_prefix_hits == 32
    assert all(i.block_manager.num_used_blocks == 0 for i in engine.instances)
    stage = decode.engine.runner.stages[0]
    stage.kv_cache = jax.tree.map(lambda a: a * 0, stage.kv_cache)  # what the decode side caches: zeros
    engine.add_request("r2", prompts[1], GREEDY)
    got = run_staggered(engine, [], GREEDY)["r2"]
    assert engine.transfer_log[-1].num_blocks == 1 and got[0] == hf["r1"][0] and got != hf["r1"]
