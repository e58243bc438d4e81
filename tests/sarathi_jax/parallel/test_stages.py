"""`sarathi_jax.parallel.stages`: what a stage does with and without a mesh (placement, its LM head for the
sampler with the logits gathering, the step's output shardings), and the multi-process copies seen from one process. Whole parallel engines are in
test_parallel.py."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from pallas_kernels.greedy_head_cpu import engine_uses_kernel as greedy_head_usable
from sarathi_jax.models import get_model, get_preset
from sarathi_jax.parallel.plan import TP_AXIS
from sarathi_jax.parallel.stages import Copies, LMHead, Stage, copy_to_every_process, local_copy


def _stage(mesh=None, tp: int = 1, shard_vocab: bool = False, kv_sharding=None, params=None) -> Stage:
    model = get_model(get_preset("tiny-llama"), "float32", attention_fn=None)  # tied embeddings
    return Stage(0, (0, 2), mesh, model=model, params=params or {}, kv_cache=(), is_last=True,
                 tensor_parallel_size=tp, shard_vocab=shard_vocab, kv_sharding=kv_sharding)


def test_a_stage_without_a_mesh_is_the_default_device():
    stage = _stage()
    x = jnp.arange(4)
    assert stage.replicated is None and stage.place(x) is x and stage.place(None) is None
    host = (np.arange(3, dtype=np.int32), np.ones(2, np.int32))
    assert stage.upload(host) is host  # the jitted step copies host arrays up as it dispatches
    assert stage.jit_shardings() == {}
    # nothing to gather; on a CPU greedy-only samplers take vocab-major logits, or the C++ greedy head where the
    # engine uses it (float32 on one device, built for AVX-512)
    assert stage.lm_head() == LMHead(dtype=np.dtype(np.float32), vocab_major_greedy=True,
                                     greedy_kernel=greedy_head_usable())


def test_a_tensor_parallel_stage_replicates_its_inputs_and_gathers_its_logits():
    mesh = Mesh(np.array(jax.devices()[:2]).reshape(1, 2), ("pp", TP_AXIS))
    kv = NamedSharding(mesh, PartitionSpec(None, None, None, TP_AXIS, None))
    vocab = NamedSharding(mesh, PartitionSpec(TP_AXIS, None))  # the tied embedding [vocab, embed], vocab-parallel
    weight = jax.device_put(jnp.arange(12.0).reshape(4, 3), vocab)
    stage = _stage(mesh, tp=2, shard_vocab=True, kv_sharding=kv, params={"embed_tokens": weight})
    placed = stage.place(np.arange(6, dtype=np.float32))
    assert placed.sharding.is_fully_replicated and len(placed.devices()) == 2
    assert stage.jit_shardings() == {"out_shardings": (stage.replicated, (kv, kv))}
    # a draft's steps (draft_runner): tokens and q replicated, or the KV cache alone (a shadow step)
    assert stage.jit_shardings(2) == {"out_shardings": (stage.replicated, stage.replicated, (kv, kv))}
    assert stage.jit_shardings(0) == {"out_shardings": (kv, kv)}
    head = stage.lm_head()
    assert head.vocab_sharding == NamedSharding(mesh, PartitionSpec(None, TP_AXIS)) and head.replicated == stage.replicated
    assert stage.lm_head_weight is weight
    h = stage.place(np.array([[1.0, 0.0, 2.0], [0.0, 1.0, 0.0]], np.float32))
    out = jax.jit(head.logits)(h, weight)
    assert out.sharding.is_fully_replicated and out.dtype == jnp.float32
    np.testing.assert_array_equal(np.asarray(out), np.asarray(h) @ np.arange(12.0).reshape(4, 3).T)


def test_one_process_needs_no_copies():
    stages = [_stage(), _stage()]
    out = {"token_ids": jnp.arange(3)}
    assert copy_to_every_process(stages, out) is out
    a, b = jnp.arange(3), jnp.arange(3) + 1
    assert local_copy(Copies([a, b])) is a  # the first copy with a shard in this process
    assert local_copy(b) is b
