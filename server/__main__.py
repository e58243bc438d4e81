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

from sarathi_jax.config import EngineConfig  # plain Python: --help stays fast
from sarathi_jax.config_flags import ConfigFlags
from server.service import DEFAULT_MAX_WAITING_PROMPT_TOKENS, DEFAULT_MAX_WAITING_REQUESTS, GenerationServer

ENGINE_FLAGS = ConfigFlags(EngineConfig)  # every field, under its own name


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m server", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--host", default="0.0.0.0")
    p.add_argument("--port", type=int, default=50051, help="gRPC port (0 picks a free one)")
    p.add_argument("--no-grpc", action="store_true", help="serve no gRPC (HTTP only: give --http-port)")
    p.add_argument("--http-port", type=int, default=None,
                   help="OpenAI-compatible HTTP API port (off when unset; 0 picks a free one)")
    p.add_argument("--served-model-name", default=None,
                   help="the model name clients send and /v1/models lists (default: --model)")
    p.add_argument("--metrics-port", type=int, default=None, help="Prometheus /metrics port (off when unset)")
    p.add_argument("--max-waiting-requests", type=int, default=DEFAULT_MAX_WAITING_REQUESTS,
                   help="refuse (RESOURCE_EXHAUSTED) beyond this many requests waiting for their first token")
    p.add_argument("--max-waiting-prompt-tokens", type=int, default=DEFAULT_MAX_WAITING_PROMPT_TOKENS,
                   help="refuse (RESOURCE_EXHAUSTED) beyond this many prompt tokens waiting")
    p.add_argument("--drain-grace", type=float, default=None,
                   help="on SIGTERM, seconds to let running requests finish before cancelling them (default: no limit)")
    p.add_argument("--log-level", default="INFO")
    ENGINE_FLAGS.add_to(p.add_argument_group(
        "engine", "EngineConfig's fields (sarathi_jax/config.py); a flag left out takes EngineConfig's default"))
    return p


def engine_config_from_args(args: argparse.Namespace) -> EngineConfig:
    return EngineConfig(**ENGINE_FLAGS.given(args))


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
    model_name = args.served_model_name or args.model or engine.config.model  # the last: the default preset
    server = GenerationServer(engine, engine_config=engine.config, model_name=model_name,
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
