"""SamplingParams validation: every bad field is a ValueError that names the field."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sarathi_jax.request.sampling_params import (
    MAX_LOGPROBS,
    MAX_STOP_STRING_CHARS,
    MAX_STOP_STRINGS,
    MAX_STOP_TOKEN_IDS,
    SamplingParams,
)


@pytest.mark.parametrize(
    "kwargs, field",
    [
        (dict(temperature=-0.1), "temperature"),
        (dict(temperature=float("nan")), "temperature"),
        (dict(temperature=float("inf")), "temperature"),
        (dict(temperature="1.0"), "temperature"),
        (dict(top_p=0.0), "top_p"),
        (dict(top_p=1.5), "top_p"),
        (dict(top_p=-0.2), "top_p"),
        (dict(top_p=float("nan")), "top_p"),
        (dict(top_p="0.5"), "top_p"),
        (dict(top_k=-2), "top_k"),
        (dict(top_k=2.0), "top_k"),
        (dict(min_p=-0.1), "min_p"),
        (dict(min_p=1.1), "min_p"),
        (dict(min_p=float("nan")), "min_p"),
        (dict(seed=-1), "seed"),
        (dict(seed=1.5), "seed"),
        (dict(max_tokens=0), "max_tokens"),
        (dict(max_tokens=-3), "max_tokens"),
        (dict(max_tokens=2.5), "max_tokens"),
        (dict(max_tokens=True), "max_tokens"),
        (dict(min_tokens=-1), "min_tokens"),
        (dict(min_tokens=5, max_tokens=4), "min_tokens"),
        (dict(stop=[""]), "stop"),
        (dict(stop=["ok", 3]), "stop"),
        (dict(stop_token_ids=[-1]), "stop_token_ids"),
        (dict(stop_token_ids=["a"]), "stop_token_ids"),
        (dict(logprobs=-1), "logprobs"),
        (dict(logprobs=MAX_LOGPROBS + 1), "logprobs"),
        (dict(logprobs=1.5), "logprobs"),
        (dict(stop=["s"] * (MAX_STOP_STRINGS + 1)), "stop"),
        (dict(stop=["s" * (MAX_STOP_STRING_CHARS + 1)]), "stop"),
        (dict(stop_token_ids=[5] * (MAX_STOP_TOKEN_IDS + 1)), "stop_token_ids"),
    ],
)
def test_bad_field_is_named(kwargs: dict, field: str) -> None:
    with pytest.raises(ValueError, match=field):
        SamplingParams(**kwargs)


def test_stop_lists_at_their_bounds_are_accepted() -> None:
    params = SamplingParams(stop=["s" * MAX_STOP_STRING_CHARS] * MAX_STOP_STRINGS,
                            stop_token_ids=[5] * MAX_STOP_TOKEN_IDS)
    assert len(params.stop) == MAX_STOP_STRINGS and len(params.stop_token_ids) == MAX_STOP_TOKEN_IDS


def test_replace_revalidates() -> None:
    params = SamplingParams(max_tokens=4)
    assert params.replace(max_tokens=8).max_tokens == 8
    with pytest.raises(ValueError, match="max_tokens"):
        params.replace(max_tokens=0)


def test_defaults_and_normalisation() -> None:
    params = SamplingParams(
        temperature=np.float32(0.5), top_k=np.int64(3), seed=np.uint32(7), stop="END", stop_token_ids=[np.int64(5)]
    )
    assert params.stop == ("END",) and params.stop_token_ids == (5,)
    assert type(params.temperature) is float and type(params.top_k) is int and type(params.seed) is int
    assert hash(params) == hash(params.replace())  # stays hashable (tuples, plain numbers)
    assert SamplingParams(temperature=0).greedy and not SamplingParams().greedy
    assert SamplingParams(stop=None).stop == ()
    # Edges that are valid.
    SamplingParams(top_p=1.0, top_k=-1, min_p=1.0, logprobs=0, min_tokens=16, max_tokens=16, seed=2**70)
    SamplingParams(logprobs=MAX_LOGPROBS)


@settings(max_examples=100, deadline=None)
@given(
    temperature=st.floats(0, 10),
    top_p=st.floats(0, 1, exclude_min=True),
    top_k=st.integers(-1, 10_000),
    min_p=st.floats(0, 1),
    max_tokens=st.integers(1, 10_000),
    logprobs=st.none() | st.integers(0, MAX_LOGPROBS),
)
def test_valid_params_are_accepted(
    temperature: float, top_p: float, top_k: int, min_p: float, max_tokens: int, logprobs: int | None
) -> None:
    params = SamplingParams(
        temperature=temperature, top_p=top_p, top_k=top_k, min_p=min_p, max_tokens=max_tokens, logprobs=logprobs
    )
    assert params.max_tokens == max_tokens
