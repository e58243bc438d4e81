"""Per-request sampling settings, with vLLM's field names, and `AdmissionError`, the one error of a bad request.

SamplingParams checks what a field means on its own (types, ranges); `sarathi_jax.core.admission.Admission` checks
what depends on the model and the engine (vocabulary, tokenizer, lengths). Both raise `AdmissionError`.
"""

from __future__ import annotations

import dataclasses
import json
import math
import numbers
from collections.abc import Mapping
from dataclasses import dataclass, field

from sarathi_jax.request.structured_outputs import StructuredOutputs

# Fixed width of the device sampler's top-N logprobs output; requests may ask for at most this many.
MAX_LOGPROBS = 20
# Bounds on a request's stop lists, so that one request cannot make every engine step slow (the detokenizer
# looks for each stop string in the new text; stop ids are checked per token) or the request huge.
MAX_STOP_STRINGS = 64
MAX_STOP_STRING_CHARS = 1024
MAX_STOP_TOKEN_IDS = 1024


class AdmissionError(ValueError):
    """A request refused before it reached the engine. `param` names the request field at fault (servers
    report it as data: OpenAI's error `param`); the message is `"{param}: {reason}"`.

    Defined here, the lowest module that raises it (SamplingParams validates its own fields); callers import
    it from `sarathi_jax.core.admission`. A ValueError, so callers that catch ValueError keep working.
    """

    def __init__(self, param: str, reason: str) -> None:
        super().__init__(f"{param}: {reason}")
        self.param, self.reason = param, reason

    def __reduce__(self) -> tuple:  # pickles (to another process) with both arguments, not the joined message
        return type(self), (self.param, self.reason)


def _is_int(value: object) -> bool:
    # bool is an int subclass, but max_tokens=True is a caller bug, not 1.
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def _is_real(value: object) -> bool:
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


