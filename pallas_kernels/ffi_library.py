"""Loading a CPU kernel's shared library (built by setup.py), registering its XLA FFI target and checking it with
one tiny first call: the one loader of `ragged_paged_attention_cpu`, `panel_matmul_cpu` and `greedy_head_cpu`."""

from __future__ import annotations

import ctypes
import importlib.util
from collections.abc import Callable

import jax


def load_ffi_library(module: str, target: str, symbol: str, what: str) -> tuple[ctypes.CDLL | None, str]:
    """(the library of extension `module`, its path) with FFI handler `symbol` registered as `target` on the CPU,
    or (None, why not). `what` names the kernel in the reasons."""
    try:
        spec = importlib.util.find_spec(module)
    except ImportError as e:  # pragma: no cover - a broken package
        return None, f"{module}: {e}"
    if spec is None or not spec.origin:
        return None, (f"the {what} was not built ({module} is missing): reinstall with a C++17 compiler, "
                      "`pip install -e .`, and read the build log")
    try:
        lib = ctypes.CDLL(spec.origin)
        jax.ffi.register_ffi_target(target, jax.ffi.pycapsule(getattr(lib, symbol)), platform="cpu")
    except (OSError, AttributeError, RuntimeError, ValueError) as e:
        return None, f"the {what} at {spec.origin} could not be loaded: {e}"
    return lib, spec.origin


def first_call_status(what: str, call: Callable[[], bool]) -> str | None:
    """None when `call()`, one tiny call of a kernel that says whether its result is right, returns True; else why
    the kernel is not usable here (a library built against another jaxlib's FFI, or for another CPU, fails here
    rather than in the engine's first step). Run on the CPU and eagerly, even when first asked inside a trace (a
    jitted caller's first call). `what` names the kernel in the reasons."""
    try:
        with jax.ensure_compile_time_eval(), jax.default_device(jax.devices("cpu")[0]):
            ok = bool(call())
    except Exception as e:  # noqa: BLE001 - any failure of the library means "not usable here"
        return f"the {what} failed its first call: {type(e).__name__}: {e}"
    return None if ok else f"the {what} computed a wrong result on its first call"
