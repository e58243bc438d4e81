"""`bench.roofline`: FLOP and byte counts by hand on tiny-llama, floors from given rates, rates from
the probes."""

from __future__ import annotations

import pytest

from sarathi_jax.bench.roofline import ModelShape, Rates, decode_chunks, floors, measure_rates, work
from sarathi_jax.sim.cost_model import Chunk
from sarathi_jax.models.presets import get_preset


def tiny_shape() -> ModelShape:
    return ModelShape.from_model_config(get_preset("tiny-llama"), "float32")


def test_matmul_params_by_hand():
    shape = tiny_shape()
    # hidden 256, 4 heads x 64 (q, o: 256x256), 2 KV heads x 64 (k, v: 256x128), SwiGLU MLP 3 x 256x768, 4 layers
    per_layer = 256 * 256 + 2 * 256 * 128 + 256 * 256 + 3 * 256 * 768
    assert per_layer == 786_432
    assert shape.layer_matmul_params == 4 * per_layer
    assert shape.head_params == 32000 * 256
    assert shape.kv_bytes_per_token == 2 * 4 * 2 * 64 * 4  # K and V, 4 layers, 2 KV heads x 64, float32


def test_work_by_hand():
    shape = tiny_shape()
    # two decodes at context 16 plus a fresh 8-token prompt (which samples: it reaches the prompt's end)
    chunks = decode_chunks(2, 16) + [Chunk(0, 8)]
    w = work(shape, chunks)
    assert (w.num_tokens, w.num_sampled) == (10, 3)
    assert w.attention_pairs == 2 * 17 + 8 * 9 // 2 == 70
    assert w.linear_flops == 2 * 3_145_728 * 10
    assert w.head_flops == 2 * 8_192_000 * 3
    assert w.attention_flops == 4 * 4 * 4 * 64 * 70  # QK^T and PV, 4 layers, 4 query heads, head_dim 64
    assert w.flops == 62_914_560 + 49_152_000 + 286_720
    weights = (3_145_728 + 8_192_000 + 9 * 256) * 4  # tied embedding: the LM head is the table, read once
    assert weights == 11_340_032 * 4  # every parameter of the preset (its tree holds 11,340,032)
    assert w.weight_bytes == weights
    assert w.kv_read_bytes == 32 * 4096 and w.kv_write_bytes == 10 * 4096
    assert w.bytes == weights + 42 * 4096
    # a non-final chunk samples nothing and sees the keys before it
    mid = work(shape, [Chunk(8, 4, seq_len=16)])
    assert (mid.num_sampled, mid.attention_pairs, mid.head_flops) == (0, 4 * 8 + 10, 0)


def test_floors_from_given_rates():
    w = work(tiny_shape(), [Chunk(0, 16)])
    compute, memory = floors(w, Rates(matmul_flops=2e9, bandwidth=5e8))
    assert compute == pytest.approx(w.flops / 2e9)
    assert memory == pytest.approx(w.bytes / 5e8)


def test_measure_rates_takes_the_machine_probes_and_records_them(monkeypatch):
    from pallas_kernels import machine_rates

    monkeypatch.setattr(machine_rates, "matmul_rate",
                        lambda n, dtype, repeats: {"float32": 2e9, "bfloat16": 5e9}[dtype] * n / 64)
    monkeypatch.setattr(machine_rates, "memory_bandwidth",
                        lambda mbytes, repeats: machine_rates.Bandwidth(3e9, 4e9, mbytes))
    r = measure_rates("float32", matmul_n=64, bandwidth_mb=8, repeats=2)
    assert (r.matmul_flops, r.bandwidth) == (2e9, 4e9)  # the better of read and copy
    assert r.details["matmul"] == {"n": 64, "dtype": "float32", "flops_per_s": 2e9}
    assert r.details["matmul_bf16_flops_per_s"] == 5e9
    # The keys the GPU report reads (`gpu_report_parts`).
    assert r.details["bandwidth"] == {"read_bytes_per_s": 3e9, "copy_bytes_per_s": 4e9, "array_mbytes": 8}
    given = measure_rates("bfloat16", matmul_rate=1e12, bandwidth=2e11)
    assert (given.matmul_flops, given.bandwidth) == (1e12, 2e11) and "matmul_bf16_flops_per_s" not in given.details
