"""The real disaggregated engine (partial: docs/design/disaggregation.md): `EngineConfig.disaggregation = "P:D"` on real devices.

The first P devices run prefill instances, the next D decode instances (`config.disaggregation`: "P:D" is one
instance per side, tensor parallel over its devices; "P/TP:D/TP" several). Each instance is an `LLMEngine`'s
parts on its own devices: its weights, model runner and KV cache (tensor parallel over its mesh, the
`parallel` path), scheduler and block manager, driven by its own `EngineCore`. The request flow (queue,
prefill with max_tokens 1, hand-off, back-pressure, landing, aborts) is sarathi_jax/disagg/flow.py,
the one copy the simulator shares; the K/V moves device to device (`disagg.kv_transfer.KVBlockMover`).

`step()` on the wall clock: the transfers whose copy is done by now are recorded, new requests enter the
prefill cores (unless a finished prefill waits for decode room), each busy prefill instance runs one iteration,
finished prompts move at once (the gather, the copy and the scatter dispatched, none waited for: the devices
order them after the prefill that wrote the blocks and before the decode side's next step, and the prefill
blocks are free at once, `disagg.kv_transfer`), each busy decode instance runs one iteration (a request it
preempts goes back to a prefill instance as a recompute), and what that freed lets held prompts move. Both
sides run the configured loop (overlapped by default); one thread drives them in turn, so the two sides'
device work and the copies overlap as far as the dispatches run ahead. A transfer's record (its time: the
gather's dispatch to the copy seen done) comes when a thread of its mover has seen the copy done; the engine has
unfinished work until every record is in.

The decode side owns the text: the prefill core has no tokenizer, and the hand-off detokenizes the token it
sampled (a stop string inside it ends the request there). Structured outputs: one grammar matcher per request,
advanced by whichever core samples. Several processes (jax.distributed, docs/parallelism.md): every process
drives every instance, as the multi-process pipeline does (`place_instances`: each instance on one process's
devices, prefill and decode sides on different processes); the K/V copy is a cross-process `device_put`, and
each instance's sampled tokens are copied to the other processes (`parallel.stages.copy_to_every_process`).
Prefix caching runs on both sides: the decode side shares the leading blocks of a prompt that its own cache
holds (from an earlier transfer or decode of the same tokens) and only the rest are copied.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import jax

from sarathi_jax.core.admission import Admission, KVCapacity
from sarathi_jax.request.chat_template import ChatTemplate
from sarathi_jax.config.engine_config import EngineConfig
from sarathi_jax.config.disaggregation import DisaggregationSplit, InstanceGroup
from sarathi_jax.disagg.flow import DisaggregationFlow, Handoff, Instance
from sarathi_jax.disagg.kv_transfer import KVBlockMover
from sarathi_jax.engine.llm_engine import LLMEngine
from sarathi_jax.core.engine_api import WallClock
from sarathi_jax.core.engine_core import EngineCore, LoopConfig
from sarathi_jax.request.outputs import RequestOutput
from sarathi_jax.parallel.loading import load_model_config


class _RealInstance(Instance):
    """An instance on its own devices: the `LLMEngine` whose parts it runs, and its own core over them."""

    def __init__(self, name: str, engine: LLMEngine, *, text: bool) -> None:
        config = engine.config
        core = EngineCore(engine.scheduler, engine.runner, loop=LoopConfig(config.async_scheduling),
                          eos_token_ids=engine.model_config.eos_token_ids,
                          tokenizer=engine.tokenizer if text else None, seed=config.seed)
        super().__init__(name, core)
        self.engine = engine


class DisaggregatedEngine(DisaggregationFlow):
    """The engine API (`engine_api.Engine`) over prefill and decode instances on their own devices."""

    clock = WallClock()  # as `LLMEngine`'s: the runners stamp metrics with time.monotonic()

    def __init__(self, config: EngineConfig, *, warmup: bool = True, devices: Sequence[Any] | None = None) -> None:
        """Check the split against the devices and the model's heads (ValueError naming both numbers), then
        build every instance (`LLMEngine` on its devices) and the KV movers between them."""
        if config.disaggregation is None:
            raise ValueError("DisaggregatedEngine needs EngineConfig.disaggregation ('P:D'); use LLMEngine")
        t_start = time.time()
        devices = list(jax.devices() if devices is None else devices)
        self.split = split = DisaggregationSplit.parse(config.disaggregation)
        model = load_model_config(config.model, config.quantization)
        split.check(len(devices), model.num_attention_heads, model.num_key_value_heads)
        prefill_devices, decode_devices = place_instances(split, devices)
        self.devices = [d for group in prefill_devices + decode_devices for d in group]
        side = dataclasses.replace(config, disaggregation=None, pipeline_parallel_size=1)

        def build(role: str, group: InstanceGroup, placed: list[list[Any]], caching: bool,
                  text: bool) -> list[_RealInstance]:
            cfg = dataclasses.replace(side, tensor_parallel_size=group.tensor_parallel_size,
                                      enable_prefix_caching=caching)
            return [_RealInstance(f"{role}{i}", LLMEngine(cfg, warmup=warmup, devices=d), text=text)
                    for i, d in enumerate(placed)]

        # Prefix caching on both sides: a decode side that holds a prompt's leading blocks is sent only the rest.
        prefill = build("prefill", split.prefill, prefill_devices, config.enable_prefix_caching, text=False)
        decode = build("decode", split.decode, decode_devices, config.enable_prefix_caching, text=True)
        first = prefill[0].engine
        self.config, self.model_config, self.tokenizer = config, first.model_config, first.tokenizer
        self.budget_setup = first.budget_setup
        # A request must fit whole on every instance it may go to (as colocated: it may grow to prompt + max_tokens).
        smallest = min(prefill + decode,
                       key=lambda i: i.block_manager.num_total_blocks - i.block_manager.watermark_blocks)
        admission = Admission(
            vocab_size=self.model_config.vocab_size,
            max_model_len=min(i.engine.max_model_len for i in prefill + decode),
            kv_cache=KVCapacity.of(smallest.block_manager),
            tokenizer=self.tokenizer,
            eos_token_ids=self.model_config.eos_token_ids,
            chat_template=ChatTemplate.from_folder(config.model) if Path(config.model).is_dir() else None,
        )
        super().__init__(prefill, decode, admission, seed=config.seed)
        self.movers = {(p.name, d.name): KVBlockMover(p.engine.runner, d.engine.runner, self.clock.now)
                       for p in prefill for d in decode}
        if warmup:
            for mover in self.movers.values():
                mover.warmup()
        self._startup_s = time.time() - t_start

    # ----------------------------------------------------------------------------------- one iteration

    def step(self) -> list[RequestOutput]:
        """The transfers done, prefill instances, the moves their finished prompts start, decode instances, then
        the moves the decodes made room for (module docstring)."""
        outputs, self._outputs = self._outputs, []
        # Nothing else left to do: wait for the last copies rather than spin on them.
        self.finish_transfers(wait=not (self._requests or any(i.busy for i in self.instances)))
        for p in self.prefill:
            if not self.waiting_for_room():  # back-pressure: no new prefill while one waits for decode room
                self.admit_arrivals(p, self.clock.now())
            if p.busy:
                outputs += self.run_prefill(p)
        for d in self.decode:
            if d.busy:
                outputs += self.run_decode(d)
        self.start_transfers(self.clock.now())
        return outputs

    def begin_transfer(self, h: Handoff, at: float) -> None:
        """Dispatch the copy of the computed tokens' blocks and land at once: the decode core's next step runs
        on the cache the scatter returns, and the prefill blocks are freed (a later write to them is ordered
        after the gather that reads them: `disagg.kv_transfer`). `h.start` is the gather's dispatch; `h.copy`
        says when the copy was seen done (the flow's `finish_transfers` records it then). The leading blocks
        the decode side's prefix cache held are not copied; when it held them all, nothing is."""
        k = h.num_cached_blocks
        source, target = h.holder.block_table[k:], h.state.seq.block_table[k:]
        if not source:
            h.start = h.end = self.clock.now()
        else:
            h.copy = copy = self.movers[(h.source.name, h.target.name)].move(source, target)
            h.start, h.num_bytes = copy.start, copy.num_bytes
        self.land(h, h.start)

    # ----------------------------------------------------------------------------------- the rest of the API

    def pipeline_stats(self) -> None:
        return None

    def reset_pipeline_stats(self) -> None:
        """No pipeline inside an instance."""

    def wait_until_compiled(self, timeout: float | None = None) -> bool:
        return all(i.engine.wait_until_compiled(timeout) for i in self.instances)

    def stop_background_compile(self) -> None:
        for i in self.instances:
            i.engine.stop_background_compile()

    def startup_stats(self) -> dict:
        """The first prefill instance's `LLMEngine.startup_stats`, with the whole engine's devices, KV blocks and
        time, and every instance's own under "instances"."""
        per = {i.name: i.engine.startup_stats() for i in self.instances}
        total = {k: sum(s[k] for s in per.values()) for k in ("num_kv_blocks", "kv_cache_bytes", "executables")}
        return {**per[self.prefill[0].name], **total, "num_devices": self.split.num_devices,
                "total_s": self._startup_s, "disaggregation": str(self.split), "instances": per}


def place_instances(split: DisaggregationSplit, devices: Sequence[Any]) -> tuple[list[list[Any]], list[list[Any]]]:
    """Each instance's devices, prefill instances first, in `devices`' order (`jax.devices()`: by process).
    One process: the first P devices, then the next D. Several processes (jax.distributed): every instance on
    one process's devices (tensor parallelism inside a process; an instance across processes is refused, and so
    are sides of different TP), the prefill side from the first process on and the decode side from the first
    process after it, so that the K/V moves between processes. ValueError naming the numbers otherwise."""
    def take(group: InstanceGroup, pool: list[Any]) -> list[list[Any]]:
        tp = group.tensor_parallel_size
        out = [pool[i * tp:(i + 1) * tp] for i in range(group.num_instances)]
        if len(pool) < group.devices:
            raise ValueError(f"disaggregation='{split}' needs {split.num_devices} devices ({split.prefill.devices} "
                             f"prefill + {split.decode.devices} decode), placed by process; only "
                             f"{len(pool)} are left for its {'decode' if group is split.decode else 'prefill'} side")
        for inst in out:
            procs = sorted({d.process_index for d in inst})
            if len(procs) > 1:
                raise ValueError(f"disaggregation='{split}': an instance of {tp} devices would span processes "
                                 f"{procs} (not supported: an instance's tensor parallelism stays in one process; "
                                 f"use instances of at most one process's {_per_process(devices)} devices)")
        return out

    devices = list(devices)
    if len({d.process_index for d in devices}) == 1:
        return take(split.prefill, devices), take(split.decode, devices[split.prefill.devices:])
    prefill = take(split.prefill, devices)
    last = max(d.process_index for inst in prefill for d in inst)
    decode = take(split.decode, [d for d in devices if d.process_index > last])
    tp_p, tp_d = split.prefill.tensor_parallel_size, split.decode.tensor_parallel_size
    if tp_p != tp_d:  # CPU: "Cannot reshard an input that is not fully addressable" (docs/parallelism.md)
        raise ValueError(f"disaggregation='{split}' across processes: the prefill instances' tensor parallelism "
                         f"{tp_p} and the decode instances' {tp_d} must be equal (JAX copies an array across "
                         f"processes only onto as many devices as it is on)")
    if _per_process(devices) < tp_p:  # each instance's tokens are copied to every process on as many devices
        raise ValueError(f"disaggregation='{split}' across processes needs {tp_p} devices on every process (an "
                         f"instance's sampled tokens reach the others on as many devices); the smallest process "
                         f"has {_per_process(devices)}")
    return prefill, decode


def _per_process(devices: Sequence[Any]) -> int:
    return min(sum(d.process_index == p for d in devices) for p in {d.process_index for d in devices})

