"""The bench's command line: options and their defaults, the checks on their combinations, and what they
expand to (one engine configuration per scheduler x token budget x prefix caching, one run per
--structured-share on each)."""

from __future__ import annotations

import argparse
from typing import Any, Callable

from sarathi_jax.bench.capacity import DEFAULT_MAX_SCHED_DELAY
from sarathi_jax.bench.metrics import DEFAULT_STALL_FACTOR
from sarathi_jax.bench.slo_mix import GoodputTarget, SloMix, parse_goodput_target, parse_slo_mix
from sarathi_jax.bench.structured import (DEFAULT_CONSTRAINT, NAMED_CONSTRAINTS, parse_constraint, parse_shares,
                                          share_label)
from sarathi_jax.bench.workload import ARRIVAL_PROCESSES
from sarathi_jax.config.engine_config import ACCELERATOR_PLATFORMS, DEFAULT_TOKEN_BUDGET, EngineConfig, token_budget_arg
from sarathi_jax.config.flags import ConfigFlags, DefaultsHelpFormatter
from sarathi_jax.config.disaggregation import DisaggregationSplit, KVLink, parse_kv_link
from sarathi_jax.utils.paths import cli_path
from sarathi_jax.scheduler.registry import SCHEDULER_POLICIES, TOKEN_BUDGET_POLICIES, WHOLE_PROMPT_POLICIES
from sarathi_jax.request.structured_outputs import StructuredOutputs

CPU_DEFAULT_MODEL = "tiny-llama"
ACCELERATOR_DEFAULT_MODEL = "llama-1b"  # a GPU-sized preset: tiny-llama would measure launch overhead only
DEFAULT_SCHEDULERS = "sarathi,vllm"  # the point of the project: stall-free batches against prefill-first
DEFAULT_TOKEN_BUDGETS = "128"
DEFAULT_NUM_REQUESTS = 24
DEFAULT_QPS = 2.0
# Engine settings the bench passes unless told otherwise: the engine's own defaults (128 sequences, the
# model's full 4096-token context) pad every step to far more attention work than a CPU run needs.
DEFAULT_MAX_NUM_SEQS = 32
DEFAULT_MAX_MODEL_LEN = 1024
# Long prompts on purpose: a small model's step is short on any device, and a short prefill barely holds the
# running decodes back; 256-960 tokens (the conversation trace's median is about 1000) show the stalls that
# sarathi removes, against the prefill-first baseline, within the default max_model_len.
DEFAULT_PROMPT_LEN = "uniform:256:960"
DEFAULT_OUTPUT_LEN = "uniform:16:64"

# EngineConfig fields whose bench flag is written below by hand, with the bench's own meaning: the swept ones
# (comma-separated lists; --prefix-caching off,on), and those with a bench default. Every other field's flag
# is generated (`ENGINE_FLAGS`); EngineConfig.seed is --engine-seed, as --seed seeds the workload.
HAND_WRITTEN_ENGINE_FLAGS = {
    "model": "--model", "scheduler": "--scheduler", "token_budget": "--token-budget",
    "max_num_seqs": "--max-num-seqs", "max_model_len": "--max-model-len", "enable_prefix_caching": "--prefix-caching",
    "disaggregation": "--disaggregation",
}
ENGINE_FLAGS = ConfigFlags(EngineConfig, skip=frozenset(HAND_WRITTEN_ENGINE_FLAGS), renamed={"seed": "--engine-seed"})


class BenchError(Exception):
    """A usage or setup problem, reported as one line without a traceback."""


