"""sarathi-jax gRPC generation service (`sarathi.v1.Generation`) and OpenAI-compatible HTTP API; see
docs/serving.md.

    python -m server --model tiny-llama --port 8033 --metrics-port 9090 [--http-port 8000]
    python -m server.client --token-ids 1,2,3 --max-tokens 16 --target 127.0.0.1:8033

`GenerationServer` (server.service) resolves lazily, so importing the proto modules or the client does not pull
in the rest. The load driver that drives these servers is `sarathi_jax.bench.loadgen` (`run_load`), a layer above.
"""

from __future__ import annotations

from sarathi_jax.utils.lazy_exports import lazy_exports

_EXPORTS = {
    "GenerationServer": "server.service",
    "EngineWorker": "server.engine_worker",
    "ServingEngine": "server.engine_worker",
    "make_request": "server.client",
}

__all__ = list(_EXPORTS)
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
