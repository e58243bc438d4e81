"""Request-length trace files: CSV with `num_prefill_tokens`, `num_decode_tokens` and optionally `arrived_at`.

`load_trace` reads and validates a file and raises `TraceError` (a ValueError) naming the file, the row and the
column of the first problem. Extra columns are ignored.

Two real traces ship with the package (`trace_data/`, with their license and a README): `arxiv` (the
arxiv-summarization lengths, no arrival times) and `conversation` (Azure's conversation trace, with arrival
times). Every function that takes a trace path also takes these names (`trace_file`); a file of the same name
is reached as `./arxiv`.
"""

from __future__ import annotations

import csv
import math
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np

PROMPT_COLUMN = "num_prefill_tokens"
OUTPUT_COLUMN = "num_decode_tokens"
ARRIVAL_COLUMN = "arrived_at"
REQUIRED_COLUMNS = (PROMPT_COLUMN, OUTPUT_COLUMN)

TRACE_DATA_DIR = Path(__file__).resolve().with_name("trace_data")  # package data (pyproject's package-data)
SHIPPED_TRACES = {"arxiv": "arxiv_summarization.csv", "conversation": "splitwise_conv.csv"}


class TraceError(ValueError):
    """A trace file that cannot be used, with the reason (file, row, column, value)."""


@dataclass(frozen=True)
class Trace:
    """Columns of a trace, one entry per row in file order. `arrivals` is None when the file has no arrived_at."""

    path: str
    prompt_lens: np.ndarray  # int64
    output_lens: np.ndarray  # int64
    arrivals: np.ndarray | None  # float64 seconds

    def __len__(self) -> int:
        return len(self.prompt_lens)


def _parse_number(text: str, path: str, row: int, column: str) -> float:
    try:
        value = float(text)
    except (TypeError, ValueError):
        raise TraceError(f"{path}: row {row}, column {column!r}: expected a number, got {text!r}") from None
    if not math.isfinite(value):
        raise TraceError(f"{path}: row {row}, column {column!r}: expected a finite number, got {text!r}")
    return value


def _parse_length(text: str, path: str, row: int, column: str) -> int:
    value = _parse_number(text, path, row, column)
    if value < 0:
        raise TraceError(f"{path}: row {row}, column {column!r}: token count must be >= 0, got {text!r}")
    if value != int(value):
        raise TraceError(f"{path}: row {row}, column {column!r}: token count must be an integer, got {text!r}")
    return int(value)


def trace_file(name_or_path: str | os.PathLike) -> str:
    """The absolute file of a shipped trace's name (`arxiv`, `conversation`), else of the path as given
    (relative to the current directory)."""
    text = os.fspath(name_or_path)
    if text in SHIPPED_TRACES:
        return str(TRACE_DATA_DIR / SHIPPED_TRACES[text])
    if not text:
        raise TraceError(f"empty trace path; give a file or one of {', '.join(SHIPPED_TRACES)}")
    return os.path.abspath(os.path.expanduser(text))


def load_trace(path: str | os.PathLike) -> Trace:
    """Read a trace CSV, or a shipped trace by name (see `trace_file`). Rows are numbered from 2 in messages
    (row 1 is the header), as a spreadsheet shows them.

    Arrival times must be finite and >= 0; rows are kept in file order and sorted by arrival time (stable)
    when the file has them.
    """
    given = os.fspath(path)
    path = trace_file(given)
    if not os.path.exists(path):
        raise TraceError(f"{given}: trace file not found (a CSV path, or a shipped trace: "
                         f"{', '.join(SHIPPED_TRACES)})")
    if os.path.isdir(path):
        raise TraceError(f"{path}: is a directory, expected a CSV trace file")
    with open(path, newline="", encoding="utf-8") as f:
        reader = csv.reader(f)
        try:
            header = next(reader)
        except StopIteration:
            raise TraceError(f"{path}: empty file, expected a CSV header with {', '.join(REQUIRED_COLUMNS)}") from None
        header = [h.strip() for h in header]
        missing = [c for c in REQUIRED_COLUMNS if c not in header]
        if missing:
            raise TraceError(
                f"{path}: missing column(s) {', '.join(repr(c) for c in missing)}; "
                f"found {', '.join(repr(h) for h in header) or 'nothing'}"
            )
        i_prompt = header.index(PROMPT_COLUMN)
        i_output = header.index(OUTPUT_COLUMN)
        i_arrival = header.index(ARRIVAL_COLUMN) if ARRIVAL_COLUMN in header else None
        prompts: list[int] = []
        outputs: list[int] = []
        arrivals: list[float] = []
        for row_no, row in enumerate(reader, start=2):
            if not row or all(not cell.strip() for cell in row):
                continue  # blank line
            if len(row) != len(header):
                raise TraceError(f"{path}: row {row_no}: expected {len(header)} fields, got {len(row)}")
            prompts.append(_parse_length(row[i_prompt].strip(), path, row_no, PROMPT_COLUMN))
            outputs.append(_parse_length(row[i_output].strip(), path, row_no, OUTPUT_COLUMN))
            if i_arrival is not None:
                t = _parse_number(row[i_arrival].strip(), path, row_no, ARRIVAL_COLUMN)
                if t < 0:
                    raise TraceError(f"{path}: row {row_no}, column {ARRIVAL_COLUMN!r}: must be >= 0, got {t}")
                arrivals.append(t)
    if not prompts:
        raise TraceError(f"{path}: no data rows")
    p = np.asarray(prompts, dtype=np.int64)
    o = np.asarray(outputs, dtype=np.int64)
    a = None
    if i_arrival is not None:
        a = np.asarray(arrivals, dtype=np.float64)
        order = np.argsort(a, kind="stable")
        p, o, a = p[order], o[order], a[order]
    return Trace(path=path, prompt_lens=p, output_lens=o, arrivals=a)