def _csv_list(text: str, kind: Callable[[str], Any], name: str) -> list:
    items = [x.strip() for x in str(text).split(",") if x.strip()]
    if not items:
        raise BenchError(f"{name}: empty list")
    try:
        return [kind(x) for x in items]
    except ValueError:
        raise BenchError(f"{name}: could not parse {text!r}") from None


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m sarathi_jax.bench",
        description="Benchmark sarathi-jax schedulers on the same requests: latency (TTFT, TBT), throughput, "
                    "stalls, and optionally capacity under SLOs.",
        formatter_class=DefaultsHelpFormatter,
    )
    g = p.add_argument_group("engine configurations (every scheduler x token budget is one run)")
    g.add_argument("--model", default=None,
                   help=f"preset name or HF checkpoint folder (default: {ACCELERATOR_DEFAULT_MODEL} on a GPU or "
                        f"TPU, {CPU_DEFAULT_MODEL} elsewhere)")
    g.add_argument("--scheduler", default=DEFAULT_SCHEDULERS,
                   help=f"comma-separated policies from {', '.join(SCHEDULER_POLICIES)}")
    g.add_argument("--token-budget", default=DEFAULT_TOKEN_BUDGETS,
                   help="comma-separated token budgets: integers, 'auto' or 'dynamic' (both need --slo-tbt-s, the "
                        "TBT target they are picked for; see EngineConfig.token_budget); policies that never split "
                        f"prompts ({', '.join(WHOLE_PROMPT_POLICIES)}) run once, with the largest integer")
    g.add_argument("--max-num-seqs", type=int, default=DEFAULT_MAX_NUM_SEQS,
                   help="EngineConfig.max_num_seqs (0: the engine's default, min(128, the token budget))")
    g.add_argument("--max-model-len", type=int, default=DEFAULT_MAX_MODEL_LEN,
                   help="EngineConfig.max_model_len (0: the engine's default, the model's limit); "
                        "longer requests are scaled down to fit")
    g.add_argument("--prefix-caching", default="off",
                   help="EngineConfig.enable_prefix_caching: off, on, or off,on to compare both on the same "
                        "requests (off by default here, as in the paper's systems; the engine's default is on)")
    ENGINE_FLAGS.add_to(g)
    g.add_argument("--simulate", action="store_true",
                   help="use SimulatedEngine (real schedulers, cost model, virtual clock) instead of LLMEngine")
    g.add_argument("--cost-model", type=cli_path, default=None, metavar="PATH",
                   help="--simulate: a cost model calibrated on the real runner (JSON written by "
                        "`python -m sarathi_jax.bench.step_cost --mode calibrate --cost-model-out PATH`) "
                        "instead of the simulator's default")
    g.add_argument("--disaggregation", default=None, metavar="P:D[,P:D...]",
                   help="also run each configuration disaggregated, prefill on P devices and decode on D (a side "
                        "may be DEVICES/TP: instances of TP devices), one run per split, on the same requests "
                        "(EngineConfig.disaggregation): simulated devices with --simulate, else this process's "
                        "devices (DisaggregatedEngine; partial)")
    g.add_argument("--devices", type=int, default=None, metavar="N",
                   help="--simulate: N simulated devices; the colocated runs are tensor parallel over all N "
                        "(tensor_parallel_size N) and each --disaggregation split must fit in N")
    g.add_argument("--kv-link", default="nvlink", metavar="LINK",
                   help="--simulate: the link between devices, for KV transfers and tensor-parallel all-reduces: "
                        "nvlink (300 GB/s), pcie (32 GB/s), 25gbe (3.125 GB/s) or a bandwidth in GB/s "
                        "(sarathi_jax/config/disaggregation.py says where each figure comes from)")
    g.add_argument("--tp-serial-fraction", type=float, default=0.0, metavar="F",
                   help="--simulate: the part of an iteration that tensor parallelism does not split "
                        "(sarathi_jax/sim/tp_cost.py; 0: an ideal split)")
    g.add_argument("--endpoint", default=None, metavar="HOST:PORT",
                   help="drive a running server through sarathi_jax/bench/loadgen.py instead of an in-process engine: "
                        "HOST:PORT (gRPC) or http://HOST:PORT (the OpenAI-compatible HTTP API)")

    w = p.add_argument_group("workload")
    w.add_argument("--trace", default=None, metavar="NAME|PATH",
                   help="a shipped trace by name, arxiv (arxiv-summarization lengths) or conversation (Azure's "
                        "conversation trace, with arrival times), or a CSV with num_prefill_tokens, "
                        "num_decode_tokens and optionally arrived_at")
    w.add_argument("--sample", type=int, default=None, metavar="N",
                   help="use N trace rows (a contiguous window when the trace has arrival times, else random rows)")
    w.add_argument("--num-requests", type=int, default=None, metavar="N",
                   help=f"synthetic requests (default {DEFAULT_NUM_REQUESTS}); with --trace, same as --sample")
    w.add_argument("--qps", type=float, default=None,
                   help=f"arrival rate, req/s (synthetic default {DEFAULT_QPS}); with --trace it replaces "
                        "the trace's arrival times with --arrival")
    w.add_argument("--arrival", default=None, choices=[a for a in ARRIVAL_PROCESSES if a != "offline"],
                   help="arrival process (default: the trace's own times when it has them, else poisson)")
    w.add_argument("--cv", type=float, default=1.0, help="coefficient of variation of gamma inter-arrival gaps")
    w.add_argument("--prompt-len", default=DEFAULT_PROMPT_LEN,
                   help="N | uniform:LO:HI | zipf:THETA:LO:HI | trace:NAME|PATH")
    w.add_argument("--output-len", default=DEFAULT_OUTPUT_LEN,
                   help="N | uniform:LO:HI | zipf:THETA:LO:HI | trace:NAME|PATH")
    w.add_argument("--length-scale", type=float, default=1.0,
                   help="multiply prompt and output lengths (rounded, >= 1); requests that still exceed "
                        "max_model_len are scaled down proportionally to fit")
    w.add_argument("--rate-scale", type=float, default=1.0, help="multiply the arrival rate")
    w.add_argument("--offline", action="store_true", help="all requests at t=0 (throughput)")
    w.add_argument("--seed", type=int, default=0, help="workload seed (lengths, arrivals, sampled rows, prompts)")
    w.add_argument("--prompts-file", type=cli_path, default=None, metavar="PATH",
                   help="real text prompts, one per line (request i sends line i mod the line count), rendered "
                        "with the model's chat template as a user turn when it has one; the model folder needs a "
                        "tokenizer. Requests stop at EOS (at most the workload's output length) and the first "
                        "completion is printed")
    w.add_argument("--shared-prefix-len", type=int, default=0, metavar="N",
                   help="every prompt starts with the same N tokens (a system prompt), then its own prompt length")
    w.add_argument("--multi-turn", type=int, default=1, metavar="K",
                   help="group requests into K-turn conversations: turn i re-sends turns 1..i-1 (prompts and "
                        "replies as long as their outputs) before its own prompt")
    w.add_argument("--temperature", type=float, default=0.0)
    w.add_argument("--structured-share", default=None, metavar="FRACTIONS",
                   help="comma-separated fractions of the requests whose output is constrained to "
                        "--structured-outputs, one run per fraction on the same requests and arrivals (e.g. "
                        "0,0.5,1); the constrained ones are drawn from --seed, a larger fraction's including a "
                        "smaller one's. A constrained request ends when its output is complete or at its output "
                        "length. Real engine only (not --simulate or --endpoint); the model needs a tokenizer")
    w.add_argument("--structured-outputs", default=None, metavar="SPEC",
                   help=f"the constraint of --structured-share: {' or '.join(NAMED_CONSTRAINTS)} (default "
                        f"{DEFAULT_CONSTRAINT}: a nested JSON schema, sarathi_jax/bench/structured.py's SCHEMA), a "
                        "structured-outputs object as JSON text (e.g. '{\"regex\": \"[a-z]+( [a-z]+)*\"}', as "
                        "SamplingParams.structured_outputs takes), or @PATH to a file holding one")

    s = p.add_argument_group("SLOs and capacity")
    s.add_argument("--slo-ttft", type=float, default=None, help="TTFT SLO (s) for goodput")
    s.add_argument("--slo-tbt", type=float, default=None, help="TBT SLO (s), for goodput and capacity")
    s.add_argument("--slo-tbt-multiple", type=float, default=None, metavar="M",
                   help="TBT SLO as M x the measured decode-only iteration time (paper: 5 strict, 25 relaxed)")
    s.add_argument("--decode-probe-batch", type=int, default=8,
                   help="decode batch size for measuring the decode-only iteration time")
    s.add_argument("--decode-probe-context", type=int, default=32, metavar="TOKENS",
                   help="the decode-only probe's prompt length, so its decodes run at about this context (the "
                        "paper's reference: batch 32 at context 4096; capped to fit --max-model-len)")
    s.add_argument("--slo-mix", default=None, metavar="SPEC",
                   help="SLO classes, e.g. 'interactive:0.2:ttft=0.5,tbt=0.05,priority=-1;batch:0.8:ttft=30,tbt=1': "
                        "NAME:SHARE:TARGETS per class (shares add up to 1; each request's class is drawn from "
                        "--seed); ttft and tbt targets in seconds (tbt: every gap between tokens), priority sent "
                        "with the class's requests (see --scheduling-policy). Adds goodput overall and per class")
    s.add_argument("--capacity", action="store_true",
                   help="binary-search the highest QPS with P99 TBT <= SLO and median scheduling delay <= limit "
                        "(or, with --capacity-goodput, with enough requests meeting their SLO)")
    s.add_argument("--capacity-goodput", default=None, metavar="FRACTION[:CLASS]",
                   help="capacity: pass a rate when at least FRACTION of the requests (of SLO class CLASS, or of "
                        "all) meet their --slo-mix targets, e.g. 0.9 or 0.9:interactive")
    s.add_argument("--max-sched-delay", type=float, default=DEFAULT_MAX_SCHED_DELAY,
                   help="capacity: median scheduling delay limit (s)")
    s.add_argument("--capacity-probes", type=int, default=8, help="capacity: most runs per configuration")
    s.add_argument("--capacity-tol", type=float, default=0.05, help="capacity: relative tolerance")
    s.add_argument("--capacity-start-qps", type=float, default=None,
                   help="capacity: first rate probed (default: the workload's rate)")
    s.add_argument("--stall-factor", type=float, default=DEFAULT_STALL_FACTOR,
                   help="a stall is a TBT above this many times the run's median TBT")

    o = p.add_argument_group("output")
    o.add_argument("--out", type=cli_path, default=None, metavar="DIR",
                   help="write JSON and CSV per run, summary.csv/json and PNG plots here")
    o.add_argument("--no-plots", action="store_true", help="skip the PNGs")
    o.add_argument("--quiet", action="store_true", help="no progress bars or progress lines")
    p.set_defaults(argv=None)  # `main`'s argv as given (summary.json records it); None: sys.argv
    return p


