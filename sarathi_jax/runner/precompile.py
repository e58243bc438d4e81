"""Building a `ModelRunner`'s executables ahead of time: in the foreground, or on a background thread.

`ExecutableBuilder` builds one executable at a time: a bucket's model step (each pipeline stage's) or a sampler
variant (the LM head and the sampler) for a row count R of the runner's `row_ladder` (a step samples the
smallest R that holds its sequences), loaded from the `ExecutableCache` when it holds it, else lowered and
compiled with
`jit(...).lower(...).compile()` and saved there. Each one goes into the runner's `ExecutableTable`, which
dispatch reads (instead of calling the jitted function) and which says what is ready. It lowers from a
snapshot of the KV cache's shape (the live cache is donated by every step), so it may run while the engine
serves.

`BackgroundBuild` runs a list of such builds on daemon threads after the engine is ready, and stops between
two builds when cancelled (when its runner is collected, or at interpreter exit: waiting for at most the
build in flight). `compile_threads` (`$SARATHI_JAX_COMPILE_THREADS`) says how many threads build.
"""

from __future__ import annotations

import atexit
import logging
import os
import threading
import time
import weakref
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import jax
import jax.numpy as jnp

from sarathi_jax.runner.compile_cache import compiles_in_this_thread
from sarathi_jax.runner.executable_cache import ExecutableCache
from sarathi_jax.parallel.stages import Stage
from sarathi_jax.runner.sample.sampler import FULL_VARIANT, SAMPLER_VARIANTS, SamplerVariant
from sarathi_jax.runner.sample.inputs import general_variant
from sarathi_jax.config.sizing import bucket_for
from sarathi_jax.runner.step_inputs import BatchLayout, PackedStep

COMPILE_THREADS_ENV = "SARATHI_JAX_COMPILE_THREADS"
_log = logging.getLogger(__name__)

# What an executable is for: (stage index, packed batch length) for a model step, or (sampler variant, rows R)
# for the LM head and sampler.
Entry = tuple[int, int] | tuple[SamplerVariant, int]


def is_sampler(entry: Entry) -> bool:
    return isinstance(entry[0], SamplerVariant)


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


def shape_of(tree: Any) -> Any:
    """`tree` as `ShapeDtypeStruct`s, with the sharding of committed leaves: what lowering needs of it, and
    the same description for `ExecutableCache.key` as the arrays themselves."""
    def spec(x: jax.Array) -> jax.ShapeDtypeStruct:
        return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding if x.committed else None)

    return jax.tree.map(spec, tree)


