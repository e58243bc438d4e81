"""The real KV transfer of a disaggregated engine: a request's prompt blocks, from a prefill
instance's paged KV cache to the blocks a decode instance reserved for it, device to device.

`KVBlockMover(source, target)` between two model runners (one stage each: no pipeline parallelism). A move is
three dispatches, none waited for (`move` returns a `PendingCopy` at once):

1. gather: a jitted function takes the source cache's blocks `[layers, n, block_size, kv_heads, head_dim]`
   (n padded to a power of two, `bucket_for`, with block 0, so nothing compiles per request), on the source's
   devices, sharded over KV heads as the cache is;
2. `jax.device_put` to the target's KV sharding: a device-to-device copy (with tensor parallelism, each target
   device receives its KV heads; a different TP on each side reshards here);
3. scatter: a jitted function writes them into the target cache's reserved blocks (padding ids point past the
   cache and are dropped), donating the cache so it updates in place, and the runner steps on the result.

Both caches are the runners' own: every later step of either side takes the array this returns or read, so the
device orders the copy after the prefill that wrote the blocks and before the decode that reads them. The source
blocks may be freed (and given to another prompt) as soon as `move` returns: a prefill step that writes them
later is dispatched after the gather, on the same devices, and takes the cache array the gather reads as its
donated input; the runtime runs a computation that donates a buffer only after those already reading it (JAX
arrays are immutable: a later dispatch cannot change what an earlier one reads), so the write follows the read
(tests/sarathi_jax/disagg/test_disaggregated_transfer.py, test_source_blocks_reused_right_after_the_move, overwrites
them at once). When the sides' KV head counts differ (KV heads replicated for a larger TP, `parallel.plan`), the
gather repeats or picks heads so the target receives its own layout.

The transfer's time (`PendingCopy.done_at`): a thread of the mover's blocks on the copied blocks (the
device-to-device copy's result, which the scatter reads) and stamps the engine clock when they are ready, so
it measures from the gather's dispatch to the copy's end, including any wait behind device work dispatched
before it (the prefill side's next step, which the overlapped loop dispatched before the hand-off). The stamp
is taken when that thread next holds the GIL: up to `sys.getswitchinterval()` (5 ms) late while the engine
thread runs Python. One thread per mover: its copies finish in dispatch order (the same devices, the same
path), so waiting for them in turn delays no stamp.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec, SingleDeviceSharding

from sarathi_jax.runner.model_runner import ModelRunner
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


@dataclass(frozen=True)
class PendingCopy:
    """A move dispatched and not waited for (`disagg.state.CopyInFlight`): its bytes, when the gather
    was dispatched, and when the copy was seen done (the mover's thread; module docstring)."""

    num_bytes: int
    start: float
    _done: Future[float]

    def done_at(self, *, wait: bool = False) -> float | None:
        return self._done.result() if wait or self._done.done() else None


class KVBlockMover:
    """Copies blocks of `source`'s KV cache into blocks of `target`'s (module docstring). `now`: the engine's
    clock, which stamps a copy's dispatch and its end."""

    def __init__(self, source: ModelRunner, target: ModelRunner, now: Callable[[], float] = time.monotonic) -> None:
        assert len(source.stages) == 1 and len(target.stages) == 1, "one stage per side (no pipeline parallelism)"
        self.source, self.target = source.stages[0], target.stages[0]
        self._now = now
        self._waiter = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kv-copy-wait")
        self.buckets = block_buckets(source.max_blocks_per_seq)
        self.num_traces = 0  # gathers and scatters traced: one each per bucket used, never per request
        src_kv, src_replicated = _sharding(self.source)
        dst_kv, _ = _sharding(self.target)
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
        out = src_kv if src_heads == dst_heads else src_replicated
        self._gather: Callable = jax.jit(gather, out_shardings=None if self.source.mesh is None else (out, out))
        self._scatter: Callable = jax.jit(scatter, donate_argnums=(0,),
                                          out_shardings=None if self.target.mesh is None else (dst_kv, dst_kv))

    def bucket_for(self, num_blocks: int) -> int:
        return next(b for b in self.buckets if b >= num_blocks)

    def move(self, source_blocks: list[int], target_blocks: list[int]) -> PendingCopy:
        """Copy the K/V of `source_blocks` (the source cache) into `target_blocks` (the target's, reserved),
        in order: dispatched, not waited for. The bytes are the bucket's blocks, K and V."""
        n = len(source_blocks)
        assert 0 < n <= len(target_blocks), (n, len(target_blocks))
        bucket = self.bucket_for(n)
        src = np.zeros(bucket, np.int32)
        dst = np.full(bucket, self._pad_dst, np.int32)
        src[:n], dst[:n] = source_blocks, target_blocks[:n]
        start = self._now()
        # The ids go up with the jitted calls, as a step's host arrays do (`Stage.upload`), not by two
        # `jax.device_put`s: behind busy device work each host call can wait for the CPU client's workers (a
        # `device_put` of the ids 40-100 ms behind the transfer test's busy loop; the jitted calls 2-80 ms).
        with jax.transfer_guard_host_to_device("allow"):
            blocks = self._gather(self.source.kv_cache, src)
            moved = jax.device_put(blocks, self._dst_kv)  # device to device
            done = self._waiter.submit(self._wait, moved)
            # The runner's next step takes the updated cache (the runner owns its stages; this is the one other
            # writer of a stage's cache, between its steps).
            self.target.kv_cache = self._scatter(self.target.kv_cache, moved, dst)
        return PendingCopy(sum(x.nbytes for x in moved), start, done)

    def _wait(self, moved: Any) -> float:
        jax.block_until_ready(moved)  # releases the GIL while it waits
        return self._now()

    def warmup(self) -> None:
        """Compile every bucket's gather and scatter (ids all padding: the scatter writes nothing)."""
        for bucket in self.buckets:
            src, dst = np.zeros(bucket, np.int32), np.full(bucket, self._pad_dst, np.int32)
            with jax.transfer_guard_host_to_device("allow"):
                moved = jax.device_put(self._gather(self.source.kv_cache, src), self._dst_kv)
                self.target.kv_cache = self._scatter(self.target.kv_cache, moved, dst)
        jax.block_until_ready(self.target.kv_cache)
