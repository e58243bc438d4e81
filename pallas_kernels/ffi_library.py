"""Loading a CPU kernel's shared library (built by setup.py) and registering its XLA FFI target: the one loader of
`ragged_paged_attention_cpu`, `panel_matmul_cpu` and `greedy_head_cpu`."""

from __future__ import annotations

import ctypes
import importlib.util

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
