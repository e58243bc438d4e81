"""The one admission path: every request rule is decided here, once; text is tokenised and chats rendered.

`LLMEngine.add_request` (offline API), `SimulatedEngine.add_request` and both server front ends (gRPC, OpenAI
HTTP) call `Admission`; what it returns, an `AdmittedRequest`, is what the engine core trusts (the scheduler
only asserts it). Front ends run it in their own thread, so tokenisation and template rendering never hold up
the engine thread, and the token count they apply back-pressure with is the real one.

The rules, each written once:
- what a sampling field means on its own (types, ranges): `SamplingParams` (sarathi_jax/request/sampling_params.py);
- what depends on the engine, here: prompt token ids inside the vocabulary (text needs a tokenizer), a
  prompt that is not empty and leaves room to generate within max_model_len, prompt + max_tokens within
  max_model_len and within the KV cache, stop strings only where the engine sees text, stop ids inside the
  vocabulary, at most MAX_BANNED ids suppressed before min_tokens, and a structured-outputs constraint only
  with a tokenizer and an EOS id, compiled here (`GrammarCompiler`, built once from the tokenizer and cached
  by the constraint's text), so the engine thread never compiles: the request gets its `GrammarMatcher`;
- a request's priority: an integer in [PRIORITY_MIN, PRIORITY_MAX], the range of a signed 32-bit integer
  (`check_priority`); its SLO targets `slo_ttft_s` and `slo_tbt_s`: None or a finite number of seconds > 0
  (`check_slo`);
- what keeps a hostile input from costing more than it may: text must be valid Unicode (encodable as
  UTF-8: JSON can carry lone surrogates, which the tokenizer cannot take), and a prompt too long to fit
  max_model_len is refused before it is tokenised or converted (token ids: more than max_model_len of them;
  text: more characters than max_model_len tokens of the tokenizer's longest token can hold).
A refusal is an `AdmissionError` (a ValueError): its field is `.param`, its message `"{param}: {reason}"`.
Whatever a request's input is, admitting it raises nothing else: servers answer every refusal with a 400 /
INVALID_ARGUMENT naming the field, and anything else would be a server error.
Servers map it to a status; they check only what belongs to their protocol (JSON types, fields they do not
serve, the model name).
"""

from __future__ import annotations

import copy
import dataclasses
import math
import numbers
import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from sarathi_jax.scheduler.block_manager import BlockManager
from sarathi_jax.request.chat_template import ChatTemplate
from sarathi_jax.runner.sample.inputs import MAX_BANNED
from sarathi_jax.request.sampling_params import AdmissionError, SamplingParams
from sarathi_jax.request.sequence import PRIORITY_MAX, PRIORITY_MIN
from sarathi_jax.request.structured_outputs import GrammarCompiler, GrammarMatcher, StructuredOutputs
from sarathi_jax.request.tokenizer import Tokenizer

Prompt = str | Sequence[int]


@dataclass(frozen=True)
class AdmittedRequest:
    """A validated request: its prompt as token ids, its sampling parameters, and the ids suppressed while it
    has fewer than params.min_tokens outputs (`Admission.banned_until_min_tokens`), its priority (lower is
    served first under scheduling_policy="priority"), and with params.structured_outputs the request's
    grammar state (its own: queue an admitted request once)."""

    prompt_token_ids: tuple[int, ...]
    params: SamplingParams
    banned_until_min_tokens: tuple[int, ...]
    priority: int = 0
    grammar: GrammarMatcher | None = field(default=None, compare=False)
    slo_ttft_s: float | None = None  # the request's own SLO targets (outputs.RequestMetrics: what they mean)
    slo_tbt_s: float | None = None


@dataclass(frozen=True)
class KVCapacity:
    """The KV cache a whole request must fit in: `num_blocks` blocks of `block_size` tokens, of which the
    scheduler keeps `watermark_blocks` free when it admits a request."""

    block_size: int
    num_blocks: int
    watermark_blocks: int

    @classmethod
    def of(cls, block_manager: BlockManager) -> KVCapacity:
        """The block manager's sizes; read after the scheduler is built (it raises the watermark to its own)."""
        return cls(block_manager.block_size, block_manager.num_total_blocks, block_manager.watermark_blocks)


