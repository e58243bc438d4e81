"""Fixtures for the gRPC server tests: a small real engine behind a real server on 127.0.0.1 (free port)."""

from __future__ import annotations

import pathlib
import sys

REPO_ROOT = pathlib.Path(__file__).resolve().parents[2]
if str(REPO_ROOT) not in sys.path:  # `server` and `sarathi_jax` import from the repository root
    sys.path.insert(0, str(REPO_ROOT))


import pytest  # noqa: E402


@pytest.fixture(scope="session")
def llama_engine(hf_checkpoint):
    """(engine, config): one small real engine (tiny random Llama with a tokenizer) shared by the server tests.

    Each test module runs its own server over it, one at a time: a stopped server leaves the engine idle and
    clean (its engine thread aborts whatever was left), so the next server can take it over.
    """
    from grpc_test_utils import make_engine

    return make_engine(hf_checkpoint("llama"))


@pytest.fixture(scope="session")
def vocab(llama_engine):
    return llama_engine[0].model_config.vocab_size


@pytest.fixture(scope="module")
def engine_before_server():
    """What a module does with the engine directly before its gRPC `server` takes it over: nothing, unless the
    module overrides this fixture (test_grpc_generation.py runs its offline reference)."""
    return None


@pytest.fixture(scope="module")
def server(llama_engine, engine_before_server):
    """A gRPC server (Prometheus metrics on a free port too) over the shared engine, one per test module.
    Module scope, not session: the other server modules (test_grpc_drain.py, test_http_server.py, whose own
    `server` overrides this one) take the same engine over once it has stopped, and two servers must never
    drive it at once."""
    from grpc_test_utils import serving

    with serving(llama_engine, metrics_port=0) as srv:
        yield srv


@pytest.fixture(scope="module")
def stub(server):
    from grpc_test_utils import stub_for

    channel, stub = stub_for(server.target)
    yield stub
    channel.close()


@pytest.fixture
def engine_resumed(server):
    """Tests that pause the engine of their module's `server` get it resumed (and the back-pressure limits
    restored) whatever happens."""
    limits = (server.session.max_waiting_requests, server.session.max_waiting_prompt_tokens)
    yield server
    server.resume_engine()
    server.session.max_waiting_requests, server.session.max_waiting_prompt_tokens = limits
