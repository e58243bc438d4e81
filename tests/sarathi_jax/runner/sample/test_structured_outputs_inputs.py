"""Structured outputs without a tokenizer: constraints parsed and refused (a ValueError with the grammar
library's message, before anything compiles), and the device-side mask application
(`sampling.apply_token_bitmask`) against a token-by-token reference and llguidance's own."""

from __future__ import annotations

import jax.numpy as jnp
import llguidance.numpy
import numpy as np
import pytest

from sarathi_jax.runner.sample.sampler import apply_token_bitmask
from sarathi_jax.request.structured_outputs import MAX_CONSTRAINT_CHARS, StructuredOutputs, bitmask_width


# ------------------------------------------------------------------------------------------------ bad input


def short_id(value: object) -> str:
    try:
        return str(value)[:40]
    except RecursionError:
        return "deeply nested"


def nested_schema(depth: int) -> dict:
    schema: dict = {"type": "string"}
    for _ in range(depth):
        schema = {"type": "object", "properties": {"x": schema}}
    return schema


@pytest.mark.parametrize(("value", "message"), [
    ({"json": {"type": "foo"}}, "Invalid type: foo"),
    ({"json": {"$ref": "#/definitions/nope"}}, "does not exist"),
    ({"json": "{not json"}, "not valid JSON"),
    ({"json": [1, 2]}, "is an object"),
    ({"regex": "a(b"}, "unclosed group"),
    ({"regex": ""}, "non-empty string"),
    ({"grammar": "start: foo"}, 'unknown name: "foo"'),
    ({"grammar": "root ::= [a-"}, "invalid grammar: Failed to convert the grammar from GBNF to Lark"),
    ({"choice": []}, "non-empty list"),
    ({"choice": ["a", 1]}, "every choice must be a string"),
    ({"json_object": "yes"}, "json_object must be true"),
    ({"regex": "a", "choice": ["a"]}, "exactly one of .*got regex, choice"),
    ({"json_object": False}, "exactly one of .*got none"),
    ({}, "got none"),
    ({"guided_json": {}}, "unknown keys"),
    ({"regex": "a" * (MAX_CONSTRAINT_CHARS + 1)}, f"the limit is {MAX_CONSTRAINT_CHARS}"),
    ({"json": {"enum": [f"value-{i}" for i in range(6000)]}}, f"the limit is {MAX_CONSTRAINT_CHARS}"),
    ({"json": nested_schema(100)}, "recursion limit exceeded"),  # llguidance's limit
    ({"json": nested_schema(500)}, "nested too deeply"),  # Python's, reached first
], ids=lambda v: short_id(v))
def test_bad_constraints_raise_value_error_naming_the_problem(value: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        StructuredOutputs.parse(value)


def test_a_constraint_built_directly_is_validated_too() -> None:
    with pytest.raises(ValueError, match="unknown kind"):
        StructuredOutputs("yaml", "x")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="unclosed group"):
        StructuredOutputs("regex", "(")


# --------------------------------------------------------------------------------------- device application


def reference_apply(logits: np.ndarray, bitmask: np.ndarray) -> np.ndarray:
    """Token by token: bit t % 32 of word t // 32."""
    out = logits.copy()
    for r in range(logits.shape[0]):
        for t in range(logits.shape[1]):
            if not (int(bitmask[r, t // 32]) >> (t % 32)) & 1:
                out[r, t] = -np.inf
    return out


@pytest.mark.parametrize("vocab", [100, 128])
def test_apply_token_bitmask_matches_the_reference(vocab: int) -> None:
    rng = np.random.default_rng(vocab)
    logits = rng.standard_normal((4, vocab)).astype(np.float32)
    bitmask = rng.integers(-(2**31), 2**31, size=(4, bitmask_width(vocab)), dtype=np.int64).astype(np.int32)
    bitmask[2] = -1  # unconstrained: all ones
    bitmask[3, 0] = np.int32(-(2**31))  # only bit 31 of the first word: the sign bit
    bitmask[3, 1:] = 0
    got = np.asarray(apply_token_bitmask(jnp.asarray(logits), jnp.asarray(bitmask)))
    want = reference_apply(logits, bitmask)
    np.testing.assert_array_equal(got, want)
    np.testing.assert_array_equal(got[2], logits[2])
    assert np.isfinite(got[3]).sum() == 1 and np.isfinite(got[3, 31])
    library = logits.copy()  # llguidance's own numpy application agrees
    llguidance.numpy.apply_token_bitmask_inplace(library, bitmask)
    np.testing.assert_array_equal(got, library)


def test_apply_token_bitmask_keeps_the_logits_dtype() -> None:
    logits = jnp.ones((2, 40), jnp.bfloat16)
    bitmask = jnp.asarray([[1, 0], [-1, -1]], jnp.int32)
    out = apply_token_bitmask(logits, bitmask)
    assert out.dtype == jnp.bfloat16 and out.shape == (2, 40)
    assert np.isfinite(np.asarray(out[0], np.float32)).sum() == 1 and np.isfinite(np.asarray(out[1], np.float32)).all()