class Admission:
    """The request rules of one engine (its vocabulary, tokenizer, max_model_len and KV cache), tokenisation
    and chat rendering.

    kv_cache: the cache a whole request must fit in (None: only max_model_len bounds a request).
    no_structured_outputs: why the engine refuses structured outputs (None: it runs them).
    stop_strings: whether the engine ends requests on stop strings; None means when it has a tokenizer (its
    detokenizer finds them). The simulator says True: it stands for an engine that has one, and accepts what
    that engine would (its dummy tokens have no text, so they never match, as they never hit an EOS).
    """

    def __init__(
        self,
        *,
        vocab_size: int,
        max_model_len: int,
        kv_cache: KVCapacity | None = None,
        tokenizer: Tokenizer | None = None,
        eos_token_ids: Sequence[int] = (),
        chat_template: ChatTemplate | None = None,
        stop_strings: bool | None = None,
        no_structured_outputs: str | None = None,
    ) -> None:
        self.vocab_size = vocab_size
        self.max_model_len = max_model_len
        self.kv_cache = kv_cache
        self.tokenizer = tokenizer
        self.eos_token_ids = tuple(eos_token_ids)
        self.chat_template = chat_template  # a plain attribute: tests swap it
        self.stop_strings = tokenizer is not None if stop_strings is None else stop_strings
        # Built on the first constrained request; a str: why this tokenizer has none (kept, not retried).
        # A string: why structured outputs are refused (`no_structured_outputs`: the engine cannot run them).
        self._grammar_compiler: GrammarCompiler | str | None = no_structured_outputs
        self._grammar_lock = threading.Lock()
        self._defer_grammars = False  # `deferring_grammars`

    # ----------------------------------------------------------------------------------- prompts

    def prompt_ids(self, prompt: Prompt) -> list[int]:
        """A text prompt tokenised (special tokens added, as HF does), or token ids checked against the vocab.
        Emptiness is `check`'s (`room`'s) rule: an empty text gives no ids, not a lone BOS."""
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise AdmissionError("prompt", "text prompts need a tokenizer; this model has none, pass token ids")
            return self._encode("prompt", prompt, add_special_tokens=True) if prompt else []
        if isinstance(prompt, (bytes, bytearray, memoryview)):  # a sequence of ints, but not token ids
            raise AdmissionError("prompt", f"must be a string or a sequence of token ids, got "
                                           f"{type(prompt).__name__} (decode bytes to a string)")
        try:
            n = len(prompt)
        except TypeError:
            raise AdmissionError("prompt", f"must be a string or a sequence of token ids, got "
                                           f"{type(prompt).__name__}") from None
        if n >= self.max_model_len:  # before converting a list that could be huge
            self.room(range(n))
        if not all(isinstance(t, numbers.Integral) and not isinstance(t, bool) for t in prompt):
            raise AdmissionError("prompt", "token ids must be integers")
        ids = [int(t) for t in prompt]
        self._check_vocab("prompt", ids)
        return ids

    def _encode(self, param: str, text: str, add_special_tokens: bool) -> list[int]:
        """Token ids of a text the request carries (`param`: the field it came from), refused with an
        AdmissionError when it is not valid Unicode or too long to fit max_model_len, before tokenising."""
        assert self.tokenizer is not None
        try:
            text.encode("utf-8")
        except UnicodeEncodeError as exc:  # a lone surrogate (JSON's "\ud800"): the tokenizer raises TypeError
            raise AdmissionError(param, f"not valid Unicode: {exc.reason} at character {exc.start}") from None
        limit = self.max_model_len * self.tokenizer.longest_token_chars
        if len(text) > limit:
            raise AdmissionError(param, f"{len(text)} characters cannot fit max_model_len={self.max_model_len} "
                                        f"tokens of at most {self.tokenizer.longest_token_chars} characters "
                                        f"(limit {limit} characters)")
        return self.tokenizer.encode(text, add_special_tokens=add_special_tokens)

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
        return self.prompt_ids(self._encode("messages", text, add_special_tokens=False))

    def room(self, prompt_ids: Sequence[int]) -> int:
        """The most tokens a request with this prompt may generate (OpenAI's default max_tokens for a chat);
        AdmissionError when the prompt is empty or leaves no room."""
        n = len(prompt_ids)
        if n == 0:
            raise AdmissionError("prompt", "empty")
        if n >= self.max_model_len:
            raise AdmissionError("prompt", f"{n} tokens leave no room to generate within "
                                           f"max_model_len={self.max_model_len}")
        return self.max_model_len - n

    # ----------------------------------------------------------------------------------- requests

    def admit(self, prompt: Prompt, params: SamplingParams | None = None, priority: Any = 0, *,
              slo_ttft_s: Any = None, slo_tbt_s: Any = None) -> AdmittedRequest:
        """Validate a request with a plain prompt; raises AdmissionError naming the field."""
        priority = check_priority(priority)  # first: a refused request costs no tokenising
        check_slo("slo_ttft_s", slo_ttft_s), check_slo("slo_tbt_s", slo_tbt_s)
        return self.check(self.prompt_ids(prompt), params, priority, slo_ttft_s=slo_ttft_s, slo_tbt_s=slo_tbt_s)

    def admit_chat(self, messages: Sequence[Mapping[str, Any]], params: SamplingParams | None = None,
                   priority: Any = 0, *, slo_ttft_s: Any = None, slo_tbt_s: Any = None,
                   **template_kwargs: Any) -> AdmittedRequest:
        priority = check_priority(priority)
        check_slo("slo_ttft_s", slo_ttft_s), check_slo("slo_tbt_s", slo_tbt_s)
        return self.check(self.chat_prompt_ids(messages, **template_kwargs), params, priority,
                          slo_ttft_s=slo_ttft_s, slo_tbt_s=slo_tbt_s)

    def check(self, prompt_ids: Sequence[int], params: SamplingParams | None, priority: Any = 0, *,
              slo_ttft_s: Any = None, slo_tbt_s: Any = None) -> AdmittedRequest:
        """The rules on a prompt (ids as `prompt_ids` or `chat_prompt_ids` return them: inside the vocabulary)
        together with its sampling parameters, priority and SLO targets."""
        priority = check_priority(priority)
        slo_ttft_s, slo_tbt_s = check_slo("slo_ttft_s", slo_ttft_s), check_slo("slo_tbt_s", slo_tbt_s)
        params = params or SamplingParams()
        n, m = len(prompt_ids), params.max_tokens
        if m > self.room(prompt_ids):
            raise AdmissionError("max_tokens", f"prompt ({n} tokens) + max_tokens ({m}) = {n + m} tokens exceeds "
                                               f"max_model_len ({self.max_model_len})")
        kv = self.kv_cache
        if kv is not None:
            # The scheduler admits a request only when its whole (re-)prefill's blocks are free above the
            # watermark, and a preempted one re-prefills up to prompt + max_tokens - 1 tokens: the full
            # length must fit, or it would wait forever.
            blocks, usable = -(-(n + m) // kv.block_size), kv.num_blocks - kv.watermark_blocks
            if blocks > usable:
                raise AdmissionError(
                    "max_tokens", f"prompt + max_tokens = {n + m} tokens need {blocks} KV blocks of {kv.block_size} "
                                  f"tokens, but the cache has {kv.num_blocks} blocks ({usable} usable at admission, "
                                  f"above the watermark of {kv.watermark_blocks})")
        if params.stop and not self.stop_strings:
            raise AdmissionError("stop", "stop strings need a tokenizer, and this model has none "
                                         "(use stop_token_ids)")
        self._check_vocab("stop_token_ids", params.stop_token_ids)
        banned = self.banned_until_min_tokens(params)
        if len(banned) > MAX_BANNED:
            raise AdmissionError("stop_token_ids",
                                 f"with min_tokens at most {MAX_BANNED} stop and EOS ids can be suppressed")
        constraint = params.structured_outputs
        grammar = None
        if constraint is not None:
            self._check_grammar_support()
            grammar = None if self._defer_grammars else self.grammar_matcher(constraint)
        return AdmittedRequest(tuple(prompt_ids), params, banned, priority, grammar, slo_ttft_s, slo_tbt_s)

    def deferring_grammars(self) -> Admission:
        """This admission, except that `check` leaves a constrained request's grammar unset (its cheap checks
        still run): the servers compile it with `with_grammar` after their own checks, off their event loop."""
        view = copy.copy(self)
        view._defer_grammars = True
        return view

    def with_grammar(self, admitted: AdmittedRequest) -> AdmittedRequest:
        """`admitted` with its constraint's grammar compiled (the request itself when it has one or none)."""
        constraint = admitted.params.structured_outputs
        if constraint is None or admitted.grammar is not None:
            return admitted
        return dataclasses.replace(admitted, grammar=self.grammar_matcher(constraint))

    def _check_grammar_support(self) -> None:
        if isinstance(self._grammar_compiler, str):
            raise AdmissionError("structured_outputs", self._grammar_compiler)
        if self.tokenizer is None:
            raise AdmissionError("structured_outputs", "needs a tokenizer, and this model has none")
        if not self.eos_token_ids:
            raise AdmissionError("structured_outputs", "needs an EOS token id (the output ends with it), and this "
                                                       "model has none")

    def warm_grammars(self) -> None:
        """Build the grammar compiler now, where the model supports structured outputs (it reads the tokenizer's
        whole vocabulary: up to about a second, holding the GIL), so no constrained request pays for it. Servers
        call it before they serve."""
        try:
            self._check_grammar_support()
        except AdmissionError:
            return
        self._compiler()

    def _compiler(self) -> GrammarCompiler | str:
        """The grammar compiler, built once; or why this tokenizer has none."""
        assert self.tokenizer is not None
        with self._grammar_lock:  # front ends admit on several threads; the compiler is built once
            if self._grammar_compiler is None:
                try:
                    self._grammar_compiler = GrammarCompiler(self.tokenizer.backend.to_str(), self.vocab_size,
                                                             self.eos_token_ids)
                except ValueError as e:  # llguidance cannot read this tokenizer (e.g. its decoder type)
                    self._grammar_compiler = f"not available with this model's tokenizer: {e}"
            return self._grammar_compiler

    def grammar_matcher(self, constraint: StructuredOutputs) -> GrammarMatcher:
        """A fresh matcher of a constraint, compiled (or taken from the compiler's cache) now."""
        param = "structured_outputs"
        self._check_grammar_support()
        compiler = self._compiler()
        if isinstance(compiler, str):
            raise AdmissionError(param, compiler)
        try:
            return compiler.matcher(constraint)
        except ValueError as e:  # the library's message
            raise AdmissionError(param, str(e).removeprefix(f"{param}: ")) from None

    def banned_until_min_tokens(self, params: SamplingParams) -> tuple[int, ...]:
        """The ids suppressed while a request has fewer than min_tokens outputs: its stop ids and (unless
        ignore_eos) EOS."""
        if params.min_tokens == 0:
            return ()
        return tuple(dict.fromkeys((() if params.ignore_eos else self.eos_token_ids) + params.stop_token_ids))

    def _check_vocab(self, param: str, ids: Sequence[int]) -> None:
        bad = [t for t in ids if not 0 <= t < self.vocab_size]
        if bad:
            raise AdmissionError(param, f"token ids {bad[:5]} outside the vocabulary [0, {self.vocab_size})")


def check_priority(priority: Any) -> int:
    """A request's priority as an int: AdmissionError("priority") unless it is an integer (not a bool) in
    [PRIORITY_MIN, PRIORITY_MAX]."""
    if not isinstance(priority, numbers.Integral) or isinstance(priority, bool):
        raise AdmissionError("priority", f"must be an integer, got {type(priority).__name__}")
    if not PRIORITY_MIN <= priority <= PRIORITY_MAX:
        raise AdmissionError("priority", f"{priority} is outside [{PRIORITY_MIN}, {PRIORITY_MAX}]")
    return int(priority)


def check_slo(param: str, seconds: Any) -> float | None:
    """An SLO target as a float: None (no target) or a finite number of seconds > 0 (not a bool); else
    AdmissionError(param)."""
    if seconds is None:
        return None
    if not isinstance(seconds, numbers.Real) or isinstance(seconds, bool):
        raise AdmissionError(param, f"must be a number of seconds, got {type(seconds).__name__}")
    if not (math.isfinite(seconds) and seconds > 0):
        raise AdmissionError(param, f"must be a finite number of seconds > 0, got {seconds}")
    return float(seconds)


__all__ = ["Admission", "AdmissionError", "AdmittedRequest", "KVCapacity", "check_priority", "check_slo", "Prompt"]
