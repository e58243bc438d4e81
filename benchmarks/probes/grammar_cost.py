"""`python -m benchmarks.probes.grammar_cost`: what a grammar engine costs on the host, per library.

For each installed candidate (llguidance, xgrammar, outlines-core) and a tokenizer (`--model DIR` holding a
tokenizer.json, e.g. a `checkpoints_convert --gguf` output folder; or `--gguf FILE`, whose tokenizer files are
built into a temporary folder), with a nested JSON schema (`SCHEMA`, the bench's default constraint, from
sarathi_jax/bench/structured.py: nested objects, arrays with min/max items, enums, bounded numbers, patterns,
optional keys):

  tokenizer  the one-time set-up per tokenizer (the library's vocabulary tables)
  compile    the schema compiled from its text, no cache (median of `--compiles`)
  mask       one row's next-token bitmask, int32[ceil(V/32)], filled on the host, walking the tokens of a valid
             document (`DOCUMENT`, compact) one by one (median and p99 over every step of `--walks` walks)
  advance    the matcher's state advance on one token (median)
  (first mask: the first step's, median over walks: set-up a library defers to it; mean and p99: the others)
  walk ok    every token of the document is allowed by the mask of its step, EOS only after the last one
  valid      of `--samples` documents drawn by picking allowed tokens at random (seeded), how many parse and
             validate against the schema (the `jsonschema` library)

The timings are wall time on this machine's CPU; run it on a quiet machine.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import numpy as np
import tokenizers

from sarathi_jax.bench.structured import SCHEMA

DOCUMENT: dict[str, Any] = {
    "id": 4242, "name": "Grace", "status": "active", "score": 0.75, "tags": ["math", "navy", "cobol"],
    "address": {"street": "12 Harbour Road", "city": "Arlington", "zip": "22201"},
    "items": [{"sku": "A-100", "qty": 2}, {"sku": "B-7", "qty": 11}],
}


@dataclass(frozen=True)
class Vocab:
    """What every library is built from: the tokenizer.json text, each id's bytes, EOS and V."""
    tokenizer_json: str
    token_bytes: list[bytes]
    eos_id: int

    @property
    def size(self) -> int:
        return len(self.token_bytes)


class Matcher(Protocol):
    def fill(self, bitmask: np.ndarray) -> None: ...
    def advance(self, token: int) -> bool: ...


@dataclass(frozen=True)
class Library:
    name: str
    setup: Callable[[Vocab], Any]  # -> the per-tokenizer object
    compile: Callable[[Any, str], Any]  # (per-tokenizer object, schema text) -> compiled grammar
    matcher: Callable[[Any, Any], Matcher]  # (per-tokenizer object, compiled) -> a fresh matcher


def _byte_decoder() -> dict[str, int]:
    # GPT-2's byte-level alphabet: printable bytes stand for themselves, the rest are shifted past 255.
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(0xA1, 0xAD)) + list(range(0xAE, 0x100))
    chars, extra = {b: chr(b) for b in printable}, 0
    for b in range(256):
        if b not in chars:
            chars[b], extra = chr(256 + extra), extra + 1
    return {c: b for b, c in chars.items()}


def load_vocab(folder: Path) -> Vocab:
    text = (folder / "tokenizer.json").read_text()
    backend = tokenizers.Tokenizer.from_str(text)
    decoder = _byte_decoder()
    size = backend.get_vocab_size(with_added_tokens=True)
    specials = {t.content for t in backend.get_added_tokens_decoder().values()}
    tokens = [backend.id_to_token(i) or "" for i in range(size)]
    token_bytes = [t.encode() if t in specials else bytes(decoder.get(c, 0) for c in t) for t in tokens]
    config = json.loads((folder / "generation_config.json").read_text()) if (folder / "generation_config.json").is_file() else {}
    eos = config.get("eos_token_id", backend.token_to_id("<|endoftext|>"))
    return Vocab(text, token_bytes, int(eos[0] if isinstance(eos, list) else eos))


# ------------------------------------------------------------------------------------------- the candidates


