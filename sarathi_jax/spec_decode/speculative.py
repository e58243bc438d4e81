"""Speculative decoding, the plain-data side (no JAX): its configuration, which requests speculate, how a
verified chunk's sampled rows become emitted tokens, and the counters.

A speculating decode runs as a chunk of 1 + k tokens: its last known token and k draft tokens
(`ScheduledChunk.draft_token_ids`, proposed by `ngram_proposer`; the scheduler grants k under the token
budget: `scheduler/speculation.py`). The target model scores every position of the chunk: besides the
chunk's own sampling row (row i of the step, at its last position, as for any chunk), it gets k verification
rows after the step's chunk rows (`verify_rows`), at positions 0..k-1 of the chunk. Row j of those holds the
target's token after chunk token j, which verifies draft j. Acceptance (`emitted_rows`): the longest prefix
of drafts equal to the target's tokens, then the target's own next token: 1 to k + 1 tokens a step.

Greedy rows hold the target's argmax, sampled rows its sample (temperature, top-k, top-p, min-p, the row's
seed at that position's step): for a point-mass proposal such as lookup's this *is* rejection sampling
(Leviathan et al. 2023; Chen et al. 2023), with its acceptance probability, and the emitted tokens are the
non-speculative run's (`rejection_sampling`'s docstring has the argument and the general formula). A draft
model's drafts for a sampled request are drawn from its dense q instead: the verification step replaces their
rows by `rejection_sampling.verify_sampled_drafts`' tokens (`draft_runner`), which keep "accepted iff the
row's token equals the draft" true, so the rows are read here alike.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, fields

from sarathi_jax.request.outputs import RequestMetrics
from sarathi_jax.request.sampling_params import SamplingParams

SPECULATIVE_METHODS = ("ngram", "self", "draft_model")
MAX_SPECULATIVE_TOKENS = 32  # a chunk of 1 + k tokens is a small prefill; past this it is not speculation


@dataclass(frozen=True)
class SpeculativeConfig:
    """vLLM's spelling. num_speculative_tokens: k, the most draft tokens a sequence gets per step.
    method "ngram" (the default): prompt lookup (the continuation of the last n-gram's most recent earlier
    match in the request's own tokens), n from prompt_lookup_max down to prompt_lookup_min.
    method "self": a self-speculative draft, the target's first `num_layers` decoder layers, its final norm
    and LM head (`draft_runner`); 1 <= num_layers < the model's layers (checked when the model is loaded).
    `model` (a preset or a folder, as `EngineConfig.model`; method "draft_model", the default when `model`
    is given): a separate draft with the target's vocabulary (`draft_runner`)."""

    method: str | None = None  # None: "draft_model" when `model` is given, else "ngram"
    num_speculative_tokens: int = 4
    prompt_lookup_min: int = 2
    prompt_lookup_max: int = 4
    num_layers: int | None = None
    model: str | None = None

    def __post_init__(self) -> None:
        if self.method is None:
            object.__setattr__(self, "method", "ngram" if self.model is None else "draft_model")
        if self.method not in SPECULATIVE_METHODS:
            raise ValueError(f"speculative_config.method must be one of {SPECULATIVE_METHODS}, got {self.method!r}")
        if (self.method == "draft_model") != (self.model is not None):
            raise ValueError("speculative_config: method 'draft_model' goes with a draft model, "
                             f"{{'model': PRESET_OR_FOLDER, ...}}, and 'model' with no other method "
                             f"(method {self.method!r}, model {self.model!r})")
        if self.model is not None and not isinstance(self.model, str):
            raise ValueError(f"speculative_config.model must be a preset name or a folder, got {self.model!r}")
        for name in ("num_speculative_tokens", "prompt_lookup_min", "prompt_lookup_max"):
            _check_positive(name, getattr(self, name))
        if self.num_speculative_tokens > MAX_SPECULATIVE_TOKENS:
            raise ValueError(f"speculative_config.num_speculative_tokens must be at most {MAX_SPECULATIVE_TOKENS}, "
                             f"got {self.num_speculative_tokens}")
        if self.prompt_lookup_min > self.prompt_lookup_max:
            raise ValueError(f"speculative_config.prompt_lookup_min ({self.prompt_lookup_min}) must be <= "
                             f"prompt_lookup_max ({self.prompt_lookup_max})")
        if self.method == "self":
            if self.num_layers is None:
                raise ValueError("speculative_config: method 'self' needs num_layers (the target's first layers "
                                 "that make the draft), e.g. {'method': 'self', 'num_layers': 4, "
                                 "'num_speculative_tokens': 4}")
            _check_positive("num_layers", self.num_layers)
        elif self.num_layers is not None:
            raise ValueError(f"speculative_config.num_layers is for method 'self' only, not {self.method!r}")

    def check_model(self, num_hidden_layers: int) -> None:
        """ValueError unless this config fits a target of `num_hidden_layers` layers (a "self" draft must be
        shallower than its target: else it costs a target's step and proposes the target's own tokens)."""
        if self.method == "self" and self.num_layers >= num_hidden_layers:
            raise ValueError(f"speculative_config.num_layers must be less than the model's {num_hidden_layers} "
                             f"layers, got {self.num_layers}")

    @classmethod
    def parse(cls, value: SpeculativeConfig | Mapping[str, object] | None) -> SpeculativeConfig | None:
        """A config from vLLM's dict (unknown keys refused), or None (no speculation)."""
        if value is None or isinstance(value, cls):
            return value
        if not isinstance(value, Mapping):
            raise ValueError(f"speculative_config must be a dict such as {{'method': 'ngram', "
                             f"'num_speculative_tokens': 4}}, got {value!r}")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(value) - known)
        if unknown:
            raise ValueError(f"speculative_config: unknown keys {unknown} (known: {sorted(known)})")
        return cls(**value)  # type: ignore[arg-type]


