"""The OpenAI wire format of the HTTP API: request bodies (pydantic) and their mapping onto `SamplingParams`; the
response objects and server-sent events made from a request's outputs (`Renderer`, `sse_event`, `usage_of`).

Unknown fields are ignored, as OpenAI's API does. Types are strict, as OpenAI's are: no bool or string is
coerced into a number (`"max_tokens": true` or `"5"`), nor a string into a bool (`"stream": "yes"`); an int
is a valid float. Fields this engine cannot honour (`n > 1`, `best_of > 1`,
`echo`, `suffix`, `tools`) are refused by `unsupported()`, naming the field.
vLLM's extra sampling fields are accepted as vLLM accepts them: `top_k`, `min_p`, `min_tokens`,
`stop_token_ids`, `ignore_eos`, `return_token_ids` (each choice then carries its new `token_ids`), and
`priority` (an integer; lower is served first when the server schedules by priority).
This engine's own extras: `slo_ttft_s` and `slo_tbt_s` (a request's SLO targets in seconds, > 0; admission
checks them; the dynamic token budget honours slo_tbt_s).
Structured outputs (`SamplingParams.structured_outputs`), on both endpoints: OpenAI's `response_format`
(`{"type": "json_object"}`, `{"type": "json_schema", "json_schema": {"name", "schema", "strict"}}`, or
`"text"`: none), and vLLM's `guided_json`, `guided_regex`, `guided_choice`, `guided_grammar` and
`structured_outputs` object; at most one of them per request. A bad one is refused naming its field.
"""

from __future__ import annotations

import json
import math
import time
import uuid
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict

from sarathi_jax.core.admission import AdmissionError
from sarathi_jax.request.outputs import RequestOutput, TokenLogprob
from sarathi_jax.request.sampling_params import SamplingParams
from sarathi_jax.request.tokenizer import Tokenizer


class _Body(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)


class StreamOptions(_Body):
    include_usage: bool = False


class _SamplingFields(_Body):
    model: str | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int = 1
    # vLLM's extras
    top_k: int | None = None
    min_p: float | None = None
    min_tokens: int | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    return_token_ids: bool = False
    priority: int = 0  # vLLM's: lower is served first under --scheduling-policy priority (range: admission's)
    slo_ttft_s: float | None = None  # this engine's: the request's SLO targets (range: admission's)
    slo_tbt_s: float | None = None
    # structured outputs: OpenAI's, then vLLM's
    response_format: dict[str, Any] | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    structured_outputs: dict[str, Any] | None = None

    def unsupported(self) -> str | None:
        """The first field set to something this engine cannot honour, or None."""
        return "n" if self.n != 1 else None

    def sampling_params(self, logprobs: int | None, max_tokens: int | None) -> SamplingParams:
        """SamplingParams of this body (ValueError naming the field); unset fields keep its defaults."""
        fields: dict[str, Any] = dict(temperature=self.temperature, top_p=self.top_p, seed=self.seed,
                                      top_k=self.top_k, min_p=self.min_p, min_tokens=self.min_tokens,
                                      max_tokens=max_tokens, logprobs=logprobs)
        kwargs = {k: v for k, v in fields.items() if v is not None}
        try:
            return SamplingParams(stop=self.stop or (), stop_token_ids=self.stop_token_ids or (),
                                  ignore_eos=self.ignore_eos, structured_outputs=self.constraint()[1], **kwargs)
        except AdmissionError as e:
            raise self.named(e) from None

    def slo_targets(self) -> dict[str, float | None]:
        """The request's SLO targets, as admission's keywords."""
        return {"slo_ttft_s": self.slo_ttft_s, "slo_tbt_s": self.slo_tbt_s}

    def named(self, error: AdmissionError) -> AdmissionError:
        """`error`, or if it is about the structured-outputs constraint, the same naming the body field that
        set it (SamplingParams and admission call it `structured_outputs`)."""
        field = next((name for name in CONSTRAINT_FIELDS if getattr(self, name) is not None), None)
        return AdmissionError(field, error.reason) if error.param == "structured_outputs" and field else error

    def constraint(self) -> tuple[str | None, dict[str, Any] | None]:
        """(the body field that sets a structured-outputs constraint, the constraint as
        `SamplingParams.structured_outputs` takes it), or (None, None); AdmissionError for more than one."""
        given = {name: value for name, value in (
            ("response_format", self._response_format()), ("guided_json", _kind("json", self.guided_json)),
            ("guided_regex", _kind("regex", self.guided_regex)), ("guided_choice", _kind("choice", self.guided_choice)),
            ("guided_grammar", _kind("grammar", self.guided_grammar)), ("structured_outputs", self.structured_outputs),
        ) if value is not None}
        if len(given) > 1:
            raise AdmissionError(list(given)[1], f"only one structured-outputs field per request; got "
                                                 f"{', '.join(given)}")
        return next(iter(given.items()), (None, None))

    def _response_format(self) -> dict[str, Any] | None:
        rf = self.response_format
        kind = None if rf is None else rf.get("type")
        if rf is None or kind == "text":
            return None
        if kind == "json_object":
            return {"json_object": True}
        if kind == "json_schema":
            spec = rf.get("json_schema")
            if not isinstance(spec, dict) or not isinstance(spec.get("schema"), dict):
                raise AdmissionError("response_format", "json_schema needs an object with a `schema` object")
            return {"json": spec["schema"]}
        raise AdmissionError("response_format", f"type must be text, json_object or json_schema, got {kind!r}")

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage


