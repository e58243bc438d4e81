"""The serving benchmark, `python -m sarathi_jax.bench` (its --help is the CLI): workloads (synthetic or from the
shipped traces), a real-time or offline driver, metrics and SLO goodput, capacity search, reports and plots, on a
real or a simulated engine (`sarathi_jax.factory`), or against a running server (`--endpoint`, through the load
driver `loadgen`). The pieces are importable:
  workload.synthetic_workload / workload.trace_workload -> Workload
  driver.run_workload(engine, workload, prompts) -> RunResult
  metrics.summarize(records, iterations) -> dict
  capacity.find_capacity(engine, workload, prompts, slo_tbt=...) -> CapacityResult
  loadgen.run_load(target, requests) -> per-request client-side results
Step costs: `python -m sarathi_jax.bench.step_cost` times one iteration beside the machine's floors (`roofline`,
`step_timer`) and calibrates the simulator's `sarathi_jax.sim.cost_model.BucketCostModel` (`cost_profile=`).
Developer instruments (probes, the vLLM comparison, the GPU report, the paper's experiments) are in the
repository's `benchmarks/`, not in this package.
"""
