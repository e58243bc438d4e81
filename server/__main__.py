"""`python -m server --model NAME_OR_DIR --port N [--http-port M] [...]`: serve one engine over gRPC and/or
the OpenAI-compatible HTTP API (`--http-port`; `--no-grpc` for HTTP only).

SIGTERM (and a first Ctrl-C) drains: health turns NOT_SERVING, new requests get UNAVAILABLE, running requests
finish (for at most --drain-grace seconds), then the process exits. A second Ctrl-C stops at once.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import signal
import sys

from sarathi_jax.config import DTYPES  # plain Python: --help stays fast
from server.service import DEFAULT_MAX_WAITING_PROMPT_TOKENS, DEFAULT_MAX_WAITING_REQUESTS, GenerationServer


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m server", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="tiny-llama", help="preset name or HF checkpoint folder")
    p.add_argument("--host", default="0.0.0.0")
    p.add_argument("--port", type=int, default=50051, help="gRPC port (0 picks a free one)")
    p.add_argument("--no-grpc", action="store_true", help="serve no gRPC (HTTP only: give --http-port)")
    p.add_argument("--http-port", type=int, default=None,
                   help="OpenAI-compatible HTTP API port (off when unset; 0 picks a free one)")
    p.add_argument("--served-model-name", default=None,
                   help="the model name clients send and /v1/models lists (default: --model)")
    p.add_argument("--metrics-port", type=int, default=None, help="Prometheus /metrics port (off when unset)")
    p.add_argument("--token-budget", type=int, default=None)
    p.add_argument("--scheduler", default=None, help="sarathi, vllm, orca, ...")
    p.add_argument("--max-num-seqs", type=int, default=None)
    p.add_argument("--block-size", type=int, default=None)
    p.add_argument("--num-blocks", type=int, default=None)
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument("--attention-backend", default="auto", choices=("auto", "xla", "pallas", "cpu"),
                   help="auto: pallas on GPU, cpu (the C++ kernel) on a CPU where it is built, xla elsewhere")
    p.add_argument("--compilation-cache-dir", default=None, metavar="PATH",
                   help="JAX's persistent compilation cache directory, or 'off' "
                        "(default: $SARATHI_JAX_COMPILATION_CACHE, else ~/.cache/sarathi-jax/jax)")
    p.add_argument("--dtype", default=None, choices=DTYPES,
                   help="auto (the default): bfloat16 on GPU and TPU, float32 on CPU")
    p.add_argument("--kv-cache-bytes", type=int, default=None, help="a fixed KV cache budget (CPU default: 1 GiB)")
    p.add_argument("--gpu-memory-utilization", type=float, default=None, metavar="F",
                   help="fraction of the device's memory the engine may use, the KV cache getting the rest "
                        "(default 0.9, at most JAX's XLA_CLIENT_MEM_FRACTION)")
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--tensor-parallel-size", type=int, default=None, help="devices per pipeline stage")
    p.add_argument("--pipeline-parallel-size", type=int, default=None, help="pipeline stages")
    p.add_argument("--async-scheduling", default=None, action=argparse.BooleanOptionalAction,
                   help="overlap host work with the device (default on); --no-async-scheduling: synchronous loop")
    p.add_argument("--enable-prefix-caching", default=None, action=argparse.BooleanOptionalAction,
                   help="reuse cached KV blocks of shared prompt prefixes (default on)")
    p.add_argument("--background-compile", default=None, action=argparse.BooleanOptionalAction,
                   help="serve once the largest step is compiled and build the rest on background threads "
                        "(default on); --no-background-compile builds everything before listening (benchmarks)")
    p.add_argument("--max-waiting-requests", type=int, default=DEFAULT_MAX_WAITING_REQUESTS,
                   help="refuse (RESOURCE_EXHAUSTED) beyond this many requests waiting for their first token")
    p.add_argument("--max-waiting-prompt-tokens", type=int, default=DEFAULT_MAX_WAITING_PROMPT_TOKENS,
                   help="refuse (RESOURCE_EXHAUSTED) beyond this many prompt tokens waiting")
    p.add_argument("--drain-grace", type=float, default=None,
                   help="on SIGTERM, seconds to let running requests finish before cancelling them (default: no limit)")
    p.add_argument("--log-level", default="INFO")
    return p


def engine_config_from_args(args: argparse.Namespace):
    from sarathi_jax.config import EngineConfig

    overrides = {}
    for name in ("token_budget", "scheduler", "max_num_seqs", "block_size", "num_blocks", "max_model_len",
                 "attention_backend", "dtype", "seed", "tensor_parallel_size", "pipeline_parallel_size",
                 "async_scheduling", "enable_prefix_caching", "background_compile", "compilation_cache_dir",
                 "kv_cache_bytes", "gpu_memory_utilization"):
        value = getattr(args, name)
        if value is not None:
            overrides[name] = value
    return EngineConfig(model=args.model, **overrides)


async def _serve(args: argparse.Namespace) -> None:
    from sarathi_jax.engine import LLMEngine, format_startup

    log = logging.getLogger("server")
    config = engine_config_from_args(args)
    log.info("building engine: %s", config)
    # Engine construction compiles and warms up: keep the loop responsive meanwhile (nothing is served yet).
    engine = await asyncio.get_running_loop().run_in_executor(None, LLMEngine, config)
    print(format_startup(engine.startup_stats()), flush=True)
    # engine.config names what "auto" resolved to (attention backend, cache directory).
    # The served name defaults to --model as typed (vLLM's rule); engine.config holds it made absolute.
    server = GenerationServer(engine, engine_config=engine.config, model_name=args.served_model_name or args.model,
                              host=args.host, port=None if args.no_grpc else args.port,
                              metrics_port=args.metrics_port, http_port=args.http_port,
                              max_waiting_requests=args.max_waiting_requests,
                              max_waiting_prompt_tokens=args.max_waiting_prompt_tokens)
    await server.start()
    if server.port is not None:
        print(f"sarathi server listening on {server.host}:{server.port}"
              + (f" (metrics on :{server.metrics_port})" if server.metrics_port is not None else ""), flush=True)
    if server.http_port is not None:
        print(f"sarathi HTTP API on http://{server.http_host}:{server.http_port}/v1", flush=True)

    loop = asyncio.get_running_loop()
    signals = {"n": 0}

    def on_signal(signame: str) -> None:
        signals["n"] += 1
        if signals["n"] == 1:
            log.info("%s: draining", signame)
            asyncio.ensure_future(server.drain_async(args.drain_grace))
        else:
            log.info("%s again: stopping now", signame)
            asyncio.ensure_future(server.stop_async(grace=0))

    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, on_signal, sig.name)
    await server.wait_stopped()


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.no_grpc and args.http_port is None:
        parser.error("--no-grpc needs --http-port (nothing would be served)")
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    asyncio.run(_serve(args))
    return 0


if __name__ == "__main__":
    sys.exit(main())