def _llguidance() -> Library:
    import llguidance
    import llguidance.numpy as llnp

    class M:
        def __init__(self, tok: Any, grammar: str) -> None:
            self.m = llguidance.LLMatcher(tok, grammar)

        def fill(self, bitmask: np.ndarray) -> None:
            llnp.fill_next_token_bitmask(self.m, bitmask, 0)

        def advance(self, token: int) -> bool:
            return self.m.consume_token(token)

    def compile_(tok: Any, schema: str) -> str:
        grammar = llguidance.LLMatcher.grammar_from_json_schema(schema)
        matcher = llguidance.LLMatcher(tok, grammar)  # the lexer is built here: the compile
        assert not matcher.is_error(), matcher.get_error()
        return grammar

    return Library("llguidance", lambda v: llguidance.LLTokenizer(v.tokenizer_json, eos_token=v.eos_id),
                   compile_, M)


def _xgrammar() -> Library:
    import xgrammar as xgr

    class M:
        def __init__(self, _: Any, compiled: Any) -> None:
            self.m = xgr.GrammarMatcher(compiled)

        def fill(self, bitmask: np.ndarray) -> None:
            self.m.fill_next_token_bitmask(bitmask, 0)

        def advance(self, token: int) -> bool:
            return self.m.accept_token(token)

    def setup(v: Vocab) -> Any:
        info = xgr.TokenizerInfo(v.token_bytes, xgr.VocabType.RAW, vocab_size=v.size, stop_token_ids=[v.eos_id])
        return xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)

    return Library("xgrammar", setup, lambda c, schema: c.compile_json_schema(schema), M)


def _outlines_core() -> Library:
    import outlines_core

    class M:
        def __init__(self, _: Any, index: Any) -> None:
            self.g = outlines_core.Guide(index)

        def fill(self, bitmask: np.ndarray) -> None:
            self.g.write_mask_into(bitmask.ctypes.data, bitmask.size, 4)

        def advance(self, token: int) -> bool:
            self.g.advance(token, return_tokens=False)
            return True

    def setup(v: Vocab) -> Any:
        table: dict[bytes, list[int]] = {}
        for i, b in enumerate(v.token_bytes):
            if i != v.eos_id and b:
                table.setdefault(b, []).append(i)
        return outlines_core.Vocabulary(v.eos_id, table)

    def compile_(vocab: Any, schema: str) -> Any:
        return outlines_core.Index(outlines_core.json_schema.build_regex_from_schema(schema), vocab)

    return Library("outlines-core", setup, compile_, M)


CANDIDATES: dict[str, Callable[[], Library]] = {
    "llguidance": _llguidance, "xgrammar": _xgrammar, "outlines-core": _outlines_core,
}


# ---------------------------------------------------------------------------------------------- measuring


