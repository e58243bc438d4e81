"""The real KV transfer of a disaggregated engine (issue 33): a request's prompt blocks, from a prefill
instance's paged KV cache to the blocks a decode instance reserved for it, device to device.

`KVBlockMover(source, target)` between two model runners (one stage each: no pipeline parallelism). A move is
three dispatches; the first two are waited for, to time the transfer (`move` returns its bytes and seconds;
the blocks' prefill has run by then: its sampled token was on the host before the hand-off):

1. gather: a jitted function takes the source cache's blocks `[layers, n, block_size, kv_heads, head_dim]`
   (n padded to a power of two, `bucket_for`, with block 0, so nothing compiles per request), on the source's
   devices, sharded over KV heads as the cache is;
2. `jax.device_put` to the target's KV sharding: a device-to-device copy (with tensor parallelism, each target
   device receives its KV heads; a different TP on each side reshards here);
3. scatter: a jitted function writes them into the target cache's reserved blocks (padding ids point past the
   cache and are dropped), donating the cache so it updates in place, and the runner steps on the result.

Both caches are the runners' own: every later step of either side takes the array this returns or read, so the
device orders the copy after the prefill that wrote the blocks and before the decode that reads them. When the
sides' KV head counts differ (KV heads replicated for a larger TP, `parallel.plan`), the gather repeats or picks
heads so the target receives its own layout.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec, SingleDeviceSharding

from sarathi_jax.model_runner import ModelRunner
from sarathi_jax.parallel.stages import Stage


def _sharding(stage: Stage) -> tuple[Any, Any]:
    """(KV cache sharding, replicated) of a stage: its mesh's, or the default device's."""
    if stage.mesh is None:
        device = SingleDeviceSharding(jax.devices()[0])
        return device, device
    return stage.kv_sharding, NamedSharding(stage.mesh, PartitionSpec())


def block_buckets(max_blocks: int) -> tuple[int, ...]:
    """Powers of two up to the first that holds `max_blocks` (the most blocks one prompt has)."""
    buckets = [1]
    while buckets[-1] < max_blocks:
        buckets.append(buckets[-1] * 2)
    return tuple(buckets)


class KVBlockMover:
    """Copies blocks of `source`'s KV cache into blocks of `target`'s (module docstring)."""

    def __init__(self, source: ModelRunner, target: ModelRunner) -> None:
        assert len(source.stages) == 1 and len(target.stages) == 1, "one stage per side (no pipeline parallelism)"
        self.source, self.target = source.stages[0], target.stages[0]
        self.buckets = block_buckets(source.max_blocks_per_seq)
        self.num_traces = 0  # gathers and scatters traced: one each per bucket used, never per request
        src_kv, self._src_ids = _sharding(self.source)
        dst_kv, self._dst_ids = _sharding(self.target)
        self._dst_kv = dst_kv
        src_heads, dst_heads = self.source.kv_cache[0].shape[3], self.target.kv_cache[0].shape[3]
        self._pad_dst = self.target.kv_cache[0].shape[1]  # an id past the cache: the scatter drops it

        def gather(kv_cache, ids):
            self.num_traces += 1  # Python side effect: once per trace
            k, v = (pages[:, ids] for pages in kv_cache)
            if dst_heads > src_heads:  # the target replicates each KV head (as `parallel.plan` lays it out)
                k, v = (jnp.repeat(x, dst_heads // src_heads, axis=3) for x in (k, v))
            elif src_heads > dst_heads:  # the source replicated them: one copy of each
                k, v = (x[:, :, :, :: src_heads // dst_heads] for x in (k, v))
            return k, v

        def scatter(kv_cache, blocks, ids):
            self.num_traces += 1
            return tuple(pages.at[:, ids].set(new, mode="drop") for pages, new in zip(kv_cache, blocks))

        # The gathered blocks keep the cache's KV-head sharding when the layouts match; else they are gathered
        # replicated on the source (a head count the source's TP may not divide) and resharded by the copy.
        out = src_kv if src_heads == dst_heads else self._src_ids
        self._gather: Callable = jax.jit(gather, out_shardings=None if self.source.mesh is None else (out, out))
        self._scatter: Callable = jax.jit(scatter, donate_argnums=(0,),
                                          out_shardings=None if self.target.mesh is None else (dst_kv, dst_kv))

    def bucket_for(self, num_blocks: int) -> int:
        return next(b for b in self.buckets if b >= num_blocks)

    def move(self, source_blocks: list[int], target_blocks: list[int]) -> tuple[int, float]:
        """Copy the K/V of `source_blocks` (the source cache) into `target_blocks` (the target's, reserved),
        in order. Returns (bytes copied, seconds): the gather and the device-to-device copy are waited for and
        timed (the copy's bytes: the bucket's blocks, K and V); the scatter is dispatched, not waited for."""
        n = len(source_blocks)
        assert 0 < n <= len(target_blocks), (n, len(target_blocks))
        bucket = self.bucket_for(n)
        src = np.zeros(bucket, np.int32)
        dst = np.full(bucket, self._pad_dst, np.int32)
        src[:n], dst[:n] = source_blocks, target_blocks[:n]
        src_ids, dst_ids = jax.device_put(src, self._src_ids), jax.device_put(dst, self._dst_ids)
        start = time.perf_counter()
        blocks = self._gather(self.source.kv_cache, src_ids)
        moved = jax.block_until_ready(jax.device_put(blocks, self._dst_kv))  # device to device
        seconds = time.perf_counter() - start
        # The runner's next step takes the updated cache (the runner owns its stages; this is the one other
        # writer of a stage's cache, between its steps).
        self.target.kv_cache = self._scatter(self.target.kv_cache, moved, dst_ids)
        return sum(x.nbytes for x in moved), seconds

    def warmup(self) -> None:
        """Compile every bucket's gather and scatter (ids all padding: the scatter writes nothing)."""
        for bucket in self.buckets:
            src = jax.device_put(np.zeros(bucket, np.int32), self._src_ids)
            dst = jax.device_put(np.full(bucket, self._pad_dst, np.int32), self._dst_ids)
            moved = jax.device_put(self._gather(self.source.kv_cache, src), self._dst_kv)
            self.target.kv_cache = self._scatter(self.target.kv_cache, moved, dst)
        jax.block_until_ready(self.target.kv_cache)
