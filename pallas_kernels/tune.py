"""Tunes the Pallas ragged paged attention kernel on a GPU and writes the tuning table it reads.

    python -m pallas_kernels.tune                       # GPU: sweep, write pallas_kernels/tuning_table.json
    python -m pallas_kernels.tune --budget-s 200 --out /tmp/table.json
    python -m pallas_kernels.tune --dry-run             # anywhere: list the cases and candidates
    python -m pallas_kernels.tune --write-defaults      # anywhere: the rule-based table ("tuned": false)

Cases (`CASES`): for each head shape (Mistral-7B 32/8/128 and Llama-3.2-1B 32/8/64, bf16, block 16) the
decode batches of `cases.SUITE` (64 x ctx 1024, 8 x ctx 16384, 256 x ctx 2048; they exercise only the decode
tiles) and its prefill batches (a 2048-token prefill, a 512-token chunk at ctx 1536; only prefill tiles).
Each case tunes one tile kind by coordinate descent from the rule-based config: one parameter at a time
(decode: KV step, warps, stages, split target; prefill: query rows x KV step jointly, warps, stages), keeping
the best so far, so a case costs about 8-10 compiles instead of the full product. Each candidate is
compiled (first call) and timed over a few back-to-back warm calls (`--iters`, synchronised with
block_until_ready, best of `--repeats`). A candidate that fails to compile or mismatches the rule config's
output is skipped.

The sweep stops when `--budget-s` seconds have passed (checked before each candidate) and writes what it
has: cases not reached keep no entry, so the kernel falls back to the rules there. The default budget (200 s)
plus start-up fits in about 4 minutes on an H100. Entries carry the best time in microseconds.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time

import numpy as np

from pallas_kernels.tuning import TABLE_PATH, KernelConfig, TileConfig, next_pow2, rule_config

HEAD_SHAPES = {  # name: (num_q_heads, num_kv_heads, head_dim)
    "mistral7b": (32, 8, 128),
    "llama1b": (32, 8, 64),
}


@dataclasses.dataclass(frozen=True)
class TuneCase:
    kind: str  # "decode" or "prefill": which tile kind this batch exercises
    heads: str
    dtype: str
    block_size: int
    seqs: tuple[tuple[int, int], ...]  # (q_len, kv_len) per sequence

    @property
    def name(self) -> str:
        ql = {}
        for s in self.seqs:
            ql[s] = ql.get(s, 0) + 1
        desc = " + ".join(f"{n}x(q{q},kv{kv})" for (q, kv), n in ql.items())
        return f"{self.kind} {self.heads} {self.dtype} bs{self.block_size}: {desc}"

    def shape(self):
        """(tokens T, max_context) as the benchmark builds them (T padded to 16, 2 padding sequences)."""
        rows = sum(q for q, _ in self.seqs)
        max_blocks = -(-max(kv for _, kv in self.seqs) // self.block_size)
        return -(-rows // 16) * 16, max_blocks * self.block_size


def default_cases() -> list[TuneCase]:
    cases = []
    for heads in ("mistral7b", "llama1b"):
        for seqs in (((1, 1025),) * 64, ((1, 16385),) * 8, ((1, 2049),) * 256):
            cases.append(TuneCase("decode", heads, "bfloat16", 16, seqs))
        for seqs in (((2048, 2048),), ((512, 2048),)):
            cases.append(TuneCase("prefill", heads, "bfloat16", 16, seqs))
    # Priority: Mistral first, then llama-1b (the budget may stop the sweep).
    return cases


def interpret_smoke_cases() -> list[TuneCase]:
    """`--interpret-smoke`'s tiny cases (the harness on a CPU)."""
    return [TuneCase("decode", "llama1b", "float32", 16, ((1, 40),) * 3),
            TuneCase("prefill", "llama1b", "float32", 16, ((24, 30),))]


