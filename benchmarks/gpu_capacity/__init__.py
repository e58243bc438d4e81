"""`python -m benchmarks.gpu_capacity --out DIR`: the paper's capacity experiment (Sarathi-Serve, Fig. 10), on
the real engine or, with `--simulate`, on the simulator over a cost model calibrated on this device.

For each trace (arxiv_summarization, conversation) and SLO (strict: P99 TBT <= 5x one decode iteration of batch 32
at context 4096; relaxed: 25x), one `python -m sarathi_jax.bench --capacity` run searches the highest request
rate each policy sustains: sarathi at two token budgets (the paper's 512 and 2048), vllm and orca (whole prompts,
at most `--max-num-seqs` sequences, the paper's largest vLLM batch). The decode iteration time is measured once,
by the first run into DIR (kept in `decode_time.json`), and every later run gets the same SLO in seconds.

Modules: `settings` (the settings and the bench commands), `experiment` (the command line), `report` (the
table, the plot, the machine description), `verify` (real-engine spot checks of a simulated grid).

**On the real engine** (the default) the experiment can be run in pieces (`--traces`, `--slos`, `--policies`; for
example one trace, SLO and policy per command where a command may run only minutes) into the same DIR: every
invocation rebuilds the report from all the runs there.

**Simulated** (`--simulate`): the same grid on `SimulatedEngine` (the engine core and schedulers, a virtual
clock), priced by a `BucketCostModel`: `--cost-model PATH`, else `DIR/cost_model.json`, else calibrated first on
this device (`python -m sarathi_jax.bench.step_cost --mode calibrate`, minutes) and kept there. The decode
iteration time behind the SLOs is the cost model's. Probes replay the paper's 2,048 requests. `--devices N`
prices tensor parallelism over N devices through the TP cost model: such tables are marked extrapolated.
`--verify N` then runs N points of the grid (trace, SLO, policy) on the real engine, each beside the simulator
on the same `--verify-sample` requests, and reports the capacities side by side (`verify.md`).

Writes, under DIR:

- `<trace>-<slo>/<policies>/`: the bench's own output for one run (per-run JSON/CSV, summary.json, TBT CDF
  and capacity PNGs);
- `commands.sh`: every bench command, as run (appended to);
- `machine.json`: platform, device, versions, git commit, `nvidia-smi` when there is one, the cost model;
- `capacity.md`, `capacity.json` and `capacity.png`: the capacities side by side, sarathi's best over vllm per
  trace and SLO;
- with `--verify N`: `verify/<point>/{sim,real}/` and `verify.md`, `verify.json`.

`--smoke` runs the same pipeline in minutes on a CPU (tiny-llama, a handful of requests, two or three probes), so
the script is known to work before a GPU is spent on it. A capacity marked ">=" passed every probe (the search
found no failing rate: a lower bound); "<" failed every probe (below the lowest rate probed); "<=" passed probes
above the fastest completion rate measured (too short to build a queue), so the capacity is at most that rate.
"""

from benchmarks.gpu_capacity.experiment import Experiment, main
from benchmarks.gpu_capacity.report import collect, format_report, machine_info

__all__ = ["Experiment", "collect", "format_report", "machine_info", "main"]
