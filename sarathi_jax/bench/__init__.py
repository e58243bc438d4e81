"""Serving benchmark for sarathi-jax: workloads, a real-time/offline driver, metrics, capacity search, reports.

`python -m sarathi_jax.bench --help` for the CLI; the pieces are importable:
  workload.synthetic_workload / workload.trace_workload -> Workload
  driver.run_workload(engine, workload, prompts) -> RunResult
  metrics.summarize(records, iterations) -> dict
  capacity.find_capacity(engine, workload, prompts, slo_tbt=...) -> CapacityResult
Cost tools: `python -m sarathi_jax.bench.step_cost` (one iteration's time beside the machine's floors:
roofline.py, step_timer.py; calibrates sarathi_jax.cost_model.BucketCostModel) and
`python -m sarathi_jax.bench.loop_cost` (the synchronous vs the overlapped engine loop: loop_timing.py,
step_replay.py). `python -m sarathi_jax.bench.bubble_demo`: the pipeline bubble fraction per scheduling policy.
"""
