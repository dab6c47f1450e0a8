"""Checks that need 8 (simulated) devices; run as a script by test_sharding.py, which sets
XLA_FLAGS=--xla_force_host_platform_device_count=8 before jax starts. Prints one JSON object."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

os.environ.setdefault("JAX_PLATFORMS", "cpu")
sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402

from conftest import counting_compiles, micro_config  # noqa: E402
from glm_jax.cache import LayerSplit, create_cache, shard_cache  # noqa: E402
from glm_jax.decoding.generate import Generator  # noqa: E402
from glm_jax.model import GLMModel  # noqa: E402
from glm_jax.sharding import ShardingError, make_mesh, per_device_bytes, shard_params  # noqa: E402


def _prefill_then_decode(model, cache, tokens, prefill: int):
    """Logits [B, n, V] of a prefill chunk then one decode step per remaining token."""
    logits, _, cache = model.forward_cached(tokens[:, :prefill], cache)
    out = [logits]
    for t in range(prefill, tokens.shape[1]):
        step, _, cache = model.forward_cached(tokens[:, t:t + 1], cache)
        out.append(step)
    return jnp.concatenate(out, axis=1)


def split_equals_unsplit() -> dict:
    cfg = micro_config(vocab_size=96, n_routed_experts=8)   # experts split over tensor x layer = 8
    model = GLMModel(cfg, rngs=nnx.Rngs(0))
    tokens = jax.random.randint(jax.random.key(1), (4, 9), 0, cfg.vocab_size)
    run = jax.jit(_prefill_then_decode, static_argnames="prefill")
    ref = run(model, create_cache(cfg, 4, 32), tokens, prefill=8)
    out = {}
    for spec, collective in (("data=1,layer=8", "permute"), ("data=2,tensor=2,layer=2", "psum")):
        mesh = make_mesh(spec)
        graphdef, state = nnx.split(model)
        sharded = nnx.merge(graphdef, shard_params(state, mesh))
        cache = shard_cache(create_cache(cfg, 4, 32, split=LayerSplit(mesh, collective=collective)), mesh)
        got = run(sharded, cache, tokens, prefill=8)
        out[spec] = {"max_abs_diff": float(jnp.max(jnp.abs(got - ref))),
                     "same_argmax": bool(jnp.all(jnp.argmax(got, -1) == jnp.argmax(ref, -1)))}
    return out


PROMPTS = [np.arange(3, 12), np.arange(20, 25), np.arange(40, 53)]


def generator_tokens() -> tuple[dict, dict]:
    """Greedy tokens: contiguous Generator on one device and on data=1,layer=8; the paged
    engine on data=2,layer=4 (pool pages split by data shard). -> (tokens, `engine_on_mesh`'s report)."""
    model = GLMModel(micro_config(n_routed_experts=8), rngs=nnx.Rngs(0))   # experts over 8 devices
    result = {}
    for spec in (None, "data=1,layer=8"):
        gen = Generator(model, batch=3, max_len=48, prefill_chunk=4, block_size=4,
                        mesh=None if spec is None else make_mesh(spec))
        result[str(spec)] = np.concatenate(list(gen.generate(PROMPTS, max_new_tokens=8)), axis=1).tolist()
    result["engine data=2,layer=4"], report = engine_on_mesh(model)
    return result, report


def engine_on_mesh(model) -> tuple[list, dict]:
    """The engine's greedy tokens on data=2,layer=4 (3 requests, 2 slots: prefill and decode each
    run many times), the compilations of its two programs during the run, and the shardings of
    its cache and slot state before and after (each PartitionSpec as a list)."""
    from glm_jax.decoding.engine import Request, ServingEngine

    def specs(engine) -> list[list]:
        return [list(x.sharding.spec) for x in jax.tree.leaves((engine.cache, engine.slot_state))]

    engine = ServingEngine(model, slots=2, num_pages=12, page_size=8, max_context=48, prefill_chunk=8,
                           mesh=make_mesh("data=2,layer=4"))
    before = specs(engine)
    with counting_compiles() as compiles:
        tokens = [r.tokens for r in engine.serve([Request(p, 8) for p in PROMPTS])]
    return tokens, {"compiles": dict(compiles), "specs_before": before, "specs_after": specs(engine)}


def cache_bytes_per_device() -> dict:
    cfg = micro_config(num_hidden_layers=8, index_topk_pattern="FSFSFSFS")
    out = {}
    for n in (1, 2, 4, 8):
        mesh = make_mesh(f"layer={n}")
        cache = shard_cache(create_cache(cfg, 2, 64, split=LayerSplit(mesh)), mesh)
        per_device = per_device_bytes((cache.latent, cache.index_keys))
        out[n] = {"max": max(per_device.values()), "devices": len(per_device),
                  "latent_slot": int(cache.latent[0].size * cache.latent.dtype.itemsize),
                  "key_slot": int(cache.index_keys[0].size * cache.index_keys.dtype.itemsize)}
    return out


def indivisible_mesh_error() -> str:
    model = GLMModel(micro_config(), rngs=nnx.Rngs(0))          # vocab 97
    try:
        shard_params(nnx.state(model), make_mesh("tensor=2"))
    except ShardingError as e:
        return str(e)
    return ""


def hlo_overlap() -> dict | None:
    """Async collective pairs in a LayerSplit decode step compiled for a 4-chip TPU slice."""
    try:
        import libtpu  # noqa: F401
    except ImportError:
        return None
    from glm_jax.aot import collective_overlap, compile_decode_step

    compiled = compile_decode_step(micro_config(vocab_size=96, dtype="bfloat16"), topology="v5p:2x2x1",
                                   mesh_spec="layer=4", batch=1, max_len=256)
    return collective_overlap(compiled)


if __name__ == "__main__":
    tokens, engine_report = generator_tokens()
    print(json.dumps({"devices": len(jax.devices()), "split_equals_unsplit": split_equals_unsplit(),
                      "generator_tokens": tokens, "engine_on_mesh": engine_report,
                      "cache_bytes": cache_bytes_per_device(),
                      "indivisible_error": indivisible_mesh_error(), "hlo_overlap": hlo_overlap()}))