def check_args(args: argparse.Namespace) -> None:
    """Option combinations that cannot work, refused before anything is built."""
    if args.slo_tbt is not None and args.slo_tbt_multiple is not None:
        raise BenchError("give either --slo-tbt or --slo-tbt-multiple, not both")
    mix = slo_mix_of(args)
    goodput_target_of(args, mix)
    if args.capacity_goodput is not None and not args.capacity:
        raise BenchError("--capacity-goodput is the criterion of --capacity: add --capacity")
    if args.capacity_goodput is not None and (args.slo_tbt is not None or args.slo_tbt_multiple is not None):
        raise BenchError("--capacity searches on goodput (--capacity-goodput) or on a TBT SLO, not both")
    if args.capacity and args.capacity_goodput is None and args.slo_tbt is None and args.slo_tbt_multiple is None:
        raise BenchError("--capacity needs a TBT SLO: --slo-tbt SECONDS or --slo-tbt-multiple M (5 strict, 25 relaxed), "
                         "or a goodput target: --capacity-goodput FRACTION with --slo-mix")
    if args.decode_probe_batch < 1 or args.decode_probe_context < 1:
        raise BenchError(f"--decode-probe-batch and --decode-probe-context must be >= 1, got "
                         f"{args.decode_probe_batch} and {args.decode_probe_context}")
    if args.devices is not None and not args.simulate:
        raise BenchError("--devices is simulator-only so far: add --simulate")
    if args.disaggregation is not None and args.endpoint:
        raise BenchError("--disaggregation builds the engines here: not with --endpoint (serve it with "
                         "`python -m server --disaggregation P:D` instead)")
    if args.devices is not None and (args.devices < 1 or ENGINE_FLAGS.given(args).get("tensor_parallel_size")):
        raise BenchError("--devices N (N >= 1) sets the colocated runs' tensor_parallel_size: not both")
    if not 0.0 <= args.tp_serial_fraction <= 1.0:
        raise BenchError(f"--tp-serial-fraction must be in [0, 1], got {args.tp_serial_fraction}")
    kv_link_of(args)
    splits_of(args)
    if args.cost_model and not args.simulate:
        raise BenchError("--cost-model is for the simulator: add --simulate")
    shares = structured_shares_of(args)
    if args.structured_outputs is not None and shares is None:
        raise BenchError("--structured-outputs is the constraint of --structured-share: add --structured-share")
    if shares is not None:
        constraint_of(args)
    if shares is not None and max(shares) > 0 and (args.simulate or args.endpoint):
        raise BenchError("--structured-share constrains requests on the real engine only: the simulator has no "
                         "tokenizer to compile a constraint with (nor a model of the mask's cost), and --endpoint "
                         "does not send constraints")
    if args.prompts_file and (args.simulate or args.endpoint or args.capacity):
        raise BenchError("--prompts-file runs text prompts on the real engine: not with --simulate, --endpoint "
                         "or --capacity")


