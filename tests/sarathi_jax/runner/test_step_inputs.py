"""Packed step inputs: what the host writes is what the jitted functions read back, field by field."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from sarathi_jax.runner.input_batch import make_sampling_arrays
from sarathi_jax.runner.sample.inputs import MAX_BANNED
from sarathi_jax.request.sampling_params import SamplingParams
from sarathi_jax.runner.step_inputs import BatchLayout, pack_sampling, sampling_len, sampling_max_num_seqs, unpack_sampling


def test_batch_part_round_trips():
    layout = BatchLayout(num_tokens=32, max_num_seqs=4, max_blocks_per_seq=3)
    rng = np.random.default_rng(0)
    batch = layout.empty_batch()
    assert batch.size == layout.batch_len and BatchLayout.of_packed(batch.size, 4, 3) == layout
    views = layout.host_views(batch)
    expected = {name: rng.integers(-5, 1000, size=view.shape).astype(np.int32) for name, view in views.items()}
    for name, value in expected.items():
        views[name][...] = value
    token_ids, src_rows, positions, metadata, logits_indices = jax.jit(layout.unpack_batch)(jnp.asarray(batch))
    got = dict(token_ids=token_ids, src_rows=src_rows, positions=positions, logits_indices=logits_indices,
               slot_mapping=metadata.slot_mapping, kv_lens=metadata.kv_lens, block_tables=metadata.block_tables,
               cu_q_lens=metadata.cu_q_lens, num_seqs=metadata.num_seqs)
    assert got.keys() == expected.keys()
    for name in expected:
        np.testing.assert_array_equal(np.asarray(got[name]), expected[name], err_msg=name)


def test_empty_batch_is_padding():
    views = BatchLayout(16, 2, 2).host_views(BatchLayout(16, 2, 2).empty_batch())
    assert (views["slot_mapping"] == -1).all() and (views["src_rows"] == -1).all()
    assert views["num_seqs"][0] == 0 and not views["kv_lens"].any()


def test_sampling_part_round_trips_bit_for_bit():
    rows = [
        (SamplingParams(temperature=0.7, top_k=5, top_p=0.9, min_p=0.05, logprobs=3), 2**40 + 17, 4, (1, 2)),
        (SamplingParams(temperature=0.0), 0, 0, ()),
        (SamplingParams(temperature=1.3, seed=9), 2**64 - 1, 11, tuple(range(MAX_BANNED))),
    ]
    arrays = make_sampling_arrays(rows, 5)
    part = pack_sampling(arrays)
    assert part.dtype == np.int32 and part.shape == (sampling_len(5),)
    got = jax.jit(unpack_sampling, static_argnums=1)(jnp.asarray(part), 5)
    for name, want, have in zip(arrays._fields, arrays, got):
        have = np.asarray(have)
        assert have.dtype == want.dtype and have.shape == want.shape, name
        np.testing.assert_array_equal(have.view(np.uint32), want.view(np.uint32), err_msg=name)


def test_sampling_part_first_rows_are_the_full_parts_first_rows():
    rows = [
        (SamplingParams(temperature=0.7, top_k=5, top_p=0.9, min_p=0.05, logprobs=3), 2**40 + 17, 4, (1, 2)),
        (SamplingParams(temperature=1.3, seed=9), 2**64 - 1, 11, tuple(range(MAX_BANNED))),
        (SamplingParams(temperature=0.0), 0, 0, ()),
    ]
    arrays = make_sampling_arrays(rows, 6)
    part = jnp.asarray(pack_sampling(arrays))
    assert sampling_max_num_seqs(part.size) == 6
    for r in (1, 2, 3, 6):
        got = jax.jit(unpack_sampling, static_argnums=(1, 2))(part, 6, r)
        for name, want, have in zip(arrays._fields, arrays, got):
            have = np.asarray(have)
            assert have.shape == (r,) + want.shape[1:], (name, r)
            np.testing.assert_array_equal(have.view(np.uint32), want[:r].view(np.uint32), err_msg=f"{name} {r}")


def test_logits_rows_are_at_most_the_buckets_tokens():
    assert [BatchLayout(t, 8, 2).num_rows for t in (4, 8, 16, 512)] == [4, 8, 8, 8]