CONSTRAINT_FIELDS = ("response_format", "guided_json", "guided_regex", "guided_choice", "guided_grammar",
                     "structured_outputs")


def _kind(kind: str, value: Any) -> dict[str, Any] | None:
    return None if value is None else {kind: value}


class CompletionRequest(_SamplingFields):
    """POST /v1/completions. `prompt`: text or token ids (a batch of one is taken as that one prompt)."""

    prompt: str | list[int] | list[str] | list[list[int]]
    logprobs: int | None = None
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None

    def requested_logprobs(self) -> int | None:
        return self.logprobs

    def unsupported(self) -> str | None:
        if self.echo:
            return "echo"
        if self.suffix:
            return "suffix"
        if self.best_of not in (None, 1):
            return "best_of"
        return super().unsupported()

    def single_prompt(self) -> str | list[int]:
        """The one prompt (AdmissionError for a batch)."""
        prompt = self.prompt
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
            if len(prompt) != 1:
                raise AdmissionError("prompt", f"batches of prompts are not supported (got {len(prompt)}); "
                                               "send one request per prompt")
            return prompt[0]
        return prompt  # type: ignore[return-value]


class TextPart(_Body):
    type: Literal["text"]
    text: str


class ChatMessage(_Body):
    role: str
    content: str | list[TextPart] | None = None
    name: str | None = None

    def as_template_message(self) -> dict[str, Any]:
        """The message as chat templates read it: content parts joined into one string."""
        content = self.content
        if isinstance(content, list):
            content = "".join(part.text for part in content)
        message: dict[str, Any] = {"role": self.role, "content": content or ""}
        if self.name is not None:
            message["name"] = self.name
        return message


class ChatCompletionRequest(_SamplingFields):
    """POST /v1/chat/completions."""

    messages: list[ChatMessage]
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    tools: list[Any] | None = None

    def unsupported(self) -> str | None:
        if self.tools:
            return "tools"
        return super().unsupported()

    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    def requested_logprobs(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None


__all__ = ["ChatCompletionRequest", "ChatMessage", "CompletionRequest", "StreamOptions", "TextPart"]


def sse_event(data: dict[str, Any]) -> str:
    return f"data: {json.dumps(data, separators=(',', ':'))}\n\n"


def usage_of(out: RequestOutput) -> dict[str, int]:
    n_prompt, n_out = len(out.prompt_token_ids), len(out.token_ids)
    return {"prompt_tokens": n_prompt, "completion_tokens": n_out, "total_tokens": n_prompt + n_out}


def _candidates(lp: TokenLogprob) -> list[tuple[int, float]]:
    """A token's top logprobs without the tokens a structured-outputs constraint ruled out (logprob -inf): they
    were never candidates, and JSON has no -inf (a constrained row allowing fewer tokens than requested)."""
    return [(i, v) for i, v in zip(lp.top_token_ids, lp.top_logprobs) if v != -math.inf]


class Renderer:
    """Turns one request's engine outputs into OpenAI response objects (completion or chat flavour)."""

    def __init__(self, body: CompletionRequest | ChatCompletionRequest, model_name: str,
                 tokenizer: Tokenizer | None) -> None:
        self.chat = isinstance(body, ChatCompletionRequest)
        self.body = body
        self.id = ("chatcmpl-" if self.chat else "cmpl-") + uuid.uuid4().hex
        self.created = int(time.time())
        self.model = model_name
        self.tokenizer = tokenizer
        self.text_offset = 0

    def _token(self, token_id: int) -> str:
        if self.tokenizer is None:
            return f"token_id:{token_id}"  # vLLM's spelling for a model without a tokenizer
        return self.tokenizer.decode([token_id], skip_special_tokens=False)

    def logprobs(self, entries: tuple[TokenLogprob, ...]) -> dict[str, Any] | None:
        if self.body.requested_logprobs() is None:
            return None
        if self.chat:
            def entry(token_id: int, logprob: float) -> dict[str, Any]:
                token = self._token(token_id)
                return {"token": token, "logprob": logprob, "bytes": list(token.encode())}

            return {"content": [{**entry(lp.token_id, lp.logprob),
                                 "top_logprobs": [entry(i, v) for i, v in _candidates(lp)]}
                                for lp in entries]}
        tokens = [self._token(lp.token_id) for lp in entries]
        offsets = []
        for token in tokens:
            offsets.append(self.text_offset)
            self.text_offset += len(token)
        return {"tokens": tokens, "token_logprobs": [lp.logprob for lp in entries],
                "top_logprobs": [{self._token(i): v for i, v in _candidates(lp)} for lp in entries],
                "text_offset": offsets}

    def choice(self, text: str, token_ids: tuple[int, ...], logprobs: tuple[TokenLogprob, ...],
               finish_reason: str | None, *, stream: bool, first: bool = False) -> dict[str, Any]:
        choice: dict[str, Any] = {"index": 0}
        if self.chat:
            if stream:
                choice["delta"] = {"role": "assistant", "content": text} if first else {"content": text}
            else:
                choice["message"] = {"role": "assistant", "content": text}
        else:
            choice["text"] = text
        choice["logprobs"] = self.logprobs(logprobs)
        choice["finish_reason"] = finish_reason
        if self.body.return_token_ids:
            choice["token_ids"] = list(token_ids)
        return choice

    def envelope(self, choices: list[dict[str, Any]], *, stream: bool) -> dict[str, Any]:
        kind = ("chat.completion" if self.chat else "text_completion") + (".chunk" if stream and self.chat else "")
        return {"id": self.id, "object": kind, "created": self.created, "model": self.model, "choices": choices}
