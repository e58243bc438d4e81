"""`python -m benchmarks.peer`: this engine and vLLM side by side (compare.py holds the command line;
its docstring describes the measurements). The parts: config.py (the settings), model.py (the model both
load), workloads.py (the requests), offline.py and vllm_offline.py (every request at t=0), servers.py (the two
OpenAI servers under load), report.py (the tables)."""
