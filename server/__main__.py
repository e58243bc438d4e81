"""`python -m server --model NAME_OR_DIR --port N [--http-port M] [...]`: serve one engine over gRPC and/or
the OpenAI-compatible HTTP API (`--http-port`; `--no-grpc` for HTTP only).

SIGTERM (and a first Ctrl-C) drains: health turns NOT_SERVING, new requests get UNAVAILABLE, running requests
finish (for at most --drain-grace seconds), then the process exits. A second SIGTERM or Ctrl-C ends the grace at
once: running requests end in-band (an HTTP stream with an SSE error event and `data: [DONE]`, a gRPC stream with
a last FINISH_REASON_ABORT message), then the process exits.
"""

from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import logging
import os
import signal
import sys
from typing import NoReturn

from sarathi_jax.config.engine_config import EngineConfig  # plain Python: --help stays fast
from sarathi_jax.config.flags import ConfigFlags
from server.client import DEFAULT_GRPC_PORT
from server.http_limits import (
    DEFAULT_BODY_TIMEOUT_S,
    DEFAULT_HEADER_TIMEOUT_S,
    DEFAULT_MAX_BODY_BYTES,
    DEFAULT_MAX_CONNECTIONS,
    HttpLimits,
)
from server.security import API_KEY_ENV, ServerSecurity, api_key_from
from server.service import GenerationServer
from server.session import (
    DEFAULT_MAX_REQUEST_ID_LENGTH,
    DEFAULT_MAX_WAITING_PROMPT_TOKENS,
    DEFAULT_MAX_WAITING_REQUESTS,
)

ENGINE_FLAGS = ConfigFlags(EngineConfig)  # every field, under its own name


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m server", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--host", default="0.0.0.0")
    p.add_argument("--port", type=int, default=DEFAULT_GRPC_PORT, help="gRPC port (0 picks a free one)")
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
    p.add_argument("--max-request-id-length", type=int, default=DEFAULT_MAX_REQUEST_ID_LENGTH,
                   help="refuse (INVALID_ARGUMENT) a gRPC request_id longer than this many characters")
    p.add_argument("--max-body-bytes", type=int, default=DEFAULT_MAX_BODY_BYTES,
                   help="HTTP: refuse (413) a request body larger than this")
    p.add_argument("--header-timeout", type=float, default=DEFAULT_HEADER_TIMEOUT_S,
                   help="HTTP: close a connection whose request head is not complete within this many seconds")
    p.add_argument("--body-timeout", type=float, default=DEFAULT_BODY_TIMEOUT_S,
                   help="HTTP: answer 408 and close a connection whose request body is not complete within this "
                        "many seconds of its head")
    p.add_argument("--max-connections", type=int, default=DEFAULT_MAX_CONNECTIONS,
                   help="HTTP: answer 503 and close a connection opened while this many are open (keep it below "
                        "`ulimit -n`)")
    p.add_argument("--drain-grace", type=float, default=None,
                   help="on SIGTERM, seconds to let running requests finish before cancelling them (default: no limit)")
    p.add_argument("--log-level", default="INFO")
    add_security_flags(p.add_argument_group("security", "the API key and TLS of the gRPC and HTTP APIs (TLS: "
                                                        "the metrics endpoint too); docs/serving.md, Security"))
    ENGINE_FLAGS.add_to(p.add_argument_group(
        "engine", "EngineConfig's fields (sarathi_jax/config/engine_config.py); a flag left out takes EngineConfig's default"))
    return p


def add_security_flags(group: argparse._ArgumentGroup) -> None:
    group.add_argument("--api-key", default=None,
                       help=f"clients must send `Authorization: Bearer KEY` (HTTP header, gRPC metadata); /health, "
                            f"/metrics and gRPC health checking stay open (default: ${API_KEY_ENV}, else no key)")
    group.add_argument("--ssl-keyfile", default=None, help="TLS private key (PEM), with --ssl-certfile")
    group.add_argument("--ssl-certfile", default=None, help="TLS certificate chain (PEM), with --ssl-keyfile")
    group.add_argument("--ssl-ca-certs", default=None,
                       help="CA certificates (PEM): clients must present a certificate they signed (mutual TLS)")


def engine_config_from_args(args: argparse.Namespace) -> EngineConfig:
    return EngineConfig(**ENGINE_FLAGS.given(args))


def security_from_args(args: argparse.Namespace) -> ServerSecurity:
    """The flags' ServerSecurity; raises ValueError for a bad combination or a file that does not exist."""
    for flag in ("ssl_keyfile", "ssl_certfile", "ssl_ca_certs"):
        path = getattr(args, flag)
        if path is not None and not os.path.isfile(path):
            raise ValueError(f"--{flag.replace('_', '-')}: no such file: {path}")
    return ServerSecurity(api_key=api_key_from(args.api_key), ssl_keyfile=args.ssl_keyfile,
                          ssl_certfile=args.ssl_certfile, ssl_ca_certs=args.ssl_ca_certs)