class ExecutableBuilder:
    """Builds the executables of one runner's `stages`.

    `on_stages(bucket)` yields each stage with that bucket's all-padding packed inputs on its devices;
    `no_tokens` is stage 0's previous-tokens argument; `sampler` is the jitted LM head and sampler
    `(hidden, head_weight, sampling)` (its `variant`, `rows` and `head` static; the head and its weight are
    the last stage's, `Stage.lm_head`). Every executable built goes into `table`, and a bucket is marked
    ready there once all its stages and the general sampler (`FULL_VARIANT`) for its `BatchLayout.num_rows`
    are built, so that any batch in a ready bucket can be sampled (`bucket` builds the samplers of its rows
    that it is asked for). Thread-safe: builds may run on several threads at once. Nothing runs and the KV
    cache is not touched.
    """

    def __init__(
        self,
        stages: Sequence[Stage],
        on_stages: Callable[[int], Iterator[tuple[Stage, PackedStep]]],
        *,
        no_tokens: jax.Array,
        max_num_seqs: int,
        max_blocks_per_seq: int,
        sampler: Any,
        cache: ExecutableCache | None,
        table: ExecutableTable,
        bitmask_width: int,
    ) -> None:
        self._stages = list(stages)
        self._on_stages = on_stages
        self._no_tokens = no_tokens
        self._s, self._b = max_num_seqs, max_blocks_per_seq
        self._sampler = sampler
        self._cache = cache
        self._table = table
        self._kv_shapes = [shape_of(stage.kv_cache) for stage in self._stages]  # taken now: later donated
        self._head = self._stages[-1].lm_head()
        # (final-normed rows [S, embed], head weight, packed sampling): the sampler's arguments, the same for
        # every row count and bucket; taken from the first bucket built.
        self._sampler_args: tuple | None = None
        self._bitmask_width = bitmask_width  # a constrained sampler's token bitmask: [max_num_seqs, this] int32

    def _build(self, entry: Entry, name: str, closure: Any, jitted: Any, args: tuple, kwargs: dict,
               devices: list, load_only: bool) -> Any:
        """The executable for `entry`: loaded, else compiled (None instead with `load_only`)."""
        cache = self._cache
        key = cache.key(name, closure, args) if cache is not None else None
        exe = cache.load(key, devices) if key is not None else None
        loaded = exe is not None
        if not loaded:
            if load_only:
                return None
            compiles, hits = compiles_in_this_thread()
            exe = jitted.lower(*args, **kwargs).compile()
            # XLA:CPU cannot serialize an executable that JAX loaded from its persistent cache: the copy
            # loads, then fails with "Function ... not found" when run. Only fresh compiles are saved: not a
            # persistent-cache hit, nor a program JAX handed back from its in-process cache (a second engine
            # in the process), which may be such a load.
            now_compiles, now_hits = compiles_in_this_thread()
            if key is not None and now_compiles > compiles and now_hits == hits:
                cache.save(key, exe)
        self._table.add(entry, exe, loaded)
        return exe

    def bucket(self, bucket: int, variants: Sequence[SamplerVariant] = (FULL_VARIANT,), load_only: bool = False) -> bool:
        """Every stage's model step for `bucket`, the first stage first (each lowers with the previous one's
        output), then the samplers of `variants` (FULL_VARIANT among them) for its `BatchLayout.num_rows` that
        are not built yet. With `load_only`, only what the executable cache holds; False when that was not all."""
        assert FULL_VARIANT in variants, "a ready bucket needs the general sampler"
        x = on_device = None
        for stage, on_device in self._on_stages(bucket):
            prev = self._no_tokens if stage.index == 0 else None
            closure = ("model step", stage.model, stage.index, stage.layer_range, stage.is_last, self._s, self._b,
                       stage.mesh, stage.tensor_parallel_size, stage.shard_vocab, stage.kv_sharding)
            args = (stage.params, self._kv_shapes[stage.index], x, on_device.batch, prev)
            compiled = self._build((stage.index, on_device.batch.shape[0]), "step", closure, stage.step, args, {},
                                   stage_devices(stage), load_only)
            if compiled is None:
                return False
            out = compiled.out_info[0]
            # The next stage gets these activations placed on its own devices (`Stage.place`).
            nxt = self._stages[stage.index + 1] if not stage.is_last else None
            if nxt is not None:
                x = jax.ShapeDtypeStruct(out.shape, out.dtype, sharding=nxt.replicated)
            else:  # off a mesh the step's inputs, so its output, are uncommitted: no sharding to lower with
                x = out if stage.mesh is not None else jax.ShapeDtypeStruct(out.shape, out.dtype)
        rows = BatchLayout.of_packed(on_device.batch.shape[0], self._s, self._b).num_rows
        if self._sampler_args is None:
            self._sampler_args = (x, self._stages[-1].lm_head_weight, on_device.sampling)
        for variant in variants:
            if (variant, rows) not in self._table.executables and not self.sampler(variant, rows, load_only):
                return False
        self._table.bucket_ready(bucket)
        return True

    def sampler(self, variant: SamplerVariant, rows: int, load_only: bool = False) -> bool:
        """The LM head and sampler for `variant` on `rows` rows, after a `bucket` (whose last stage's output it
        lowers with). With `load_only`, only if the executable cache holds it; False when it did not."""
        assert self._sampler_args is not None, "build a bucket first"
        static = {"variant": variant, "rows": rows, "head": self._head}
        args = self._sampler_args
        if variant.constrained:  # laid out as the packed sampling part is (replicated on a mesh)
            sampling = args[2]
            sharding = sampling.sharding if getattr(sampling, "committed", False) else None
            args += (jax.ShapeDtypeStruct((self._s, self._bitmask_width), jnp.int32, sharding=sharding),)
        return self._build((variant, rows), "lm head and sampler", ("sampler", variant, rows, self._head),
                           self._sampler, args, static, stage_devices(self._stages[-1]), load_only) is not None


