"""The device side of a step: a scheduled batch packed into fixed-shape arrays (`step_inputs`, `input_batch`), the
jitted model step and sampler (`model_runner`, `sample/`), their executables built ahead of time and kept between
processes (`precompile`, `executable_cache`, `compile_cache`), and draft models for speculation (`draft_runner`)."""
