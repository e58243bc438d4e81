"""The real colocated engine: `LLMEngine` (`llm_engine`: weights, KV cache, scheduler, model runner and
admission on devices), the token budget (`token_budget`: the one sizing-and-budget sequence every engine runs,
real or simulated, and the "auto" and "dynamic" budgets resolved and calibrated),
and the garbage collector kept off its start-up heap (`gc_heap`)."""
