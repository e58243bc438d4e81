"""`python -m fake_load_driver`: the real load driver's command line (`sarathi_jax.bench.loadgen.main`) with the server
replaced by the simulator (`bench_fakes.sim_engine`), for the bench's --endpoint tests; the endpoint
"refused:1" fails as an unreachable server does."""

from __future__ import annotations

from bench_fakes import sim_engine
from sarathi_jax.bench.driver import RunResult, run_workload
from sarathi_jax.bench import loadgen


def run_on_simulator(target: str, workload, prompts, *, temperature: float = 0.0, **_) -> RunResult:
    if target == "refused:1":
        raise ConnectionError("refused")
    run = run_workload(sim_engine(), workload, prompts, label=target, temperature=temperature)
    run.iterations = []  # a client sees no iterations
    return run


if __name__ == "__main__":
    loadgen.run_bench_workload = run_on_simulator
    raise SystemExit(loadgen.main())
