"""The one admission path: every request is validated, tokenised and (for chat) rendered here, once.

`LLMEngine.add_request` (offline API) and both server front ends (gRPC, OpenAI HTTP) call `Admission`;
what it returns, an `AdmittedRequest`, is what the engine core trusts (`LLMEngine.add_admitted` only asserts
the contract). Front ends run it in their own thread, so tokenisation and template rendering never hold up
the engine thread, and the token count they apply back-pressure with is the real one.

A refusal is an `AdmissionError` (a ValueError) whose message starts with the field at fault (`prompt: ...`,
`max_tokens: ...`), also in `.param`.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from sarathi_jax.chat_template import ChatTemplate
from sarathi_jax.sampling_inputs import MAX_BANNED
from sarathi_jax.sampling_params import SamplingParams
from sarathi_jax.tokenizer import Tokenizer

Prompt = str | Sequence[int]

# SamplingParams' ValueErrors start with the field name ("top_p must be in (0, 1]").
_PARAM_FIELDS = tuple(f for f in SamplingParams.__dataclass_fields__)


class AdmissionError(ValueError):
    """A request refused before it reached the engine; `param` names the field at fault."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(f"{param}: {message}")
        self.param = param


def param_of(error: ValueError) -> str | None:
    """The request field a validation error is about: `AdmissionError.param`, or SamplingParams' leading word."""
    if isinstance(error, AdmissionError):
        return error.param
    head = str(error).split(" ", 1)[0].rstrip(":")
    return head if head in _PARAM_FIELDS else None


@dataclass(frozen=True)
class AdmittedRequest:
    """A validated request: its prompt as token ids, and its sampling parameters."""

    prompt_token_ids: tuple[int, ...]
    params: SamplingParams


class Admission:
    """Validation, tokenisation and chat rendering for one engine (its model, tokenizer, lengths and cache).

    `never_fits(num_prompt_tokens, max_tokens)` is the scheduler's rule for a request that could never run
    (max_model_len, KV cache size): a reason, or None.
    """

    def __init__(
        self,
        *,
        vocab_size: int,
        max_model_len: int,
        tokenizer: Tokenizer | None,
        eos_token_ids: Sequence[int],
        chat_template: ChatTemplate | None,
        never_fits: Callable[[int, int], str | None],
    ) -> None:
        self.vocab_size = vocab_size
        self.max_model_len = max_model_len
        self.tokenizer = tokenizer
        self.eos_token_ids = tuple(eos_token_ids)
        self.chat_template = chat_template  # a plain attribute: tests swap it
        self._never_fits = never_fits

    # ----------------------------------------------------------------------------------- prompts

    def prompt_ids(self, prompt: Prompt) -> list[int]:
        """A text prompt tokenised (special tokens added, as HF does), or token ids checked against the vocab."""
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise AdmissionError("prompt", "text prompts need a tokenizer; this model has none, pass token ids")
            if not prompt:
                raise AdmissionError("prompt", "empty")
            ids = self.tokenizer.encode(prompt)
        else:
            ids = [int(t) for t in prompt]
        if not ids:
            raise AdmissionError("prompt", "empty")
        bad = [t for t in ids if not 0 <= t < self.vocab_size]
        if bad:
            raise AdmissionError("prompt", f"token ids {bad[:5]} outside the vocabulary [0, {self.vocab_size})")
        return ids

    def chat_prompt_ids(self, messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool = True,
                        **template_kwargs: Any) -> list[int]:
        """A conversation rendered with the model's chat template, tokenised without adding special tokens
        (the template writes them, as HF's `apply_chat_template(..., tokenize=True)`)."""
        if self.chat_template is None or self.tokenizer is None:
            raise AdmissionError(
                "messages", "the model has no chat template (tokenizer_config.json 'chat_template' or "
                            "chat_template.jinja) or no tokenizer; send a plain prompt (text or token ids)")
        if not messages:
            raise AdmissionError("messages", "the conversation is empty")
        try:
            text = self.chat_template.render(messages, add_generation_prompt=add_generation_prompt,
                                             **template_kwargs)
        except Exception as exc:  # noqa: BLE001 - a template error (raise_exception, sandbox) is the request's fault
            raise AdmissionError("messages", str(exc)) from None
        return self.prompt_ids(self.tokenizer.encode(text, add_special_tokens=False))

    # ----------------------------------------------------------------------------------- requests

    def admit(self, prompt: Prompt, params: SamplingParams | None = None) -> AdmittedRequest:
        """Validate a request with a plain prompt; raises AdmissionError naming the field."""
        return self.check(self.prompt_ids(prompt), params)

    def admit_chat(self, messages: Sequence[Mapping[str, Any]], params: SamplingParams | None = None,
                   **template_kwargs: Any) -> AdmittedRequest:
        return self.check(self.chat_prompt_ids(messages, **template_kwargs), params)

    def check(self, prompt_ids: Sequence[int], params: SamplingParams | None) -> AdmittedRequest:
        """The checks that need both the prompt and the sampling parameters."""
        params = params or SamplingParams()
        n = len(prompt_ids)
        if n >= self.max_model_len:
            raise AdmissionError("prompt", f"{n} tokens leave no room to generate within "
                                           f"max_model_len={self.max_model_len}")
        why = self._never_fits(n, params.max_tokens)
        if why is not None:
            raise AdmissionError("max_tokens", why)
        if params.stop and self.tokenizer is None:
            raise AdmissionError("stop", "stop strings need a tokenizer, and this model has none "
                                         "(use stop_token_ids)")
        bad_stop_ids = [t for t in params.stop_token_ids if t >= self.vocab_size]
        if bad_stop_ids:
            raise AdmissionError("stop_token_ids", f"{bad_stop_ids} outside the vocabulary of size {self.vocab_size}")
        if len(self.banned_until_min_tokens(params)) > MAX_BANNED:
            raise AdmissionError("stop_token_ids",
                                 f"with min_tokens at most {MAX_BANNED} stop and EOS ids can be suppressed")
        return AdmittedRequest(tuple(prompt_ids), params)

    def banned_until_min_tokens(self, params: SamplingParams) -> tuple[int, ...]:
        """The ids suppressed while a request has fewer than min_tokens outputs: its stop ids and (unless
        ignore_eos) EOS."""
        if params.min_tokens == 0:
            return ()
        return tuple(dict.fromkeys((() if params.ignore_eos else self.eos_token_ids) + params.stop_token_ids))


__all__ = ["Admission", "AdmissionError", "AdmittedRequest", "Prompt", "param_of"]
