"""One process of the loopback multi-process test (test_multihost_loopback): SARATHI_* variables in the
environment, argv = model_dir tp pp prompts_json max_tokens [disaggregation]; prints `RESULT <json tokens>` on
success, and with a disaggregation `TRANSFERS <json [count, bytes, seconds]>` (the KV copies this process took
part in; the seconds are its own side of each copy)."""

from __future__ import annotations

import json
import sys

from sarathi_jax.parallel import initialize_distributed_from_env

initialize_distributed_from_env()  # before anything touches a JAX backend

from sarathi_jax import EngineConfig, SamplingParams  # noqa: E402
from sarathi_jax.disagg.real_engine import DisaggregatedEngine  # noqa: E402
from sarathi_jax.factory import build_engine  # noqa: E402


def main() -> None:
    model_dir, tp, pp, prompts_json, max_tokens = sys.argv[1:6]
    disaggregation = sys.argv[6] if len(sys.argv) > 6 else None
    engine = build_engine(EngineConfig(
        model=model_dir, token_budget=16, max_num_seqs=4, block_size=16, num_blocks=48, max_model_len=128,
        tensor_parallel_size=int(tp), pipeline_parallel_size=int(pp), disaggregation=disaggregation,
    ), warmup=False)
    params = SamplingParams(temperature=0.0, max_tokens=int(max_tokens), ignore_eos=True)
    pending = list(enumerate(json.loads(prompts_json)))
    tokens: dict[str, list[int]] = {}
    while pending or engine.has_unfinished_requests():  # every process runs the same loop on the same requests
        if pending:
            i, prompt = pending.pop(0)
            engine.add_request(f"r{i}", prompt, params)
        for out in engine.step():
            if out.finished:
                tokens[out.request_id] = list(out.token_ids)
    if isinstance(engine, DisaggregatedEngine):
        print("TRANSFERS " + json.dumps([engine.num_transfers, engine.transfer_bytes,
                                                  engine.transfer_seconds]), flush=True)
    print("RESULT " + json.dumps(tokens, sort_keys=True), flush=True)


if __name__ == "__main__":
    main()
