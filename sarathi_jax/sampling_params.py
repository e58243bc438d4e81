"""Per-request sampling settings, with vLLM's field names."""

from __future__ import annotations

import dataclasses
import math
import numbers
from dataclasses import dataclass

# Fixed width of the device sampler's top-N logprobs output; requests may ask for at most this many.
MAX_LOGPROBS = 20


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

    def __post_init__(self) -> None:
        # Accept lists (or a single string) from callers, store tuples so the dataclass stays hashable.
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        elif self.stop is None:
            object.__setattr__(self, "stop", ())
        else:
            object.__setattr__(self, "stop", tuple(self.stop))
        stop_token_ids = tuple(self.stop_token_ids or ())
        if not all(_is_int(t) for t in stop_token_ids):
            raise ValueError(f"stop_token_ids must be integers, got {list(stop_token_ids)!r}")
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
                raise ValueError(f"{name} must be a finite number, got {value!r}")
        for name in ("top_k", "max_tokens", "min_tokens"):
            if not _is_int(getattr(self, name)):
                raise ValueError(f"{name} must be an integer, got {getattr(self, name)!r}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not (0.0 < self.top_p <= 1.0):
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < -1:
            raise ValueError(f"top_k must be -1, 0 (disabled) or a positive integer, got {self.top_k!r}")
        if not (0.0 <= self.min_p <= 1.0):
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        # Any size is accepted; the sampler keys on seed modulo 2**64.
        if self.seed is not None and (not _is_int(self.seed) or self.seed < 0):
            raise ValueError(f"seed must be a non-negative integer or None, got {self.seed!r}")
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be an integer >= 1, got {self.max_tokens!r}")
        if self.min_tokens < 0:
            raise ValueError(f"min_tokens must be an integer >= 0, got {self.min_tokens!r}")
        if self.min_tokens > self.max_tokens:
            raise ValueError(f"min_tokens ({self.min_tokens}) must be <= max_tokens ({self.max_tokens})")
        if any(not isinstance(s, str) for s in self.stop):
            raise ValueError(f"stop must be a string or a sequence of strings, got {list(self.stop)!r}")
        if any(not s for s in self.stop):
            raise ValueError("stop strings must be non-empty")
        if any(t < 0 for t in self.stop_token_ids):
            raise ValueError(f"stop_token_ids must be non-negative, got {list(self.stop_token_ids)}")
        if self.logprobs is not None and (not _is_int(self.logprobs) or not 0 <= self.logprobs <= MAX_LOGPROBS):
            raise ValueError(f"logprobs must be None or an integer in [0, {MAX_LOGPROBS}], got {self.logprobs!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def replace(self, **changes: object) -> SamplingParams:
        return dataclasses.replace(self, **changes)


# A request's sampling settings that do not change while it runs: (params, seed, token ids banned until
# params.min_tokens outputs). The engine core hands the executor a function that gives them for a sequence;
# the step index comes from the sequence itself.
RequestSampling = tuple[SamplingParams, int, tuple[int, ...]]
