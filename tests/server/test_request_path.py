"""How many hand-written files one request runs code in (the budget of docs/design/README.md, "The request path"):
`LLM.generate` at most 10, a gRPC `Complete` at most 14 and an HTTP `/v1/completions` at most 15.

Counted as docs/design/README.md says: Python's profiler over the second of two identical requests (the first builds
what is cached), every thread, the compiled step excluded (it runs no Python); a file counts once, where it
is first entered. The order is asserted too for `LLM.generate`, since the design doc lists it."""

from __future__ import annotations

import json
import sys
import threading
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from grpc_test_utils import serving, stub_for
from sarathi_jax import LLM, SamplingParams
from server.client import make_request

REPO_ROOT = Path(__file__).resolve().parents[2]
PACKAGES = tuple(str(REPO_ROOT / p) + "/" for p in ("sarathi_jax", "server", "pallas_kernels", "checkpoints_convert"))

LLM_PATH = ["sarathi_jax/request/sampling_params.py", "sarathi_jax/llm.py", "sarathi_jax/core/engine_core.py",
            "sarathi_jax/core/admission.py", "sarathi_jax/runner/model_runner.py", "sarathi_jax/request/sequence.py",
            "sarathi_jax/scheduler/base.py", "sarathi_jax/scheduler/block_manager.py", "sarathi_jax/scheduler/sarathi.py",
            "sarathi_jax/runner/input_batch.py"]


def files_entered(request: Callable[[], Any]) -> list[str]:
    """The project's files in which `request()` (run twice; the second is counted) runs code on this thread,
    in the order first entered (`LLM.generate` runs its engine on the caller's thread)."""
    request()
    seen: list[str] = []

    def profile(frame: Any, event: str, arg: Any) -> None:
        if event == "call" and frame is not None:
            name = frame.f_code.co_filename
            if name.startswith(PACKAGES) and name not in seen:
                seen.append(name)

    sys.setprofile(profile)
    try:
        request()
    finally:
        sys.setprofile(None)
    return [str(Path(f).relative_to(REPO_ROOT)) for f in seen]


def test_llm_generate_runs_code_in_ten_files():
    llm = LLM("tiny-llama")
    entered = files_entered(lambda: llm.generate([[1, 2, 3], [4, 5, 6, 7]],
                                                 SamplingParams(temperature=0, max_tokens=4)))
    assert entered == LLM_PATH, entered


@pytest.fixture(scope="module")
def profiled_server(llama_engine):
    """A gRPC + HTTP server over the shared engine whose threads carry a profiler that records only while
    `record` is set (threads started before a profile is set cannot be given one on Python < 3.12)."""
    engine = llama_engine[0]
    engine.wait_until_compiled()  # the background builds run Python of their own: not a request's
    state: dict[str, Any] = {"on": False, "seen": []}

    def profile(frame: Any, event: str, arg: Any) -> None:
        if state["on"] and event == "call" and frame is not None:
            name = frame.f_code.co_filename
            if name.startswith(PACKAGES) and name not in state["seen"]:
                state["seen"].append(name)

    threading.setprofile(profile)
    try:
        with serving(llama_engine, http_port=0) as srv:
            threading.setprofile(None)
            yield srv, state, profile
    finally:
        threading.setprofile(None)


def _count(state: dict[str, Any], profile: Callable, request: Callable[[], Any]) -> list[str]:
    request()
    state["seen"] = []
    state["on"] = True
    sys.setprofile(profile)
    try:
        request()
    finally:
        sys.setprofile(None)
        state["on"] = False
    return [str(Path(f).relative_to(REPO_ROOT)) for f in state["seen"]]


def test_grpc_complete_runs_code_in_at_most_14_files(profiled_server):
    srv, state, profile = profiled_server
    message = make_request([5, 6, 7, 8], max_tokens=4, temperature=0.0)
    channel, stub = stub_for(srv.target)
    try:
        entered = _count(state, profile, lambda: stub.Complete(message, timeout=60))
    finally:
        channel.close()
    assert "server/grpc_service.py" in entered and "sarathi_jax/core/engine_core.py" in entered, entered
    assert len(entered) <= 14, " ".join(entered)


def test_http_completion_runs_code_in_at_most_15_files(profiled_server):
    srv, state, profile = profiled_server
    body = json.dumps({"prompt": [5, 6, 7, 8], "max_tokens": 4, "temperature": 0.0}).encode()

    def post() -> None:
        request = urllib.request.Request(f"http://127.0.0.1:{srv.http_port}/v1/completions", data=body,
                                         headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=60) as response:
            assert response.status == 200

    entered = _count(state, profile, post)
    assert "server/http_api.py" in entered and "sarathi_jax/core/engine_core.py" in entered, entered
    assert len(entered) <= 15, " ".join(entered)