class _StartupInterrupted(Exception):
    """SIGTERM or Ctrl-C before the server was serving: nothing to drain."""


async def _serve(args: argparse.Namespace, config: EngineConfig, security: ServerSecurity) -> None:
    from sarathi_jax.factory import build_engine
    from sarathi_jax.engine.llm_engine import format_startup
    from sarathi_jax.engine.gc_heap import freeze_startup_heap

    log = logging.getLogger("server")
    loop = asyncio.get_running_loop()
    main_task = asyncio.current_task()
    assert main_task is not None
    serving: list[GenerationServer] = []  # the server, once it serves
    signals = {"n": 0}

    def on_signal(signame: str) -> None:
        signals["n"] += 1
        if not serving:  # still starting (building the engine, binding ports): nothing is served yet
            log.info("%s during start-up: exiting", signame)
            main_task.cancel()
        elif signals["n"] == 1:
            log.info("%s: draining", signame)
            asyncio.ensure_future(serving[0].drain_async(args.drain_grace))
        else:  # running requests end in-band (an SSE error event and [DONE], gRPC's FINISH_REASON_ABORT), then stop
            log.info("%s again: ending running requests and stopping", signame)
            asyncio.ensure_future(serving[0].end_drain_async())

    # Installed first: a SIGTERM at any moment, start-up included, ends the process cleanly (exit 0).
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, on_signal, sig.name)
    log.info("building engine: %s", config)
    # Engine construction compiles and warms up: keep the loop responsive meanwhile (nothing is served yet). Its
    # own thread, not the loop's default executor, which asyncio.run would wait for after a start-up SIGTERM.
    build = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="engine-build")
    try:
        engine = await loop.run_in_executor(build, build_engine, config)
        print(format_startup(engine.startup_stats()), flush=True)
        freeze_startup_heap()  # no oldest-generation GC pause walks the start-up heap while serving (gc_heap.py)
        # engine.config names what "auto" resolved to (attention backend, cache directory).
        # The served name defaults to --model as typed (vLLM's rule); engine.config holds it made absolute.
        model_name = args.served_model_name or args.model or engine.config.model  # the last: the default preset
        server = GenerationServer(engine, engine_config=engine.config, model_name=model_name,
                                  host=args.host, port=None if args.no_grpc else args.port,
                                  metrics_port=args.metrics_port, http_port=args.http_port,
                                  max_waiting_requests=args.max_waiting_requests,
                                  max_waiting_prompt_tokens=args.max_waiting_prompt_tokens,
                                  max_request_id_length=args.max_request_id_length,
                                  http_limits=HttpLimits(max_body_bytes=args.max_body_bytes,
                                                         header_timeout_s=args.header_timeout,
                                                         body_timeout_s=args.body_timeout,
                                                         max_connections=args.max_connections),
                                  security=security)
        await server.start()  # on failure (a port in use) it stops what it started, then raises
    except asyncio.CancelledError:
        raise _StartupInterrupted from None
    finally:
        build.shutdown(wait=False)
    serving.append(server)
    if server.port is not None:
        print(f"sarathi server listening on {server.host}:{server.port}"
              + (f" (metrics on :{server.metrics_port})" if server.metrics_port is not None else ""), flush=True)
    if server.http_port is not None:
        scheme = "https" if security.tls else "http"
        print(f"sarathi HTTP API on {scheme}://{server.http_host}:{server.http_port}/v1", flush=True)
    if signals["n"]:  # a signal while the last port was binding
        asyncio.ensure_future(server.drain_async(args.drain_grace))
    await server.wait_stopped()
    await loop.run_in_executor(None, engine.stop_background_compile)


def _exit_now(code: int) -> NoReturn:
    """Leave without finalizing the interpreter. Native libraries' daemon threads (gRPC's completion-queue
    poller, the engine build thread after a start-up signal) may still be inside C++ then, and CPython ends
    such a thread by unwinding it, which their frames turn into std::terminate: exit -6 and "FATAL: exception
    not rethrown" after a clean stop (seen once in CI). Everything of ours has ended or is left on purpose."""
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.no_grpc and args.http_port is None:
        parser.error("--no-grpc needs --http-port (nothing would be served)")
    try:  # a contradictory or invalid setting: one line, before anything starts
        config = engine_config_from_args(args)
        security = security_from_args(args)
    except ValueError as exc:
        parser.error(str(exc))
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        asyncio.run(_serve(args, config, security))
    except _StartupInterrupted:
        _exit_now(0)  # the engine may still be building in its thread, which nothing can interrupt
    except OSError as exc:  # a port in use, an address that does not resolve: one line, not a traceback
        print(f"python -m server: could not start: {exc}", file=sys.stderr)
        return 1
    _exit_now(0)  # stopped: requests drained, the engine thread and the background builds ended


if __name__ == "__main__":
    sys.exit(main())
