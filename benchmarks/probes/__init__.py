"""Machine probes: what one step, one engine loop, the sampler and start-up cost on this machine, beside its
floors. Each command is `python -m benchmarks.probes.NAME --help`:

  loop_cost      the synchronous vs the overlapped engine loop (pieces: loop_timing.py, step_replay.py)
  host_cost      the host's CPU time per `engine.step()`, and where it goes
  sampler_cost   the device sampler's time per call for each sampler variant
  layer_matmul_cost  which form of a decode step's layer matmuls is fastest (weight on the right or the left)
  int8_matmul_cost   an int8-weight projection: the C++ int8 kernel beside the float32 one and XLA's dots
  out_major_steps    model steps with in-major against out-major projection weights, two engines alternated
  grammar_cost   structured outputs' grammar engines (llguidance, xgrammar, outlines-core): host cost per mask
  matmul_vs_torch    the engine's projection matmuls beside torch's on the same shapes
  speculation    speculative decoding's acceptance and step time against plain decoding
  startup        start-up time, cold and warm, in fresh processes
  perplexity     a fixed text's perplexity through the model forward, float against quantized weights
  profile_steps  a JAX profiler trace of steady decode, read by trace_summary.py
  trace_summary  where the time goes in a profiler trace

`sarathi_jax.bench.roofline` counts a batch's FLOPs and bytes and measures the machine's rates (the floors);
`sarathi_jax.bench.step_timer` times batch compositions on the real runner. `python -m sarathi_jax.bench.step_cost` (one iteration's time
beside the floors, and the cost model's calibration) is the command line over those two.
"""
