import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sarathi_jax.scheduler.block_manager import BlockManager
from sarathi_jax.request.sampling_params import SamplingParams
from sarathi_jax.request.sequence import Sequence


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


# ---------------------------------------------------------------------------------------------- prefix caching


def _prompt(name, tokens):
    return Sequence(name, list(tokens), SamplingParams(), 0.0)


def _admit(bm, seq):
    """What the scheduler does at admission: take the cached prefix, then blocks for the rest."""
    hit = bm.match_prefix(seq)
    bm.acquire_prefix(seq, hit)
    seq.num_computed_tokens = hit.num_tokens
    bm.allocate(seq, seq.num_tokens)
    return hit


def _compute(bm, seq, n=None):
    seq.num_computed_tokens = seq.num_tokens if n is None else n
    bm.cache_full_blocks(seq)


def test_prefix_hit_shares_full_blocks_and_recomputes_the_last_token():
    bm = BlockManager(16, block_size=4, enable_prefix_caching=True)
    a = _prompt("a", range(10))  # blocks [0..3], [4..7] full, [8, 9] partial
    assert _admit(bm, a).num_tokens == 0
    _compute(bm, a)
    assert bm.num_cached_blocks == 2  # the partial block is not registered
    b = _prompt("b", list(range(8)) + [99, 98, 97])
    hit = _admit(bm, b)
    assert hit.blocks == tuple(a.block_table[:2]) and hit.num_tokens == 8 and hit.num_evictable == 0
    assert [bm.ref_count(x) for x in b.block_table] == [2, 2, 1]
    bm.check_invariants([a, b])
    # a prompt that is exactly cached blocks still recomputes its last token, in a block of its own
    c = _prompt("c", range(8))
    assert _admit(bm, c).num_tokens == 4 and bm.ref_count(c.block_table[1]) == 1
    assert (bm.num_prefix_queries, bm.num_prefix_hits) == (10 + 11 + 8, 0 + 8 + 4)
    for s in (a, b, c):
        bm.free(s)
    bm.check_invariants([])
    assert bm.num_free_blocks == 16 and bm.num_used_blocks == 0


def test_freed_blocks_stay_cached_until_evicted_least_recently_freed_first():
    bm = BlockManager(4, block_size=2, enable_prefix_caching=True)
    a = _prompt("a", [1, 2, 3, 4, 5])
    _admit(bm, a)
    _compute(bm, a)
    bm.free(a)
    assert bm.num_free_blocks == 4 and bm.num_cached_blocks == 2
    # still there: a new request with the same prefix revives them (they counted as free)
    b = _prompt("b", [1, 2, 3, 4, 9])
    hit = _admit(bm, b)
    assert hit.num_tokens == 4 and hit.num_evictable == 2 and bm.num_free_blocks == 1
    bm.free(b)
    # b's tail is evicted before its head: a request needing 3 fresh blocks takes the plain free ones first,
    # then the cached [3, 4] block, keeping [1, 2]
    c = _prompt("c", [7] * 6)
    _admit(bm, c)
    assert bm.num_cached_blocks == 1 and _prompt("d", [1, 2, 3, 4, 0]).block_table == []
    assert bm.match_prefix(_prompt("d", [1, 2, 3, 4, 0])).num_tokens == 2
    bm.check_invariants([c])


def test_pending_tokens_are_never_registered_and_duplicates_stay_private():
    bm = BlockManager(8, block_size=2, enable_prefix_caching=True)
    a = _prompt("a", [1, 2, 3])
    _admit(bm, a)
    _compute(bm, a)
    a.append_pending_token()  # position 3: sampled, value unknown
    bm.allocate(a, 4)
    _compute(bm, a, 4)
    assert bm.num_cached_blocks == 1  # [3, pending] waits for the value
    a.resolve_pending_token(5)
    bm.cache_full_blocks(a)
    assert bm.num_cached_blocks == 2
    # the same content computed twice (both admitted before either registered): the second stays private
    b, c = _prompt("b", [8, 9, 1]), _prompt("c", [8, 9, 2])
    _admit(bm, b), _admit(bm, c)
    _compute(bm, b), _compute(bm, c)
    assert bm.num_cached_blocks == 3 and not bm.is_cached(c.block_table[0])
    bm.free(c)
    bm.check_invariants([a, b])


