"""The sampler's host side (`sampling_inputs`): the array builder, the variants and the host's choice among them,
which gives bitwise the most general variant's results; and no data-dependent control flow in any variant."""

from __future__ import annotations

import functools
import re
import warnings
from collections.abc import Iterator

import jax
import jax.extend.core as jex
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from sarathi_jax.runner.input_batch import make_sampling_arrays, sampler_variant, write_sampling_row
from sarathi_jax.runner.sample.sampler import sample, sample_jit
from sarathi_jax.runner.sample.inputs import (
    FULL_CONSTRAINED,
    FULL_VARIANT,
    GREEDY_CONSTRAINED,
    MAX_BANNED,
    SAMPLER_FILTERS,
    SAMPLER_VARIANTS,
    TOP_K_CANDIDATES,
    SamplerVariant,
    constrained_variant,
    general_variant,
    padded_bitmask,
)
from sarathi_jax.request.sampling_params import MAX_LOGPROBS, SamplingParams
from tests.sarathi_jax.sampling_oracle import S, V, WIDE_V, random_logits, row, run


def test_builder_limits() -> None:
    with pytest.raises(AssertionError):  # admission refuses such a request; here it is an invariant
        make_sampling_arrays([row(banned=tuple(range(MAX_BANNED + 1)))], S)
    with pytest.raises(ValueError, match="max_num_seqs"):
        make_sampling_arrays([row()] * (S + 1), S)
    arrays = make_sampling_arrays([row(temperature=0.5, top_k=-1, banned=(3, 4), logprobs=2, seed=9)], 4)
    assert arrays.temperature.tolist() == [0.5, -1.0, -1.0, -1.0]  # padding rows are marked < 0
    assert arrays.top_k[0] == 0  # -1 normalised to "off"
    assert arrays.banned_token_ids[0].tolist() == [3, 4] + [-1] * (MAX_BANNED - 2)
    assert arrays.num_logprobs.tolist() == [2, -1, -1, -1]  # -1: no logprobs


# ----------------------------------------------------------------------------------------------- variants


def test_a_temperature_beyond_float32_is_clamped_without_warning() -> None:
    arrays = make_sampling_arrays([], 1)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # numpy's float32 overflow is a RuntimeWarning
        write_sampling_row(arrays, 0, SamplingParams(temperature=1e300), 0, ())
    assert arrays.temperature[0] == np.finfo(np.float32).max


def test_variants_and_host_choice() -> None:
    assert len(SAMPLER_VARIANTS) == len(set(SAMPLER_VARIANTS)) == 10 and FULL_VARIANT in SAMPLER_VARIANTS
    # The constrained ones: greedy and the general one, each serving what its unconstrained cousins serve.
    assert [v for v in SAMPLER_VARIANTS if v.constrained] == [GREEDY_CONSTRAINED, FULL_CONSTRAINED]
    assert {constrained_variant(v) for v in SAMPLER_VARIANTS} == {GREEDY_CONSTRAINED, FULL_CONSTRAINED}
    assert constrained_variant(SamplerVariant(False, "none", False)) == GREEDY_CONSTRAINED
    assert constrained_variant(SamplerVariant(False, "none", True)) == FULL_CONSTRAINED
    assert {general_variant(v) for v in SAMPLER_VARIANTS} == {FULL_VARIANT, FULL_CONSTRAINED}
    mask = padded_bitmask(np.zeros((2, 3), np.int32), 4, 3)
    assert mask.shape == (4, 3) and (mask[:2] == 0).all() and (mask[2:] == -1).all()
    assert (padded_bitmask(None, 2, 3) == -1).all()
    assert all(v.sampled or v.filter == "none" for v in SAMPLER_VARIANTS)
    assert {v.filter for v in SAMPLER_VARIANTS} == set(SAMPLER_FILTERS)
    with pytest.raises(ValueError, match="filter"):
        SamplerVariant(sampled=False, filter="top_k", logprobs=False)
    with pytest.raises(ValueError, match="filter"):
        SamplerVariant(sampled=True, filter="top_p", logprobs=False)
    greedy, none, top_k, exact = (
        SamplerVariant(False, "none", False), SamplerVariant(True, "none", False),
        SamplerVariant(True, "top_k", False), SamplerVariant(True, "exact", False),
    )
    assert sampler_variant([]) == greedy
    assert sampler_variant([row(temperature=0.0, top_k=5, top_p=0.5)]) == greedy
    assert sampler_variant([row(temperature=0.0, logprobs=0)]) == SamplerVariant(False, "none", True)  # N = 0 too
    assert sampler_variant([row(temperature=0.0, logprobs=2)]) == SamplerVariant(False, "none", True)
    assert sampler_variant([row(temperature=1e-6)]) == greedy
    assert sampler_variant([row(min_p=0.5)]) == none
    assert sampler_variant([row(temperature=0.0), row(top_k=3)]) == top_k
    assert sampler_variant([row(top_k=TOP_K_CANDIDATES, min_p=0.1), row(top_k=1), row()]) == top_k
    assert sampler_variant([row(top_k=5), row(temperature=0.0, top_k=500, top_p=0.5)]) == top_k  # greedy: ignored
    assert sampler_variant([row(top_k=TOP_K_CANDIDATES + 1)]) == exact
    assert sampler_variant([row(top_k=50, top_p=0.9)]) == exact
    assert sampler_variant([row(top_k=50), row(top_p=0.99)]) == exact
    assert sampler_variant([row(top_p=0.9), row(temperature=0.0, logprobs=1)]) == FULL_VARIANT