def _allowed(bitmask: np.ndarray, token: int) -> bool:
    return bool((int(bitmask[0, token // 32]) >> (token % 32)) & 1)


def random_document(matcher: Matcher, vocab: Vocab, rng: np.random.Generator, max_tokens: int) -> bytes | None:
    """A document drawn by picking allowed tokens at random, or None if it has no end after max_tokens. Every
    other pick prefers tokens that close something (`"`, `]`, `}`) or EOS, so strings end and walks finish."""
    bitmask = np.zeros((1, (vocab.size + 31) // 32), dtype=np.int32)
    out = b""
    for _ in range(max_tokens):
        matcher.fill(bitmask)
        allowed = np.flatnonzero(np.unpackbits(bitmask.view(np.uint8), bitorder="little")[: vocab.size])
        closers = [t for t in allowed if t == vocab.eos_id or any(c in vocab.token_bytes[t] for c in b'"]}')]
        token = int(rng.choice(closers if closers and rng.random() < 0.5 else allowed))
        if token == vocab.eos_id:
            return out
        out += vocab.token_bytes[token]
        if not matcher.advance(token):
            return None
    return None


def measure(library: Library, vocab: Vocab, tokens: list[int], compiles: int, walks: int, samples: int) -> dict[str, Any]:
    start = time.perf_counter()
    per_tokenizer = library.setup(vocab)
    setup_s = time.perf_counter() - start
    schema = json.dumps(SCHEMA)
    compile_s = []
    for _ in range(compiles):
        start = time.perf_counter()
        compiled = library.compile(per_tokenizer, schema)
        compile_s.append(time.perf_counter() - start)
    bitmask = np.zeros((1, (vocab.size + 31) // 32), dtype=np.int32)
    first_s, mask_s, advance_s, walk_ok = [], [], [], True
    for _ in range(walks):
        matcher = library.matcher(per_tokenizer, compiled)
        for step, token in enumerate([*tokens, vocab.eos_id]):
            start = time.perf_counter()
            matcher.fill(bitmask)
            (mask_s if step else first_s).append(time.perf_counter() - start)
            is_last = step == len(tokens)
            walk_ok &= _allowed(bitmask, token) and (is_last or not _allowed(bitmask, vocab.eos_id))
            if not is_last:
                start = time.perf_counter()
                walk_ok &= matcher.advance(token)
                advance_s.append(time.perf_counter() - start)
    import jsonschema
    rng, valid = np.random.default_rng(0), 0
    for _ in range(samples):
        text = random_document(library.matcher(per_tokenizer, compiled), vocab, rng, max_tokens=2000)
        try:
            jsonschema.validate(json.loads(text or b""), SCHEMA)
            valid += 1
        except (ValueError, jsonschema.ValidationError):
            pass
    mask_s.sort()
    return {"library": library.name, "tokenizer_s": setup_s, "compile_s": statistics.median(compile_s),
            "first_mask_us": 1e6 * statistics.median(first_s), "mask_us": 1e6 * statistics.median(mask_s),
            "mask_mean_us": 1e6 * statistics.fmean(mask_s), "mask_p99_us": 1e6 * mask_s[int(0.99 * (len(mask_s) - 1))],
            "advance_us": 1e6 * statistics.median(advance_s), "walk_ok": walk_ok, "valid": f"{valid}/{samples}"}


def tokenizer_folder(args: argparse.Namespace, scratch: Path) -> Path:
    if args.model:
        return Path(args.model)
    from checkpoints_convert.gguf_metadata import stop_token_ids, write_tokenizer_files
    from checkpoints_convert.gguf_source import GGUFCheckpoint
    checkpoint = GGUFCheckpoint(args.gguf)
    write_tokenizer_files(checkpoint, scratch)
    (scratch / "generation_config.json").write_text(json.dumps({"eos_token_id": stop_token_ids(checkpoint)}))
    return scratch


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    where = parser.add_mutually_exclusive_group(required=True)
    where.add_argument("--model", help="a folder holding tokenizer.json (and generation_config.json for EOS)")
    where.add_argument("--gguf", help="a GGUF file: its tokenizer files are built into a temporary folder")
    parser.add_argument("--libraries", nargs="+", default=list(CANDIDATES), choices=list(CANDIDATES))
    parser.add_argument("--compiles", type=int, default=5)
    parser.add_argument("--walks", type=int, default=20)
    parser.add_argument("--samples", type=int, default=20, help="random documents checked with jsonschema")
    parser.add_argument("--json", help="also write the figures to this file")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as scratch:
        vocab = load_vocab(tokenizer_folder(args, Path(scratch)))
    document = json.dumps(DOCUMENT, separators=(",", ":"))
    tokens = tokenizers.Tokenizer.from_str(vocab.tokenizer_json).encode(document, add_special_tokens=False).ids
    print(f"vocabulary {vocab.size} tokens, EOS {vocab.eos_id}; document {len(document)} chars, {len(tokens)} tokens")
    results = []
    for name in args.libraries:
        try:
            library = CANDIDATES[name]()
        except ImportError as e:
            print(f"{name}: not installed ({e})")
            continue
        results.append(measure(library, vocab, tokens, args.compiles, args.walks, args.samples))
    columns = [("library", "library", "{}"), ("tokenizer s", "tokenizer_s", "{:.2f}"),
               ("compile ms", "compile_s", "{:.1f}", 1e3), ("first mask us", "first_mask_us", "{:.0f}"),
               ("mask us", "mask_us", "{:.1f}"), ("mean", "mask_mean_us", "{:.1f}"), ("p99", "mask_p99_us", "{:.0f}"),
               ("advance us", "advance_us", "{:.1f}"), ("walk ok", "walk_ok", "{!s}"), ("valid", "valid", "{}")]
    table = [[c[0] for c in columns]] + [[c[2].format(r[c[1]] * c[3] if len(c) > 3 else r[c[1]]) for c in columns]
                                         for r in results]
    widths = [max(len(row[i]) for row in table) for i in range(len(columns))]
    for n, row in enumerate(table):
        print("  ".join(cell.ljust(w) if i == 0 else cell.rjust(w) for i, (cell, w) in enumerate(zip(row, widths))))
        if n == 0:
            print("  ".join("-" * w for w in widths))
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
