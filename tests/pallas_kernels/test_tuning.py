"""The kernel's static configuration: rules, the tuning-table lookup, the committed rule-based table, and the
tuner's CPU-side modes (dry run, defaults, refusal without a GPU, the budget stop)."""

from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import tune, tuning
from pallas_kernels.ragged_paged_attention import ragged_paged_attention, resolve_kernel_config
from pallas_kernels.reference import ragged_paged_attention_reference as reference

KEY = dict(dtype="bfloat16", head_dim=128, group=4, block_size=16)


def _entry(kind, tokens, context, **config):
    return dict(kind=kind, tokens=tokens, context=context, config=config, time_us=1.0, **KEY)


@pytest.fixture
def table(tmp_path):
    path = tmp_path / "table.json"
    entries = [
        _entry("decode", 64, 2048, block_q=4, kv_pages_per_block=4, num_warps=8, num_stages=2, max_splits=2,
               min_split_kv=512, split_target_programs=264),
        _entry("decode", 16, 32768, block_q=4, kv_pages_per_block=16, num_warps=4, num_stages=1, max_splits=16,
               min_split_kv=256, split_target_programs=1056),
        _entry("prefill", 2048, 2048, block_q=16, kv_pages_per_block=8, num_warps=4, num_stages=4),
        _entry("prefill", 512, 2048, block_q=3, kv_pages_per_block=8, num_warps=4, num_stages=4),  # invalid
    ]
    path.write_text(json.dumps(dict(version=1, tuned=True, device="test", entries=entries)))
    return str(path)


def test_rules():
    cfg = tuning.rule_config(max_context=16384, **KEY)
    assert cfg.decode.block_q * 4 == 16  # the Triton minimum of 16 matmul rows
    assert cfg.prefill.block_q * 4 == 128 and cfg.prefill.kv_pages_per_block * 16 == 64
    assert cfg.max_splits == 16
    assert tuning.rule_config(max_context=1024, **KEY).max_splits == 4
    assert tuning.rule_config(max_context=128, **KEY).max_splits == 1
    g1 = tuning.rule_config(dtype="float32", head_dim=64, group=1, block_size=32, max_context=4096)
    assert g1.decode.block_q == 16 and g1.decode.kv_pages_per_block == 4
    assert g1.prefill.block_q == 64  # float32: half the rows of bfloat16, for shared memory
    assert tuning.rule_config(dtype="bfloat16", head_dim=64, group=1, block_size=32, max_context=4096).prefill.block_q == 128


def test_lookup_nearest_entry(table):
    cfg, src = tuning.resolve_config(tokens=64, max_context=1040, table_path=table, **KEY)
    assert cfg.decode == tuning.TileConfig(4, 4, 8, 2) and "tuned table decode" in src
    assert cfg.max_splits == 2 and cfg.min_split_kv == 512 and cfg.split_target_programs == 264
    # The nearest prefill entry (tokens 512) is invalid (block_q 3): rules, and the source says so.
    assert cfg.prefill == tuning.rule_config(max_context=1040, **KEY).prefill and "invalid" in src
    cfg, src = tuning.resolve_config(tokens=4096, max_context=2048, table_path=table, **KEY)
    assert cfg.prefill == tuning.TileConfig(16, 8, 4, 4) and "tuned table prefill" in src
    # Nearest in (log2 tokens, log2 context): the long-context decode entry; max_splits only from an entry of
    # the same context bucket, so here it stays the rule's for context 8192.
    cfg, src = tuning.resolve_config(tokens=8, max_context=8192, table_path=table, **KEY)
    assert cfg.decode.kv_pages_per_block == 16 and cfg.split_target_programs == 1056
    assert cfg.max_splits == tuning.rule_config(max_context=8192, **KEY).max_splits
    # No entry for this shape: rules.
    cfg, src = tuning.resolve_config(tokens=64, max_context=1024, table_path=table, **dict(KEY, head_dim=64))
    assert src == "rules decode; rules prefill"
    assert cfg == tuning.rule_config(max_context=1024, **dict(KEY, head_dim=64))


def test_invalid_entry_falls_back(tmp_path):
    path = tmp_path / "t.json"
    path.write_text(json.dumps(dict(version=1, tuned=True, entries=[
        _entry("prefill", 512, 2048, block_q=3, kv_pages_per_block=8, num_warps=4, num_stages=4)])))
    cfg, src = tuning.resolve_config(tokens=512, max_context=2048, table_path=str(path), **KEY)
    assert "invalid" in src and cfg.prefill == tuning.rule_config(max_context=2048, **KEY).prefill


