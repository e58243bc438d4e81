"""sarathi_jax/bench/load_client.py: the load clients' HTTP connection pool gives idle connections up before the servers do."""

from __future__ import annotations

import inspect

import uvicorn

from server.http_limits import HttpLimits
from sarathi_jax.bench.load_client import HTTP_KEEPALIVE_EXPIRY_S, http_pool_limits


def test_idle_connections_expire_before_the_servers_close_them():
    # uvicorn's keep-alive timeout closes idle connections on this server and on vLLM's (neither sets its own);
    # this server's head deadline also closes a connection idle that long after its last response. A client
    # that kept connections as long (httpx's default, 5 s, equals uvicorn's) races the close and loses requests.
    uvicorn_idle = inspect.signature(uvicorn.Config).parameters["timeout_keep_alive"].default
    assert HTTP_KEEPALIVE_EXPIRY_S < min(uvicorn_idle, HttpLimits().header_timeout_s)
    limits = http_pool_limits()
    assert limits.keepalive_expiry == HTTP_KEEPALIVE_EXPIRY_S
    assert limits.max_connections is None and limits.max_keepalive_connections is None


def test_the_servers_http_front_end_keeps_uvicorns_keep_alive():
    # If the front end ever set a shorter keep-alive of its own, the test above would compare the wrong figure.
    import server.http_api as http_api

    assert "timeout_keep_alive" not in inspect.getsource(http_api)
