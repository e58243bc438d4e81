"""Structured outputs: constrain a request's tokens to a JSON schema, a regex, a list of choices or a grammar.

The grammar engine is llguidance (docs/design/structured-outputs.md says why, with figures). Three parts:

- `StructuredOutputs`: what a user sends (`{"json": SCHEMA}`, `{"json_object": True}`, `{"regex": R}`,
  `{"choice": [...]}`, `{"grammar": EBNF_OR_LARK}`), parsed and validated without a tokenizer, so the API edge
  can refuse bad input (ValueError, with the library's message) before the request reaches the engine.
- `GrammarCompiler` (one per tokenizer) -> `GrammarMatcher` (one per request): the host side. The matcher fills
  its row of an int32 bitmask [rows, ceil(V/32)] for the next token and advances on each emitted token.

The device side, `sampling.apply_token_bitmask`, sets the logits of disallowed tokens to -inf. No JAX here:
`SamplingParams` validates its constraint with `StructuredOutputs` (plain data, below the model runner).
"""

from __future__ import annotations

import json
import os
import threading
import time
from collections import OrderedDict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Literal, get_args

import llguidance
import llguidance.numpy as llguidance_numpy
import numpy as np

ConstraintKind = Literal["json", "json_object", "regex", "choice", "grammar"]
KINDS: tuple[ConstraintKind, ...] = get_args(ConstraintKind)

# The bound on a constraint's canonical text (a schema's compact JSON, a regex, a grammar, the choices' JSON
# list), refused before anything is compiled. llguidance also bounds the work itself (`LLParserLimits`
# defaults: grammar size 500k symbols, lexer fuel 1M at build and 200k per mask step), so no constraint
# compiles or steps for long; this bound keeps hostile request bodies out of the parser altogether.
MAX_CONSTRAINT_CHARS = 65_536

# llguidance's JSON options for `json` and `json_object` constraints, unless a schema's top-level "x-guidance"
# object sets them: one line, each separator followed by at most one space, no other whitespace (`{"a":1}` and
# `{"a": 1, "b": [1, 2]}` both fit). llguidance's own default allows any run of whitespace wherever JSON does,
# so a model that favours blank tokens (random weights, a real model in a loop) can spend all of max_tokens on
# them. `"x-guidance": {"whitespace_flexible": true}` in a schema allows any whitespace again (pretty printing).
JSON_DEFAULTS: dict[str, object] = {"whitespace_flexible": False, "item_separator": ", ?", "key_separator": ": ?"}

# Compiled grammars kept per compiler (least recently used dropped first): at most this many, and at most
# DEFAULT_CACHE_BYTES of their estimated size (`GrammarCompiler.compile`: the resident memory the compile added,
# at least GRAMMAR_BYTES_PER_CHAR per character of the llguidance grammar).
DEFAULT_CACHE_SIZE = 256
DEFAULT_CACHE_BYTES = 512 << 20
GRAMMAR_BYTES_PER_CHAR = 64

# A compile walks a copy of the new grammar this many tokens (the lowest allowed id each step) and refuses the
# constraint if llguidance gives up on the way (a row past its item limits, a grammar with no finite string, a
# lexer blow-up): such constraints fail at the first tokens of every output.
PROBE_TOKENS = 64


@dataclass(frozen=True)
class MaskBudget:
    """The host time one request's masks may take: `base_s` plus `per_token_s` for each token it has taken.
    A request past it ends with finish reason "error" naming its constraint, so a grammar whose mask cost grows
    (an ambiguous one) cannot hold up other requests' tokens on the engine thread."""

    base_s: float = 0.25
    per_token_s: float = 0.001

    def allows(self, spent_s: float, num_tokens: int) -> bool:
        return spent_s <= self.base_s + self.per_token_s * num_tokens


def bitmask_width(vocab_size: int) -> int:
    """int32 words per bitmask row: one bit per token id."""
    return (vocab_size + 31) // 32


def _canonical_json(value: object) -> str:
    # Keys keep their order: llguidance emits an object's properties in the schema's order.
    return json.dumps(value, separators=(",", ":"), ensure_ascii=False)


def _llguidance_grammar(kind: ConstraintKind, text: str) -> str:
    """The llguidance grammar of a constraint (raises ValueError on input the converters refuse)."""
    if kind in ("json", "json_object"):
        schema = text if kind == "json" else '{"type":"object"}'
        return llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=JSON_DEFAULTS)  # type: ignore[arg-type]
    fmt = {"regex": "regex", "choice": "choice", "grammar": "grammar"}[kind]
    return llguidance.grammar_from(fmt, text)  # type: ignore[arg-type]


