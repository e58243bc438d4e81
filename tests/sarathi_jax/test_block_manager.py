import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sarathi_jax.block_manager import BlockManager
from sarathi_jax.sampling_params import SamplingParams
from sarathi_jax.sequence import Sequence


def _seq(name="a"):
    return Sequence(name, [1], SamplingParams(), 0.0)


def test_allocate_grow_free():
    bm = BlockManager(10, block_size=4, watermark_blocks=2)
    assert (bm.num_free_blocks, bm.num_total_blocks, bm.num_used_blocks) == (10, 10, 0)
    a = _seq()
    assert bm.blocks_needed(a, 1) == 1 and bm.blocks_needed(a, 8) == 2 and bm.blocks_needed(a, 9) == 3
    bm.allocate(a, 5)
    assert a.block_table == [0, 1] and bm.num_used_blocks == 2
    assert bm.blocks_needed(a, 8) == 0 and bm.blocks_needed(a, 3) == 0
    bm.allocate(a, 8)  # no-op: already holds 8 tokens
    assert len(a.block_table) == 2
    bm.allocate(a, 9)
    assert a.block_table == [0, 1, 2]
    bm.free(a)
    assert a.block_table == [] and bm.num_free_blocks == 10
    bm.free(a)  # idempotent
    assert bm.num_free_blocks == 10


def test_watermark():
    bm = BlockManager(10, block_size=4, watermark_blocks=2)
    assert bm.can_allocate(8) and not bm.can_allocate(9)
    assert bm.can_allocate(10, use_watermark=False) and not bm.can_allocate(11, use_watermark=False)


def test_allocate_raises_when_short():
    bm = BlockManager(2, block_size=4)
    with pytest.raises(RuntimeError, match="out of KV blocks"):
        bm.allocate(_seq(), 9)
    assert bm.num_free_blocks == 2


@pytest.mark.parametrize("kwargs", [{"num_blocks": 0}, {"num_blocks": 4, "block_size": 0},
                                    {"num_blocks": 4, "watermark_blocks": 4}])
def test_bad_args(kwargs):
    with pytest.raises(ValueError):
        BlockManager(**kwargs)


def test_check_invariants_catches_double_ownership():
    bm = BlockManager(4, block_size=1)
    a, b = _seq("a"), _seq("b")
    bm.allocate(a, 2)
    bm.check_invariants([a])
    b.block_table.append(a.block_table[0])
    with pytest.raises(AssertionError):
        bm.check_invariants([a, b])
    with pytest.raises(AssertionError, match="leaked"):
        bm.check_invariants([])


@settings(max_examples=50, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 4), st.integers(0, 40)), max_size=40))
def test_random_alloc_free_conserves_blocks(ops):
    bm = BlockManager(16, block_size=4)
    seqs = [_seq(str(i)) for i in range(5)]
    for i, n in ops:
        seq = seqs[i]
        if n == 0:
            bm.free(seq)
        elif bm.can_allocate(bm.blocks_needed(seq, n), use_watermark=False):
            bm.allocate(seq, n)
            assert len(seq.block_table) * 4 >= n
        bm.check_invariants(seqs)
    for seq in seqs:
        bm.free(seq)
    assert bm.num_free_blocks == 16
