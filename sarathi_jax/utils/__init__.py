"""Small helpers every stage may use, none of them JAX: lazy package exports, user paths made absolute, latency
percentiles."""
