"""Serving benchmark for sarathi-jax: workloads, a real-time/offline driver, metrics, capacity search, reports.

`python -m sarathi_jax.bench --help` for the CLI; the pieces are importable:
  workload.synthetic_workload / workload.trace_workload -> Workload
  driver.run_workload(engine, workload, prompts) -> RunResult
  metrics.summarize(records, iterations) -> dict
  capacity.find_capacity(engine, workload, prompts, slo_tbt=...) -> CapacityResult
"""