@dataclass(frozen=True)
class StructuredOutputs:
    """One request's constraint. `text` is canonical (a schema's compact JSON, keys in their order, the choices as
    a JSON list, a regex or grammar as given, "" for json_object): equal constraints have equal text, which
    is the compiler's cache key. Build with `parse`; direct construction is validated too."""

    kind: ConstraintKind
    text: str

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"structured_outputs: unknown kind {self.kind!r}; expected one of {', '.join(KINDS)}")
        if len(self.text) > MAX_CONSTRAINT_CHARS:
            raise ValueError(f"structured_outputs: the {self.kind} constraint has {len(self.text)} characters; "
                             f"the limit is {MAX_CONSTRAINT_CHARS}")
        try:
            error = llguidance.LLMatcher.validate_grammar(self.grammar)
        except ValueError as e:  # refused by a converter (a GBNF grammar's, a schema that is not JSON)
            error = str(e)
        if error:
            raise ValueError(f"structured_outputs: invalid {self.kind}: {error.strip()}")

    @property
    def grammar(self) -> str:
        """The llguidance grammar text."""
        return _llguidance_grammar(self.kind, self.text)

    def as_dict(self) -> dict[str, object]:
        """The object `parse` takes back to this constraint (what a request body or gRPC field carries)."""
        if self.kind == "json_object":
            return {"json_object": True}
        return {self.kind: json.loads(self.text) if self.kind in ("json", "choice") else self.text}

    @classmethod
    def parse(cls, value: Mapping[str, object]) -> StructuredOutputs:
        """The constraint of a request body's `structured_outputs` object: exactly one kind set (None, and
        json_object False, count as unset). A schema may be an object or its JSON text."""
        if not isinstance(value, Mapping):
            raise ValueError(f"structured_outputs: must be an object, not {type(value).__name__}")
        unknown = sorted(set(value) - set(KINDS))
        if unknown:
            raise ValueError(f"structured_outputs: unknown keys {unknown}; expected one of {', '.join(KINDS)}")
        given = [k for k in KINDS if value.get(k) is not None and value.get(k) is not False]
        if len(given) != 1:
            raise ValueError(f"structured_outputs: needs exactly one of {', '.join(KINDS)}; got "
                             f"{', '.join(given) if given else 'none'}")
        kind: ConstraintKind = given[0]
        item = value[kind]
        if kind == "json":
            try:
                if isinstance(item, str):
                    try:
                        item = json.loads(item)
                    except ValueError as e:
                        raise ValueError(f"structured_outputs: the json schema is not valid JSON: {e}") from e
                if not isinstance(item, dict):
                    raise ValueError(f"structured_outputs: a json schema is an object, not {type(item).__name__}")
                text = _canonical_json(item)
            except RecursionError:  # Python's own limit; llguidance refuses far shallower schemas (128 levels)
                raise ValueError("structured_outputs: the json schema is nested too deeply") from None
            return cls(kind, text)
        if kind == "json_object":
            if item is not True:
                raise ValueError("structured_outputs: json_object must be true")
            return cls(kind, "")
        if kind == "choice":
            if not isinstance(item, list) or not item:
                raise ValueError("structured_outputs: choice must be a non-empty list of strings")
            if not all(isinstance(c, str) for c in item):
                raise ValueError("structured_outputs: every choice must be a string")
            return cls(kind, json.dumps(item, ensure_ascii=False))
        if not isinstance(item, str) or not item:
            raise ValueError(f"structured_outputs: {kind} must be a non-empty string")
        return cls(kind, item)


