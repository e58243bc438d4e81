"""`python -m benchmarks.probes.constraint_cost`: what hostile structured-outputs constraints cost, host side.

With a tokenizer (`--model DIR` holding tokenizer.json, or `--gguf FILE`):

  ambiguous  the grammar `s: s s | "a" | "b" | "ab"` walked token by token (the lowest allowed id) under the
             default `MaskBudget`: the token at which the budget ends it, and the host time its masks took
             (the time it could take from other requests on the engine thread)
  cache      the resident memory after compiling `--schemas` distinct JSON schemas of about `--schema-chars`
             characters each, and what the compiler's cache holds (count, estimated bytes) under its bounds
  loop       an asyncio loop ticking every 1 ms while `--concurrent` distinct schemas of `--concurrent-chars`
             characters are admitted as `RequestSession.admit` does (checks, then compile, in the servers'
             `CompilePool`): the worst gap between ticks (how long /health or a stream would wait)

The bystander-stream figure (a stream's time alone and beside the ambiguous grammar) needs a served model; it is
not measured here.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import tempfile
import time
from pathlib import Path

from benchmarks.probes.grammar_cost import tokenizer_folder
from sarathi_jax.core.admission import Admission, AdmittedRequest
from sarathi_jax.request.sampling_params import SamplingParams
from sarathi_jax.request.structured_outputs import GrammarCompiler, StructuredOutputs, _resident_bytes
from sarathi_jax.request.tokenizer import load_tokenizer

AMBIGUOUS = 'start: s\ns: s s | "a" | "b" | "ab"\n'


def schema(i: int, chars: int) -> dict:
    """A distinct schema of about `chars` characters: up to 100 properties, each a long alternation pattern."""
    n = max(1, min(100, chars // 300))
    words = max(1, (chars // n - 40) // 13)
    return {"type": "object", "properties": {
        f"p{j}": {"type": "string", "pattern": "^(" + "|".join(f"w{i}x{j}y{k}" for k in range(words)) + ")$"}
        for j in range(n)}}


def ambiguous(compiler: GrammarCompiler, max_tokens: int) -> dict:
    matcher = compiler.matcher(StructuredOutputs("grammar", AMBIGUOUS))
    bitmask, start = compiler.allocate_bitmask(1), time.perf_counter()
    for token in range(max_tokens):
        matcher.fill_bitmask(bitmask, 0)
        if matcher.error:
            break
        row = bitmask[0].view("uint8")
        allowed = [t for t in range(compiler.vocab_size) if row[t // 8] >> (t % 8) & 1 and t not in
                   compiler.stop_token_ids]
        matcher.take(allowed[0])
    return {"ended_at_token": token, "mask_seconds": round(matcher.mask_seconds, 3),
            "wall_seconds": round(time.perf_counter() - start, 3), "error": matcher.error}


def cache(compiler: GrammarCompiler, schemas: int, chars: int) -> dict:
    before = _resident_bytes()
    for i in range(schemas):
        compiler.compile(StructuredOutputs.parse({"json": schema(i, chars)}))
    return {"rss_growth_mib": round((_resident_bytes() - before) / 2**20, 1), "cached": len(compiler),
            "cached_mib": round(compiler.cached_bytes / 2**20, 1), "bound_mib": compiler.cache_bytes >> 20}


async def loop_gap(admission: Admission, concurrent: int, chars: int) -> dict:
    from server.compile_pool import CompilePool

    pool, worst, done = CompilePool(), 0.0, False

    async def ticker() -> None:
        nonlocal worst
        last = time.perf_counter()
        while not done:
            await asyncio.sleep(0.001)
            now = time.perf_counter()
            worst, last = max(worst, now - last), now

    tick = asyncio.ensure_future(ticker())
    start = time.perf_counter()
    view = admission.deferring_grammars()

    async def admit(i: int) -> None:  # as RequestSession.admit: its checks, then the compile
        def build(adm: Admission) -> AdmittedRequest:
            params = SamplingParams(max_tokens=1, structured_outputs={"json": schema(10_000 + i, chars)})
            return adm.admit([1, 2], params)

        await pool.with_grammar(admission, await pool.check(build, view))

    await asyncio.gather(*(admit(i) for i in range(concurrent)))
    done = True
    await tick
    pool.close()
    return {"compiles": concurrent, "seconds": round(time.perf_counter() - start, 2),
            "worst_loop_gap_ms": round(worst * 1000, 1)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    where = parser.add_mutually_exclusive_group(required=True)
    where.add_argument("--model", help="a folder holding tokenizer.json (and generation_config.json for EOS)")
    where.add_argument("--gguf", help="a GGUF file: its tokenizer files are built into a temporary folder")
    parser.add_argument("--max-tokens", type=int, default=2000, help="the ambiguous walk's length at most")
    parser.add_argument("--schemas", type=int, default=256)
    parser.add_argument("--schema-chars", type=int, default=30_000)
    parser.add_argument("--concurrent", type=int, default=16)
    parser.add_argument("--concurrent-chars", type=int, default=62_000)
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as scratch:
        tokenizer = load_tokenizer(tokenizer_folder(args, Path(scratch)))
    assert tokenizer is not None
    admission = Admission(vocab_size=tokenizer.vocab_size, max_model_len=4096, tokenizer=tokenizer,
                          eos_token_ids=tokenizer.eos_token_ids)
    admission.warm_grammars()  # as the servers do before they serve
    loop = asyncio.run(loop_gap(admission, args.concurrent, args.concurrent_chars))
    compiler = GrammarCompiler(tokenizer.backend.to_str(), tokenizer.vocab_size, tokenizer.eos_token_ids)
    figures = {"ambiguous": ambiguous(compiler, args.max_tokens), "loop": loop,
               "cache": cache(compiler, args.schemas, args.schema_chars)}
    print(json.dumps(figures, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
