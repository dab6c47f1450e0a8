"""Ahead-of-time compilation of the decode step for a TPU slice, from abstract params.

    compiled = compile_decode_step(cfg, topology="v5p:2x2x1", mesh_spec="layer=4",
                                   batch=1, max_len=4096)
    compiled.memory_analysis()      # per-chip bytes
    compiled.as_text()              # the scheduled HLO
    collective_overlap(compiled)    # its async collectives, and how many have compute in flight beside them

Needs libtpu (`.venv/bin/python -m pip install -c constraints.txt -e '.[tpu]'`), not a TPU: the topology is described, not attached.
Parameters and the cache are ShapeDtypeStructs carrying their NamedShardings, so nothing is
allocated here.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import sys

import jax
import jax.numpy as jnp
from flax import nnx
from jax.experimental.layout import Format, Layout

from glm_jax import ops
from glm_jax.cache import LayerSplit, cache_shardings, create_cache
from glm_jax.config import GLMConfig
from glm_jax.forward_options import ForwardOptions
from glm_jax.hlo_overlap import async_pairs, summarize
from glm_jax.model import abstract_model
from glm_jax.sharding import logical_sharding, make_mesh, param_shardings


def topology_devices(topology: str):
    """TPU devices of a slice such as 'v5p:4x4x4' (libtpu, no TPU needed)."""
    from jax.experimental import topologies
    # Describing a topology loads libtpu; other processes on the host may have it loaded too.
    os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
    try:
        return topologies.get_topology_desc(platform="tpu", topology_name=topology).devices
    except Exception as e:       # libtpu missing or an unknown topology name
        raise ValueError(f"cannot describe TPU topology {topology!r} ({e}); install libtpu (from the project "
                         f"root: {sys.executable} -m pip install -c constraints.txt -e '.[tpu]') and use a "
                         "name like v5p:2x2x1") from e


def _abstract(tree, shardings):
    return jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), tree, shardings)


def _row_major_stores(cache):
    """Cache formats: the latent and key stores pinned to the row-major layout the decode loop
    works in (in and out, so the donated cache aliases its update). Left to choose, the TPU
    compiler gives a [slots, pages, P, 576] store a lane-friendlier transposed entry layout and
    copies the whole store into and out of the loop over groups: about 2x its size in
    temporaries. Row-major costs the lane padding of 576 to 640 instead (+11%)."""
    def pinned(x):
        return Format(Layout(major_to_minor=tuple(range(x.ndim))), x.sharding)
    return dataclasses.replace(cache, latent=pinned(cache.latent), index_keys=pinned(cache.index_keys),
                               page_table=cache.page_table.sharding, lengths=cache.lengths.sharding)


def compile_decode_step(cfg: GLMConfig, *, topology: str, mesh_spec: str, batch: int, max_len: int,
                        collective: str = "permute", forward: ForwardOptions | None = None,
                        compiler_options: dict | None = None):
    """Compile one decode step (tokens int32 [B, 1] against a cache of max_len rows, cache
    donated) for the slice. With a `layer` axis > 1 in mesh_spec the cache is LayerSplit."""
    mesh = make_mesh(mesh_spec, topology_devices(topology))
    split = LayerSplit(mesh, collective=collective) if mesh.shape["layer"] > 1 else None
    graphdef, state = nnx.split(abstract_model(cfg))
    params = _abstract(state, param_shardings(state, mesh))
    cache = jax.eval_shape(functools.partial(create_cache, cfg, batch, max_len, split=split))
    formats = _row_major_stores(_abstract(cache, cache_shardings(cache, mesh)))
    cache = _abstract(cache, formats)
    tokens = jax.ShapeDtypeStruct((batch, 1), jnp.int32,
                                  sharding=logical_sharding(mesh, ("batch", None), (batch, 1), "tokens"))
    options = forward or ForwardOptions(kernels=ops.KernelChoice(indexer_topk="xla", sparse_mla="xla"))

    @functools.partial(jax.jit, donate_argnums=(1,), out_shardings=(None, formats))
    def step(state, cache, tokens):
        logits, _, cache = nnx.merge(graphdef, state).forward_cached(tokens, cache, options=options)
        return jnp.argmax(logits[:, -1], axis=-1).astype(jnp.int32), cache

    return step.lower(params, cache, tokens).compile(compiler_options or {})


# HBM per chip by TPU generation (public specifications), for the fits / does-not-fit verdict.
HBM_PER_CHIP_GIB = {"v4": 32, "v5e": 16, "v5litepod": 16, "v5p": 95, "v6e": 32, "tpu7x": 192}


def memory_report(compiled, topology: str) -> dict:
    """Per-chip bytes of a compiled step: arguments (params + cache), outputs not aliased to
    arguments, temporaries, code; and whether they fit the chip's HBM."""
    m = compiled.memory_analysis()
    total = (m.argument_size_in_bytes + m.output_size_in_bytes - m.alias_size_in_bytes
             + m.temp_size_in_bytes + m.generated_code_size_in_bytes)
    hbm = HBM_PER_CHIP_GIB.get(topology.split(":")[0])
    return {"arguments": m.argument_size_in_bytes, "outputs_not_aliased": m.output_size_in_bytes - m.alias_size_in_bytes,
            "temporaries": m.temp_size_in_bytes, "code": m.generated_code_size_in_bytes, "total": total,
            "hbm": None if hbm is None else hbm * 2**30,
            "fits": None if hbm is None else total <= hbm * 2**30}


def collective_overlap(compiled) -> dict[str, dict[str, int]]:
    """{kind: {"pairs": n, "overlapped": m}} of a compiled program's async collectives (e.g.
    LayerSplit's collective-permutes of cache rows): m of its n start/done pairs have compute
    scheduled between them, the transfers the device hides behind work (`hlo_overlap`)."""
    return summarize(async_pairs(compiled.as_text()))


def default_mesh_spec(num_chips: int) -> str:
    """tensor x layer = 8-way LayerSplit when the slice allows it, else LayerSplit over all chips."""
    return f"tensor={num_chips // 8},layer=8" if num_chips % 8 == 0 and num_chips >= 8 else f"layer={num_chips}"
