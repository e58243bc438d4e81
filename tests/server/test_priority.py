"""Request priorities end to end through both front ends: on an idle engine scheduling by priority (one
sequence at a time), a high-priority request submitted behind many low-priority ones finishes first."""

from __future__ import annotations

import threading

import httpx2
import pytest

from grpc_test_utils import PLAIN_CHAT_TEMPLATE, greedy, make_engine, serving, stub_for, wait_until
from server.client import make_request

NUM_LOW = 5
MAX_TOKENS = 6


@pytest.fixture(scope="module")
def server(hf_checkpoint):
    # An engine of its own: the shared one schedules FCFS. One sequence at a time, so order is visible.
    engine, config = make_engine(hf_checkpoint("llama"), scheduling_policy="priority", max_num_seqs=1)
    engine.wait_until_compiled()  # no background compile outlives the tests
    with serving((engine, config), chat_template=PLAIN_CHAT_TEMPLATE, http_port=0) as srv:
        yield srv


def _run_behind_low_priority(server, send) -> list[str]:
    """Pause the engine, submit NUM_LOW priority-5 requests and then one priority -3 request with `send(name,
    priority)` (each from its own thread, blocking until its request finishes), resume; the finish order."""
    finished: list[str] = []
    lock = threading.Lock()

    def one(name: str, priority: int) -> None:
        send(name, priority)
        with lock:
            finished.append(name)

    server.pause_engine()
    threads = []
    try:
        for i in range(NUM_LOW + 1):
            name, priority = ("urgent", -3) if i == NUM_LOW else (f"low{i}", 5)
            threads.append(threading.Thread(target=one, args=(name, priority)))
            threads[-1].start()
            wait_until(lambda: server.engine.stats()["num_waiting"] == i + 1, what=f"{name} queued")
    finally:
        server.resume_engine()
    for t in threads:
        t.join(120)
    return finished


def test_grpc_priority_is_served_first(server):
    channel, stub = stub_for(server.target)

    def send(name: str, priority: int) -> None:
        request = make_request([3, 4, 5, 6], request_id=name, **greedy(max_tokens=MAX_TOKENS))
        request.priority = priority
        assert len(stub.Complete(request, timeout=120).token_ids) == MAX_TOKENS

    try:
        order = _run_behind_low_priority(server, send)
    finally:
        channel.close()
    assert order[0] == "urgent" and len(order) == NUM_LOW + 1, order


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_http_priority_is_served_first(server, path):
    base = f"http://127.0.0.1:{server.http_port}"
    prompt = {"prompt": [3, 4, 5, 6]} if path == "/v1/completions" else {"messages": [{"role": "user",
                                                                                        "content": "hi"}]}

    def send(name: str, priority: int) -> None:
        body = {**prompt, "max_tokens": MAX_TOKENS, "temperature": 0.0, "ignore_eos": True, "priority": priority}
        resp = httpx2.post(base + path, json=body, timeout=120)
        assert resp.status_code == 200, resp.text

    order = _run_behind_low_priority(server, send)
    assert order[0] == "urgent" and len(order) == NUM_LOW + 1, order


def _queued_targets(server, send) -> tuple:
    """Pause the engine, `send()` one request from a thread, read the queued sequence's SLO targets, resume."""
    server.pause_engine()
    try:
        thread = threading.Thread(target=send)
        thread.start()
        wait_until(lambda: server.engine.stats()["num_waiting"] == 1, what="the request queued")
        [seq] = server.engine.scheduler.waiting
        targets = (seq.metrics.slo_ttft_s, seq.metrics.slo_tbt_s)
    finally:
        server.resume_engine()
    thread.join(120)
    return targets


def test_slo_targets_reach_the_engine_over_grpc_and_http(server):
    channel, stub = stub_for(server.target)
    try:
        request = make_request([3, 4, 5], **greedy(max_tokens=2), slo_ttft_s=2.5, slo_tbt_s=0.25)
        assert _queued_targets(server, lambda: stub.Complete(request, timeout=120)) == (2.5, 0.25)
        plain = make_request([3, 4, 5], **greedy(max_tokens=2))
        assert _queued_targets(server, lambda: stub.Complete(plain, timeout=120)) == (None, None)
    finally:
        channel.close()
    base = f"http://127.0.0.1:{server.http_port}"
    body = {"prompt": [3, 4, 5], "max_tokens": 2, "temperature": 0.0, "slo_tbt_s": 0.5}
    assert _queued_targets(server, lambda: httpx2.post(base + "/v1/completions", json=body, timeout=120)) == (None, 0.5)