@dataclass(frozen=True)
class SamplingParams:
    """How one request is sampled and when it stops.

    temperature: 0 means greedy; otherwise logits are divided by it.
    top_k: keep the k most likely tokens; 0 or -1 disables.
    top_p: keep the smallest set of tokens whose probability reaches top_p, in (0, 1].
    min_p: drop tokens whose probability is below min_p times the most likely token's.
    seed: makes the request's tokens reproducible whatever else is in the batch.
    max_tokens / min_tokens: bounds on generated tokens (EOS and stop tokens are suppressed before min_tokens).
    stop: strings that end generation (needs a tokenizer); the stop string is not included in the text.
    stop_token_ids: token ids that end generation (the token is kept in the output).
    ignore_eos: keep generating past EOS.
    logprobs: None for none; N >= 0 for the sampled token's log-probability and the top-N.
    structured_outputs: constrain the output to a JSON schema, a regex, a choice or a grammar: a dict with
      exactly one of `json`, `json_object`, `regex`, `choice`, `grammar` (`StructuredOutputs.parse`; kept
      parsed, so the params stay hashable), or a `StructuredOutputs`. Needs a tokenizer.
    """

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    max_tokens: int = 16
    min_tokens: int = 0
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logprobs: int | None = None
    structured_outputs: StructuredOutputs | Mapping[str, object] | None = field(
        default=None, metadata={"cli": {"type": json.loads, "metavar": "JSON"}})  # a flag takes JSON text

    def __post_init__(self) -> None:
        constraint = self.structured_outputs
        if constraint is not None and not isinstance(constraint, StructuredOutputs):
            try:
                constraint = StructuredOutputs.parse(constraint)
            except ValueError as e:  # the library's message, once prefixed by the field
                raise AdmissionError("structured_outputs", str(e).removeprefix("structured_outputs: ")) from None
            object.__setattr__(self, "structured_outputs", constraint)
        # Accept lists (or a single string) from callers, store tuples so the dataclass stays hashable.
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        elif self.stop is None:
            object.__setattr__(self, "stop", ())
        else:
            object.__setattr__(self, "stop", tuple(self.stop))
        if len(self.stop) > MAX_STOP_STRINGS:
            raise AdmissionError("stop", f"at most {MAX_STOP_STRINGS} stop strings, got {len(self.stop)}")
        stop_token_ids = tuple(self.stop_token_ids or ())
        if len(stop_token_ids) > MAX_STOP_TOKEN_IDS:
            raise AdmissionError("stop_token_ids", f"at most {MAX_STOP_TOKEN_IDS} ids, got {len(stop_token_ids)}")
        if not all(_is_int(t) for t in stop_token_ids):
            raise AdmissionError("stop_token_ids", f"must be integers, got {list(stop_token_ids)!r}")
        object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in stop_token_ids))
        # numpy integers (e.g. from a config or a random draw) become plain ints: hashable, JSON-friendly.
        for name in ("top_k", "seed", "max_tokens", "min_tokens", "logprobs"):
            value = getattr(self, name)
            if _is_int(value):
                object.__setattr__(self, name, int(value))
        for name in ("temperature", "top_p", "min_p"):
            value = getattr(self, name)
            if _is_real(value):
                object.__setattr__(self, name, float(value))
        self._validate()

    def _validate(self) -> None:
        for name in ("temperature", "top_p", "min_p"):
            value = getattr(self, name)
            if not _is_real(value) or not math.isfinite(value):
                raise AdmissionError(name, f"must be a finite number, got {value!r}")
        for name in ("top_k", "max_tokens", "min_tokens"):
            if not _is_int(getattr(self, name)):
                raise AdmissionError(name, f"must be an integer, got {getattr(self, name)!r}")
        if self.temperature < 0:
            raise AdmissionError("temperature", f"must be >= 0, got {self.temperature}")
        if not (0.0 < self.top_p <= 1.0):
            raise AdmissionError("top_p", f"must be in (0, 1], got {self.top_p}")
        if self.top_k < -1:
            raise AdmissionError("top_k", f"must be -1, 0 (disabled) or a positive integer, got {self.top_k!r}")
        if not (0.0 <= self.min_p <= 1.0):
            raise AdmissionError("min_p", f"must be in [0, 1], got {self.min_p}")
        # Any size is accepted; the sampler keys on seed modulo 2**64.
        if self.seed is not None and (not _is_int(self.seed) or self.seed < 0):
            raise AdmissionError("seed", f"must be a non-negative integer or None, got {self.seed!r}")
        if self.max_tokens < 1:
            raise AdmissionError("max_tokens", f"must be an integer >= 1, got {self.max_tokens!r}")
        if self.min_tokens < 0:
            raise AdmissionError("min_tokens", f"must be an integer >= 0, got {self.min_tokens!r}")
        if self.min_tokens > self.max_tokens:
            raise AdmissionError("min_tokens", f"{self.min_tokens} must be <= max_tokens ({self.max_tokens})")
        if any(not isinstance(s, str) for s in self.stop):
            raise AdmissionError("stop", f"must be a string or a sequence of strings, got {list(self.stop)!r}")
        if any(not s for s in self.stop):
            raise AdmissionError("stop", "strings must be non-empty")
        if any(len(s) > MAX_STOP_STRING_CHARS for s in self.stop):
            raise AdmissionError("stop", f"strings must be at most {MAX_STOP_STRING_CHARS} characters")
        if any(t < 0 for t in self.stop_token_ids):
            raise AdmissionError("stop_token_ids", f"must be non-negative, got {list(self.stop_token_ids)}")
        if self.logprobs is not None and (not _is_int(self.logprobs) or not 0 <= self.logprobs <= MAX_LOGPROBS):
            raise AdmissionError("logprobs",
                                 f"must be None or an integer in [0, {MAX_LOGPROBS}], got {self.logprobs!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def replace(self, **changes: object) -> SamplingParams:
        return dataclasses.replace(self, **changes)


# A request's sampling settings that do not change while it runs: (params, seed, token ids banned until
# params.min_tokens outputs). The engine core hands the executor a function that gives them for a sequence;
# the step index comes from the sequence itself.
RequestSampling = tuple[SamplingParams, int, tuple[int, ...]]
