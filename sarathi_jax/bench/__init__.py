"""Serving benchmark for sarathi-jax: workloads, a real-time/offline driver, metrics, capacity search, reports.

`python -m sarathi_jax.bench --help` for the CLI; the pieces are importable:
  workload.synthetic_workload / workload.trace_workload -> Workload
  driver.run_workload(engine, workload, prompts) -> RunResult
  metrics.summarize(records, iterations) -> dict
  capacity.find_capacity(engine, workload, prompts, slo_tbt=...) -> CapacityResult
Cost tools: `python -m sarathi_jax.bench.step_cost` (one iteration's time beside the machine's floors:
probes/roofline.py, probes/step_timer.py; calibrates sarathi_jax.sim.cost_model.BucketCostModel); the other machine
probes are in probes/ (`python -m benchmarks.probes.loop_cost`: the synchronous vs the overlapped engine
loop; see probes/__init__.py for the rest). `python -m benchmarks.gpu_report`: every part of a lent GPU's
report (gpu_report/); `python -m benchmarks.peer`: this engine against vLLM (peer/).
`python -m benchmarks.bubble_demo`: the pipeline bubble fraction per scheduling policy.
"""
