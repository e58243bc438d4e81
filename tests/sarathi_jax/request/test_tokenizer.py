"""Tokenizer wrapper, incremental detokenization (multi-byte splits, context-dependent decoders), stop strings."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import decoders, models, pre_tokenizers, processors, trainers

from sarathi_jax.request.tokenizer import (
    REPLACEMENT_CHAR,
    IncrementalDetokenizer,
    StopStringChecker,
    Tokenizer,
    find_stop_string,
    load_tokenizer,
)

CORPUS = [
    "héllo wörld 你好",
    "the quick brown fox jumps over the lazy dog",
    "naïve café, déjà vu: größer als 你好世界",
    "hello world, hello there. Привет мир!",
    "stop here STOP there; the end",
]
# Characters of 2, 3 and 4 UTF-8 bytes that the tiny vocabularies cannot hold whole.
ALPHABET = "abc hel wö你好世界é€𝄞🙂ДЖ\n."


@pytest.fixture(scope="module")
def byte_level() -> Tokenizer:
    """ByteLevel BPE (GPT-2 style): rare characters are split into single-byte tokens."""
    tok = HFTokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), special_tokens=["<|eos|>"]
    )
    tok.train_from_iterator(CORPUS, trainer=trainer)
    return Tokenizer(tok, eos_token_ids=[tok.token_to_id("<|eos|>")])


@pytest.fixture(scope="module")
def metaspace() -> Tokenizer:
    """SentencePiece-style BPE: decoding a suffix alone drops its leading space."""
    tok = HFTokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Metaspace()
    tok.decoder = decoders.Metaspace()
    trainer = trainers.BpeTrainer(vocab_size=200, special_tokens=["<unk>", "<s>", "</s>"])
    tok.train_from_iterator(CORPUS, trainer=trainer)
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    return Tokenizer(tok)


def stream(tokenizer: Tokenizer, prompt_ids: list[int], output_ids: list[int]) -> tuple[list[str], str]:
    detok = IncrementalDetokenizer(tokenizer, prompt_ids)
    deltas = [detok.append(t) for t in output_ids]
    deltas.append(detok.flush())
    assert detok.text == "".join(deltas)
    return deltas, detok.text


# ----------------------------------------------------------------------------------------------- tokenizer


def test_byte_level_fixture_really_splits_characters(byte_level: Tokenizer) -> None:
    ids = byte_level.encode("🙂𝄞", add_special_tokens=False)
    assert len(ids) > 2
    assert any(REPLACEMENT_CHAR in byte_level.decode([i]) for i in ids)


def test_encode_decode_and_special_tokens(metaspace: Tokenizer) -> None:
    with_bos = metaspace.encode("hello world")
    without = metaspace.encode("hello world", add_special_tokens=False)
    assert with_bos == [1] + without  # the post-processor prepends <s>, as HF does by default
    assert metaspace.decode(with_bos) == "hello world"  # special tokens skipped
    assert metaspace.decode(with_bos, skip_special_tokens=False).startswith("<s>")
    assert metaspace.vocab_size == metaspace.backend.get_vocab_size(with_added_tokens=True)


def test_load_tokenizer(tmp_path: Path, metaspace: Tokenizer) -> None:
    assert load_tokenizer(tmp_path) is None
    metaspace.backend.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "tokenizer_config.json").write_text(
        json.dumps({"bos_token": "<s>", "eos_token": {"content": "</s>", "special": True}})
    )
    tok = load_tokenizer(str(tmp_path))
    assert tok is not None
    assert tok.eos_token_ids == (2,) and tok.eos_token_id == 2 and tok.bos_token_id == 1
    assert tok.encode("hello") == metaspace.encode("hello")
    # generation_config.json wins, and may list several EOS ids (Llama 3 style).
    (tmp_path / "config.json").write_text(json.dumps({"eos_token_id": 5}))
    assert load_tokenizer(tmp_path).eos_token_ids == (5,)
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 7]}))
    assert load_tokenizer(tmp_path).eos_token_ids == (2, 7)


# ----------------------------------------------------------------------------------------------- detokenizer

texts = st.text(alphabet=ALPHABET, min_size=1, max_size=30)


@settings(max_examples=60, deadline=None)
@given(prompt=texts, output=texts)
def test_byte_level_deltas_concatenate_to_decode(byte_level: Tokenizer, prompt: str, output: str) -> None:
    prompt_ids = byte_level.encode(prompt)
    output_ids = byte_level.encode(output)
    deltas, text = stream(byte_level, prompt_ids, output_ids)
    assert text == byte_level.decode(output_ids) == output
    # A split character is held back, never shown as U+FFFD (the output is valid UTF-8 throughout).
    assert not any(REPLACEMENT_CHAR in d for d in deltas)


@settings(max_examples=60, deadline=None)
@given(prompt=texts, output=texts)
def test_context_dependent_decoder(metaspace: Tokenizer, prompt: str, output: str) -> None:
    prompt_ids = metaspace.encode(prompt)
    output_ids = metaspace.encode(" " + output, add_special_tokens=False)
    full = metaspace.decode(prompt_ids + output_ids)
    prefix = metaspace.decode(prompt_ids)
    assert full.startswith(prefix)
    _, text = stream(metaspace, prompt_ids, output_ids)
    assert text == full[len(prefix):]


def test_leading_space_is_kept_where_naive_decoding_loses_it(metaspace: Tokenizer) -> None:
    prompt_ids = metaspace.encode("hello")
    output_ids = metaspace.encode(" world hello", add_special_tokens=False)
    naive = "".join(metaspace.decode([t]) for t in output_ids)
    deltas, text = stream(metaspace, prompt_ids, output_ids)
    assert text == " world hello" != naive
    assert not naive.startswith(" ") and deltas[0].startswith(" ")  # the space naive decoding drops: streamed first


def test_split_character_is_held_until_complete(byte_level: Tokenizer) -> None:
    output_ids = byte_level.encode("a🙂b", add_special_tokens=False)
    deltas, text = stream(byte_level, byte_level.encode("hi"), output_ids)
    assert text == "a🙂b"
    assert "" in deltas[:-1]  # the emoji's first bytes produced no text yet
    assert "🙂" in deltas


def test_flush_releases_an_unfinished_character(byte_level: Tokenizer) -> None:
    emoji_ids = byte_level.encode("🙂", add_special_tokens=False)
    detok = IncrementalDetokenizer(byte_level, byte_level.encode("hi"))
    assert detok.append(byte_level.encode("a", add_special_tokens=False)[0]) == "a"
    assert detok.append(emoji_ids[0]) == ""
    assert detok.flush() == REPLACEMENT_CHAR
    assert detok.flush() == ""
    assert detok.text == "a" + REPLACEMENT_CHAR


def test_empty_prompt_and_special_tokens(byte_level: Tokenizer) -> None:
    eos = byte_level.eos_token_id
    ids = byte_level.encode("你好 hello", add_special_tokens=False) + [eos]
    _, text = stream(byte_level, [], ids)
    assert text == "你好 hello"  # EOS is a special token: skipped


# ----------------------------------------------------------------------------------------------- stop strings


def test_find_stop_string() -> None:
    assert find_stop_string("hello world", ("world",)) == 6
    assert find_stop_string("hello world", ("xyz",)) is None
    assert find_stop_string("hello world", ()) is None
    # The earliest match wins, whichever stop string it is.
    assert find_stop_string("abc STOP def END", ("END", "STOP")) == 4
    # Straddling the old text / new delta boundary (new delta starts at 8): "STOP" spans 6..10.
    assert find_stop_string("abcde STOP", ("STOP",), search_from=8) == 6
    # Matches that ended before search_from were already looked for.
    assert find_stop_string("STOP and more", ("STOP",), search_from=9) is None


@settings(max_examples=200, deadline=None)
@given(
    text=st.text(alphabet="abST P", max_size=40),
    stop=st.lists(st.text(alphabet="abST P", min_size=1, max_size=4), min_size=1, max_size=3),
    cuts=st.lists(st.integers(0, 40), max_size=6),
)
# A later-starting stop ("P") completes first while an earlier-starting one ("SPP") is still open: the
# earliest start must win, so the checker waits for the next delta.
@example(text="SPP", stop=["P", "SPP"], cuts=[2])
@example(text="SPx", stop=["P", "SPP"], cuts=[2])
def test_stop_checker_matches_whole_text_search(text: str, stop: list[str], cuts: list[int]) -> None:
    """Streaming in arbitrary deltas finds the same (earliest) stop as searching the whole text at once."""
    bounds = sorted({0, len(text), *(min(c, len(text)) for c in cuts)})
    deltas = [text[a:b] for a, b in zip(bounds, bounds[1:])]
    checker = StopStringChecker(stop)
    shown = []
    for d in deltas:
        shown.append(checker.add(d))
        # Never shows text that a later stop string could still cut.
        assert text.startswith(checker.text)
    shown.append(checker.flush())
    cut = find_stop_string(text, stop)
    expected = text if cut is None else text[:cut]
    assert checker.stopped == (cut is not None)
    assert "".join(shown) == checker.text == expected


def test_stop_string_spanning_two_deltas() -> None:
    checker = StopStringChecker(["STOP"])
    assert checker.add("hello ST") == "hello "  # "ST" could be the start of "STOP": held back
    assert not checker.stopped
    assert checker.add("OP and more") == ""
    assert checker.stopped and checker.text == "hello "
    assert checker.add("ignored") == ""


def test_held_tail_is_released_when_it_cannot_be_a_stop() -> None:
    checker = StopStringChecker(["STOP"])
    assert checker.add("a ST") == "a "
    assert checker.add("ART") == "START"
    assert checker.flush() == ""
    assert checker.text == "a START"


def test_detokenizer_and_stop_string_across_token_deltas(byte_level: Tokenizer) -> None:
    output = "héllo wörld 你好 and more"
    ids = byte_level.encode(output, add_special_tokens=False)
    detok = IncrementalDetokenizer(byte_level, byte_level.encode("prompt"))
    checker = StopStringChecker(["ld 你"])  # spans several tokens, multi-byte included
    shown = ""
    for t in ids:
        shown += checker.add(detok.append(t))
        if checker.stopped:
            break
    assert checker.stopped
    assert shown == checker.text == "héllo wör"


def test_pending_stop_is_applied_when_the_request_ends_for_another_reason() -> None:
    """A found stop waiting on an earlier, still-open candidate is applied by flush(), even if the last delta
    came in with detect=False (the engine's end-of-request path): text is cut and `stopped` is set."""
    checker = StopStringChecker(["P", "SPP"])
    assert checker.add("SP") == ""  # "P" matched at 1, but "SPP" could still start at 0
    assert not checker.stopped
    assert checker.add("x", detect=False) == ""
    assert checker.flush() == "S" and checker.stopped and checker.text == "S"

