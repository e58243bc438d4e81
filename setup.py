"""Builds the CPU attention kernel (`pallas_kernels/cpu/ragged_paged_attention.cc`, an XLA FFI custom call) at
install time; everything else is in pyproject.toml.

The kernel needs a C++17 compiler and XLA's FFI headers, which jaxlib ships (`jax.ffi.include_dir()`; the
build environment gets jaxlib from `[build-system] requires`). It is optional: where it cannot be built the
install goes on, and the engine uses the portable jnp attention (`pallas_kernels.cpu_kernel_status()` says
why). It is compiled for the building machine's own CPU (`-march=native`), since it is built where it runs.
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
        print("sarathi-jax: jaxlib's XLA FFI headers not found; the CPU attention kernel is not built")
        return []
    flags = ["-std=c++17", "-O3", "-fvisibility=hidden"]
    flags += [f for f in ("-march=native",) if _accepts(f)]
    return [Extension(
        "pallas_kernels._cpu_attention",
        sources=["pallas_kernels/cpu/ragged_paged_attention.cc"],
        include_dirs=[include],
        extra_compile_args=flags,
        language="c++",
        optional=True,  # a failed build is a warning; the jnp path serves instead
    )]


setup(ext_modules=_extensions())