def kv_link_of(args: argparse.Namespace) -> KVLink:
    try:
        return parse_kv_link(args.kv_link)
    except ValueError as e:
        raise BenchError(f"--kv-link: {e}") from None


def splits_of(args: argparse.Namespace) -> list[str]:
    """The --disaggregation splits, each checked against --devices (the model's heads are checked when built)."""
    if args.disaggregation is None:
        return []
    splits = _csv_list(args.disaggregation, str, "--disaggregation")
    for text in splits:
        try:
            split = DisaggregationSplit.parse(text)
        except ValueError as e:
            raise BenchError(f"--disaggregation: {e}") from None
        if args.devices is not None and split.num_devices > args.devices:
            raise BenchError(f"--disaggregation {text} needs {split.num_devices} devices, but --devices is "
                             f"{args.devices}")
    return splits


def slo_mix_of(args: argparse.Namespace) -> SloMix | None:
    try:
        return None if args.slo_mix is None else parse_slo_mix(args.slo_mix)
    except ValueError as e:
        raise BenchError(str(e)) from None


def structured_shares_of(args: argparse.Namespace) -> list[float] | None:
    try:
        return None if args.structured_share is None else parse_shares(args.structured_share)
    except ValueError as e:
        raise BenchError(str(e)) from None


def constraint_of(args: argparse.Namespace) -> StructuredOutputs:
    try:
        return parse_constraint(args.structured_outputs or DEFAULT_CONSTRAINT)
    except ValueError as e:
        raise BenchError(str(e)) from None


