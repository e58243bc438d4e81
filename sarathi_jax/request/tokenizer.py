"""Text side of the engine: a thin `tokenizers` wrapper, incremental detokenization and stop strings.

Only `tokenizer.json` (Hugging Face fast-tokenizer format) is supported; EOS / BOS ids are read from the
usual side files (`generation_config.json`, `config.json`, `tokenizer_config.json`) when present.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import tokenizers

# Tokens of left context decoded together with new tokens: enough for decoders whose output for a token
# depends on its neighbours (SentencePiece's leading-space rule, byte fallback, multi-byte characters).
DETOKENIZE_CONTEXT = 5

REPLACEMENT_CHAR = "\ufffd"


class Tokenizer:
    """A `tokenizers.Tokenizer` with the engine's small API."""

    def __init__(
        self,
        backend: tokenizers.Tokenizer,
        eos_token_ids: Sequence[int] = (),
        bos_token_id: int | None = None,
    ) -> None:
        self.backend = backend
        self.eos_token_ids: tuple[int, ...] = tuple(dict.fromkeys(int(t) for t in eos_token_ids))
        self.bos_token_id = bos_token_id

    @classmethod
    def from_file(cls, path: str | Path, **kwargs: Any) -> Tokenizer:
        return cls(tokenizers.Tokenizer.from_file(str(path)), **kwargs)

    @property
    def vocab_size(self) -> int:
        """Ids the tokenizer can produce, added tokens included (a model's vocab may be padded larger)."""
        return self.backend.get_vocab_size(with_added_tokens=True)

    @functools.cached_property
    def longest_token_chars(self) -> int:
        """The most characters one token's vocabulary string has, added tokens included: an upper bound on the
        characters of text one token covers (byte-level BPE writes one character per byte, SentencePiece one
        per character, byte fallback `<0x41>` more), so a text longer than max_model_len times this cannot fit
        max_model_len tokens. Admission refuses such a text before tokenising it."""
        return max((len(token) for token in self.backend.get_vocab(with_added_tokens=True)), default=1)

    @property
    def eos_token_id(self) -> int | None:
        return self.eos_token_ids[0] if self.eos_token_ids else None

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of `text`. add_special_tokens=True runs the tokenizer's post-processor, as HF does by
        default: for Llama-style tokenizer.json files that prepends BOS."""
        return self.backend.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self.backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def token_to_id(self, token: str) -> int | None:
        return self.backend.token_to_id(token)


def read_json_object(path: Path) -> dict[str, Any]:
    """The JSON object in `path`, or {} when the file is missing, unreadable or not an object."""
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def _as_id_list(value: Any) -> list[int]:
    if isinstance(value, bool) or value is None:
        return []
    if isinstance(value, int):
        return [value]
    if isinstance(value, list):
        return [v for v in value if isinstance(v, int) and not isinstance(v, bool)]
    return []


def _token_content(value: Any) -> str | None:
    # tokenizer_config.json writes special tokens as "</s>" or {"content": "</s>", ...}.
    if isinstance(value, str):
        return value
    if isinstance(value, dict) and isinstance(value.get("content"), str):
        return value["content"]
    return None


def load_tokenizer(model_dir: str | Path) -> Tokenizer | None:
    """The tokenizer of a model folder, or None if it has no tokenizer.json.

    EOS ids: generation_config.json, else config.json (`eos_token_id`, an int or a list), else
    tokenizer_config.json's `eos_token`. BOS likewise (`bos_token_id` / `bos_token`).
    """
    model_dir = Path(model_dir)
    path = model_dir / "tokenizer.json"
    if not path.is_file():
        return None
    backend = tokenizers.Tokenizer.from_file(str(path))
    generation = read_json_object(model_dir / "generation_config.json")
    config = read_json_object(model_dir / "config.json")
    tok_config = read_json_object(model_dir / "tokenizer_config.json")

    def special(id_key: str, token_key: str) -> list[int]:
        for source in (generation, config):
            ids = _as_id_list(source.get(id_key))
            if ids:
                return ids
        content = _token_content(tok_config.get(token_key))
        token_id = backend.token_to_id(content) if content is not None else None
        return [token_id] if token_id is not None else []

    bos = special("bos_token_id", "bos_token")
    return Tokenizer(backend, eos_token_ids=special("eos_token_id", "eos_token"), bos_token_id=bos[0] if bos else None)


class IncrementalDetokenizer:
    """Turns a growing list of output token ids into text deltas.

    Each new token is decoded together with a few tokens of left context, and the delta is the part past the
    decode of that context alone (vLLM's prefix/read offsets): tokenizers whose decode of a suffix differs
    from the difference of decodes (SentencePiece drops the leading space of the first token) still get the
    right text. While the decoded tail ends in U+FFFD (a multi-byte character split across tokens), the text is
    held back until the character completes; `flush()` releases whatever is still held (call it when the
    request finishes), so the concatenated deltas + flush equal the decode of the output in prompt context.
    """

    def __init__(
        self,
        tokenizer: Tokenizer,
        prompt_token_ids: Sequence[int],
        skip_special_tokens: bool = True,
    ) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self._ids: list[int] = list(prompt_token_ids)
        self._num_prompt = len(self._ids)
        # ids[prefix_offset:read_offset] is context already turned into text; ids[read_offset:] is pending.
        self._read_offset = len(self._ids)
        self._prefix_offset = max(0, self._read_offset - DETOKENIZE_CONTEXT)
        self._prefix_text = self._decode(self._prefix_offset, self._read_offset)
        self.text = ""  # output text released so far

    @property
    def output_token_ids(self) -> list[int]:
        return self._ids[self._num_prompt :]

    def _decode(self, start: int, end: int | None = None) -> str:
        return self.tokenizer.decode(self._ids[start:end], skip_special_tokens=self.skip_special_tokens)

    def append(self, token_id: int) -> str:
        """Add one output token; return the text it completes ("" while a character is still partial)."""
        self._ids.append(int(token_id))
        new_text = self._decode(self._prefix_offset)
        if len(new_text) <= len(self._prefix_text) or new_text.endswith(REPLACEMENT_CHAR):
            return ""  # nothing new yet, or a multi-byte character still incomplete: wait for more bytes
        delta = new_text[len(self._prefix_text) :]
        # The next window starts where this one's new part began, so it carries a few tokens of context.
        self._prefix_offset = self._read_offset
        self._read_offset = len(self._ids)
        self._prefix_text = self._decode(self._prefix_offset, self._read_offset)
        self.text += delta
        return delta

    def append_many(self, token_ids: Iterable[int]) -> str:
        return "".join(self.append(t) for t in token_ids)

    def flush(self) -> str:
        """Release held-back text (e.g. a trailing U+FFFD of an unfinished character) at the end of a request."""
        if self._read_offset == len(self._ids):
            return ""
        new_text = self._decode(self._prefix_offset)
        delta = new_text[len(self._prefix_text) :] if len(new_text) > len(self._prefix_text) else ""
        self._prefix_offset = self._read_offset
        self._read_offset = len(self._ids)
        self._prefix_text = self._decode(self._prefix_offset, self._read_offset)
        self.text += delta
        return delta


def find_stop_string(text: str, stop: Sequence[str], search_from: int = 0) -> int | None:
    """Index where the earliest stop string in `text` starts, or None.

    Only matches that end after `search_from` count (the caller passes the length of the text before the
    new delta; earlier matches were looked for on earlier steps), so a stop string straddling the old text and
    the delta is found. The caller truncates to text[:index]: the stop string is excluded, as in vLLM.
    """
    best: int | None = None
    for s in stop:
        if not s:
            continue
        i = text.find(s, max(0, search_from - len(s) + 1))
        if i != -1 and (best is None or i < best):
            best = i
    return best


class StopStringChecker:
    """Streams text through stop-string detection: `add(delta)` returns the text safe to show now.

    A tail that could still grow into a stop string is held back (it would be cut if it did); `stopped`
    becomes True when a stop string appears, and `text` is then cut before it. `flush()` releases the held
    tail when the request ends for another reason. Concatenated returns of add + flush == `text`.
    """

    def __init__(self, stop: Sequence[str]) -> None:
        self.stop = tuple(s for s in stop if s)
        self._max_hold = max((len(s) for s in self.stop), default=1) - 1
        self._buffer = ""  # all text seen (cut at the stop string once found)
        self._released = 0
        # A complete stop string found while another one, starting earlier, may still complete: where the
        # found one starts. The earliest start wins, as when searching the whole text at once.
        self._pending_cut: int | None = None
        self.stopped = False

    @property
    def text(self) -> str:
        """Text released so far."""
        return self._buffer[: self._released]

    def add(self, delta: str, detect: bool = True) -> str:
        """Take the next text; with detect=False (before min_tokens) no stop string can end here."""
        if self.stopped or not delta:
            return ""
        search_from = len(self._buffer)
        self._buffer += delta
        if not detect:  # (a decision pending on earlier text still holds the text after it)
            return "" if self._pending_cut is not None else self._release(len(self._buffer))
        cut = find_stop_string(self._buffer, self.stop, search_from)
        if self._pending_cut is not None and (cut is None or self._pending_cut < cut):
            cut = self._pending_cut
        if cut is not None:
            open_start = self._open_match_before(cut)
            if open_start is None:
                return self._stop_at(cut)
            self._pending_cut = cut  # decided when that earlier candidate completes or fails
            return self._release(open_start)
        return self._release(len(self._buffer) - self._held_tail())

    def flush(self) -> str:
        if self._pending_cut is not None:  # no more text: the earlier candidate cannot complete
            return self._stop_at(self._pending_cut)
        return self._release(len(self._buffer))

    def _stop_at(self, cut: int) -> str:
        self._buffer = self._buffer[:cut]
        self._pending_cut = None
        self.stopped = True
        return self._release(len(self._buffer))

    def _open_match_before(self, limit: int) -> int | None:
        """The earliest unreleased position before `limit` where a stop string could still start: the rest
        of the buffer from there is a proper prefix of some stop string."""
        buf = self._buffer
        for q in range(max(self._released, len(buf) - self._max_hold), limit):
            tail = buf[q:]
            if any(len(s) > len(tail) and s.startswith(tail) for s in self.stop):
                return q
        return None

    def _held_tail(self) -> int:
        """Length of the longest suffix of the buffer that is a proper prefix of some stop string."""
        buf = self._buffer
        for n in range(min(self._max_hold, len(buf) - self._released), 0, -1):
            tail = buf[-n:]
            if any(s.startswith(tail) for s in self.stop):
                return n
        return 0

    def _release(self, end: int) -> str:
        end = max(end, self._released)
        out = self._buffer[self._released : end]
        self._released = end
        return out
