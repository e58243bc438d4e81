"""The bounds on a constraint's cost (sarathi_jax/request/structured_outputs.py): constraints llguidance gives up on
within their first tokens refused at compile, the per-request mask budget, and the compiled-grammar cache bounded
in bytes. On a small ASCII byte-level BPE (llguidance reads it)."""

from __future__ import annotations

import numpy as np
import pytest
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import decoders, models, pre_tokenizers, trainers

from sarathi_jax.request.structured_outputs import GrammarCompiler, MaskBudget, StructuredOutputs

# Each passes StructuredOutputs' own validation and, uncompiled, would fail only at the first tokens of an output.
HOSTILE = {
    "choice of 2001": {"choice": [f"opt{i}" for i in range(2001)]},
    "2500 rules": {"grammar": "start: r0\n" + "\n".join(f'r{i}: "x{i}" | r{i + 1}' for i in range(2500))
                   + '\nr2500: "end"\n'},
    "no finite string": {"grammar": 'start: a\na: "x" a\n'},
    "nested repeats": {"regex": "((a{0,100}){0,100}){0,100}"},
}
AMBIGUOUS = {"grammar": 'start: s\ns: s s | "a" | "b" | "ab"\n'}


@pytest.fixture(scope="module")
def tokenizer_json() -> str:
    backend = HFTokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    alphabet = [chr(b) for b in range(33, 127)] + ["\u0120"]
    trainer = trainers.BpeTrainer(vocab_size=160, initial_alphabet=alphabet, special_tokens=["<|eos|>"])
    backend.train_from_iterator(["hello world abab ab ba {\"a\": 1} opt12 x1 x2 end"] * 10, trainer=trainer)
    return backend.to_str()


def compiler(tokenizer_json: str, **kwargs) -> GrammarCompiler:
    return GrammarCompiler(tokenizer_json, 160, [0], **kwargs)


@pytest.mark.parametrize("name", HOSTILE)
def test_constraints_the_engine_gives_up_on_are_refused_at_compile(tokenizer_json: str, name: str) -> None:
    constraint = StructuredOutputs.parse(HOSTILE[name])  # the tokenizer-free checks let it through
    with pytest.raises(ValueError, match="structured_outputs: .* exceeds the grammar engine's limits"):
        compiler(tokenizer_json).compile(constraint)


def allowed(bitmask_row: np.ndarray) -> np.ndarray:
    return np.flatnonzero(np.unpackbits(bitmask_row.view(np.uint8), bitorder="little"))


def test_the_mask_budget_ends_a_grammar_whose_masks_grow_costly(tokenizer_json: str) -> None:
    c = compiler(tokenizer_json, mask_budget=MaskBudget(base_s=0.02, per_token_s=0.0))
    matcher = c.matcher(StructuredOutputs.parse(AMBIGUOUS))  # compiles: its first tokens are cheap
    bitmask = c.allocate_bitmask(1)
    for step in range(5000):
        matcher.fill_bitmask(bitmask, 0)
        if matcher.error is not None:
            break
        assert matcher.take(int(next(t for t in allowed(bitmask[0]) if t != 0))) is None
    assert matcher.error is not None and "past the budget of 0.02 s" in matcher.error, step
    assert matcher.mask_seconds > 0.02
    assert allowed(bitmask[0]).tolist() == [0]  # only EOS: the request can end
    assert matcher.take(0) == "error"


def test_the_default_budget_leaves_a_plain_walk_alone(tokenizer_json: str) -> None:
    c = compiler(tokenizer_json)
    matcher = c.matcher(StructuredOutputs.parse({"regex": "(ab ){40}"}))
    bitmask = c.allocate_bitmask(1)
    reason = None
    while reason is None:
        matcher.fill_bitmask(bitmask, 0)
        reason = matcher.take(int(allowed(bitmask[0])[-1]))
    assert reason == "stop" and matcher.error is None


def test_the_cache_is_bounded_in_bytes(tokenizer_json: str, monkeypatch: pytest.MonkeyPatch) -> None:
    regexes = [StructuredOutputs.parse({"regex": f"[a-z]{{{n}}}x{n}"}) for n in range(1, 5)]
    roomy, tight = compiler(tokenizer_json), compiler(tokenizer_json, cache_bytes=1)
    for r in regexes:
        roomy.compile(r), tight.compile(r)
    assert len(roomy) == 4 and roomy.cached_bytes >= 64 * sum(len(r.grammar) for r in regexes)
    assert len(tight) == 1  # the newest only: each grammar alone is past the bound
    builds = []
    for c in (roomy, tight):
        monkeypatch.setattr(c, "_build", lambda *a, _b=c._build: builds.append(1) or _b(*a))
    roomy.compile(regexes[0])
    assert builds == []  # cached
    tight.compile(regexes[0])
    assert builds == [1] and len(tight) == 1  # dropped, so compiled again


def test_a_dead_end_on_the_walked_path_is_not_a_refusal(tokenizer_json: str) -> None:
    """This tokenizer cannot write "é": the walk's lowest first token, "a", leads to a dead end, yet "b" is a whole
    output, so the constraint compiles (a dead end is the output's, mid-generation, as the engine reports it)."""
    comp = compiler(tokenizer_json)
    matcher = comp.matcher(StructuredOutputs.parse({"regex": "aé|b"}))
    bitmask = comp.allocate_bitmask(1)
    matcher.fill_bitmask(bitmask, 0)
    allowed = np.flatnonzero(np.unpackbits(bitmask[0].view(np.uint8), bitorder="little"))
    assert matcher.error is None and len(allowed) >= 2  # "a" and "b" may both start it