def run_builds(builds: Sequence[Callable[[], Any]], threads: int) -> None:
    """Run `builds` on `threads` threads (XLA compiles release the GIL) and wait for all of them."""
    if threads <= 1:
        for build in builds:
            build()
        return
    with ThreadPoolExecutor(max_workers=threads, thread_name_prefix="sarathi-compile") as pool:
        for future in [pool.submit(build) for build in builds]:
            future.result()


class BackgroundBuild:
    """Runs `builds` (in order, on `threads` daemon threads) until done or cancelled.

    `cancel()` stops it between two builds (an XLA compile in flight cannot be interrupted); it is called
    when `owner` is collected; `stop()`, also run at interpreter exit, cancels and waits for the builds in
    flight. A failed build is kept in `error` (and re-raised by `wait`); the others go on. `seconds` is the
    time from `start` to the last build's end.
    """

    def __init__(self, builds: Sequence[Callable[[], Any]], threads: int, owner: Any) -> None:
        self._builds = list(builds)
        self._next = 0
        self._lock = threading.Lock()
        self._cancelled = threading.Event()
        self._finished = threading.Event()
        self._running = 0
        self._threads = [threading.Thread(target=self._work, name=f"sarathi-compile-{i}", daemon=True)
                         for i in range(min(max(1, threads), len(self._builds)))]
        self.error: BaseException | None = None
        self.seconds: float | None = None
        self._start = 0.0
        weakref.finalize(owner, self.cancel)
        atexit.register(self.stop)

    @property
    def num_builds(self) -> int:
        return len(self._builds)

    @property
    def done(self) -> bool:
        """Every build ran (or the build was cancelled and the ones in flight ended)."""
        return self._finished.is_set()

    def start(self) -> BackgroundBuild:
        self._start = time.monotonic()
        self._running = len(self._threads)
        if not self._threads:
            self._finish()
        for thread in self._threads:
            thread.start()
        return self

    def cancel(self) -> None:
        self._cancelled.set()

    @property
    def cancelled(self) -> bool:
        return self._cancelled.is_set()

    def wait(self, timeout: float | None = None) -> bool:
        """Block until done (True) or `timeout` seconds passed (False); re-raise a failed build's error."""
        finished = self._finished.wait(timeout)
        if self.error is not None:
            raise RuntimeError("building an executable in the background failed") from self.error
        return finished

    def _work(self) -> None:
        while not self._cancelled.is_set():
            with self._lock:
                if self._next >= len(self._builds):
                    break
                build = self._builds[self._next]
                self._next += 1
            try:
                build()
            except BaseException as e:  # noqa: BLE001 -- kept for `wait`; serving goes on with what is built
                _log.exception("building an executable in the background failed; serving goes on without it")
                self.error = self.error or e
        with self._lock:
            self._running -= 1
            last = self._running == 0
        if last:
            self._finish()

    def _finish(self) -> None:
        self.seconds = time.monotonic() - self._start
        self._finished.set()
        atexit.unregister(self.stop)

    def stop(self) -> None:
        """Cancel, then wait for the builds in flight to end (at exit: none is left inside XLA)."""
        self.cancel()
        for thread in self._threads:
            if thread.is_alive():
                thread.join()


def on_stages(stages: Sequence[Stage], packed: PackedStep) -> Iterator[tuple[Stage, PackedStep]]:
    """Each stage with the step's packed inputs for its devices: the first stage's upload (`Stage.upload`:
    on one device the host arrays themselves, copied by the jitted call; on a mesh one `device_put` of both);
    later stages get device-to-device copies."""
    on_device = None
    for stage in stages:
        on_device = PackedStep(*(stage.upload(tuple(packed)) if on_device is None else stage.place(tuple(on_device))))
        yield stage, on_device


