"""Benchmark workloads: when each request arrives and how long its prompt and output are.

A `Workload` is three aligned arrays (arrival offsets in seconds from the start of a run, prompt lengths,
output lengths) plus a description for the report. Every random choice takes an explicit seed, so the same
arguments always give the same requests, and every configuration in one comparison sees the same requests.

Length specs (`--prompt-len`, `--output-len`):
  `128`                    fixed
  `uniform:32:256`         uniform integers in [32, 256]
  `zipf:1.2:16:1024`       bounded zipf, P(k) proportional to k**-1.2 over k in [16, 1024]
  `trace:PATH`             values drawn (with replacement) from the matching column of a trace CSV (or a
                           shipped trace's name: `trace:arxiv`, `trace:conversation`)
Arrival processes: `poisson` (exponential gaps), `gamma` (gamma gaps with coefficient of variation `cv`; cv=1 is
Poisson, larger is burstier), `constant` (evenly spaced), `trace` (the trace's `arrived_at`), `offline` (all at 0).
Shared prefixes (prefix caching): `as_conversations` turns the requests into multi-turn conversations, each turn
re-sending the ones before it, and `with_shared_prefix` starts every prompt with the same system prompt; both
keep each request's own lengths and arrival, and describe the prompts' content as `Workload.segments`.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field

import numpy as np

from sarathi_jax.bench.traces import OUTPUT_COLUMN, PROMPT_COLUMN, Trace, load_trace

ARRIVAL_PROCESSES = ("poisson", "gamma", "constant", "trace", "offline")


# ----------------------------------------------------------------------------------------------- lengths


@dataclass(frozen=True)
class LengthSpec:
    kind: str  # fixed | uniform | zipf | trace
    low: int = 0
    high: int = 0
    theta: float = 0.0
    values: tuple[int, ...] = ()  # trace: the column
    text: str = ""

    def sample(self, n: int, rng: np.random.Generator) -> np.ndarray:
        if self.kind == "fixed":
            return np.full(n, self.low, dtype=np.int64)
        if self.kind == "uniform":
            return rng.integers(self.low, self.high + 1, size=n, dtype=np.int64)
        if self.kind == "zipf":
            ks = np.arange(self.low, self.high + 1, dtype=np.float64)
            p = ks ** (-self.theta)
            return rng.choice(ks.astype(np.int64), size=n, p=p / p.sum())
        if self.kind == "trace":
            return np.asarray(self.values, dtype=np.int64)[rng.integers(0, len(self.values), size=n)]
        raise AssertionError(self.kind)


def parse_length_spec(text: str, *, column: str = PROMPT_COLUMN) -> LengthSpec:
    """Parse a length spec (see the module docstring); `column` is the trace column used by `trace:PATH`."""
    s = str(text).strip()

    def ints(parts: list[str]) -> list[int]:
        try:
            vals = [int(x) for x in parts]
        except ValueError:
            raise ValueError(f"bad length spec {s!r}: bounds must be integers") from None
        return vals

    if s.startswith("trace:"):
        trace = load_trace(s[len("trace:"):])
        col = trace.prompt_lens if column == PROMPT_COLUMN else trace.output_lens
        return LengthSpec("trace", values=tuple(int(v) for v in col), text=s)
    parts = s.split(":")
    if len(parts) == 1:
        (n,) = ints(parts)
        if n < 1:
            raise ValueError(f"bad length spec {s!r}: a fixed length must be >= 1")
        return LengthSpec("fixed", low=n, high=n, text=s)
    if parts[0] == "uniform" and len(parts) == 3:
        lo, hi = ints(parts[1:])
        if not 1 <= lo <= hi:
            raise ValueError(f"bad length spec {s!r}: need 1 <= low <= high")
        return LengthSpec("uniform", low=lo, high=hi, text=s)
    if parts[0] == "zipf" and len(parts) == 4:
        try:
            theta = float(parts[1])
        except ValueError:
            raise ValueError(f"bad length spec {s!r}: zipf exponent must be a number") from None
        lo, hi = ints(parts[2:])
        if not (theta > 0 and 1 <= lo <= hi):
            raise ValueError(f"bad length spec {s!r}: need exponent > 0 and 1 <= low <= high")
        return LengthSpec("zipf", low=lo, high=hi, theta=theta, text=s)
    raise ValueError(
        f"bad length spec {s!r}: expected N, uniform:LOW:HIGH, zipf:THETA:LOW:HIGH or trace:PATH"
    )


# ----------------------------------------------------------------------------------------------- arrivals


def arrival_times(process: str, n: int, qps: float, rng: np.random.Generator, cv: float = 1.0) -> np.ndarray:
    """`n` arrival offsets (seconds, the first at 0) at mean rate `qps` requests/s."""
    if process == "offline":
        return np.zeros(n)
    if not (qps > 0 and math.isfinite(qps)):
        raise ValueError(f"qps must be a positive finite number for {process!r} arrivals, got {qps}")
    if process == "poisson":
        gaps = rng.exponential(1.0 / qps, size=max(n - 1, 0))
    elif process == "gamma":
        if not cv > 0:
            raise ValueError(f"gamma arrivals need cv > 0, got {cv}")
        shape = 1.0 / (cv * cv)
        gaps = rng.gamma(shape, 1.0 / (qps * shape), size=max(n - 1, 0))
    elif process == "constant":
        gaps = np.full(max(n - 1, 0), 1.0 / qps)
    else:
        raise ValueError(f"unknown arrival process {process!r}; expected one of {ARRIVAL_PROCESSES}")
    return np.concatenate([[0.0], np.cumsum(gaps)])[:n]


# ----------------------------------------------------------------------------------------------- workload


@dataclass
class Workload:
    arrivals: np.ndarray  # float64 seconds from the start of the run, non-decreasing
    prompt_lens: np.ndarray  # int64 >= 1
    output_lens: np.ndarray  # int64 >= 1
    info: dict = field(default_factory=dict)  # how it was made, for reports
    notes: list[str] = field(default_factory=list)  # clipping and other adjustments, human readable
    # Prompt content: per request, the (key, length) pieces its prompt is made of, in order; pieces with one
    # key are the same tokens in every prompt (a shared prefix). None: every prompt is its own random tokens.
    # A prompt clipped by `fit` keeps its first prompt_len tokens, so shared prefixes stay shared.
    segments: tuple[tuple[tuple[str, int], ...], ...] | None = None

    def __post_init__(self) -> None:
        self.arrivals = np.asarray(self.arrivals, dtype=np.float64)
        self.prompt_lens = np.asarray(self.prompt_lens, dtype=np.int64)
        self.output_lens = np.asarray(self.output_lens, dtype=np.int64)
        if not (len(self.arrivals) == len(self.prompt_lens) == len(self.output_lens)):
            raise ValueError("arrivals, prompt_lens and output_lens must have the same length")

    def __len__(self) -> int:
        return len(self.prompt_lens)

    def _replace(self, **kw) -> Workload:
        info = dict(self.info)
        info.update(kw.pop("info", {}))
        notes = list(self.notes) + kw.pop("notes", [])
        return dataclasses.replace(self, info=info, notes=notes, **kw)

    @property
    def mean_rate(self) -> float:
        """Requests per second over the arrival span; inf when everything arrives at once."""
        span = float(self.arrivals[-1] - self.arrivals[0]) if len(self) else 0.0
        return (len(self) - 1) / span if span > 0 else math.inf

    def scale_rate(self, factor: float) -> Workload:
        """Multiply the arrival rate by `factor` (arrival times divided by it)."""
        if not factor > 0:
            raise ValueError(f"rate scale must be > 0, got {factor}")
        return self._replace(arrivals=self.arrivals / factor, info={"rate_scale": factor})

    def at_rate(self, qps: float) -> Workload:
        """The same arrival pattern stretched or squeezed to mean rate `qps` (used by the capacity search)."""
        rate = self.mean_rate
        if not math.isfinite(rate):
            raise ValueError("an offline workload (all arrivals at 0) has no arrival pattern to rescale")
        return self._replace(arrivals=self.arrivals * (rate / qps), info={"qps": qps})

    def offline(self) -> Workload:
        return self._replace(arrivals=np.zeros(len(self)), info={"arrival": "offline", "qps": None})

    def scale_lengths(self, factor: float) -> Workload:
        """Multiply prompt and output lengths by `factor`, rounded to nearest, clamped to >= 1."""
        if not factor > 0:
            raise ValueError(f"length scale must be > 0, got {factor}")
        if factor == 1:
            return self._replace(info={"length_scale": 1.0})
        p = np.maximum(1, np.rint(self.prompt_lens * factor)).astype(np.int64)
        o = np.maximum(1, np.rint(self.output_lens * factor)).astype(np.int64)
        return self._replace(prompt_lens=p, output_lens=o, info={"length_scale": factor})

    def fit(self, max_model_len: int) -> Workload:
        """Clamp lengths to >= 1 and make every prompt + output fit in `max_model_len`.

        A request that does not fit has both lengths scaled down by the same ratio (keeping its prefill:decode
        ratio): prompt = max(1, min(L - 1, floor(p * L / (p + o)))), output = max(1, min(o, L - prompt)).
        The number of clipped requests goes into `notes` and `info["num_clipped"]`.
        """
        L = int(max_model_len)
        if L < 2:
            raise ValueError(f"max_model_len must be >= 2 to fit a prompt and one output token, got {L}")
        p = np.maximum(1, self.prompt_lens)
        o = np.maximum(1, self.output_lens)
        zeros = int(np.sum((self.prompt_lens < 1) | (self.output_lens < 1)))
        over = p + o > L
        if over.any():
            p2 = np.clip(np.floor(p * L / (p + o)).astype(np.int64), 1, L - 1)
            o2 = np.maximum(1, np.minimum(o, L - p2))
            p = np.where(over, p2, p)
            o = np.where(over, o2, o)
        notes = []
        if zeros:
            notes.append(f"{zeros} request(s) with a zero length raised to 1 token")
        n_over = int(over.sum())
        if n_over:
            notes.append(
                f"{n_over} of {len(self)} request(s) longer than max_model_len={L} scaled down proportionally "
                f"(prompt and output by the same ratio, each >= 1) to fit"
            )
        return self._replace(
            prompt_lens=p, output_lens=o, notes=notes, info={"max_model_len": L, "num_clipped": n_over}
        )

    def prompts(self, vocab_size: int, seed: int = 0) -> list[list[int]]:
        """Random prompt token ids in [0, vocab_size), one list per request, reproducible from `seed`."""
        rng = np.random.default_rng([seed, 0x5EED])
        if self.segments is None:
            return [rng.integers(0, vocab_size, size=int(n)).tolist() for n in self.prompt_lens]
        pieces: dict[str, list[int]] = {}
        prompts = []
        for segs, n in zip(self.segments, self.prompt_lens):
            tokens: list[int] = []
            for key, length in segs:
                if key not in pieces:
                    pieces[key] = rng.integers(0, vocab_size, size=length).tolist()
                tokens += pieces[key]
            prompts.append(tokens[: int(n)])
        return prompts

    def describe(self) -> str:
        if not len(self):
            return "empty workload"
        rate = self.mean_rate
        rate_s = "offline (all at t=0)" if not math.isfinite(rate) else f"{rate:.3g} req/s over {self.arrivals[-1]:.1f} s"
        shared = []
        if self.info.get("multi_turn"):
            shared.append(f"{self.info['multi_turn']}-turn conversations")
        if self.info.get("shared_prefix_len"):
            shared.append(f"a {self.info['shared_prefix_len']}-token shared prefix")
        return (
            f"{len(self)} requests, {self.info.get('source', '?')}, arrivals {self.info.get('arrival', '?')}: {rate_s}; "
            f"prompt mean {self.prompt_lens.mean():.0f} (max {self.prompt_lens.max()}), "
            f"output mean {self.output_lens.mean():.0f} (max {self.output_lens.max()}) tokens"
            + (f"; {', '.join(shared)}" if shared else "")
        )

    def _own_segments(self) -> list[tuple[tuple[str, int], ...]]:
        if self.segments is not None:
            return list(self.segments)
        return [((f"r{j}", int(n)),) for j, n in enumerate(self.prompt_lens)]

    def summary(self) -> dict:
        return {
            **self.info,
            "num_requests": len(self),
            "mean_rate": None if not math.isfinite(self.mean_rate) else self.mean_rate,
            "prompt_len_mean": float(self.prompt_lens.mean()) if len(self) else 0.0,
            "output_len_mean": float(self.output_lens.mean()) if len(self) else 0.0,
            "prompt_len_max": int(self.prompt_lens.max()) if len(self) else 0,
            "output_len_max": int(self.output_lens.max()) if len(self) else 0,
            "notes": list(self.notes),
        }


def synthetic_workload(
    num_requests: int,
    *,
    qps: float | None,
    prompt_len: str | LengthSpec = "128",
    output_len: str | LengthSpec = "64",
    arrival: str = "poisson",
    cv: float = 1.0,
    seed: int = 0,
) -> Workload:
    """`num_requests` requests with lengths from the specs and arrivals from `arrival` at `qps` (None: offline)."""
    if num_requests < 1:
        raise ValueError(f"num_requests must be >= 1, got {num_requests}")
    ps = prompt_len if isinstance(prompt_len, LengthSpec) else parse_length_spec(prompt_len, column=PROMPT_COLUMN)
    os_ = output_len if isinstance(output_len, LengthSpec) else parse_length_spec(output_len, column=OUTPUT_COLUMN)
    rng = np.random.default_rng(seed)
    p = ps.sample(num_requests, rng)
    o = os_.sample(num_requests, rng)
    if qps is None or arrival == "offline":
        arrival, qps = "offline", None
    if arrival == "trace":
        raise ValueError("trace arrivals need --trace with an arrived_at column")
    a = arrival_times(arrival, num_requests, qps if qps is not None else 0.0, np.random.default_rng([seed, 1]), cv)
    info = {
        "source": "synthetic",
        "arrival": arrival,
        "qps": qps,
        "cv": cv if arrival == "gamma" else None,
        "prompt_len": ps.text,
        "output_len": os_.text,
        "seed": seed,
    }
    return Workload(a, p, o, info=info)


def trace_workload(
    trace: Trace | str,
    *,
    sample: int | None = None,
    qps: float | None = None,
    arrival: str | None = None,
    cv: float = 1.0,
    seed: int = 0,
) -> Workload:
    """Requests from a trace's rows (prompt and output lengths paired as in the file).

    sample: use N rows. With arrival times, a contiguous window of N rows at a seeded random offset (keeps the
      trace's own arrival pattern and rate), rebased to start at 0; without them, N distinct random rows.
    arrival: None picks `trace` when the file has arrival times and no `qps` is given, else `poisson`.
      `offline` puts everything at t=0. Synthetic processes need `qps`.
    """
    tr = trace if isinstance(trace, Trace) else load_trace(trace)
    n = len(tr)
    rng = np.random.default_rng(seed)
    if sample is not None:
        if sample < 1:
            raise ValueError(f"sample must be >= 1, got {sample}")
        if sample > n:
            raise ValueError(f"cannot sample {sample} rows from {tr.path}: it has {n}")
        if tr.arrivals is not None:
            start = int(rng.integers(0, n - sample + 1))
            idx = np.arange(start, start + sample)
        else:
            idx = np.sort(rng.choice(n, size=sample, replace=False))
    else:
        idx = np.arange(n)
    if arrival is None:
        arrival = "trace" if (tr.arrivals is not None and qps is None) else ("poisson" if qps is not None else None)
    if arrival is None:
        raise ValueError(f"{tr.path} has no {'arrived_at'!r} column: give a request rate (--qps) or use --offline")
    if arrival == "trace":
        if tr.arrivals is None:
            raise ValueError(f"{tr.path} has no 'arrived_at' column, so it cannot supply arrival times")
        a = tr.arrivals[idx] - tr.arrivals[idx[0]]
        qps = None
    elif arrival == "offline":
        a, qps = np.zeros(len(idx)), None
    else:
        if qps is None:
            raise ValueError(f"{arrival} arrivals need a request rate (--qps)")
        a = arrival_times(arrival, len(idx), qps, np.random.default_rng([seed, 1]), cv)
    info = {
        "source": f"trace {tr.path}",
        "trace": tr.path,
        "trace_rows": n,
        "sample": sample,
        "arrival": arrival,
        "qps": qps,
        "cv": cv if arrival == "gamma" else None,
        "seed": seed,
    }
    return Workload(a, tr.prompt_lens[idx], tr.output_lens[idx], info=info)


def with_shared_prefix(wl: Workload, length: int) -> Workload:
    """Every prompt starts with the same `length` tokens (a system prompt), then its own; prompts grow by it."""
    if length < 0:
        raise ValueError(f"shared prefix length must be >= 0, got {length}")
    if length == 0:
        return wl
    segments = tuple((("system", length),) + segs for segs in wl._own_segments())
    return wl._replace(prompt_lens=wl.prompt_lens + length, segments=segments, info={"shared_prefix_len": length})


def as_conversations(wl: Workload, turns: int) -> Workload:
    """Group the requests into conversations of `turns` turns; a turn's prompt re-sends the earlier turns
    (each one's prompt, then a reply as long as its output) before its own prompt. Request j is turn j // C of
    conversation j % C (C = ceil(n / turns)), so a conversation's turns arrive spread over the run, in order.
    The replies re-sent are made-up tokens (the requests are fixed before the run): a turn finds the earlier
    turns' prompts in the prefix cache, not the K/V of the replies the engine really generated."""
    if turns < 1:
        raise ValueError(f"turns must be >= 1, got {turns}")
    if turns == 1:
        return wl
    own = wl._own_segments()
    n = len(wl)
    convs = -(-n // turns)
    segments, lens = [], []
    for j in range(n):
        c, t = j % convs, j // convs
        segs: tuple[tuple[str, int], ...] = ()
        for i in range(t):  # the earlier turns of conversation c: requests c, c + C, ...
            k = i * convs + c
            segs += own[k] + ((f"reply{k}", int(wl.output_lens[k])),)
        segs += own[j]
        segments.append(segs)
        lens.append(sum(length for _, length in segs))
    return wl._replace(prompt_lens=np.asarray(lens, dtype=np.int64), segments=tuple(segments),
                       info={"multi_turn": turns})
