"""Client helpers and the CLI `python -m server.client "prompt" [--max-tokens N --temperature T --target H:P]`.

    python -m server.client "Hello, my name is" --max-tokens 32 --temperature 0
    python -m server.client --token-ids 1,2,3 --max-tokens 8 --target 127.0.0.1:8033
    python -m server.client --chat "What is the capital of France?" --max-tokens 64 --temperature 0
    python -m server.client "Hello" --tls --ssl-ca-certs cert.pem --api-key KEY   # (or $SARATHI_API_KEY)

Streams the generated text to stdout as it arrives (token ids, space separated, when the model has no
tokenizer), then the finish reason, usage and timings to stderr.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from typing import Mapping, Sequence

import grpc

from sarathi_jax.config.flags import ConfigFlags
from sarathi_jax.request.sampling_params import SamplingParams
from sarathi_jax.request.structured_outputs import StructuredOutputs
from server.proto.sarathi.v1 import generation_pb2 as pb
from server.proto.sarathi.v1 import generation_pb2_grpc as pb_grpc
from server.security import add_client_flags, client_security_from_args, grpc_channel

SAMPLING_FLAGS = ConfigFlags(SamplingParams)
# python -m server's gRPC port: below Linux's ephemeral port range (32768-60999), which outgoing connections use.
DEFAULT_GRPC_PORT = 8033

FINISH_REASON_NAMES = {
    pb.FINISH_REASON_UNSPECIFIED: None,
    pb.FINISH_REASON_STOP: "stop",
    pb.FINISH_REASON_LENGTH: "length",
    pb.FINISH_REASON_ABORT: "abort",
    pb.FINISH_REASON_ERROR: "error",
}


def make_request(prompt: str | Sequence[int] | Sequence[Mapping[str, str]], params=None, request_id: str | None = None,
                 **sampling: object) -> pb.GenerateRequest:
    """A GenerateRequest from a text, token-id or chat-messages prompt and a SamplingParams (and/or sampling keyword fields).

    Only fields that are given (not None) are set, so the server applies SamplingParams' defaults to the rest.
    """
    req = pb.GenerateRequest()
    if request_id is not None:
        req.request_id = request_id
    if isinstance(prompt, str):
        req.text = prompt
    elif prompt and isinstance(prompt[0], Mapping):  # a conversation: [{"role": ..., "content": ...}, ...]
        for message in prompt:
            req.messages.messages.add(role=str(message["role"]), content=str(message.get("content", "")))
        req.messages.SetInParent()
    else:
        req.token_ids.ids.extend(int(t) for t in prompt)
        req.token_ids.SetInParent()  # an empty list still selects token_ids (the server refuses it)
    fields: dict[str, object] = {}
    if params is not None:
        fields.update((f.name, getattr(params, f.name)) for f in dataclasses.fields(params))
    fields.update(sampling)
    for name, value in fields.items():
        if value is None:
            continue
        if name in ("stop", "stop_token_ids"):
            if isinstance(value, str):
                value = [value]
            getattr(req, name).extend(value)
        elif name == "structured_outputs":  # a StructuredOutputs or its object, sent as JSON text
            req.structured_outputs = value if isinstance(value, str) else json.dumps(
                value.as_dict() if isinstance(value, StructuredOutputs) else value)
        else:
            setattr(req, name, value)
    return req


def finish_reason_name(value: int) -> str | None:
    return FINISH_REASON_NAMES.get(value)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m server.client", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("prompt", nargs="?", default=None, help="text prompt (needs a model with a tokenizer)")
    p.add_argument("--token-ids", default=None, help="comma-separated prompt token ids instead of text")
    p.add_argument("--chat", default=None, metavar="TEXT",
                   help="a user message, sent as a conversation rendered with the model's chat template")
    p.add_argument("--system", default=None, help="with --chat: a system message before it")
    p.add_argument("--target", default=f"127.0.0.1:{DEFAULT_GRPC_PORT}", help="server host:port")
    SAMPLING_FLAGS.add_to(p.add_argument_group("sampling", "SamplingParams' fields; a flag left out is not "
                                                           "sent (the server applies SamplingParams' default)"))
    p.add_argument("--timeout", type=float, default=None, help="deadline in seconds")
    add_client_flags(p.add_argument_group("security", "the server's API key and TLS (docs/serving.md, Security)"))
    args = p.parse_args(argv)
    try:
        security = client_security_from_args(args)
    except ValueError as exc:
        p.error(str(exc))
    if sum(x is not None for x in (args.prompt, args.token_ids, args.chat)) != 1:
        p.error("give exactly one of a text prompt, --token-ids or --chat")
    if args.system is not None and args.chat is None:
        p.error("--system goes with --chat")
    prompt: str | list[int] | list[dict[str, str]]
    if args.chat is not None:
        prompt = ([{"role": "system", "content": args.system}] if args.system is not None else [])
        prompt.append({"role": "user", "content": args.chat})
    elif args.token_ids is not None:
        prompt = [int(t) for t in args.token_ids.split(",") if t.strip()]
    else:
        prompt = args.prompt
    req = make_request(prompt, **SAMPLING_FLAGS.given(args))
    with grpc_channel(args.target, security) as channel:
        stub = pb_grpc.GenerationStub(channel)
        try:
            info = stub.GetModelInfo(pb.GetModelInfoRequest(), timeout=args.timeout or 30)
            as_ids = not info.has_tokenizer
            last = None
            for resp in stub.Generate(req, timeout=args.timeout):
                if as_ids:
                    if resp.token_ids:
                        sys.stdout.write(" ".join(str(t) for t in resp.token_ids) + " ")
                else:
                    sys.stdout.write(resp.text)
                sys.stdout.flush()
                last = resp
        except grpc.RpcError as err:
            sys.stdout.write("\n")
            print(f"error: {err.code().name}: {err.details()}", file=sys.stderr)
            return 1
    sys.stdout.write("\n")
    if last is not None:
        t = last.timings
        print(f"[finish_reason={finish_reason_name(last.finish_reason)} prompt_tokens={last.usage.prompt_tokens} "
              f"completion_tokens={last.usage.completion_tokens} queue={t.queue_time_s:.4f}s ttft={t.ttft_s:.4f}s "
              f"e2e={t.e2e_s:.4f}s]", file=sys.stderr)
        if last.error:
            print(f"error: {last.error}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