def covers(w: SamplerVariant, variant: SamplerVariant) -> bool:
    """Whether `w` has every capability of `variant` (and so serves every batch that `variant` serves)."""
    rank = SAMPLER_FILTERS.index
    return w.sampled >= variant.sampled and rank(w.filter) >= rank(variant.filter) and w.logprobs >= variant.logprobs


def random_batch(rng: np.random.Generator, v: int) -> list:
    """A mixed batch of up to S rows; each capability (sampling, filters: none, small top-k only or any,
    logprobs) is allowed or not at random, so that every variant gets chosen."""
    allow_sampled, allow_logprobs = rng.random(2) < 0.6
    allow_filter = str(rng.choice(SAMPLER_FILTERS))
    rows = []
    for i in range(int(rng.integers(0, S + 1))):
        params: dict = {"temperature": 0.0}
        if allow_sampled and rng.random() < 0.7:
            params = {"temperature": float(rng.choice([0.3, 1.0, 2.0])), "min_p": float(rng.choice([0.0, 0.05]))}
            if allow_filter == "top_k":  # k <= TOP_K_CANDIDATES, no top-p (k >= v is off on device)
                params["top_k"] = int(rng.choice([0, 1, 5, 50, 127, TOP_K_CANDIDATES]))
            elif allow_filter == "exact":
                params["top_k"] = int(rng.choice([0, 1, 5, 50, 150, 10_000]))
                params["top_p"] = float(rng.choice([1.0, 0.9, 0.3]))
        if allow_logprobs and rng.random() < 0.5:
            params["logprobs"] = int(rng.choice([0, 3, MAX_LOGPROBS]))
        banned = tuple(int(t) for t in rng.choice(v, int(rng.integers(0, 4)), replace=False))
        rows.append(row(seed=int(rng.integers(2**63)), step=int(rng.integers(1000)), banned=banned, **params))
    return rows


@pytest.mark.parametrize("v", [V, WIDE_V])
@settings(max_examples=12, deadline=None)
@given(seed=st.integers(0, 2**32 - 1))
@example(seed=3)  # (both v) filter "top_k" with k up to TOP_K_CANDIDATES, heavy ties
@example(seed=23)  # (both v) filter "top_k" + logprobs
def test_host_chosen_variant_matches_the_full_variant_bitwise(v: int, seed: int) -> None:
    rng = np.random.default_rng(seed)
    if rng.random() < 0.25:  # heavy ties: the k-th value shared by many tokens
        logits = rng.integers(-3, 3, (S, v)).astype(np.float32)
    else:
        logits = random_logits(rng, (S, v), scale=float(rng.choice([0.3, 3.0])))
    rows = random_batch(rng, v)
    chosen = sampler_variant(rows)
    full = run(logits, rows, variant=FULL_VARIANT)
    # Every variant able to serve these rows (the chosen one's capabilities or more) agrees with the full one.
    covering = [w for w in SAMPLER_VARIANTS if covers(w, chosen)]
    assert chosen in covering
    for variant in covering:
        out = run(logits, rows, variant=variant)
        np.testing.assert_array_equal(out.token_ids, full.token_ids, err_msg=str(variant))
        np.testing.assert_array_equal(out.logprobs, full.logprobs, err_msg=str(variant))
        wants = np.array([(r[0].logprobs or 0) > 0 for r in rows] + [False] * (S - len(rows)))
        if variant.logprobs:
            np.testing.assert_array_equal(out.top_token_ids[wants], full.top_token_ids[wants])
            np.testing.assert_array_equal(out.top_logprobs[wants], full.top_logprobs[wants])
        else:
            assert not wants.any()
            assert (out.top_token_ids == 0).all() and np.isneginf(out.top_logprobs).all()


def all_jaxprs(jaxpr: jex.Jaxpr) -> Iterator[jex.Jaxpr]:
    yield jaxpr
    for sub in jex.subjaxprs(jaxpr):
        yield from all_jaxprs(sub)


@pytest.mark.parametrize("variant", SAMPLER_VARIANTS, ids=str)
def test_no_data_dependent_control_flow(variant: SamplerVariant) -> None:
    """No cond / while anywhere (a GPU would sync with the host on its predicate), nor in the StableHLO a CUDA
    build would compile (lowered here without a GPU)."""
    logits = jnp.zeros((S, WIDE_V), jnp.float32)
    arrays = make_sampling_arrays([], S)
    bitmask = padded_bitmask(None, S, -(-WIDE_V // 32)) if variant.constrained else None
    closed = jax.make_jaxpr(functools.partial(sample, variant=variant))(logits, arrays, token_bitmask=bitmask)
    primitives = {eqn.primitive.name for jaxpr in all_jaxprs(closed.jaxpr) for eqn in jaxpr.eqns}
    assert not primitives & {"cond", "while", "scan"}, primitives
    module = jax.export.export(sample_jit, platforms=["cuda"])(logits, arrays, variant=variant,
                                                                token_bitmask=bitmask).mlir_module()
    ops = set(re.findall(r"stablehlo\.(\w+)", module))
    assert not ops & {"while", "case", "if"}, ops
    assert ("top_k" in primitives) == (variant.logprobs or variant.filter == "top_k")
    assert ("scatter-add" in primitives) == (variant.filter == "exact")  # the radix-select histograms
    assert ("random_bits" in primitives) == variant.sampled
