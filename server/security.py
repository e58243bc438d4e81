"""Who may use the servers: `ServerSecurity` (an API key, TLS and client-certificate settings, built from
`python -m server`'s flags), and what enforces it on each front end: `ApiKeyMiddleware` (HTTP: every route but
/health and /metrics needs `Authorization: Bearer KEY`, else 401), `ApiKeyInterceptor` (gRPC: every RPC but
health checking needs the metadata `authorization: Bearer KEY`, else UNAUTHENTICATED), `grpc_server_credentials`.

`ClientSecurity` is the clients' side (server/client.py, the bench's load driver): the key to send and the TLS
settings of their gRPC channel and HTTP client.

Plain configuration and small adapters: the flags build these without loading starlette or uvicorn.
"""

from __future__ import annotations

import collections
import dataclasses
import hmac
import ipaddress
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import grpc

if TYPE_CHECKING:
    import argparse

    from starlette.types import ASGIApp, Receive, Scope, Send

API_KEY_ENV = "SARATHI_API_KEY"
# Open without a key, as vLLM's: load balancers and Prometheus probe them.
OPEN_HTTP_PATHS = frozenset({"/health", "/metrics"})
OPEN_GRPC_SERVICE_PREFIX = "/grpc.health.v1.Health/"


@dataclass(frozen=True)
class ServerSecurity:
    """api_key: what clients must send as `Authorization: Bearer KEY` (None: no key needed). ssl_keyfile /
    ssl_certfile: the server's TLS key and certificate chain (PEM; both or neither). ssl_ca_certs: with TLS,
    client certificates are required and checked against these CA certificates (mutual TLS)."""

    api_key: str | None = dataclasses.field(default=None, repr=False)
    ssl_keyfile: str | None = None
    ssl_certfile: str | None = None
    ssl_ca_certs: str | None = None

    def __post_init__(self) -> None:
        if (self.ssl_keyfile is None) != (self.ssl_certfile is None):
            raise ValueError("--ssl-keyfile and --ssl-certfile go together (give both or neither)")
        if self.ssl_ca_certs is not None and self.ssl_certfile is None:
            raise ValueError("--ssl-ca-certs needs --ssl-certfile and --ssl-keyfile (client certificates need TLS)")
        if self.api_key == "":
            raise ValueError("--api-key: must not be empty")

    @property
    def tls(self) -> bool:
        return self.ssl_certfile is not None

    def uvicorn_ssl_options(self) -> dict[str, Any]:
        """uvicorn.Config's ssl_* keywords."""
        if not self.tls:
            return {}
        import ssl

        options: dict[str, Any] = {"ssl_keyfile": self.ssl_keyfile, "ssl_certfile": self.ssl_certfile}
        if self.ssl_ca_certs is not None:
            options.update(ssl_ca_certs=self.ssl_ca_certs, ssl_cert_reqs=ssl.CERT_REQUIRED)
        return options

    def metrics_tls_options(self) -> dict[str, Any]:
        """prometheus_client.start_http_server's TLS keywords."""
        if not self.tls:
            return {}
        return {"certfile": self.ssl_certfile, "keyfile": self.ssl_keyfile, "client_cafile": self.ssl_ca_certs,
                "client_auth_required": self.ssl_ca_certs is not None}


def api_key_from(flag: str | None) -> str | None:
    """The key from `--api-key`, else from the environment's SARATHI_API_KEY (unset or empty: none)."""
    return flag if flag is not None else (os.environ.get(API_KEY_ENV) or None)


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def _key_matches(expected: bytes, authorization: bytes | None) -> bool:
    """Whether an Authorization value is `Bearer <expected>` (the scheme in any case), compared in constant time."""
    if authorization is None:
        return False
    scheme, _, token = authorization.strip().partition(b" ")
    return scheme.lower() == b"bearer" and hmac.compare_digest(token.strip(), expected)


MISSING_KEY = "missing API key: send the header `Authorization: Bearer <key>`"
WRONG_KEY = "incorrect API key provided"


# ----------------------------------------------------------------------------------------------------- HTTP


