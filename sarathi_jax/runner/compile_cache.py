"""JAX's persistent compilation cache, on by default, and a record of what compiling cost at start-up.

`enable_compilation_cache(setting)` points JAX's own cache (`jax_compilation_cache_dir`) at a directory:

    "auto"            $SARATHI_JAX_COMPILATION_CACHE when set: a directory, or "0", "off", "false", "no", "none"
                      or "" for no cache; else the directory JAX was already given (JAX_COMPILATION_CACHE_DIR
                      or `jax.config`); else $XDG_CACHE_HOME/sarathi-jax/jax (~/.cache/sarathi-jax/jax).
    a path            that directory.
    None or "off"     no persistent cache (also "0", "false", "no", "none", ""): compiled programs are kept
                      for this process only.

The cache is process-wide (JAX has one): the setting of the last engine built applies to every compile after
it. A second start of the same model and configuration then loads its executables instead of compiling them.
Entries are keyed by the program, the devices, the XLA flags and the jax/jaxlib versions, so one directory
serves several models and machines. JAX trusts what it reads there: do not share it with untrusted users.

`CompileRecorder` counts, while active, the executables JAX built, how many came from the persistent cache,
and the wall time spent tracing, lowering and compiling (from `jax.monitoring` events).
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import jax
from jax import monitoring

from sarathi_jax.utils.paths import absolute_path

ENV_VAR = "SARATHI_JAX_COMPILATION_CACHE"
_OFF_WORDS = ("", "0", "off", "false", "no", "none")

# jax.monitoring event names (jax/_src/dispatch.py, jax/_src/compiler.py). A jitted function's first call
# traces, lowers and compiles (or loads from the persistent cache) inside these spans.
_TRACE_EVENT = "/jax/core/compile/jaxpr_trace_duration"
_LOWER_EVENT = "/jax/core/compile/jaxpr_to_mlir_module_duration"
_COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"  # one per executable, cache hit or not
_CACHE_HIT_EVENT = "/jax/compilation_cache/cache_hits"
# Ours: loading a ready-made executable (sarathi_jax/runner/executable_cache.py), counted as compile time.
EXECUTABLE_LOAD_EVENT = "/sarathi_jax/executable_cache/load_duration"
_SPAN_EVENTS = (_TRACE_EVENT, _LOWER_EVENT, _COMPILE_EVENT, EXECUTABLE_LOAD_EVENT)


def default_cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "sarathi-jax" / "jax"


def resolve_cache_dir(setting: str | None) -> str | None:
    """The directory `setting` names (see the module docstring), or None for no persistent cache."""
    if setting is None or setting.strip().lower() in _OFF_WORDS:
        return None
    # A path is made absolute here, where the setting and the environment variable are read: JAX keeps the
    # string and would otherwise follow later changes of the current directory.
    if setting != "auto":
        return absolute_path(setting)
    env = os.environ.get(ENV_VAR)
    if env is not None:
        return None if env.strip().lower() in _OFF_WORDS else absolute_path(env)
    configured = jax.config.jax_compilation_cache_dir  # the user's own JAX setting wins over our default
    return configured or str(default_cache_dir())


def enable_compilation_cache(setting: str | None = "auto") -> str | None:
    """Point JAX's persistent compilation cache at the directory `setting` names, or turn it off.

    Idempotent: the same directory twice changes nothing. Returns the directory in use, or None.
    """
    from jax.experimental.compilation_cache import compilation_cache as jax_cc

    path = resolve_cache_dir(setting)
    current = jax.config.jax_compilation_cache_dir
    if path is not None:
        Path(path).mkdir(parents=True, exist_ok=True)
        # JAX's defaults skip programs that compile in under a second; on a CPU most buckets do, and together
        # they are the whole start-up.
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
        jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
    if path != current:
        jax.config.update("jax_compilation_cache_dir", path)
        # JAX opens its cache once, at the first compile after a directory is set, and keeps it; a new
        # directory takes effect only after a reset.
        jax_cc.reset_cache()
    return path


# ----------------------------------------------------------------------------------------------- counting


class CompileRecorder:
    """What JAX compiled while this recorder was active (see `record_compiles`).

    executables: executables built, whether compiled or loaded from the persistent cache.
    cache_hits: of those, loaded from the persistent cache.
    """

    def __init__(self) -> None:
        self.executables = 0
        self.cache_hits = 0
        self._spans: list[tuple[float, float]] = []

    def compile_seconds(self, start: float | None = None, end: float | None = None) -> float:
        """Wall time inside tracing, lowering or compiling (nested spans counted once), clipped to
        [start, end] (`time.time()` values)."""
        lo, hi = start if start is not None else float("-inf"), end if end is not None else float("inf")
        total, reach = 0.0, float("-inf")
        for s, e in sorted(self._spans):
            s, e = max(s, lo, reach), min(e, hi)
            if e > s:
                total += e - s
            reach = max(reach, e)
        return total


_active: list[CompileRecorder] = []  # JAX's monitoring listeners are process-wide: they feed these
_lock = threading.Lock()
_listeners_installed = False
# .compiles / .cache_hits: the backend compiles this thread ran, and of those the persistent-cache hits
_this_thread = threading.local()


def _on_event(event: str, **_: object) -> None:
    if event == _CACHE_HIT_EVENT:  # recorded by the thread that compiles, while it compiles
        _this_thread.cache_hits = getattr(_this_thread, "cache_hits", 0) + 1
        for r in tuple(_active):
            r.cache_hits += 1


def _on_span(event: str, start_time: float, end_time: float, **_: object) -> None:
    if event == _COMPILE_EVENT:  # in the compiling thread too
        _this_thread.compiles = getattr(_this_thread, "compiles", 0) + 1
    if event in _SPAN_EVENTS:
        for r in tuple(_active):
            r._spans.append((start_time, end_time))
            if event == _COMPILE_EVENT:
                r.executables += 1


def _install_listeners() -> None:
    global _listeners_installed
    with _lock:
        if not _listeners_installed:
            monitoring.register_event_listener(_on_event)
            monitoring.register_event_time_span_listener(_on_span)
            _listeners_installed = True


def compiles_in_this_thread() -> tuple[int, int]:
    """(backend compiles, of those loaded from JAX's persistent cache) that the calling thread ran since the
    first call of this. A `compile()` that JAX answers from its in-process cache counts in neither."""
    _install_listeners()
    return getattr(_this_thread, "compiles", 0), getattr(_this_thread, "cache_hits", 0)


@contextmanager
def record_compiles() -> Iterator[CompileRecorder]:
    """Count JAX's compiles (in any thread) while the block runs."""
    _install_listeners()
    with _lock:
        recorder = CompileRecorder()
        _active.append(recorder)
    try:
        yield recorder
    finally:
        with _lock:
            _active.remove(recorder)


class PhaseTimer:
    """Wall time per named phase, with the compile time inside each phase moved to one "compile" phase."""

    def __init__(self, recorder: CompileRecorder) -> None:
        self.recorder = recorder
        self.seconds: dict[str, float] = {}
        self._compile = 0.0

    @contextmanager
    def phase(self, name: str) -> Iterator[None]:
        t0 = time.time()
        try:
            yield
        finally:
            t1 = time.time()
            compiling = self.recorder.compile_seconds(t0, t1)
            self.seconds[name] = self.seconds.get(name, 0.0) + (t1 - t0 - compiling)
            self._compile += compiling

    @property
    def compile_seconds(self) -> float:
        return self._compile
