"""Attention kernels for sarathi-jax: ragged paged attention over a fixed-shape padded token budget."""

from pallas_kernels.ragged_paged_attention_xla import ragged_paged_attention_xla

__all__ = ["ragged_paged_attention_xla"]
