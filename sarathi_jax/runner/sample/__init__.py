"""Sampling on the device: the jitted fixed-shape sampler (`sampler`), its per-row inputs and compiled variants
(`inputs`), the greedy-only CPU forms (`vocab_major`), and rejection sampling of speculative drafts
(`rejection`)."""
