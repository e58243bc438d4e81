"""End-to-end tests of the OpenAI-compatible HTTP API: the shared tiny Llama engine (with a tokenizer, and a
test chat template) behind a real HTTP server on 127.0.0.1, driven by the official `openai` client and raw HTTP.
One server (HTTP only) for the whole module."""

from __future__ import annotations

import asyncio
import json
import random
import threading

import httpx2
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from grpc_test_utils import fail_next_step, wait_until
from sarathi_jax import LLM, SamplingParams
from sarathi_jax.request.chat_template import ChatTemplate
from server.service import GenerationServer

# Roles and contents as plain text; "<s>" is the test tokenizer's BOS, written by the template.
CHAT_TEMPLATE = ("{% for m in messages %}<s>{{ m.role }}: {{ m.content }}\n{% endfor %}"
                 "{% if add_generation_prompt %}<s>assistant:{% endif %}")
TEXT_PROMPT = "Hello world! How are you"
IDS_PROMPT = [5, 17, 33, 60, 9, 101, 7]
CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "The quick brown fox"}]
MAX_TOKENS = 10
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)


# --------------------------------------------------------------------------------------------- fixtures
@pytest.fixture(scope="module")
def engine(llama_engine):
    """The shared engine with a chat template for this module (the test checkpoint has none)."""
    engine, _ = llama_engine
    saved, engine.admission.chat_template = engine.admission.chat_template, ChatTemplate(CHAT_TEMPLATE)
    yield engine
    engine.admission.chat_template = saved


@pytest.fixture(scope="module")
def offline(engine):
    """`LLM.generate` / `LLM.chat` outputs on the same engine, before the server owns it."""
    llm = LLM.__new__(LLM)  # LLM around the existing engine: building a second one would only add compile time
    llm.engine, llm._next_id = engine, 0
    [text] = llm.generate(TEXT_PROMPT, GREEDY)
    [ids] = llm.generate(IDS_PROMPT, GREEDY)
    [chat] = llm.chat(CHAT, GREEDY)
    assert text.text and chat.text  # the comparisons below are about real text
    return {"text": text, "ids": ids, "chat": chat}


@pytest.fixture(scope="module")
def server(engine, llama_engine, offline):
    srv = GenerationServer(engine, engine_config=llama_engine[1], host="127.0.0.1", port=None, http_port=0)
    srv.start_in_thread()
    yield srv
    srv.stop(grace=0, timeout=60)


@pytest.fixture(scope="module")
def base_url(server):
    return f"http://127.0.0.1:{server.http_port}"


