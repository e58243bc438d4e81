"""Configuration, plain Python: the engine's frozen `EngineConfig` (`engine_config`), the command-line flags generated
from it (`flags`), how a configuration sizes an engine for a model (`sizing`: KV blocks, max_model_len, scheduler
limits, buckets, and the token-budget sequence every engine shares), and prefill/decode disaggregation's split and
links (`disaggregation`)."""
