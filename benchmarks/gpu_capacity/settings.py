"""The capacity experiment's settings (`Experiment`, the GPU defaults and `--smoke`'s) and the bench command line
each trace and SLO runs (`bench_argv`)."""

from __future__ import annotations

from dataclasses import dataclass, replace

SLO_MULTIPLES = {"strict": 5.0, "relaxed": 25.0}  # x the decode iteration time (the paper's section 5)
POLICIES = ("sarathi", "vllm", "orca")
DECODE_TIME_FILE = "decode_time.json"
COST_MODEL_FILE = "cost_model.json"
PAPER_SAMPLE = 2048  # requests per probe in the paper's capacity searches
PAPER_PROBES = 8  # probes per search (the paper's 7-8)


@dataclass(frozen=True)
class Experiment:
    """One full experiment's settings (the GPU defaults, or `--smoke`'s)."""

    model: str = "mistral-7b"
    dtype: str = "bfloat16"
    traces: tuple[str, ...] = ("arxiv", "conversation")
    slos: tuple[str, ...] = ("strict", "relaxed")
    sarathi_budgets: tuple[int, ...] = (512, 2048)
    max_num_seqs: int = 128
    max_model_len: int = 4096
    sample: int = 128  # requests per probe on the real engine (the paper replays 2,048: the simulated default)
    length_scale: float = 1.0
    capacity_probes: int = 6
    decode_probe_batch: int = 32
    decode_probe_context: int = 4096  # the SLOs' reference: a decode iteration of batch 32 at context 4k
    kv_cache_bytes: int | None = None  # None: sized from the device's free memory (gpu_memory_utilization)
    start_qps: float | None = None  # the capacity search's first probe (None: the bench's default, 1 req/s)
    seed: int = 0
    policies: tuple[str, ...] = POLICIES
    simulate: bool = False  # the grid on the simulator, over a calibrated cost model
    devices: int | None = None  # simulated: tensor parallel over N devices (extrapolated through the TP cost model)
    verify: int = 0  # simulated: points of the grid run on the real engine too
    verify_sample: int = 128  # requests per probe of those points, on both sides


SMOKE = Experiment(model="tiny-llama", dtype="auto", sarathi_budgets=(32, 64), max_num_seqs=8, max_model_len=256,
                   sample=6, length_scale=0.05, capacity_probes=2, decode_probe_batch=4, decode_probe_context=64,
                   verify_sample=6)


def defaults(smoke: bool, simulate: bool) -> Experiment:
    """The settings before the command line's overrides: the paper's probe size and count when simulated."""
    exp = SMOKE if smoke else Experiment()
    if simulate:
        exp = replace(exp, simulate=True, sample=24 if smoke else PAPER_SAMPLE,
                                  capacity_probes=3 if smoke else PAPER_PROBES)
    return exp


def labels(exp: Experiment) -> list[str]:
    """The engines' labels, as the bench names them: sarathi once per budget."""
    return [f"sarathi-{b}" if p == "sarathi" else p for p in exp.policies
            for b in (exp.sarathi_budgets if p == "sarathi" else (None,))]


def bench_argv(exp: Experiment, trace_path: str, out_dir: str, slo: str, slo_tbt: float | None,
               cost_model: str | None = None) -> list[str]:
    """The bench command line for one trace and SLO; `slo_tbt`: seconds, or None to measure the decode time;
    `cost_model`: the simulated experiment's."""
    argv = ["--model", exp.model, "--dtype", exp.dtype, "--trace", trace_path, "--sample", str(exp.sample),
            "--length-scale", f"{exp.length_scale:g}", "--seed", str(exp.seed),
            "--scheduler", ",".join(exp.policies), "--token-budget", ",".join(map(str, exp.sarathi_budgets)),
            "--max-num-seqs", str(exp.max_num_seqs), "--max-model-len", str(exp.max_model_len),
            "--capacity", "--capacity-probes", str(exp.capacity_probes),
            "--decode-probe-batch", str(exp.decode_probe_batch),
            "--decode-probe-context", str(exp.decode_probe_context), "--out", out_dir]  # not --quiet: probes
    if exp.simulate:
        argv += ["--simulate", "--cost-model", cost_model]
        if exp.devices:
            argv += ["--devices", str(exp.devices)]
        argv += ["--no-plots"]  # hundreds of runs' CDFs: the report's plot is the one that matters
    if exp.start_qps is not None:
        argv += ["--capacity-start-qps", f"{exp.start_qps:g}"]
    if exp.kv_cache_bytes is not None:
        argv += ["--kv-cache-bytes", str(exp.kv_cache_bytes)]
    if slo_tbt is None:
        argv += ["--slo-tbt-multiple", f"{SLO_MULTIPLES[slo]:g}"]
    else:
        argv += ["--slo-tbt", repr(slo_tbt)]
    return argv


def run_name(exp: Experiment) -> str:
    """One run's folder name: its engines' labels (sarathi once per budget), so runs made piece by piece
    (one policy or budget per command) land in folders of their own."""
    return "-".join(labels(exp))