def _check_positive(name: str, value: object) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"speculative_config.{name} must be a positive integer, got {value!r}")


def speculates(params: SamplingParams) -> bool:
    """Whether a request may get draft tokens: greedy or sampled, unconstrained (a constrained one would need
    its grammar to check drafts: not implemented)."""
    return params.structured_outputs is None


def verify_rows(num_chunks: int, draft_counts: Sequence[int]) -> list[int]:
    """The first verification row of each chunk (its k rows follow; chunks without drafts get none): the
    step's chunk rows come first, then each speculating chunk's k rows in chunk order."""
    starts, row = [], num_chunks
    for k in draft_counts:
        starts.append(row)
        row += k
    return starts


def emitted_rows(chunk_row: int, first_verify_row: int, drafts: Sequence[int], token_ids: Sequence[int]) -> list[int]:
    """The rows whose tokens a verified chunk emits, in order: the target's token (argmax or sample) after each
    accepted draft's predecessor, then its token after the last accepted one. A draft is accepted iff the
    target's token in its place equals it (for sampled rows: point-mass rejection sampling, see above)."""
    rows = []
    for j, draft in enumerate(drafts):
        row = first_verify_row + j
        rows.append(row)
        if int(token_ids[row]) != draft:
            return rows  # the target's own token in place of the first rejected draft
    rows.append(chunk_row)  # every draft accepted: the bonus token after the last
    return rows


@dataclass
class SpeculationStats:
    """Totals over an engine's life: draft tokens proposed (scheduled) and accepted, verification steps
    (chunks that carried drafts) and the tokens they emitted (accepted + one each, unless a stop cut it)."""

    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    num_verify_steps: int = 0
    num_emitted_tokens: int = 0

    def add(self, metrics: RequestMetrics, drafts: int, accepted: int, emitted: int) -> None:
        """One verification step of a request: to the totals and to the request's `metrics`."""
        self.num_draft_tokens += drafts
        self.num_accepted_tokens += accepted
        self.num_verify_steps += 1
        self.num_emitted_tokens += emitted
        metrics.num_draft_tokens += drafts
        metrics.num_accepted_tokens += accepted
        metrics.num_verify_steps += 1

    def as_dict(self) -> dict[str, float | int | None]:
        d = self.num_draft_tokens
        return {
            "spec_num_draft_tokens": d,
            "spec_num_accepted_tokens": self.num_accepted_tokens,
            "spec_num_verify_steps": self.num_verify_steps,
            "spec_num_emitted_tokens": self.num_emitted_tokens,
            "spec_acceptance_rate": self.num_accepted_tokens / d if d else None,
            "spec_mean_accepted_length": (self.num_emitted_tokens / self.num_verify_steps
                                          if self.num_verify_steps else None),
        }
