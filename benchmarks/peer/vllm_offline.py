"""vLLM's side of `python -m benchmarks.peer`'s offline part, run by the interpreter that has vllm.

    VLLM_PYTHON -c "$(cat vllm_offline.py)" SPEC.json OUT.json [GO_FD DONE_FD]

This file imports only the standard library at module level and vllm inside `main`: the peer bench runs it in
a subprocess with vllm's interpreter (never in the project's own process), from a scratch directory so that no
module beside it shadows one vllm imports. SPEC.json (written by `offline.vllm_spec`): the engine
settings (`engine`: keyword arguments of `vllm.LLM`), the requests (`prompts`: token-id lists, `max_tokens`)
and a warm-up (`warmup_prompts`, `warmup_max_tokens`). Every request is greedy with ignore_eos and
min_tokens = max_tokens, so each produces exactly max_tokens tokens, as on this engine. OUT.json: the wall time
of the one `LLM.generate` call over all the requests (after the warm-up call) and the token counts.

With `passes` > 1 in SPEC.json the timed call runs that many times, and OUT.json gets `passes`: each one's wall
time. GO_FD and DONE_FD (two pipe ends) let the peer bench interleave those passes with this engine's: the
script writes a line to DONE_FD when it is warm and after each pass, and reads a line from GO_FD before each
pass, so only one engine runs at a time.
"""

from __future__ import annotations

import json
import sys
import time


def sampling_kwargs(max_tokens: int) -> dict:
    """Greedy, a fixed output length: what this engine's bench requests are (driver.sampling_params_for)."""
    return {"temperature": 0.0, "max_tokens": int(max_tokens), "min_tokens": int(max_tokens), "ignore_eos": True}


def run(spec: dict, go_fd: int | None = None, done_fd: int | None = None) -> dict:
    import vllm
    from vllm import LLM, SamplingParams

    t0 = time.monotonic()
    llm = LLM(**spec["engine"])
    startup_s = time.monotonic() - t0

    def generate(prompts: list, max_tokens: list) -> tuple[float, list]:
        params = [SamplingParams(**sampling_kwargs(n)) for n in max_tokens]
        inputs = [{"prompt_token_ids": list(p)} for p in prompts]
        start = time.monotonic()
        outs = llm.generate(inputs, params, use_tqdm=False)
        return time.monotonic() - start, outs

    go = open(go_fd, "r", closefd=False) if go_fd is not None else None
    done = open(done_fd, "w", closefd=False) if done_fd is not None else None

    def signal(what: str) -> None:
        if done is not None:
            done.write(what + "\n")
            done.flush()

    if spec.get("warmup_prompts"):
        generate(spec["warmup_prompts"], spec["warmup_max_tokens"])
    signal("ready")
    walls = []
    for i in range(int(spec.get("passes", 1))):
        if go is not None and not go.readline():
            break  # the bench closed the pipe: stop
        wall, outs = generate(spec["prompts"], spec["max_tokens"])
        walls.append(wall)
        signal(f"pass {i}")
    output_tokens = [len(o.outputs[0].token_ids) for o in outs]
    return {
        "wall_s": sorted(walls)[(len(walls) - 1) // 2],  # the median pass (the lower one of an even count)
        "passes": walls,
        "startup_s": startup_s,
        "num_requests": len(outs),
        "num_completed": sum(o.outputs[0].finish_reason == "length" for o in outs),
        "prompt_tokens": sum(len(p) for p in spec["prompts"]),
        "output_tokens": sum(output_tokens),
        "output_tokens_per_request": output_tokens,
        "vllm_version": vllm.__version__,
    }


def main(argv: list[str]) -> int:
    if len(argv) not in (2, 4):
        print("usage: vllm_offline.py SPEC.json OUT.json [GO_FD DONE_FD]", file=sys.stderr)
        return 2
    with open(argv[0]) as f:
        spec = json.load(f)
    result = run(spec, *map(int, argv[2:]))
    with open(argv[1], "w") as f:
        json.dump(result, f)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