def test_kernel_reads_table_through_env(table, monkeypatch):
    monkeypatch.setenv(tuning.TABLE_ENV, table)
    cfg, src = resolve_kernel_config((64, 32, 128), (300, 16, 8, 128), (66, 65), jnp.bfloat16)
    assert "tuned table decode" in src and cfg.decode.kv_pages_per_block == 4
    cfg, src = resolve_kernel_config((64, 32, 128), (300, 16, 8, 128), (66, 65), jnp.bfloat16, num_kv_splits=1,
                                     block_q=32)
    assert cfg.max_splits == 1 and cfg.prefill.block_q == 32 and "explicit" in src


def test_committed_table_is_measured_and_covers_the_default_cases(tmp_path):
    """The committed table was measured on a GPU (`pallas_kernels.tune`, "tuned": true), has one entry for
    each of tune's default cases (the ones `--write-defaults` lists), and every entry is a config the kernel
    takes: the lookup uses it for its own shape rather than falling back to the rules."""
    committed = json.loads(tuning.TABLE_PATH.read_text())
    assert committed["tuned"] is True and "H100" in committed["device"]
    out = tmp_path / "defaults.json"
    tune.main(["--write-defaults", "--out", str(out)])
    key = lambda e: (e["kind"], e["dtype"], e["head_dim"], e["group"], e["block_size"], e["tokens"], e["context"])
    defaults = json.loads(out.read_text())
    assert sorted(map(key, committed["entries"])) == sorted(map(key, defaults["entries"]))
    for e in committed["entries"]:
        assert e["time_us"] > 0
        cfg, src = tuning.resolve_config(dtype=e["dtype"], head_dim=e["head_dim"], group=e["group"],
                                         block_size=e["block_size"], tokens=e["tokens"], max_context=e["context"])
        assert f"tuned table {e['kind']}:" in src and "untuned" not in src and "invalid" not in src
        tile = getattr(cfg, e["kind"])
        assert (tile.block_q, tile.kv_pages_per_block, tile.num_warps, tile.num_stages) == tuple(
            e["config"][k] for k in ("block_q", "kv_pages_per_block", "num_warps", "num_stages"))


def test_tune_dry_run_and_cpu_refusal(capsys):
    tune.main(["--dry-run"])
    out = capsys.readouterr().out
    assert "10 cases" in out and "decode mistral7b" in out and "prefill llama1b" in out
    if jax.default_backend() == "cpu":
        with pytest.raises(SystemExit) as e:
            tune.main([])
        assert e.value.code == 2
        assert "needs a GPU" in capsys.readouterr().err


def test_tune_budget_stops_and_writes(tmp_path, capsys):
    out = tmp_path / "t.json"
    tune.main(["--interpret-smoke", "--budget-s", "0", "--out", str(out)])
    table = json.loads(out.read_text())
    assert table["entries"] == [] and "0 of 2 cases" in table["note"]


def test_table_config_is_exact(table, monkeypatch):
    """A kernel call under a table entry (other block sizes, split bounds) is still exact."""
    monkeypatch.setenv(tuning.TABLE_ENV, table)
    rng = np.random.default_rng(0)
    hq, hkv, d, bs, nb = 8, 2, 128, 16, 40
    q = rng.standard_normal((64, hq, d)).astype(np.float32)
    k = rng.standard_normal((nb, bs, hkv, d)).astype(np.float32)
    v = rng.standard_normal((nb, bs, hkv, d)).astype(np.float32)
    q, k, v = (np.asarray(jnp.asarray(x, jnp.bfloat16)) for x in (q, k, v))
    kv_lens = np.array([100, 7, 300, 0], np.int32)
    cu = np.array([0, 1, 2, 40, 40], np.int32)
    bt = np.stack([rng.permutation(nb)[:20] for _ in range(4)]).astype(np.int32)  # pages may be shared
    args = (q, k, v, kv_lens, bt, cu, np.array([3], np.int32))
    cfg, src = resolve_kernel_config(q.shape, k.shape, bt.shape, jnp.bfloat16)
    assert "tuned table" in src
    out = np.asarray(ragged_paged_attention(*args, interpret=True), np.float64)
    ref = reference(*args, sm_scale=d**-0.5)
    assert np.abs(out[:40] - ref[:40]).max() <= 2e-2 * np.abs(ref[:40]).max()
    assert np.all(out[40:] == 0)