def _group(case: TuneCase) -> int:
    hq, hkv, _ = HEAD_SHAPES[case.heads]
    return next_pow2(hq // hkv)


def base_config(case: TuneCase) -> KernelConfig:
    _, _, d = HEAD_SHAPES[case.heads]
    _, ctx = case.shape()
    return rule_config(dtype=case.dtype, head_dim=d, group=_group(case), block_size=case.block_size, max_context=ctx)


def coordinate_steps(case: TuneCase, cfg: KernelConfig):
    """Per step, a function from the current best config to the candidates of that step."""
    g, bs = _group(case), case.block_size

    def pages(tokens):
        return max(1, tokens // bs)

    if case.kind == "decode":
        def kv_step(c):
            return [dataclasses.replace(c, decode=dataclasses.replace(c.decode, kv_pages_per_block=pages(t)))
                    for t in (64, 128, 256) if pages(t) * bs >= 16]

        def warps(c):
            return [dataclasses.replace(c, decode=dataclasses.replace(c.decode, num_warps=w)) for w in (4, 8)]

        def stages(c):
            return [dataclasses.replace(c, decode=dataclasses.replace(c.decode, num_stages=s)) for s in (1, 2, 3)]

        def split(c):
            return [dataclasses.replace(c, split_target_programs=p) for p in (264, 528, 1056)]

        return [("kv step", kv_step), ("warps", warps), ("stages", stages), ("split target", split)]

    def tile(c):
        out = []
        for rows in (64, 128):
            for t in (64, 128):
                bq = max(1, rows // g)
                if bq * g >= 16:
                    out.append(dataclasses.replace(c, prefill=dataclasses.replace(
                        c.prefill, block_q=bq, kv_pages_per_block=pages(t))))
        return out

    def warps(c):
        return [dataclasses.replace(c, prefill=dataclasses.replace(c.prefill, num_warps=w)) for w in (4, 8)]

    def stages(c):
        return [dataclasses.replace(c, prefill=dataclasses.replace(c.prefill, num_stages=s)) for s in (2, 3, 4)]

    return [("tile", tile), ("warps", warps), ("stages", stages)]


def _unique(cands, seen):
    out = []
    for c in cands:
        if c not in seen:
            seen.add(c)
            out.append(c)
    return out


def entry(case: TuneCase, cfg: KernelConfig, time_us) -> dict:
    _, _, d = HEAD_SHAPES[case.heads]
    t, ctx = case.shape()
    tile: TileConfig = getattr(cfg, case.kind)
    c = tile.to_json()
    if case.kind == "decode":
        c.update(max_splits=cfg.max_splits, min_split_kv=cfg.min_split_kv,
                 split_target_programs=cfg.split_target_programs)
    return dict(kind=case.kind, dtype=case.dtype, head_dim=d, group=_group(case), block_size=case.block_size,
                tokens=next_pow2(t), context=next_pow2(ctx), config=c,
                time_us=None if time_us is None else round(time_us, 2), case=case.name)


def write_table(path, entries, *, tuned: bool, device: str, note: str):
    table = dict(version=1, tuned=tuned, device=device, note=note, entries=entries)
    with open(path, "w") as f:
        json.dump(table, f, indent=1)
        f.write("\n")


def tune_case(case: TuneCase, *, deadline: float, iters: int, repeats: int, interpret: bool, log):
    import jax
    import jax.numpy as jnp

    from pallas_kernels.cases import build_batch
    from pallas_kernels.timing import best_seconds_per_call
    from pallas_kernels.ragged_paged_attention import ragged_paged_attention

    hq, hkv, d = HEAD_SHAPES[case.heads]
    arrays = build_batch(list(case.seqs), num_q_heads=hq, num_kv_heads=hkv, head_dim=d, block_size=case.block_size,
                         dtype=jnp.dtype(case.dtype), rng=np.random.default_rng(0))
    rows = sum(q for q, _ in case.seqs)
    ref = None
    best_cfg, best_t = base_config(case), None
    seen: set = set()

    def measure(cfg):
        nonlocal ref
        fn = jax.jit(lambda *a: ragged_paged_attention(*a, interpret=interpret, config=cfg))
        t0 = time.perf_counter()
        out = np.asarray(jax.block_until_ready(fn(*arrays))[:rows], np.float32)
        compile_s = time.perf_counter() - t0
        if ref is None:
            ref = out
        elif not np.allclose(out, ref, rtol=2e-2, atol=2e-2):
            raise ValueError("output differs from the first candidate's")
        return best_seconds_per_call(fn, *arrays, iters=iters, repeats=repeats, warmup=0), compile_s

    steps = [("rules", lambda c: [c])] + coordinate_steps(case, best_cfg)
    for step_name, make in steps:
        for cand in _unique(make(best_cfg), seen):
            if time.perf_counter() > deadline:
                log(f"   budget exhausted during step {step_name!r}")
                return best_cfg, best_t, False
            try:
                t, compile_s = measure(cand)
            except Exception as e:  # noqa: BLE001 - a candidate that fails to compile is skipped
                log(f"   {step_name}: {_describe(case, cand)} FAILED: {type(e).__name__}: {str(e)[:200]}")
                continue
            better = best_t is None or t < best_t
            log(f"   {step_name}: {_describe(case, cand)}: {t * 1e6:9.1f} us (compile {compile_s:.1f} s)"
                f"{'  *' if better else ''}")
            if better:
                best_cfg, best_t = cand, t
    return best_cfg, best_t, True


def _describe(case: TuneCase, cfg: KernelConfig) -> str:
    t: TileConfig = getattr(cfg, case.kind)
    s = f"block_q {t.block_q} kv_pages {t.kv_pages_per_block} warps {t.num_warps} stages {t.num_stages}"
    if case.kind == "decode":
        s += f" splits<={cfg.max_splits} target {cfg.split_target_programs}"
    return s


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default=str(TABLE_PATH), help=f"table to write (default {TABLE_PATH})")
    p.add_argument("--budget-s", type=float, default=200.0, help="stop sweeping after this many seconds")
    p.add_argument("--iters", type=int, default=10, help="back-to-back calls per timed run")
    p.add_argument("--repeats", type=int, default=3, help="timed runs per candidate (best kept)")
    p.add_argument("--heads", default="mistral7b,llama1b", help=f"comma-separated subset of {sorted(HEAD_SHAPES)}")
    p.add_argument("--kinds", default="decode,prefill", help="tile kinds to tune")
    p.add_argument("--dry-run", action="store_true", help="list the cases and candidate counts; run nothing")
    p.add_argument("--write-defaults", action="store_true",
                   help='write the rule-based table ("tuned": false) for the default cases; runs nothing')
    p.add_argument("--interpret-smoke", action="store_true",
                   help="CPU smoke test of the harness: tiny cases in interpret mode, table to --out")
    args = p.parse_args(argv)

    heads = set(args.heads.split(","))
    kinds = set(args.kinds.split(","))
    cases = [c for c in default_cases() if c.heads in heads and c.kind in kinds]

    if args.write_defaults:
        entries = [entry(c, base_config(c), None) for c in cases]
        write_table(args.out, entries, tuned=False, device="none (rule-based defaults)",
                    note="rule-based defaults from pallas_kernels/tuning.py; run `python -m pallas_kernels.tune` "
                         "on a GPU to replace them with measured configs")
        print(f"wrote {len(entries)} rule-based entries to {args.out}")
        return

    if args.dry_run:
        total = 0
        for c in cases:
            base = base_config(c)
            n = 1 + sum(len(make(base)) for _, make in coordinate_steps(c, base))
            total += n
            t, ctx = c.shape()
            print(f"{c.name}\n   T={t} (bucket {next_pow2(t)}), context {ctx} (bucket {next_pow2(ctx)}): "
                  f"<= {n} candidates from {_describe(c, base)}; steps: "
                  + ", ".join(name for name, _ in coordinate_steps(c, base)))
        print(f"{len(cases)} cases, <= {total} candidates (duplicates skipped); budget {args.budget_s:.0f} s")
        return

    import jax

    backend = jax.default_backend()
    interpret = False
    if args.interpret_smoke:
        interpret = True
        cases = interpret_smoke_cases()
    elif backend != "gpu":
        print(f"pallas_kernels.tune measures the compiled Triton kernel and needs a GPU; the default backend is "
              f"{backend!r}. Use --dry-run to list the sweep, --write-defaults for the rule-based table.",
              file=sys.stderr)
        raise SystemExit(2)

    device = jax.devices()[0].device_kind
    start = time.perf_counter()
    deadline = start + args.budget_s
    entries, complete = [], []
    print(f"device {device}; {len(cases)} cases; budget {args.budget_s:.0f} s", flush=True)
    for c in cases:
        if time.perf_counter() > deadline:
            print(f"skipped (budget): {c.name}")
            continue
        print(f"== {c.name}", flush=True)
        cfg, t, done = tune_case(c, deadline=deadline, iters=args.iters if not interpret else 1,
                                 repeats=args.repeats if not interpret else 1, interpret=interpret,
                                 log=lambda m: print(m, flush=True))
        if t is not None:
            entries.append(entry(c, cfg, t * 1e6))
            complete.append(done)
            print(f"   best: {_describe(c, cfg)}: {t * 1e6:.1f} us{'' if done else ' (partial sweep)'}", flush=True)
    elapsed = time.perf_counter() - start
    note = (f"measured by pallas_kernels.tune in {elapsed:.0f} s; {sum(complete)} of {len(cases)} cases fully swept, "
            f"{len(entries) - sum(complete)} partially")
    write_table(args.out, entries, tuned=not interpret, device=device + (" (interpret smoke)" if interpret else ""),
                note=note)
    print(f"wrote {len(entries)} entries to {args.out} ({note})")


if __name__ == "__main__":
    main()