@pytest.fixture(scope="module")
def client(base_url):
    return openai.OpenAI(base_url=f"{base_url}/v1", api_key="unused", max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def http(base_url):
    with httpx2.Client(base_url=base_url, timeout=60) as c:
        yield c


def metric_values(http) -> dict[tuple[str, tuple], float]:
    text = http.get("/metrics").text
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def metric(http, name: str, **labels) -> float:
    return sum(v for (n, lab), v in metric_values(http).items()
               if n == name and all(dict(lab).get(k) == val for k, val in labels.items()))


def greedy_extra(**kw):
    return dict(temperature=0.0, max_tokens=MAX_TOKENS, extra_body={"ignore_eos": True, **kw})


def assert_openai_error(resp, status: int, param: str | None, word: str) -> None:
    assert resp.status_code == status, resp.text
    err = resp.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["param"] == param and word in err["message"], err
    assert err["type"] == ("invalid_request_error" if status == 400 else err["type"])


# --------------------------------------------------------------------------------------------- basics
def test_models_health_metrics(server, client, http):
    [model] = client.models.list().data
    assert model.id == server.model_name
    assert model.model_extra["max_model_len"] == 256 and model.model_extra["sarathi"]["vocab_size"] == 256
    assert http.get("/health").status_code == 200
    resp = http.get("/metrics")
    assert resp.status_code == 200 and "sarathi:kv_cache_usage_perc" in resp.text


def test_completion_text_prompt_streamed_and_not(server, client, offline):
    expected = offline["text"]
    resp = client.completions.create(model=server.model_name, prompt=TEXT_PROMPT, **greedy_extra())
    assert resp.object == "text_completion" and resp.choices[0].text == expected.text
    assert resp.choices[0].finish_reason == "length"
    assert (resp.usage.prompt_tokens, resp.usage.completion_tokens) == (len(expected.prompt_token_ids), MAX_TOKENS)

    chunks = list(client.completions.create(model=server.model_name, prompt=TEXT_PROMPT, stream=True,
                                            stream_options={"include_usage": True}, **greedy_extra()))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == expected.text  # token identity, streamed
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert not chunks[-1].choices and chunks[-1].usage.completion_tokens == MAX_TOKENS
    assert all(c.usage is None for c in chunks[:-1])


def test_completion_token_id_prompt(server, client, offline):
    expected = offline["ids"]
    resp = client.completions.create(model=server.model_name, prompt=IDS_PROMPT, logprobs=2,
                                     **greedy_extra(return_token_ids=True))
    choice = resp.choices[0]
    assert choice.model_extra["token_ids"] == list(expected.token_ids) and choice.text == expected.text
    lp = choice.logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == MAX_TOKENS
    assert all(len(top) <= 2 and max(top.values()) >= logprob - 1e-5  # greedy: the sampled token is the best
               for top, logprob in zip(lp.top_logprobs, lp.token_logprobs))

    chunks = list(client.completions.create(model=server.model_name, prompt=IDS_PROMPT, stream=True,
                                            **greedy_extra(return_token_ids=True)))
    assert [t for c in chunks for t in c.choices[0].model_extra["token_ids"]] == list(expected.token_ids)


def test_chat_streamed_and_not(server, client, offline):
    expected = offline["chat"]
    resp = client.chat.completions.create(model=server.model_name, messages=CHAT, logprobs=True, top_logprobs=3,
                                          **greedy_extra())
    choice = resp.choices[0]
    assert resp.object == "chat.completion" and choice.message.role == "assistant"
    assert choice.message.content == expected.text and choice.finish_reason == "length"
    assert resp.usage.prompt_tokens == len(expected.prompt_token_ids)
    assert len(choice.logprobs.content) == MAX_TOKENS and all(len(c.top_logprobs) == 3 for c in choice.logprobs.content)

    chunks = list(client.chat.completions.create(model=server.model_name, messages=CHAT, stream=True,
                                                 **greedy_extra()))
    assert chunks[0].choices[0].delta.role == "assistant" and chunks[0].object == "chat.completion.chunk"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == expected.text
    assert chunks[-1].choices[0].finish_reason == "length"


def test_chat_without_template_is_a_400_that_says_so(server, client, engine):
    template, engine.admission.chat_template = engine.admission.chat_template, None
    try:
        with pytest.raises(openai.BadRequestError) as info:
            client.chat.completions.create(model=server.model_name, messages=CHAT, max_tokens=2)
    finally:
        engine.admission.chat_template = template
    assert "no chat template" in info.value.message and info.value.body["param"] == "messages"


# --------------------------------------------------------------------------------------------- bad input
BAD_BODIES = [
    # (case, path, body (bytes: sent raw), param, word in the message)
    ("bad-json", "/v1/completions", b'{"prompt": "hi", ', None, "JSON"),
    ("wrong-type", "/v1/completions", {"prompt": "hi", "max_tokens": "many"}, "max_tokens", "integer"),
    ("negative-max_tokens", "/v1/completions", {"prompt": "hi", "max_tokens": -1}, "max_tokens", "max_tokens"),
    ("prompt-too-long", "/v1/completions", {"prompt": [5] * 300, "max_tokens": 1}, "prompt", "max_model_len"),
    ("prompt+max_tokens-too-long", "/v1/completions", {"prompt": [5] * 200, "max_tokens": 57}, "max_tokens",
     "max_model_len"),
    ("unknown-model", "/v1/completions", {"model": "gpt-17", "prompt": "hi"}, "model", "gpt-17"),
    ("missing-prompt", "/v1/completions", {"max_tokens": 2}, "prompt", "required"),
    ("token-out-of-vocab", "/v1/completions", {"prompt": [1, 10**6]}, "prompt", "vocabulary"),
    ("priority-float", "/v1/completions", {"prompt": "hi", "priority": 1.5}, "priority", "integer"),
    ("priority-string", "/v1/chat/completions", {"messages": CHAT, "priority": "1"}, "priority", "integer"),
    ("priority-bool", "/v1/completions", {"prompt": "hi", "priority": True}, "priority", "integer"),
    ("priority-above-int32", "/v1/completions", {"prompt": "hi", "priority": 2**31}, "priority", "outside"),
    ("priority-below-int32", "/v1/chat/completions", {"messages": CHAT, "priority": -(2**31) - 1}, "priority",
     "outside"),
    ("slo_ttft_s-negative", "/v1/completions", {"prompt": "hi", "slo_ttft_s": -1}, "slo_ttft_s", "> 0"),
    ("slo_tbt_s-zero", "/v1/chat/completions", {"messages": CHAT, "slo_tbt_s": 0}, "slo_tbt_s", "> 0"),
    ("slo_tbt_s-string", "/v1/completions", {"prompt": "hi", "slo_tbt_s": "0.1"}, "slo_tbt_s", "number"),
    ("top_p", "/v1/completions", {"prompt": "hi", "top_p": 0}, "top_p", "top_p"),
    ("batch", "/v1/completions", {"prompt": ["a", "b"]}, "prompt", "batches"),
    ("n", "/v1/completions", {"prompt": "hi", "n": 2}, "n", "not supported"),
    ("chat-n", "/v1/chat/completions", {"messages": CHAT, "n": 3}, "n", "not supported"),
    ("tools", "/v1/chat/completions", {"messages": CHAT, "tools": [{"type": "function", "function": {"name": "f"}}]},
     "tools", "not supported"),
    # Structured outputs: this engine's tokenizer (Metaspace) is one llguidance cannot read; bad ones are
    # refused before that, naming their field (tests/server/test_structured_outputs_api.py serves them).
    ("response_format", "/v1/chat/completions", {"messages": CHAT, "response_format": {"type": "json_object"}},
     "response_format", "not available with this model's tokenizer"),
    ("response_format-type", "/v1/completions", {"prompt": "hi", "response_format": {"type": "yaml"}},
     "response_format", "json_schema"),
    ("guided_regex", "/v1/completions", {"prompt": "hi", "guided_regex": "("}, "guided_regex", "invalid regex"),
    ("two-constraints", "/v1/completions", {"prompt": "hi", "guided_regex": "a", "guided_choice": ["a"]},
     "guided_choice", "only one"),
    ("message-without-role", "/v1/chat/completions", {"messages": [{"content": "hi"}]}, "messages.0.role",
     "required"),
]


@pytest.mark.parametrize("case", BAD_BODIES, ids=[c[0] for c in BAD_BODIES])
def test_bad_input_gets_openai_error_and_server_keeps_serving(server, http, case):
    _, path, body, param, word = case
    if isinstance(body, bytes):
        resp = http.post(path, content=body, headers={"Content-Type": "application/json"})
    else:
        resp = http.post(path, json=body)
    assert_openai_error(resp, 400, param, word)
    ok = http.post("/v1/completions", json={"prompt": [3, 4, 5], "max_tokens": 3, "ignore_eos": True})
    assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 3


def test_unknown_fields_are_ignored(server, http):
    resp = http.post("/v1/completions", json={"prompt": [3, 4], "max_tokens": 2, "ignore_eos": True,
                                              "frequency_penalty_v9": 1, "user": "u"})
    assert resp.status_code == 200 and resp.json()["usage"]["completion_tokens"] == 2


def test_overload_is_429(server, http, engine_resumed):
    server.pause_engine()
    server.session.max_waiting_requests = 1
    body = {"prompt": [7, 8, 9], "max_tokens": 4, "ignore_eos": True, "stream": True, "return_token_ids": True}
    with http.stream("POST", "/v1/completions", json=body) as first:  # admitted: waits for its first token
        assert first.status_code == 200
        resp = http.post("/v1/completions", json={"prompt": [1, 2], "max_tokens": 2})
        assert resp.status_code == 429 and resp.json()["error"]["type"] == "rate_limit_error"
        assert "max_waiting_requests" in resp.json()["error"]["message"]
        server.resume_engine()
        lines = [line for line in first.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "data: [DONE]"  # the admitted request was served in full
    assert sum(len(json.loads(line[6:])["choices"][0]["token_ids"]) for line in lines[:-1]) == 4


# --------------------------------------------------------------------------------------------- disconnects
def test_100_streams_20_percent_disconnected(server, http, base_url):
    n, rng = 100, random.Random(15)
    dropped = set(rng.sample(range(n), n // 5))
    aborts_before = metric(http, "sarathi:request_success_total", finished_reason="abort")
    first_iteration = len(server.worker.call(lambda e: e.iteration_log).result(timeout=10))

    async def one(client, i):
        long = i in dropped  # long enough to be mid-stream when its client leaves
        body = {"prompt": [3 + i % 200, 4, 5], "max_tokens": 200 if long else 6, "ignore_eos": True,
                "temperature": 0.0, "stream": True, "return_token_ids": True}
        tokens = 0
        async with client.stream("POST", "/v1/completions", json=body) as resp:
            assert resp.status_code == 200
            async for line in resp.aiter_lines():
                if line == "data: [DONE]":
                    return tokens
                if line.startswith("data: "):
                    tokens += len(json.loads(line[6:])["choices"][0]["token_ids"])
                    if long and tokens:
                        return None  # disconnect mid-stream: closing the response drops the connection
        raise AssertionError("stream ended without [DONE]")

    async def drive():
        limits = httpx2.Limits(max_connections=None, max_keepalive_connections=None)
        async with httpx2.AsyncClient(base_url=base_url, timeout=120, limits=limits) as client:
            return await asyncio.gather(*(one(client, i) for i in range(n)))

    results = asyncio.run(drive())
    assert [i for i, r in enumerate(results) if r is None] == sorted(dropped)
    assert all(r == 6 for i, r in enumerate(results) if i not in dropped)

    def idle() -> bool:
        return (metric(http, "sarathi:num_requests_running") == 0 and metric(http, "sarathi:num_requests_waiting") == 0
                and metric(http, "sarathi:kv_cache_usage_perc") == 0 and server.num_active_requests == 0)

    wait_until(idle, timeout=30, interval=0.05, what="no running requests and no used KV blocks on /metrics")
    assert metric(http, "sarathi:request_success_total", finished_reason="abort") - aborts_before == len(dropped)
    # ... aborted at once, not served to the end: the engine decoded far fewer than their 200 tokens each.
    log = server.worker.call(lambda e: list(e.iteration_log[first_iteration:])).result(timeout=10)
    num_decoded = sum(it.num_decode_tokens for it in log)
    assert num_decoded < (n - len(dropped)) * 6 + len(dropped) * 50, num_decoded


def test_non_streamed_request_is_aborted_when_its_client_leaves(server, http, base_url, engine_resumed):
    server.pause_engine()  # it cannot finish: only the disconnect can end it
    aborts_before = metric(http, "sarathi:request_success_total", finished_reason="abort")
    with httpx2.Client(base_url=base_url, timeout=httpx2.Timeout(60, read=0.5)) as impatient:
        with pytest.raises(httpx2.ReadTimeout):
            impatient.post("/v1/completions", json={"prompt": [3, 4, 5], "max_tokens": 50})
    wait_until(lambda: server.num_active_requests == 0, what="the abandoned request to be aborted")
    assert metric(http, "sarathi:request_success_total", finished_reason="abort") - aborts_before == 1
    server.resume_engine()
    wait_until(lambda: metric(http, "sarathi:kv_cache_usage_perc") == 0, what="its KV blocks to be free")


def test_engine_step_failure_is_500_and_server_recovers(server, http):
    fail_next_step(server)
    resp = http.post("/v1/completions", json={"prompt": [1, 2, 3], "max_tokens": 3})
    assert resp.status_code == 500 and resp.json()["error"]["type"] == "server_error"
    assert "injected step failure" in resp.json()["error"]["message"]
    ok = http.post("/v1/completions", json={"prompt": [1, 2, 3], "max_tokens": 3, "ignore_eos": True})
    assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 3


# --------------------------------------------------------------------------------------------- bench
def test_bench_endpoint_over_http(server, base_url, tmp_path, capsys):
    from sarathi_jax.bench.__main__ import main

    rc = main(["--endpoint", base_url, "--num-requests", "4", "--prompt-len", "8", "--output-len", "3",
               "--out", str(tmp_path), "--quiet"])
    assert rc == 0 and "4/4" in capsys.readouterr().out
    [result] = [p for p in tmp_path.iterdir() if p.name.startswith("http") and p.suffix == ".json"]
    records = json.loads(result.read_text())["requests"]
    assert [r["num_output_tokens"] for r in records] == [3] * 4 and all(r["error"] is None for r in records)


def test_draining_refuses_with_503_and_health_turns_unhealthy(llama_engine, server, http):
    """Last in the module: drains the module's server (in-flight stream completes, new requests get 503)."""
    server.pause_engine()
    body = {"prompt": [7, 8, 9], "max_tokens": 5, "ignore_eos": True, "stream": True}
    with http.stream("POST", "/v1/completions", json=body) as running:
        assert running.status_code == 200
        drain = threading.Thread(target=server.drain, kwargs={"timeout": 60})
        drain.start()
        wait_until(lambda: http.get("/health").status_code == 503, what="health 503")
        resp = http.post("/v1/completions", json={"prompt": [1, 2], "max_tokens": 2})
        assert resp.status_code == 503 and resp.json()["error"]["code"] == "unavailable"
        server.resume_engine()
        lines = [line for line in running.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "data: [DONE]"
    assert json.loads(lines[-2][6:])["choices"][0]["finish_reason"] == "length"
    drain.join(60)
    assert not drain.is_alive() and not server.worker.alive
