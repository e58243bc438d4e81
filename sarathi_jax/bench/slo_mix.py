"""SLO classes of the bench's workload (--slo-mix) and the goodput target of a capacity search (--capacity-goodput).

`--slo-mix "interactive:0.2:ttft=0.5,tbt=0.05,priority=-1;batch:0.8:ttft=30,tbt=1"`: classes separated by `;`,
each `NAME:SHARE:TARGETS`. SHARE: the fraction of requests in the class (the shares add up to 1); each request's
class is drawn with these weights from the workload seed. TARGETS, comma-separated `key=value`: `ttft` (seconds
to the first token), `tbt` (seconds between consecutive tokens: a deadline on every token, counted from the one
before it, as the bench's goodput has always meant; not a P99), at least one of them, and optionally `priority`
(an integer: the request priority sent with the class's requests, lower served first when the engine runs with
--scheduling-policy priority; default 0). A request is good when it completes within both of its targets.
The runs send each request with its class's priority and targets (`slo_ttft_s`, `slo_tbt_s`), so the engine
sees them (token_budget "dynamic" keeps iterations within the tightest running slo_tbt_s).
Plain Python.
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from sarathi_jax.bench.metrics import RequestSlo
from sarathi_jax.request.sequence import PRIORITY_MAX, PRIORITY_MIN

_NAME = re.compile(r"^[A-Za-z0-9_.-]+$")
_SHARE_TOLERANCE = 1e-6


@dataclass(frozen=True)
class SloClass:
    name: str
    share: float
    ttft: float | None = None
    tbt: float | None = None
    priority: int = 0


NO_CLASS = SloClass("none", 1.0)  # a request sent without a class: priority 0, no SLO targets


@dataclass(frozen=True)
class SloMix:
    classes: tuple[SloClass, ...]

    def assign(self, num_requests: int, seed: int) -> list[SloClass]:
        """Each request's class, drawn with the shares' weights from `seed` (a stream of its own: the workload's
        other draws do not change)."""
        rng = np.random.default_rng([seed, 0x5105])
        picks = rng.choice(len(self.classes), size=num_requests, p=[c.share for c in self.classes])
        return [self.classes[int(i)] for i in picks]

    def class_named(self, name: str) -> SloClass:
        for c in self.classes:
            if c.name == name:
                return c
        raise ValueError(f"unknown SLO class {name!r}; the mix has {', '.join(c.name for c in self.classes)}")


def request_slos(assigned: Sequence[SloClass]) -> list[RequestSlo]:
    return [RequestSlo(c.name, c.ttft, c.tbt) for c in assigned]


def parse_slo_mix(text: str) -> SloMix:
    """The mix a --slo-mix spec describes; ValueError saying what is wrong."""
    parts = [p.strip() for p in str(text).split(";") if p.strip()]
    if not parts:
        raise ValueError("--slo-mix: empty; expected NAME:SHARE:ttft=S,tbt=S[,priority=N];...")
    classes = [_parse_class(p) for p in parts]
    names = [c.name for c in classes]
    if len(set(names)) != len(names):
        raise ValueError(f"--slo-mix: class names must differ, got {', '.join(names)}")
    total = sum(c.share for c in classes)
    if abs(total - 1.0) > _SHARE_TOLERANCE:
        raise ValueError(f"--slo-mix: the shares add up to {total:g}, not 1")
    return SloMix(tuple(classes))


def _parse_class(spec: str) -> SloClass:
    fields = spec.split(":")
    if len(fields) != 3:
        raise ValueError(f"--slo-mix: {spec!r} is not NAME:SHARE:TARGETS (e.g. interactive:0.2:ttft=0.5,tbt=0.05)")
    name, share_text, targets = (f.strip() for f in fields)
    if not _NAME.match(name):
        raise ValueError(f"--slo-mix: class name {name!r} must be letters, digits, '_', '-' or '.'")
    share = _number(name, "share", share_text)
    if not 0 < share <= 1:
        raise ValueError(f"--slo-mix: class {name}: share must be in (0, 1], got {share_text}")
    values: dict[str, str] = {}
    for item in (t.strip() for t in targets.split(",") if t.strip()):
        key, eq, value = item.partition("=")
        key = key.strip()
        if not eq or key not in ("ttft", "tbt", "priority"):
            raise ValueError(f"--slo-mix: class {name}: {item!r} is not ttft=SECONDS, tbt=SECONDS or priority=N")
        if key in values:
            raise ValueError(f"--slo-mix: class {name}: {key} given twice")
        values[key] = value.strip()
    if "ttft" not in values and "tbt" not in values:
        raise ValueError(f"--slo-mix: class {name}: give a ttft= or tbt= target (or both)")
    slo = {}
    for key in ("ttft", "tbt"):
        if key in values:
            slo[key] = _number(name, key, values[key])
            if not slo[key] > 0 or not math.isfinite(slo[key]):
                raise ValueError(f"--slo-mix: class {name}: {key} must be a positive number of seconds, "
                                 f"got {values[key]}")
    priority = 0
    if "priority" in values:
        try:
            priority = int(values["priority"])
        except ValueError:
            raise ValueError(f"--slo-mix: class {name}: priority must be an integer, got {values['priority']}") from None
        if not PRIORITY_MIN <= priority <= PRIORITY_MAX:
            raise ValueError(f"--slo-mix: class {name}: priority {priority} is outside [{PRIORITY_MIN}, {PRIORITY_MAX}]")
    return SloClass(name, share, slo.get("ttft"), slo.get("tbt"), priority)


def _number(name: str, key: str, text: str) -> float:
    try:
        return float(text)
    except ValueError:
        raise ValueError(f"--slo-mix: class {name}: {key} must be a number, got {text!r}") from None


@dataclass(frozen=True)
class GoodputTarget:
    """A capacity probe passes when at least `fraction` of the requests (of `slo_class`, or of all) meet their
    own SLO targets."""

    fraction: float
    slo_class: str | None = None

    def good_fraction(self, summary: dict) -> float | None:
        classes = summary.get("slo_classes")
        if classes is None:
            return None
        part = classes["overall"] if self.slo_class is None else classes["classes"].get(self.slo_class)
        return None if part is None else part["good_fraction"]

    def met(self, summary: dict) -> bool:
        got = self.good_fraction(summary)
        return got is not None and got >= self.fraction


def parse_goodput_target(text: str, mix: SloMix | None) -> GoodputTarget:
    """--capacity-goodput FRACTION[:CLASS] (e.g. 0.9, or 0.9:interactive); needs a mix to name its classes."""
    if mix is None:
        raise ValueError("--capacity-goodput needs --slo-mix (each request's targets)")
    fraction_text, _, name = str(text).partition(":")
    try:
        fraction = float(fraction_text)
    except ValueError:
        raise ValueError(f"--capacity-goodput: expected FRACTION[:CLASS], got {text!r}") from None
    if not 0 < fraction <= 1:
        raise ValueError(f"--capacity-goodput: the fraction must be in (0, 1], got {fraction_text}")
    name = name.strip() or None
    if name is not None:
        mix.class_named(name)  # ValueError: unknown class
    return GoodputTarget(fraction, name)
