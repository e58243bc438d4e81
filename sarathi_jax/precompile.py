"""Building a `ModelRunner`'s executables ahead of time, the first half of its warm-up.

Owns how many threads compile (`compile_threads`, `$SARATHI_JAX_COMPILE_THREADS`) and `build_executables`:
every bucket's model step (each pipeline stage's) and every sampler variant, loaded from the
`ExecutableCache` when it holds them, else lowered and compiled with `jit(...).lower(...).compile()` and
saved there. The runner keeps what was loaded (through `on_loaded`) and dispatches it instead of the jitted
function; what was compiled lands in JAX's own caches, so the runner's first call finds it.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import jax

from sarathi_jax.executable_cache import ExecutableCache
from sarathi_jax.parallel.stages import Stage
from sarathi_jax.sampling import SAMPLER_VARIANTS, SamplerVariant
from sarathi_jax.step_inputs import PackedStep

COMPILE_THREADS_ENV = "SARATHI_JAX_COMPILE_THREADS"


def compile_threads() -> int:
    """Threads that compile at warm-up: $SARATHI_JAX_COMPILE_THREADS when set, else 1 on up to 4 CPU cores
    (this process's), else half of them, at most 8."""
    env = os.environ.get(COMPILE_THREADS_ENV)
    if env:
        return max(1, int(env))
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        cores = os.cpu_count() or 1
    # XLA:CPU already compiles one program on several threads: on a 2-core CPU two compiles at once were
    # slower (smollm2-135m cold 51.5 s against 31.8 s), so small machines compile one at a time.
    return 1 if cores <= 4 else min(cores // 2, 8)


def stage_devices(stage: Stage) -> list:
    """The devices a stage's executables run on: its mesh's, else those its parameters live on."""
    if stage.mesh is not None:
        return list(stage.mesh.devices.flat)
    return sorted(jax.tree.leaves(stage.params)[0].devices(), key=lambda d: d.id)


def build_executables(
    stages: Sequence[Stage],
    buckets: Sequence[int],
    on_stages: Callable[[int], Iterator[tuple[Stage, PackedStep]]],
    *,
    no_tokens: jax.Array,
    max_num_seqs: int,
    max_blocks_per_seq: int,
    sampler: Any,
    cache: ExecutableCache | None,
    threads: int | None,
    on_loaded: Callable[[Any, Callable], None],
) -> None:
    """Build every bucket's step executables and every sampler variant on `threads` threads (default:
    `compile_threads()`). `on_stages(bucket)` yields each stage with that bucket's all-padding packed inputs
    on its devices; `no_tokens` is stage 0's previous-tokens argument; `sampler` is the jitted sampler (its
    `variant` static). Each executable loaded from `cache` is handed to `on_loaded(entry, executable)`,
    `entry` being (stage index, packed batch rows) for a model step and the `SamplerVariant` for a sampler.
    Nothing runs and the KV cache is not touched. With one thread and no cache (or in a multi-process
    engine) it does nothing: the first run of each compiles it."""
    threads = compile_threads() if threads is None else threads
    if jax.process_count() > 1 or (threads <= 1 and cache is None):
        return
    s, b = max_num_seqs, max_blocks_per_seq

    def build(entry: Any, name: str, closure: Any, jitted: Any, args: tuple, kwargs: dict, devices: list) -> Any:
        """The executable for `jitted(*args, **kwargs)`: loaded (and handed to `on_loaded`) or compiled."""
        key = cache.key(name, closure, args) if cache is not None else None
        exe = cache.load(key, devices) if key is not None else None
        if exe is not None:
            on_loaded(entry, exe)
            return exe
        exe = jitted.lower(*args, **kwargs).compile()
        if key is not None:
            cache.save(key, exe)
        return exe

    def compile_bucket(bucket: int) -> Any:
        """Lower and compile each stage's step for `bucket`; returns the last stage's output (the logits)
        and the uploaded sampling array, as the sampler's lowering arguments."""
        x = on_device = None
        for stage, on_device in on_stages(bucket):
            prev = no_tokens if stage.index == 0 else None
            closure = ("model step", stage.model, stage.index, stage.layer_range, stage.is_last, s, b,
                       stage.mesh, stage.tensor_parallel_size, stage.shard_vocab, stage.kv_sharding)
            args = (stage.params, stage.kv_cache, x, on_device.batch, prev)
            compiled = build((stage.index, on_device.batch.shape[0]), "step", closure, stage.step, args, {},
                             stage_devices(stage))
            out = compiled.out_info[0]
            # The next stage gets these activations placed on its own devices (`Stage.place`).
            nxt = stages[stage.index + 1] if not stage.is_last else None
            if nxt is not None:
                x = jax.ShapeDtypeStruct(out.shape, out.dtype, sharding=nxt.replicated)
            else:  # off a mesh the step's inputs, so its logits, are uncommitted: no sharding to lower with
                x = out if stage.mesh is not None else jax.ShapeDtypeStruct(out.shape, out.dtype)
        return x, on_device.sampling

    def compile_sampler(logits: Any, sampling: jax.Array, variant: SamplerVariant) -> None:
        build(variant, "sampler", ("sampler", variant), sampler, (logits, sampling), {"variant": variant},
              stage_devices(stages[-1]))

    # Longest first: the first bucket (whose logits the sampler variants need), then the sampler
    # variants and the other buckets from the largest down.
    with ThreadPoolExecutor(max_workers=max(1, threads), thread_name_prefix="sarathi-compile") as pool:
        first = pool.submit(compile_bucket, buckets[0])
        others = [pool.submit(compile_bucket, bucket) for bucket in reversed(buckets[1:])]
        logits, sampling = first.result()
        samplers = [pool.submit(compile_sampler, logits, sampling, v) for v in reversed(SAMPLER_VARIANTS)]
        for future in others + samplers:
            future.result()
