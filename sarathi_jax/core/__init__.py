"""The engine core, plain Python: the engine API that every driver programs against (`engine_api`: the `Engine` and
`Executor` protocols, clocks), the one admission path (`admission`), the one serving loop shared by the real
engine, the simulator and both disaggregated engines (`engine_core`), and the driver loop of timed arrivals
(`arrival_loop`). The model runner is reached only through the `Executor` protocol."""
