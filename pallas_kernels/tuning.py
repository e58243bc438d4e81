"""Block sizes and compiler parameters of the Pallas ragged paged attention kernel: the rule-based defaults,
and the lookup in the tuning table (`tuning_table.json`, written by `python -m pallas_kernels.tune`).

Everything here is static: the kernel resolves its `KernelConfig` once per traced shape (at trace time),
so a serving engine with fixed token buckets never recompiles because of it.

Table format (JSON):

    {"version": 1, "device": "...", "tuned": false,
     "entries": [{"kind": "decode" | "prefill", "dtype": "bfloat16", "head_dim": 128, "group": 4,
                  "block_size": 16, "tokens": 64, "context": 1024,
                  "config": {"block_q": 4, "kv_pages_per_block": 8, "num_warps": 4, "num_stages": 3,
                             "max_splits": 16, "min_split_kv": 256, "split_target_programs": 528},
                  "time_us": 123.4 | null}, ...]}

`group` is next_power_of_2(num_q_heads // num_kv_heads), `tokens` the token bucket T rounded up to a power of
two, `context` the cache's max context (max_blocks_per_seq * block_size) rounded up to a power of two.
Lookup (`resolve_config`): entries of the same kind, dtype, head_dim, group and block_size qualify; the one
nearest in log2 tokens + log2 context wins. The split fields only matter for decode entries; `max_splits`
is taken from an entry only when its context bucket is the call's (otherwise the rule sizes it). Where no
entry qualifies, the rules in `rule_tile_config` / `rule_split_config` decide.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import os
from pathlib import Path

__all__ = ["TileConfig", "KernelConfig", "rule_config", "resolve_config", "load_table", "TABLE_PATH"]

TABLE_PATH = Path(__file__).with_name("tuning_table.json")
# Override the table with another file (the tuner's output, say) without editing the package.
TABLE_ENV = "SARATHI_PALLAS_TUNING_TABLE"
# Streaming multiprocessors of an H100 SXM; used only by the split rule (enough programs to fill it).
_NUM_SMS = 132


def next_pow2(x: int) -> int:
    return 1 << max(0, int(x) - 1).bit_length()


@dataclasses.dataclass(frozen=True)
class TileConfig:
    """Static parameters of one tile kind (one `pallas_call`).

    block_q: query rows (tokens) per tile; the matmul has block_q * group_pad rows.
    kv_pages_per_block: cache pages per KV step (kv step = kv_pages_per_block * block_size tokens).
    num_warps, num_stages: Triton compiler parameters (None: the Pallas defaults).
    """

    block_q: int
    kv_pages_per_block: int
    num_warps: int | None = None
    num_stages: int | None = None

    def to_json(self):
        return dataclasses.asdict(self)


@dataclasses.dataclass(frozen=True)
class KernelConfig:
    """The whole static configuration of one kernel call.

    decode: tiles of sequences with 1 <= q_len <= decode.block_q (one tile each; split over the KV length).
      decode.block_q == 0 disables decode tiles (every sequence then uses prefill tiles).
    prefill: tiles of longer sequences, and the zero tiles of the padding rows (never split).
    max_splits: static bound on the KV splits of a decode tile (the size of the grid's split axis; a power of
      two; 1 means decode tiles write the output directly, with no merge pass).
    min_split_kv: a split covers at least this many KV tokens (rounded up to whole KV steps).
    split_target_programs: decode tiles are split until about this many programs run (the number of decode
      tiles times num_kv_heads times splits), within the two bounds above; computed per call from the data.
    """

    decode: TileConfig
    prefill: TileConfig
    max_splits: int = 1
    min_split_kv: int = 256
    split_target_programs: int = 4 * _NUM_SMS


def _pow2_floor(x: int) -> int:
    return 1 << (max(1, int(x)).bit_length() - 1)


def _kv_pages(block_size: int, tokens: int) -> int:
    """Pages per KV step: the largest power of two with pages * block_size <= tokens, raised to reach 16."""
    pages = _pow2_floor(max(1, tokens // max(1, block_size)))
    while pages * block_size < 16:
        pages *= 2
    return pages


def rule_tile_config(kind: str, *, dtype: str, head_dim: int, group: int, block_size: int) -> TileConfig:
    """The rule-based default for one tile kind (`group` is the padded GQA group, a power of two)."""
    if kind == "decode":
        # The Triton minimum of 16 matmul rows (or the group, if larger): 16 // group queries of a sequence.
        # Long KV steps (128 tokens) amortise the loop overhead of a memory-bound walk.
        return TileConfig(
            block_q=max(1, 16 // group), kv_pages_per_block=_kv_pages(block_size, 128), num_warps=4,
            num_stages=3 if dtype != "float32" else 2,
        )
    if kind == "prefill":
        # Flash-attention-like tiles: 128 matmul rows against 64-token KV steps (head_dim <= 128).
        # float32 tiles are twice the bytes: 64 rows keeps q, the pipelined K/V steps and the probabilities
        # well inside a Hopper SM's 227 KiB of shared memory.
        rows = 128 if head_dim <= 128 and dtype != "float32" else 64
        return TileConfig(
            block_q=max(1, rows // group), kv_pages_per_block=_kv_pages(block_size, 64),
            num_warps=8 if head_dim >= 128 else 4, num_stages=3 if dtype != "float32" else 2,
        )
    raise ValueError(f"unknown tile kind {kind!r}")


def rule_split_config(*, block_size: int, max_context: int, decode: TileConfig) -> dict:
    """Static split bounds: enough splits that one long sequence can spread over the GPU, each at least
    `min_split_kv` tokens long (whole KV steps)."""
    step = decode.kv_pages_per_block * block_size
    min_split_kv = max(256, step)
    max_splits = min(16, _pow2_floor(max(1, max_context // min_split_kv)))
    return dict(max_splits=max_splits, min_split_kv=min_split_kv, split_target_programs=4 * _NUM_SMS)


def rule_config(*, dtype: str, head_dim: int, group: int, block_size: int, max_context: int) -> KernelConfig:
    decode = rule_tile_config("decode", dtype=dtype, head_dim=head_dim, group=group, block_size=block_size)
    prefill = rule_tile_config("prefill", dtype=dtype, head_dim=head_dim, group=group, block_size=block_size)
    return KernelConfig(decode=decode, prefill=prefill,
                        **rule_split_config(block_size=block_size, max_context=max_context, decode=decode))


@functools.lru_cache(maxsize=8)
def _load_table(path: str) -> dict:
    p = Path(path)
    if not p.exists():
        return {"version": 1, "tuned": False, "entries": []}
    with open(p) as f:
        table = json.load(f)
    if table.get("version") != 1 or not isinstance(table.get("entries"), list):
        raise ValueError(f"{path}: not a version-1 ragged paged attention tuning table")
    return table


def load_table(path: str | os.PathLike | None = None) -> dict:
    return _load_table(str(path or current_table_path()))


def _lookup(table: dict, kind: str, *, dtype, head_dim, group, block_size, tokens, context):
    best, best_d = None, None
    for e in table["entries"]:
        if (e["kind"], e["dtype"], e["head_dim"], e["group"], e["block_size"]) != (kind, dtype, head_dim, group,
                                                                                   block_size):
            continue
        dt = abs(math.log2(e["tokens"]) - math.log2(tokens))
        dc = abs(math.log2(e["context"]) - math.log2(context))
        d = (dt + dc, dt, dc)
        if best_d is None or d < best_d:
            best, best_d = e, d
    return best


def _entry_name(e) -> str:
    return f"{e['kind']}:{e['dtype']}:d{e['head_dim']}:g{e['group']}:bs{e['block_size']}:t{e['tokens']}:ctx{e['context']}"


def _valid_tile(cfg: TileConfig, *, group: int, block_size: int, kind: str) -> bool:
    ok_q = cfg.block_q == 0 if (kind == "decode" and cfg.block_q == 0) else (
        cfg.block_q > 0 and cfg.block_q & (cfg.block_q - 1) == 0 and cfg.block_q * group >= 16)
    kvp = cfg.kv_pages_per_block
    return ok_q and kvp > 0 and kvp & (kvp - 1) == 0 and kvp * block_size >= 16


def current_table_path() -> str:
    """The table the kernel reads: $SARATHI_PALLAS_TUNING_TABLE if set, else the committed one."""
    return str(os.environ.get(TABLE_ENV) or TABLE_PATH)


def resolve_config(*, dtype: str, head_dim: int, group: int, block_size: int, tokens: int, max_context: int,
                   table_path: str | None = None) -> tuple[KernelConfig, str]:
    """(config, where it came from) for one static shape: table entries where they exist, else the rules.

    `group` is the padded GQA group (a power of two); `tokens` the token bucket T; `max_context`
    max_blocks_per_seq * block_size. Both are bucketed to powers of two for the lookup. Tables are read
    once per path and process (cached).
    """
    return _resolve_config(dtype=dtype, head_dim=head_dim, group=group, block_size=block_size, tokens=tokens,
                           max_context=max_context, table_path=str(table_path or current_table_path()))


@functools.lru_cache(maxsize=256)
def _resolve_config(*, dtype, head_dim, group, block_size, tokens, max_context, table_path):
    rules = rule_config(dtype=dtype, head_dim=head_dim, group=group, block_size=block_size, max_context=max_context)
    table = load_table(table_path)
    key = dict(dtype=dtype, head_dim=head_dim, group=group, block_size=block_size, tokens=next_pow2(tokens),
               context=next_pow2(max_context))
    parts, sources = {}, []
    for kind in ("decode", "prefill"):
        e = _lookup(table, kind, **key)
        tile = getattr(rules, kind)
        if e is not None:
            c = e["config"]
            cand = TileConfig(c["block_q"], c["kv_pages_per_block"], c.get("num_warps"), c.get("num_stages"))
            if _valid_tile(cand, group=group, block_size=block_size, kind=kind):
                tile = cand
                sources.append(("tuned " if table.get("tuned") else "untuned ") + "table " + _entry_name(e))
                if kind == "decode":
                    # The split bound is sized for the entry's context: taken only for the same context bucket.
                    fields = ("min_split_kv", "split_target_programs")
                    if e["context"] == key["context"]:
                        fields += ("max_splits",)
                    parts.update({f: int(c[f]) for f in fields if f in c})
            else:
                sources.append(f"rules {kind} (table entry {_entry_name(e)} invalid here)")
        else:
            sources.append(f"rules {kind}")
        parts[kind] = tile
    split = rule_split_config(block_size=block_size, max_context=max_context, decode=parts["decode"])
    split.update({k: v for k, v in parts.items() if k in split})
    ms = split["max_splits"]
    split["max_splits"] = max(1, min(_pow2_floor(ms), _pow2_floor(max(1, max_context // max(1, block_size)))))
    cfg = KernelConfig(decode=parts["decode"], prefill=parts["prefill"], **split)
    return cfg, "; ".join(sources)
