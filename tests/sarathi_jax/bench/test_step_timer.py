"""`bench.step_timer`: the compositions each `python -m sarathi_jax.bench.step_cost` mode times."""

from __future__ import annotations

from sarathi_jax.bench.step_cost import parse_args
from sarathi_jax.bench.step_timer import compositions, engine_needs


def test_compositions():
    args = parse_args(["--mode", "chunking,hybrid", "--prompt-len", "40", "--chunks", "16", "--tile-probe", "16",
                          "--decodes", "3", "--context", "5", "--whole-prompt", "24"])
    chunking = compositions("chunking", args)
    by_label = {c.label: c for c in chunking}
    steps = by_label["prompt 40 in chunks of 16"].steps
    assert [[(c.start, c.num_new_tokens, c.sample) for c in s] for s in steps] == [
        [(0, 16, False)], [(16, 16, False)], [(32, 8, True)]]
    assert len(by_label["prompt 40 unchunked"].steps) == 1  # the reference is added automatically
    assert [c.steps[0][0].num_new_tokens for c in chunking if c.info.get("probe") == "iteration"] == [16, 17]
    hybrid = compositions("hybrid", args)
    assert [sum(c.num_new_tokens for c in comp.steps[0]) for comp in hybrid] == [3, 3 + 16, 3 + 24]
    assert engine_needs(chunking + hybrid) == {"max_tokens": 40, "max_seqs": 4, "max_len": 40}
