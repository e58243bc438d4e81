"""Constrained requests in the bench's workload: --structured-share and --structured-outputs.

`--structured-share 0,0.5,1`: the fraction of requests whose output is constrained, one run per fraction on the
same requests and arrivals (swept like --scheduler). The constrained requests of fraction f are the first
round(f * n) of a permutation of the requests drawn from the workload seed (a stream of its own: the
workload's other draws do not change), so every fraction's constrained requests include a smaller one's.
`--structured-outputs SPEC`: their constraint, `schema` (the default: `SCHEMA` here, a
nested JSON schema with nested objects, arrays with min/max items, enums, bounded numbers, patterns and
optional keys), `json_object`, a structured-outputs object as JSON text (what `SamplingParams.structured_outputs`
takes, e.g. '{"regex": "[a-z]+( [a-z]+)*"}') or `@PATH`, a file holding one.

A constrained request ends when its output is complete (finish "stop") or at its output length ("length"), so
it may produce fewer tokens than the same request unconstrained: out tok/s counts the tokens produced. Real
engine only: the simulator has no tokenizer to compile a constraint with (nor a model of the mask's cost), and
--endpoint does not send constraints. Plain Python.
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from sarathi_jax.bench.metrics import RequestRecord
from sarathi_jax.request.structured_outputs import StructuredOutputs

DEFAULT_CONSTRAINT = "schema"
NAMED_CONSTRAINTS = ("schema", "json_object")

# The default constraint (`schema`); `python -m benchmarks.probes.grammar_cost` times the grammar engines on it.
SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "id": {"type": "integer", "minimum": 0, "maximum": 100000},
        "name": {"type": "string", "pattern": "^[A-Z][a-z]{1,12}$"},
        "status": {"enum": ["active", "inactive", "pending"]},
        "score": {"type": "number", "minimum": 0, "maximum": 1},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 10}, "minItems": 1, "maxItems": 4},
        "address": {
            "type": "object",
            "properties": {"street": {"type": "string"}, "city": {"type": "string"},
                           "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
            "required": ["street", "city"],
        },
        "items": {
            "type": "array", "minItems": 1, "maxItems": 3,
            "items": {"type": "object", "required": ["sku", "qty"],
                      "properties": {"sku": {"type": "string"}, "qty": {"type": "integer", "minimum": 1, "maximum": 99}}},
        },
    },
    "required": ["id", "name", "status", "tags", "address", "items"],
}


def parse_shares(text: str) -> list[float]:
    """The fractions of --structured-share (comma-separated, each in [0, 1], in the order given, repeats
    dropped); ValueError saying what is wrong."""
    items = [x.strip() for x in str(text).split(",") if x.strip()]
    if not items:
        raise ValueError("--structured-share: empty; expected fractions in [0, 1], e.g. 0,0.5,1")
    shares = []
    for item in items:
        try:
            share = float(item)
        except ValueError:
            raise ValueError(f"--structured-share: {item!r} is not a number") from None
        if not 0 <= share <= 1:
            raise ValueError(f"--structured-share: {item} is not a fraction in [0, 1]")
        shares.append(share)
    return list(dict.fromkeys(shares))


def parse_constraint(spec: str) -> StructuredOutputs:
    """The constraint of --structured-outputs SPEC; ValueError with the grammar library's message."""
    spec = str(spec).strip()
    if spec == "schema":
        return StructuredOutputs.parse({"json": SCHEMA})
    if spec == "json_object":
        return StructuredOutputs.parse({"json_object": True})
    text = spec
    if spec.startswith("@"):
        try:
            text = Path(spec[1:]).read_text()
        except OSError as e:
            raise ValueError(f"--structured-outputs {spec}: {e}") from None
    try:
        value = json.loads(text)
    except ValueError:
        raise ValueError(f"--structured-outputs: expected {' or '.join(NAMED_CONSTRAINTS)}, a JSON object such as "
                         f"'{{\"regex\": \"[a-z]+\"}}', or @PATH; got {spec[:80]!r}") from None
    if not isinstance(value, dict):
        raise ValueError(f"--structured-outputs: a JSON object, not {type(value).__name__}")
    try:
        return StructuredOutputs.parse(value)
    except ValueError as e:
        raise ValueError(f"--structured-outputs: {str(e).removeprefix('structured_outputs: ')}") from None


def constrained_rows(num_requests: int, share: float, seed: int) -> np.ndarray:
    """bool [num_requests]: which requests are constrained at this share (see the module docstring)."""
    order = np.random.default_rng([seed, 0x57C7]).permutation(num_requests)
    rows = np.zeros(num_requests, dtype=bool)
    rows[order[: int(round(share * num_requests))]] = True
    return rows


def request_constraints(rows: np.ndarray, constraint: StructuredOutputs) -> list[StructuredOutputs | None]:
    return [constraint if r else None for r in rows]


def share_label(share: float) -> str:
    """The suffix of a run's label: `+constrained50` at 0.5."""
    return f"+constrained{share * 100:g}"


def constrained_summary(records: Sequence[RequestRecord], rows: np.ndarray, share: float) -> dict:
    """The constrained requests of a run: how many, their finish reasons and output tokens (and the others')."""
    ours = [r for r, c in zip(records, rows) if c]
    others = [r for r, c in zip(records, rows) if not c]
    return {
        "share": share,
        "num_constrained": len(ours),
        "finish_reasons": dict(Counter(str(r.finish_reason) for r in ours)),
        "constrained_output_tokens": sum(r.num_output_tokens or 0 for r in ours),
        "unconstrained_output_tokens": sum(r.num_output_tokens or 0 for r in others),
    }


def constrained_cell(summary: dict | None) -> str:
    """The report's cell: `12 (10 stop, 2 length)`; "-" when the run had no --structured-share."""
    if summary is None:
        return "-"
    reasons = ", ".join(f"{n} {reason}" for reason, n in sorted(summary["finish_reasons"].items()))
    return f"{summary['num_constrained']}" + (f" ({reasons})" if reasons else "")