def goodput_target_of(args: argparse.Namespace, mix: SloMix | None) -> GoodputTarget | None:
    try:
        return None if args.capacity_goodput is None else parse_goodput_target(args.capacity_goodput, mix)
    except ValueError as e:
        raise BenchError(f"--capacity-goodput: {e}" if not str(e).startswith("--") else str(e)) from None


def default_model(platform: str) -> str:
    """The bench's model when --model is not given, for `jax.default_backend()`'s platform."""
    return ACCELERATOR_DEFAULT_MODEL if platform in ACCELERATOR_PLATFORMS else CPU_DEFAULT_MODEL


def run_configs(args: argparse.Namespace) -> list[dict]:
    schedulers = _csv_list(args.scheduler, str, "--scheduler")
    budgets = _csv_list(args.token_budget, token_budget_arg, "--token-budget")
    fixed = [b for b in budgets if isinstance(b, int)]
    for s_ in schedulers:
        if s_ not in SCHEDULER_POLICIES:
            raise BenchError(f"--scheduler: unknown policy {s_!r}; choose from {', '.join(SCHEDULER_POLICIES)}")
    caching = _csv_list(args.prefix_caching, str, "--prefix-caching")
    if any(c not in ("off", "on") for c in caching):
        raise BenchError(f"--prefix-caching: expected off, on or off,on, got {args.prefix_caching!r}")
    shares = structured_shares_of(args)
    configs = []
    for s_ in dict.fromkeys(schedulers):
        runs = ([(f"{s_}-{b}", b) for b in dict.fromkeys(budgets)] if s_ in TOKEN_BUDGET_POLICIES
                else [(s_, max(fixed, default=DEFAULT_TOKEN_BUDGET))])
        for label, b in runs:
            for c in dict.fromkeys(caching):
                config = {"label": label + ("+prefix" if c == "on" else ""), "scheduler": s_, "token_budget": b,
                          "prefix_caching": c == "on"}
                if shares is None:
                    configs.append(config)
                # One engine serves every share of a configuration (`runs.run_all` reuses it).
                configs += [{**config, "label": config["label"] + share_label(f), "structured_share": f}
                            for f in shares or ()]
    # Disaggregated runs after the colocated ones, each policy's prefill side as the policy batches it.
    return configs + [{**c, "label": f"{c['label']}+pd{split}", "disaggregation": split}
                      for split in splits_of(args) for c in configs]


def engine_config_kwargs(args: argparse.Namespace, cfg: dict) -> dict:
    """EngineConfig keywords for one run: its scheduler, token budget and prefix caching (`run_configs`), and
    the engine flags given (a 0 for --max-num-seqs or --max-model-len: the engine's default)."""
    kw = {"model": args.model, "scheduler": cfg["scheduler"], "token_budget": cfg["token_budget"],
          "enable_prefix_caching": cfg.get("prefix_caching", False)}
    for name in ("max_num_seqs", "max_model_len"):
        if getattr(args, name):
            kw[name] = getattr(args, name)
    kw.update(ENGINE_FLAGS.given(args))
    if cfg.get("disaggregation"):
        kw["disaggregation"] = cfg["disaggregation"]
    elif args.devices is not None:
        kw["tensor_parallel_size"] = args.devices
    return kw