class GrammarMatcher:
    """One request's grammar state. `fill_bitmask` writes the next token's row; `advance` takes each emitted
    token. Once it is in error (`error` is set: a token the grammar refuses, or the library's step limits
    exceeded) it stays there, and its rows allow only the stop ids, so the request can end; the engine
    finishes such a request with the error."""

    def __init__(self, matcher: llguidance.LLMatcher, compiler: GrammarCompiler) -> None:
        self._matcher = matcher
        self._compiler = self.compiler = compiler
        self._stopped_by: int | None = None  # the stop id that ended the output, once one has
        self._refused_after_stop = False
        self.mask_seconds = 0.0  # host time its masks took (`MaskBudget`)
        self._num_tokens = 0
        self._over_budget: str | None = None

    @property
    def error(self) -> str | None:
        if self._over_budget is not None:
            return self._over_budget
        if self._matcher.is_error():
            return _library_error(self._matcher.get_error())
        return "a token after the output ended" if self._refused_after_stop else None

    def _failed(self) -> bool:
        return self._over_budget is not None or self._matcher.is_error()

    def may_stop(self) -> bool:
        """Whether EOS / a stop id may be emitted now: only where the grammar may end."""
        return self._matcher.is_accepting() and not self._failed()

    def is_finished(self) -> bool:
        """The output is complete: a stop id was taken, or the grammar allows nothing but stopping."""
        return self._stopped_by is not None or (self._matcher.is_stopped() and not self._matcher.is_error())

    def fill_bitmask(self, bitmask: np.ndarray, row: int, stop_token_ids: Iterable[int] = ()) -> None:
        """Write the allowed next tokens into bitmask[row] (int32 [rows, ceil(V/32)], C-contiguous).
        `stop_token_ids`: the request's own stop ids beyond the compiler's, allowed where the grammar may end."""
        if not self._failed():
            start = time.perf_counter()
            llguidance_numpy.fill_next_token_bitmask(self._matcher, bitmask, row)
            self.mask_seconds += time.perf_counter() - start
            budget = self._compiler.mask_budget
            if not budget.allows(self.mask_seconds, self._num_tokens):
                self._over_budget = (f"masks took {self.mask_seconds:.3f} s of host time over {self._num_tokens} "
                                     f"tokens, past the budget of {budget.base_s} s + {budget.per_token_s} s "
                                     f"per token (this grammar is too costly to follow)")
        if self._failed():  # already, or the step just now ran out of its limits or its budget
            bitmask[row] = 0
            _set_bits(bitmask[row], self._compiler.stop_token_ids)
        elif self.may_stop():
            _set_bits(bitmask[row], (*self._compiler.stop_token_ids, *stop_token_ids))

    def advance(self, token: int, stop_token_ids: Iterable[int] = ()) -> bool:
        """Take one emitted token; False (and `error` set) if the grammar refuses it. A stop id (the
        compiler's or `stop_token_ids`) is taken where the grammar may end and finishes the output."""
        if self._stopped_by is not None or self._failed():
            self._refused_after_stop = self._stopped_by is not None
            return False
        self._num_tokens += 1
        if token in self._compiler.stop_token_ids or token in stop_token_ids:
            if self.may_stop():
                self._stopped_by = token
                return True
        return bool(self._matcher.consume_token(token))

    def take(self, token: int, stop_token_ids: Iterable[int] = ()) -> str | None:
        """`advance`, and the finish reason it gives the request: None (go on), "stop" (the output is
        complete) or "error" (a token the grammar refuses, or its limits exceeded: `error` says why)."""
        if not self.advance(token, stop_token_ids) or self._failed():
            return "error"
        return "stop" if self.is_finished() else None

    def rollback(self, num_tokens: int) -> None:
        """Undo the last `num_tokens` advances (for speculative decoding: drafts past the first rejected one).
        A stop id taken counts as one token. Not out of an error state."""
        if num_tokens <= 0:
            return
        self._num_tokens = max(0, self._num_tokens - num_tokens)
        if self._stopped_by is not None:
            self._stopped_by, num_tokens = None, num_tokens - 1
        if num_tokens and not self._matcher.rollback(num_tokens):
            raise ValueError(f"cannot roll back {num_tokens} tokens: {self._matcher.get_error() or 'too many'}")


def _library_error(text: str) -> str:
    """llguidance's error message without the parser-state dump it appends; its bare stop reason for a dead end
    (no token allowed) in words."""
    message = text.split("\n<state>", 1)[0].strip()
    if message == "NoExtensionBias":
        return "a dead end: no token of this tokenizer can continue the output (llguidance: NoExtensionBias)"
    return message


