"""Chat templates: a model's Jinja2 template rendered the way HF transformers' `apply_chat_template` does.

Where the template comes from (first found): `chat_template.jinja`, `chat_template.json` (`chat_template`),
`tokenizer_config.json` (`chat_template`: a string, or a list of `{"name", "template"}` of which "default"
is used). Rendering uses Jinja2's `ImmutableSandboxedEnvironment` with `trim_blocks` / `lstrip_blocks` and the
`loopcontrols` extension, and the globals HF passes: `raise_exception`, `strftime_now`, the special tokens
(`bos_token`, `eos_token`, `unk_token`, `pad_token`) from tokenizer_config.json, and `add_generation_prompt`.
"""

from __future__ import annotations

import datetime
import functools
import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from sarathi_jax.request.tokenizer import read_json_object

Message = Mapping[str, Any]


class ChatTemplateError(ValueError):
    """The model has no chat template, or the template refused the conversation (`raise_exception`)."""


def _token_content(value: Any) -> str | None:
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


def _pick(template: Any) -> str | None:
    if isinstance(template, str):
        return template
    if isinstance(template, list):  # [{"name": "default", "template": "..."}, {"name": "tool_use", ...}]
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        chosen = named.get("default")
        return chosen if isinstance(chosen, str) else None
    return None


@functools.lru_cache(maxsize=32)
def _compile(source: str) -> Any:
    from jinja2.ext import loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message: str) -> None:
        raise ChatTemplateError(f"chat template: {message}")

    def tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None, separators: Any = None,
               sort_keys: bool = False) -> str:
        return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    def strftime_now(fmt: str) -> str:
        return datetime.datetime.now().strftime(fmt)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = strftime_now
    return env.from_string(source)


class ChatTemplate:
    def __init__(self, source: str, special_tokens: Mapping[str, str | None] | None = None) -> None:
        self.source = source
        self.special_tokens = {k: v for k, v in (special_tokens or {}).items() if v is not None}
        self._template = _compile(source)

    @classmethod
    def from_folder(cls, folder: str | Path) -> ChatTemplate | None:
        """The template of a model folder, or None if it has none."""
        folder = Path(folder)
        tok_config = read_json_object(folder / "tokenizer_config.json")
        source: str | None = None
        if (folder / "chat_template.jinja").is_file():
            source = (folder / "chat_template.jinja").read_text()
        if source is None:
            source = _pick(read_json_object(folder / "chat_template.json").get("chat_template"))
        if source is None:
            source = _pick(tok_config.get("chat_template"))
        if not source:
            return None
        special = {name: _token_content(tok_config.get(name)) for name in ("bos_token", "eos_token", "unk_token",
                                                                            "pad_token")}
        return cls(source, special)

    def render(self, messages: Sequence[Message], add_generation_prompt: bool = True, **kwargs: Any) -> str:
        """The conversation as the prompt text (special tokens included as text; encode it without adding any)."""
        if not messages:
            raise ValueError("messages: the conversation is empty")
        for i, message in enumerate(messages):
            if not isinstance(message, Mapping) or "role" not in message:
                raise ValueError(f"messages[{i}]: each message needs a 'role' (and usually 'content')")
        context = {**self.special_tokens, **kwargs}
        return self._template.render(messages=[dict(m) for m in messages],
                                     add_generation_prompt=add_generation_prompt, **context)


__all__ = ["ChatTemplate", "ChatTemplateError", "Message"]
