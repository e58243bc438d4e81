"""`lazy_exports`: a package's exported names resolve to their modules' objects on first use, and importing
the light packages does not load JAX."""

from __future__ import annotations

import subprocess
import sys

import pytest

from sarathi_jax.utils.lazy_exports import lazy_exports


def test_names_resolve_to_their_modules_objects():
    import json

    getattr_, dir_ = lazy_exports("json", {"dumps": "json", "JSONDecoder": "json.decoder"})
    assert getattr_("dumps") is json.dumps
    assert getattr_("JSONDecoder") is json.decoder.JSONDecoder
    assert {"dumps", "JSONDecoder", "loads"} <= set(dir_())  # the exports and the module's own names
    with pytest.raises(AttributeError, match="module 'json' has no attribute 'nope'"):
        getattr_("nope")


def test_importing_the_packages_does_not_load_jax():
    code = ("import sys, sarathi_jax, server, sarathi_jax.request.sampling_params; "
            "assert 'jax' not in sys.modules, sorted(m for m in sys.modules if m.startswith('jax'))[:3]; "
            "from sarathi_jax import SamplingParams; assert SamplingParams.__module__ == 'sarathi_jax.request.sampling_params'")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