def _set_bits(row: np.ndarray, token_ids: Iterable[int]) -> None:
    for t in token_ids:
        if 0 <= t < 32 * row.shape[0]:
            row[t // 32] |= np.int32(np.uint32(1 << (t % 32)).view(np.int32))


class GrammarCompiler:
    """Compiles constraints for one tokenizer; compiled grammars are cached by their canonical text.

    `tokenizer_json`: the tokenizer.json text (`tokenizers.Tokenizer.to_str()`); `vocab_size`: the model's
    vocabulary (logits width, may be padded past the tokenizer's: ids past it are never allowed);
    `stop_token_ids`: EOS and the model's stop ids, allowed exactly where a grammar may end. The cache keeps at
    most `cache_size` grammars and `cache_bytes` of their estimated size; `mask_budget` bounds each request's
    mask time. Thread-safe: the API edge compiles off the engine's hot path while the engine makes matchers."""

    def __init__(self, tokenizer_json: str, vocab_size: int, stop_token_ids: Sequence[int],
                 cache_size: int = DEFAULT_CACHE_SIZE, cache_bytes: int = DEFAULT_CACHE_BYTES,
                 mask_budget: MaskBudget = MaskBudget()) -> None:
        if not stop_token_ids:
            raise ValueError("a grammar compiler needs at least one stop id (EOS)")
        self.vocab_size = vocab_size
        self.stop_token_ids: tuple[int, ...] = tuple(dict.fromkeys(int(t) for t in stop_token_ids))
        self._tokenizer = llguidance.LLTokenizer(tokenizer_json, n_vocab=vocab_size,
                                                 eos_token=list(self.stop_token_ids))
        self._cache: OrderedDict[tuple[str, str], tuple[llguidance.LLMatcher, int]] = OrderedDict()
        self._cache_size = cache_size
        self.cache_bytes = cache_bytes
        self.cached_bytes = 0  # the cached grammars' estimated size
        self.mask_budget = mask_budget
        self._lock = threading.Lock()

    @property
    def bitmask_width(self) -> int:
        return bitmask_width(self.vocab_size)

    def allocate_bitmask(self, rows: int) -> np.ndarray:
        """An all-ones (unconstrained) int32 bitmask [rows, ceil(V/32)]."""
        return np.full((rows, self.bitmask_width), -1, dtype=np.int32)

    def __len__(self) -> int:
        return len(self._cache)

    def compile(self, constraint: StructuredOutputs) -> llguidance.LLMatcher:
        """The pristine matcher of a constraint, built once and cached; ValueError if it does not compile for
        this tokenizer or fails on the way of its probe walk (`PROBE_TOKENS`). Call it where a request arrives,
        so `matcher` later only copies."""
        key = (constraint.kind, constraint.text)
        with self._lock:
            entry = self._cache.get(key)
            if entry is not None:
                self._cache.move_to_end(key)
                return entry[0]
        grammar = constraint.grammar
        rss = _resident_bytes()
        template = self._build(constraint, grammar)
        size = max(_resident_bytes() - rss, GRAMMAR_BYTES_PER_CHAR * len(grammar))
        with self._lock:
            if key not in self._cache:
                self._cache[key] = (template, size)
                self.cached_bytes += size
            while len(self._cache) > 1 and (len(self._cache) > self._cache_size
                                            or self.cached_bytes > self.cache_bytes):
                _, (_, dropped) = self._cache.popitem(last=False)
                self.cached_bytes -= dropped
        return template

    def _build(self, constraint: StructuredOutputs, grammar: str) -> llguidance.LLMatcher:
        template = llguidance.LLMatcher(self._tokenizer, grammar, log_level=0)
        if template.is_error():
            raise ValueError(f"structured_outputs: invalid {constraint.kind}: {_library_error(template.get_error())}")
        # The first mask builds the lexer's start states; copies made afterwards share them. It also finds a
        # constraint no output can start (text this tokenizer cannot write): refused here, not at the first step.
        bitmask = self.allocate_bitmask(1)
        llguidance_numpy.fill_next_token_bitmask(template, bitmask, 0)
        if template.is_error():
            raise ValueError(f"structured_outputs: the {constraint.kind} cannot be generated with this model's "
                             f"tokenizer: {_library_error(template.get_error())}")
        error = self._probe_walk(template.deep_copy(), bitmask)
        if error:
            raise ValueError(f"structured_outputs: the {constraint.kind} exceeds the grammar engine's limits "
                             f"within its first {PROBE_TOKENS} tokens: {_library_error(error)}")
        return template

    def _probe_walk(self, walker: llguidance.LLMatcher, bitmask: np.ndarray) -> str | None:
        """Take the lowest allowed non-stop id up to PROBE_TOKENS times; llguidance's error on the way, if any. A
        dead end (no token continues the path walked) ends the walk without one: another path may go on."""
        stops = np.array(self.stop_token_ids)
        for _ in range(PROBE_TOKENS):
            llguidance_numpy.fill_next_token_bitmask(walker, bitmask, 0)
            if walker.is_error():
                error = walker.get_error()
                return None if error.split("\n<state>", 1)[0].strip() == "NoExtensionBias" else error
            allowed = np.flatnonzero(np.unpackbits(bitmask[0].view(np.uint8), bitorder="little"))
            allowed = allowed[~np.isin(allowed, stops)]
            if allowed.size == 0:
                return None
            walker.consume_token(int(allowed[0]))
            if walker.is_error():
                return walker.get_error()
        return None

    def matcher(self, constraint: StructuredOutputs) -> GrammarMatcher:
        """A fresh matcher for one request (a copy of the compiled grammar's pristine state)."""
        return GrammarMatcher(self.compile(constraint).deep_copy(), self)


def _resident_bytes() -> int:
    """This process's resident memory (Linux /proc; 0 elsewhere, where the per-character floor sizes grammars)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0


def step_bitmask(rows: Sequence[tuple[GrammarMatcher | None, Sequence[int]] | None]) -> np.ndarray | None:
    """A step's token bitmask [len(rows), ceil(V/32)]: row i filled by rows[i]'s matcher (with its request's own
    stop ids), all-ones where rows[i] or its matcher is None; None when no row has a matcher."""
    bitmask = None
    for i, row in enumerate(rows):
        if row is None or row[0] is None:
            continue
        if bitmask is None:
            bitmask = row[0].compiler.allocate_bitmask(len(rows))
        row[0].fill_bitmask(bitmask, i, row[1])
    return bitmask
