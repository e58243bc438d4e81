"""The real colocated engine: `LLMEngine` (`llm_engine`: weights, KV cache, scheduler, model runner and
admission on devices), the "auto" and "dynamic" token budgets resolved and calibrated for it (`token_budget`),
and the garbage collector kept off its start-up heap (`gc_heap`)."""
