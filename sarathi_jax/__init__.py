"""sarathi-jax: Sarathi-Serve's stall-free chunked-prefill scheduling on JAX/XLA.

Exports resolve lazily, so `import sarathi_jax.scheduler` (plain Python, used by simulators) never loads JAX.
"""

from __future__ import annotations

from sarathi_jax.utils.lazy_exports import lazy_exports

_EXPORTS = {
    "LLM": "sarathi_jax.llm",
    "LLMEngine": "sarathi_jax.engine.llm_engine",
    "EngineConfig": "sarathi_jax.config.engine_config",
    "SamplingParams": "sarathi_jax.request.sampling_params",
    "RequestOutput": "sarathi_jax.request.outputs",
    "RequestMetrics": "sarathi_jax.request.outputs",
    "TokenLogprob": "sarathi_jax.request.outputs",
    "IterationRecord": "sarathi_jax.request.outputs",
}

__all__ = list(_EXPORTS)
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