class ExecutableTable:
    """The executables a runner dispatches and what is ready to run, filled by `ExecutableBuilder` (maybe on
    background threads; the fields dispatch reads are replaced, never mutated, so reading needs no lock).

    `buckets`: the ready buckets, ascending (a batch is padded to the smallest that holds it). `variants`:
    the ready samplers, (variant, rows); None means any (the jitted sampler compiles one on first use).
    What dispatch looks up per step is resolved here whenever those change, not per step: `bucket_of[n]`,
    the smallest ready bucket that holds n tokens (None: none does), and `samplers[variant, rows,
    bucket_rows]`, the (variant, rows) that `sampler_for` picks on the runner's row `ladder`.
    `stage_traces` and `sampler_builds` count compilations for `ModelRunner.num_compilations`.
    """

    def __init__(self, buckets: Sequence[int], num_stages: int, ladder: Sequence[int]) -> None:
        self.executables: dict[Entry, Callable] = {}
        self.buckets: tuple[int, ...] = tuple(buckets)
        self.variants: frozenset[tuple[SamplerVariant, int]] | None = None
        self.ladder = tuple(ladder)
        self._max_tokens = max(buckets)
        self.stage_traces = [0] * num_stages
        self.sampler_builds = 0
        self.lock = threading.Lock()
        self._resolve()

    def traced(self, stage_index: int) -> None:
        with self.lock:
            self.stage_traces[stage_index] += 1

    def add(self, entry: Entry, executable: Callable, loaded: bool) -> None:
        """Use `executable` for `entry` from now on; a sampler is then ready. A loaded model step counts as a
        compilation (a compiled one was counted when it was traced)."""
        with self.lock:
            self.executables = {**self.executables, entry: executable}
            if is_sampler(entry):
                self.sampler_builds += 1
                if self.variants is not None:
                    self.variants = self.variants | {entry}
                    self._resolve()
            elif loaded:
                self.stage_traces[entry[0]] += 1

    def bucket_ready(self, bucket: int) -> None:
        with self.lock:
            self.buckets = tuple(sorted({*self.buckets, bucket}))
            self._resolve()

    def sampler_for(self, variant: SamplerVariant, rows: int, bucket_rows: int) -> tuple[SamplerVariant, int]:
        """The (variant, rows) a step runs, from `rows` (the `ladder` value that holds its sequences) up to its
        bucket's `bucket_rows`: the first built with `variant`, else with FULL_VARIANT (the same tokens, and
        logprobs where asked for), which a ready bucket has for its `bucket_rows`. A constrained variant goes
        up to the ladder's top (the sampler may run more rows than the bucket has: the rest are padding),
        where warm-up builds it, falling back on FULL_CONSTRAINED (compiled on first use if not built yet)."""
        ready, ladder = self.variants, self.ladder
        if ready is None:  # not warmed up: the jitted sampler compiles what is asked for
            return variant, rows
        general = general_variant(variant)
        for r in ladder[ladder.index(rows):]:
            if (variant, r) in ready:
                return variant, r
            if (general, r) in ready or (r >= bucket_rows and not variant.constrained):
                return general, r
        if variant.constrained:
            return general, ladder[-1]
        raise AssertionError(f"{rows} rows are past the row ladder {ladder}")

    def only(self, buckets: Sequence[int], variants: Sequence[tuple[SamplerVariant, int]]) -> None:
        """From now on run only these (until more are added)."""
        with self.lock:
            self.buckets = tuple(sorted(buckets))
            self.variants = frozenset(variants)
            self._resolve()

    def _resolve(self) -> None:
        """`bucket_of` and `samplers` for what is ready now (under the lock, or before any thread runs)."""
        buckets = self.buckets
        self.bucket_of = tuple(bucket_for(buckets, n) for n in range(self._max_tokens + 1))
        ladder = self.ladder
        self.samplers = {(v, r, top): self.sampler_for(v, r, top)
                         for v in SAMPLER_VARIANTS for top in ladder for r in ladder if r <= top}