def test_reset_prefix_cache():
    bm = BlockManager(4, block_size=2, enable_prefix_caching=True)
    a, b = _prompt("a", [1, 2, 3]), _prompt("b", [4, 5, 6])
    for s in (a, b):
        _admit(bm, s)
        _compute(bm, s)
    bm.free(a)
    bm.reset_prefix_cache()
    assert bm.num_cached_blocks == 0 and bm.match_prefix(_prompt("x", [1, 2, 3])).num_tokens == 0
    bm.check_invariants([b])
    bm.free(b)
    bm.check_invariants([])
    assert bm.num_free_blocks == 4


def test_prefix_caching_off_never_shares():
    bm = BlockManager(8, block_size=2)
    a = _prompt("a", [1, 2, 3])
    _admit(bm, a)
    _compute(bm, a)
    assert _admit(bm, _prompt("b", [1, 2, 3])).num_tokens == 0 and bm.num_cached_blocks == 0


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["admit", "compute", "free"]), st.integers(0, 5), st.integers(0, 3),
                          st.integers(1, 14)), max_size=60))
def test_random_prefix_sharing_conserves_blocks(ops):
    """Random admissions (prompts from 3 families sharing prefixes), computation and frees (finish, abort or
    preemption alike): reference counts stay >= 0 and match the tables, a referenced block is never evicted
    or handed out again, and every block comes back."""
    bm = BlockManager(12, block_size=2, enable_prefix_caching=True)
    seqs: dict[int, Sequence] = {}
    for op, i, family, n in ops:
        seq = seqs.get(i)
        if op == "admit" and seq is None:
            seq = _prompt(str(i), [100 * family + t for t in range(n)])
            hit = bm.match_prefix(seq)
            if bm.can_allocate(bm.blocks_for_tokens(n - hit.num_tokens) + hit.num_evictable, use_watermark=False):
                held = {b: bm.ref_count(b) for s in seqs.values() for b in s.block_table}
                _admit(bm, seq)
                seqs[i] = seq
                for b, r in held.items():  # nothing held was evicted: counts only went up
                    assert bm.ref_count(b) >= r
        elif op == "compute" and seq is not None:
            _compute(bm, seq, min(seq.num_tokens, seq.num_computed_tokens + n))
        elif op == "free" and seq is not None:
            bm.free(seq)
            del seqs[i]
        bm.check_invariants(seqs.values())
    for seq in seqs.values():
        bm.free(seq)
    bm.check_invariants([])
    assert bm.num_free_blocks == 12


@pytest.mark.parametrize("caching", [False, True])
def test_retake_gives_back_the_blocks_just_freed(caching):
    """A disaggregated prefill instance holds a finished prompt's own blocks (they hold its K/V): `retake` takes
    exactly those back, a cached one keeps its registration, and freeing the holder returns them."""
    bm = BlockManager(8, block_size=4, enable_prefix_caching=caching)
    other = _seq("other")
    bm.allocate(other, 4)
    seq = Sequence("a", list(range(10)), SamplingParams(), 0.0)
    bm.allocate(seq, 10)
    seq.num_computed_tokens = 10  # two full blocks computed: registered when freed (with caching)
    blocks = seq.block_table
    bm.free(seq)
    assert bm.num_free_blocks == 7 and bm.num_cached_blocks == (2 if caching else 0)
    holder = Sequence("a", list(range(10)), SamplingParams(), 0.0)
    bm.retake(holder, blocks)
    assert holder.block_table == blocks and bm.num_free_blocks == 4
    assert [bm.ref_count(b) for b in blocks] == [1, 1, 1]
    assert [bm.is_cached(b) for b in blocks] == [caching, caching, False]
    bm.check_invariants([other, holder])
    bm.allocate(_seq("b"), 16)  # the other free blocks: none of the held ones
    bm.free(holder)
    assert bm.num_free_blocks == 3 and bm.num_cached_blocks == (2 if caching else 0)
