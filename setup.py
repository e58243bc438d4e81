"""Builds the CPU kernels, XLA FFI custom calls, at install time; everything else is in pyproject.toml:
the attention kernel (`pallas_kernels/cpu/ragged_paged_attention.cc`), and in a second library the 
matmul of the layers' projections on packed weights (`pallas_kernels/cpu/panel_matmul.cc`) and the greedy LM head
(`pallas_kernels/cpu/greedy_head.cc`).

They need a C++17 compiler and XLA's FFI headers, which jaxlib ships (`jax.ffi.include_dir()`; the build
environment gets jaxlib from `[build-system] requires`). Both are optional: where one cannot be built the
install goes on, and the engine uses the portable jnp attention (`pallas_kernels.cpu_kernel_status()` says
why) or XLA's dot (`pallas_kernels.cpu_matmul_status()`). They are compiled for the building machine's own CPU
(`-march=native`), since they are built where they run.
"""

import importlib.util
import os
import subprocess
import tempfile

from setuptools import Extension, setup


def _ffi_include_dir() -> str | None:
    spec = importlib.util.find_spec("jaxlib")
    if spec is None or not spec.submodule_search_locations:
        return None
    for root in spec.submodule_search_locations:
        include = os.path.join(root, "include")
        if os.path.exists(os.path.join(include, "xla", "ffi", "api", "ffi.h")):
            return include
    return None


def _accepts(flag: str) -> bool:
    """Whether the C++ compiler takes `flag` (an old or foreign compiler may not know -march=native)."""
    cxx = os.environ.get("CXX", "c++")
    with tempfile.TemporaryDirectory() as d:
        src = os.path.join(d, "t.cc")
        with open(src, "w") as f:
            f.write("int main() { return 0; }\n")
        try:
            return subprocess.run([cxx, flag, "-c", src, "-o", os.path.join(d, "t.o")],
                                  capture_output=True).returncode == 0
        except OSError:
            return False


def _extensions() -> list[Extension]:
    include = _ffi_include_dir()
    if include is None:
        print("sarathi-jax: jaxlib's XLA FFI headers not found; the CPU kernels are not built")
        return []
    flags = ["-std=c++17", "-O3", "-fvisibility=hidden"]
    flags += [f for f in ("-march=native",) if _accepts(f)]
    # A failed build is a warning (optional): the jnp attention or XLA's dot serves instead.
    return [Extension(name, sources=sources, depends=["pallas_kernels/cpu/work_sharing.h"], include_dirs=[include],
                      extra_compile_args=flags, language="c++", optional=True)
            for name, sources in (("pallas_kernels._cpu_attention", ["pallas_kernels/cpu/ragged_paged_attention.cc"]),
                                  ("pallas_kernels._cpu_matmul", ["pallas_kernels/cpu/panel_matmul.cc",
                                                                  "pallas_kernels/cpu/greedy_head.cc"]))]


setup(ext_modules=_extensions())
