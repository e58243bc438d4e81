"""sarathi-jax: Sarathi-Serve's stall-free chunked-prefill scheduling on JAX/XLA.

Exports resolve lazily, so `import sarathi_jax.scheduler` (plain Python, used by simulators) never loads JAX.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "LLM": "sarathi_jax.llm",
    "LLMEngine": "sarathi_jax.engine",
    "EngineConfig": "sarathi_jax.config",
    "SamplingParams": "sarathi_jax.sampling_params",
    "RequestOutput": "sarathi_jax.outputs",
    "RequestMetrics": "sarathi_jax.outputs",
    "TokenLogprob": "sarathi_jax.outputs",
    "IterationRecord": "sarathi_jax.outputs",
}

__all__ = list(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'sarathi_jax' has no attribute {name!r}")
    module = importlib.import_module(_EXPORTS[name])
    return getattr(module, name)
