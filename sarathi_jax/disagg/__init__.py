"""Prefill/decode disaggregation: the request flow shared by both engines (`flow`) over instances and requests
between them (`state`), the real engine on devices (`real_engine`) with its device-to-device KV transfer
(`kv_transfer`), and the simulated engine on virtual clocks (`sim_engine`). The split itself is configuration
(`sarathi_jax.config.disaggregation`)."""
