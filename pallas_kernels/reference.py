"""The float64 numpy reference for ragged paged attention: the oracle both attention paths are tested against.

Same arguments and semantics as `ragged_paged_attention_xla` / `ragged_paged_attention` (see
`pallas_kernels/ragged_paged_attention.py` for shapes): query row j of sequence i sits at position
`kv_lens[i] - q_len_i + j` and attends causally to positions `0 .. kv_lens[i] - q_len_i + j` of the same
sequence, GQA heads `h` reading KV head `h // (num_q_heads // num_kv_heads)`. Written for clarity, one
sequence at a time with each sequence's K/V gathered token by token from its block table, in float64, so
that it shares no code and no rounding with the paths it checks. Rows past `cu_q_lens[num_seqs]` are zeros.
"""

from __future__ import annotations

import numpy as np


def ragged_paged_attention_reference(q, k_pages, v_pages, kv_lens, block_tables, cu_q_lens, num_seqs,
                                     sm_scale: float) -> np.ndarray:
    """`[T, num_q_heads, head_dim]` float64."""
    q, k_pages, v_pages = (np.asarray(x, np.float64) for x in (q, k_pages, v_pages))
    kv_lens, block_tables, cu_q_lens = (np.asarray(x) for x in (kv_lens, block_tables, cu_q_lens))
    num_q_heads = q.shape[1]
    block_size, num_kv_heads = k_pages.shape[1], k_pages.shape[2]
    if num_q_heads % num_kv_heads:
        raise ValueError(f"num_q_heads {num_q_heads} is not a multiple of num_kv_heads {num_kv_heads}")
    group = num_q_heads // num_kv_heads
    out = np.zeros_like(q)
    for i in range(int(np.asarray(num_seqs).reshape(()))):
        start, end = int(cu_q_lens[i]), int(cu_q_lens[i + 1])
        kv_len, q_len = int(kv_lens[i]), end - start
        if q_len == 0:
            continue
        positions = np.arange(kv_len)
        pages = block_tables[i][positions // block_size]
        k = np.repeat(k_pages[pages, positions % block_size], group, axis=1)  # [kv_len, num_q_heads, head_dim]
        v = np.repeat(v_pages[pages, positions % block_size], group, axis=1)
        s = np.einsum("qhd,khd->hqk", q[start:end], k) * sm_scale
        row_pos = kv_len - q_len + np.arange(q_len)
        s = np.where(positions[None, None, :] <= row_pos[None, :, None], s, -np.inf)
        p = np.exp(s - s.max(-1, keepdims=True))
        out[start:end] = np.einsum("hqk,khd->qhd", p / p.sum(-1, keepdims=True), v)
    return out