class ApiKeyMiddleware:
    """ASGI middleware: a request to any path but `OPEN_HTTP_PATHS` without `Authorization: Bearer <api_key>` gets
    401 in OpenAI's error shape (code `invalid_api_key`) with `WWW-Authenticate: Bearer`, before the app reads
    it. Requests that pass go through untouched (streams included)."""

    def __init__(self, app: ASGIApp, api_key: str) -> None:
        self.app = app
        self.api_key = api_key.encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] in OPEN_HTTP_PATHS:
            await self.app(scope, receive, send)
            return
        authorization = next((v for k, v in scope["headers"] if k == b"authorization"), None)
        if _key_matches(self.api_key, authorization):
            await self.app(scope, receive, send)
            return
        message = MISSING_KEY if authorization is None else WRONG_KEY
        body = json.dumps({"error": {"message": message, "type": "invalid_request_error", "param": None,
                                     "code": "invalid_api_key"}}).encode()
        await send({"type": "http.response.start", "status": 401,
                    "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                                (b"www-authenticate", b"Bearer")]})
        await send({"type": "http.response.body", "body": body})


# ----------------------------------------------------------------------------------------------------- gRPC


def _refusal(handler: grpc.RpcMethodHandler, message: str) -> grpc.RpcMethodHandler:
    """A handler of `handler`'s kind that answers UNAUTHENTICATED without decoding the request."""

    async def refuse(_request: Any, context: grpc.aio.ServicerContext) -> None:
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, message)

    if handler.request_streaming and handler.response_streaming:
        return grpc.stream_stream_rpc_method_handler(refuse)
    if handler.request_streaming:
        return grpc.stream_unary_rpc_method_handler(refuse)
    if handler.response_streaming:
        return grpc.unary_stream_rpc_method_handler(refuse)
    return grpc.unary_unary_rpc_method_handler(refuse)


class ApiKeyInterceptor(grpc.aio.ServerInterceptor):
    """Every RPC but health checking's (the Generation service and reflection alike) needs the metadata
    `authorization: Bearer <api_key>`; without it the RPC is answered UNAUTHENTICATED."""

    def __init__(self, api_key: str) -> None:
        self.api_key = api_key.encode()

    async def intercept_service(self, continuation: Any, details: grpc.HandlerCallDetails) -> Any:
        handler = await continuation(details)
        if handler is None or details.method.startswith(OPEN_GRPC_SERVICE_PREFIX):
            return handler
        values = [v for k, v in details.invocation_metadata or () if k == "authorization"]
        authorization = values[0].encode() if values and isinstance(values[0], str) else None
        if _key_matches(self.api_key, authorization):
            return handler
        return _refusal(handler, MISSING_KEY.replace("header", "metadata") if authorization is None else WRONG_KEY)


def grpc_server_credentials(security: ServerSecurity) -> grpc.ServerCredentials:
    """TLS credentials for `add_secure_port` (client certificates required with `ssl_ca_certs`)."""
    assert security.ssl_keyfile is not None and security.ssl_certfile is not None
    key, chain = Path(security.ssl_keyfile).read_bytes(), Path(security.ssl_certfile).read_bytes()
    ca = Path(security.ssl_ca_certs).read_bytes() if security.ssl_ca_certs is not None else None
    return grpc.ssl_server_credentials([(key, chain)], root_certificates=ca, require_client_auth=ca is not None)


# --------------------------------------------------------------------------------------------------- clients


@dataclass(frozen=True)
class ClientSecurity:
    """A client's side. api_key: sent as `authorization: Bearer KEY` (None: nothing sent). tls: gRPC over TLS
    (an HTTP client follows its URL's scheme). ssl_ca_certs: the CA certificates that the server's certificate is
    checked against (None: the system's). ssl_certfile / ssl_keyfile: the client's own certificate and key, for a
    server that requires one."""

    api_key: str | None = dataclasses.field(default=None, repr=False)
    tls: bool = False
    ssl_ca_certs: str | None = None
    ssl_certfile: str | None = None
    ssl_keyfile: str | None = None

    def __post_init__(self) -> None:
        if (self.ssl_keyfile is None) != (self.ssl_certfile is None):
            raise ValueError("the client's --ssl-certfile and --ssl-keyfile go together (give both or neither)")

    def grpc_metadata(self) -> tuple[tuple[str, str], ...]:
        return () if self.api_key is None else (("authorization", f"Bearer {self.api_key}"),)

    def http_headers(self) -> dict[str, str]:
        return {} if self.api_key is None else {"Authorization": f"Bearer {self.api_key}"}

    def grpc_channel_credentials(self) -> grpc.ChannelCredentials | None:
        """TLS channel credentials (None: a plaintext channel)."""
        if not self.tls:
            return None

        def read(path: str | None) -> bytes | None:
            return None if path is None else Path(path).read_bytes()

        return grpc.ssl_channel_credentials(read(self.ssl_ca_certs), read(self.ssl_keyfile), read(self.ssl_certfile))

    def httpx_verify(self) -> Any:
        """httpx's `verify` argument: an SSL context with the CA file and client certificate, or True."""
        if self.ssl_ca_certs is None and self.ssl_certfile is None:
            return True
        import ssl

        context = ssl.create_default_context(cafile=self.ssl_ca_certs)
        if self.ssl_certfile is not None:
            context.load_cert_chain(self.ssl_certfile, self.ssl_keyfile)
        return context


class _CallDetails(collections.namedtuple("_CallDetails", ("method", "timeout", "metadata", "credentials",
                                                               "wait_for_ready", "compression")),
                   grpc.ClientCallDetails):
    pass


def _with_metadata(details: Any, metadata: tuple[tuple[str, str], ...]) -> _CallDetails:
    return _CallDetails(details.method, details.timeout, tuple(details.metadata or ()) + metadata,
                        details.credentials, details.wait_for_ready, details.compression)


class _MetadataInterceptor(grpc.UnaryUnaryClientInterceptor, grpc.UnaryStreamClientInterceptor,
                           grpc.StreamUnaryClientInterceptor, grpc.StreamStreamClientInterceptor):
    """Adds `metadata` to every call of a blocking channel."""

    def __init__(self, metadata: tuple[tuple[str, str], ...]) -> None:
        self.metadata = metadata

    def _call(self, continuation: Any, details: Any, request: Any) -> Any:
        return continuation(_with_metadata(details, self.metadata), request)

    intercept_unary_unary = intercept_unary_stream = _call
    intercept_stream_unary = intercept_stream_stream = _call


def _aio_interceptors(metadata: tuple[tuple[str, str], ...]) -> list[grpc.aio.ClientInterceptor]:
    """Interceptors adding `metadata` to every call of an asyncio channel (one per call kind: grpc.aio picks an
    interceptor by its class)."""

    async def call(self: Any, continuation: Any, details: Any, request: Any) -> Any:
        details = grpc.aio.ClientCallDetails(details.method, details.timeout,
                                             grpc.aio.Metadata(*(tuple(details.metadata or ()) + metadata)),
                                             details.credentials, details.wait_for_ready)
        return await continuation(details, request)

    kinds = {"intercept_unary_unary": grpc.aio.UnaryUnaryClientInterceptor,
             "intercept_unary_stream": grpc.aio.UnaryStreamClientInterceptor,
             "intercept_stream_unary": grpc.aio.StreamUnaryClientInterceptor,
             "intercept_stream_stream": grpc.aio.StreamStreamClientInterceptor}
    return [type(f"_Aio{base.__name__}", (base,), {name: call})() for name, base in kinds.items()]


def grpc_channel(target: str, security: ClientSecurity = ClientSecurity(), options: Any = None) -> grpc.Channel:
    """A blocking gRPC channel to `target`: TLS when `security.tls`; the key, if any, sent on every RPC."""
    creds = security.grpc_channel_credentials()
    channel = (grpc.secure_channel(target, creds, options=options) if creds is not None
               else grpc.insecure_channel(target, options=options))
    if security.api_key is None:
        return channel
    return grpc.intercept_channel(channel, _MetadataInterceptor(security.grpc_metadata()))


def grpc_aio_channel(target: str, security: ClientSecurity = ClientSecurity(), options: Any = None) -> grpc.aio.Channel:
    """An asyncio gRPC channel to `target`, as `grpc_channel`."""
    creds = security.grpc_channel_credentials()
    interceptors = _aio_interceptors(security.grpc_metadata()) if security.api_key is not None else None
    if creds is not None:
        return grpc.aio.secure_channel(target, creds, options=options, interceptors=interceptors)
    return grpc.aio.insecure_channel(target, options=options, interceptors=interceptors)


def add_client_flags(parser: argparse.ArgumentParser | argparse._ArgumentGroup) -> None:
    """A client's flags for `ClientSecurity`: --api-key, --tls, --ssl-ca-certs, --ssl-certfile, --ssl-keyfile."""
    parser.add_argument("--api-key", default=None,
                        help=f"sent as `authorization: Bearer KEY` (default: ${API_KEY_ENV}, else none)")
    parser.add_argument("--tls", action="store_true", help="gRPC over TLS (an HTTP endpoint: its https:// URL)")
    parser.add_argument("--ssl-ca-certs", default=None, metavar="PATH",
                        help="CA certificates (PEM) to check the server's certificate against (a self-signed "
                             "server's own certificate); default: the system's")
    parser.add_argument("--ssl-certfile", default=None, metavar="PATH",
                        help="the client's certificate (PEM), for a server that requires one; with --ssl-keyfile")
    parser.add_argument("--ssl-keyfile", default=None, metavar="PATH", help="the client's private key (PEM)")


def client_security_from_args(args: argparse.Namespace) -> ClientSecurity:
    """`add_client_flags`' ClientSecurity (the key from SARATHI_API_KEY when --api-key is not given); raises
    ValueError for a certificate without its key."""
    return ClientSecurity(api_key=api_key_from(args.api_key), tls=args.tls, ssl_ca_certs=args.ssl_ca_certs,
                          ssl_certfile=args.ssl_certfile, ssl_keyfile=args.ssl_keyfile)
