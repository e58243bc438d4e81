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


@pytest.fixture
def engine_resumed(server):
    """Tests that pause the engine of their module's `server` get it resumed (and the back-pressure limits
    restored) whatever happens."""
    limits = (server.max_waiting_requests, server.max_waiting_prompt_tokens)
    yield server
    server.resume_engine()
    server.max_waiting_requests, server.max_waiting_prompt_tokens = limits
