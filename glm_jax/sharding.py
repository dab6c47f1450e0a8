"""Device mesh, the logical-axis rules table, and NamedShardings for params and the KV cache.

    mesh = make_mesh("data=2,tensor=2,layer=2")          # 8 devices
    params = shard_params(nnx.state(model), mesh)          # device_put with the rules below
    cache = shard_cache(create_cache(cfg, b, t, split=LayerSplit(mesh)), mesh)

Mesh axes (always in this order; a missing one has size 1):
    data    batch rows (and the cache pages that hold them)
    tensor  attention heads, MLP columns, routed experts, vocabulary ("expert" is an alias)
    layer   LayerSplit: each device of this axis stores the KV cache of a disjoint subset of
            layers (glm_jax.layer_split); routed experts are split over tensor x layer, the
            other weights and the activations are replicated along it

Layers never name mesh axes: every array dimension carries a logical name and LOGICAL_AXIS_RULES
(the only table) maps it to a mesh axis or to None (replicated).
"""

from __future__ import annotations

import dataclasses
import math
import os
import re

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from glm_jax.multihost import place

MESH_AXES = ("data", "tensor", "layer")
AXIS_ALIASES = {"expert": "tensor", "experts": "tensor", "dp": "data", "tp": "tensor", "ep": "tensor"}

# logical dimension name -> mesh axis, tuple of mesh axes (split over their product), or None
LOGICAL_AXIS_RULES: dict[str, str | tuple[str, ...] | None] = {
    "batch": "data",
    "embed": None,
    "heads": "tensor",          # attention heads (q_b, kv_b outputs; o_proj input)
    "index_heads": "tensor",    # lightning-indexer query heads
    "mlp": "tensor",            # dense FFN columns
    "experts": ("tensor", "layer"),  # routed experts: expert parallelism over tensor x layer devices
    "vocab": "tensor",
    "stack": None,              # stacked IndexShare groups (the scan axis of parameters)
    "cache_layers": "layer",    # LayerSplit: one slot per layer (latent) / per Full layer (keys)
    "cache_pages": "data",      # pages of the cache pool (contiguous cache: one page per row)
    "page_rows": None,          # token rows inside a page
    "latent": None,             # kv_lora + rope (576) or the indexer head dim
}


class ShardingError(ValueError):
    """A mesh that cannot be built or does not divide a dimension it would split."""


def parse_mesh_spec(spec: str) -> dict[str, int]:
    """"data=2,tensor=2,layer=2" -> {"data": 2, "tensor": 2, "layer": 2} (missing axes are 1)."""
    sizes = dict.fromkeys(MESH_AXES, 1)
    seen = set()
    for part in filter(None, (p.strip() for p in spec.split(","))):
        m = re.fullmatch(r"([a-z_]+)\s*=\s*(\d+)", part)
        if not m:
            raise ShardingError(f"mesh spec {spec!r}: {part!r} is not 'axis=size' (e.g. 'data=1,layer=8')")
        name = AXIS_ALIASES.get(m.group(1), m.group(1))
        if name not in sizes:
            raise ShardingError(f"mesh spec {spec!r}: unknown axis {m.group(1)!r}; axes are "
                                f"{', '.join(MESH_AXES)} ('expert' = tensor)")
        if name in seen:
            raise ShardingError(f"mesh spec {spec!r}: axis {name!r} given twice")
        if int(m.group(2)) < 1:
            raise ShardingError(f"mesh spec {spec!r}: axis {name!r} must have size >= 1")
        seen.add(name)
        sizes[name] = int(m.group(2))
    return sizes


def simulate_cpu_devices(spec: str, processes: int = 1) -> None:
    """Lets the host platform offer each of `processes` processes its share of the devices the
    mesh `spec` needs. Call it before jax starts a backend; it only affects the CPU platform
    (harmless on GPU and TPU hosts)."""
    sizes = parse_mesh_spec(spec)
    need = -(-sizes["data"] * sizes["tensor"] * sizes["layer"] // processes)
    flags = os.environ.get("XLA_FLAGS", "")
    if need > 1 and "xla_force_host_platform_device_count" not in flags:
        os.environ["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count={need}".strip()


def make_mesh(spec: str | dict[str, int], devices=None) -> Mesh:
    """A Mesh with axes (data, tensor, layer) over the first prod(sizes) devices."""
    sizes = parse_mesh_spec(spec) if isinstance(spec, str) else {**dict.fromkeys(MESH_AXES, 1), **spec}
    devices = list(jax.devices() if devices is None else devices)
    need = math.prod(sizes[a] for a in MESH_AXES)
    if need > len(devices):
        raise ShardingError(
            f"mesh {format_mesh(sizes)} needs {need} devices but {len(devices)} are available; "
            f"shrink the mesh (on CPU, XLA_FLAGS=--xla_force_host_platform_device_count={need} "
            "simulates more devices)")
    if jax.process_count() > 1 and need != len(devices):
        raise ShardingError(
            f"mesh {format_mesh(sizes)} uses {need} of the {len(devices)} devices of {jax.process_count()} "
            f"processes; a mesh over several processes must use all {len(devices)}, so that each process "
            "holds part of it")
    grid = np.array(devices[:need], dtype=object).reshape([sizes[a] for a in MESH_AXES])
    return Mesh(grid, MESH_AXES, axis_types=(jax.sharding.AxisType.Auto,) * len(MESH_AXES))


def format_mesh(sizes: dict[str, int] | Mesh) -> str:
    shape = dict(sizes.shape) if isinstance(sizes, Mesh) else sizes
    return ",".join(f"{a}={shape[a]}" for a in MESH_AXES)


def logical_spec(names: tuple[str | None, ...], rules: dict[str, str | None] = LOGICAL_AXIS_RULES
                 ) -> PartitionSpec:
    """Logical dimension names (None = unnamed, replicated) -> PartitionSpec of mesh axes."""
    for n in names:
        if n is not None and n not in rules:
            raise ShardingError(f"logical axis {n!r} has no rule; add it to LOGICAL_AXIS_RULES")
    return PartitionSpec(*(None if n is None else rules[n] for n in names))


def logical_sharding(mesh: Mesh, names: tuple[str | None, ...], shape: tuple[int, ...], what: str,
                     rules: dict[str, str | None] = LOGICAL_AXIS_RULES) -> NamedSharding:
    """NamedSharding for an array of `shape` whose dims are named `names`; checks divisibility.

    Raises ShardingError naming the array (`what`), the dimension and the fix."""
    if len(names) != len(shape):
        raise ShardingError(f"{what}: {len(names)} logical names {names} for shape {shape}")
    spec = logical_spec(names, rules)
    for name, size, axis in zip(names, shape, spec):
        if axis is None:
            continue
        n = math.prod(mesh.shape[a] for a in ((axis,) if isinstance(axis, str) else axis))
        if size % n:
            raise ShardingError(
                f"{what}: dimension {name!r} of size {size} (shape {shape}) is split over mesh axis "
                f"{axis!r} of size {n}, which does not divide it; use a mesh whose {axis!r} size divides "
                f"{size} (mesh is {format_mesh(mesh)}), or change the rule for {name!r} in LOGICAL_AXIS_RULES")
    return NamedSharding(mesh, spec)


# ------------------------------------------------------------------ parameters
# Trailing dims of a parameter, by the end of its path; leading (stacked-group) dims are "stack".
_PARAM_AXES: tuple[tuple[str, tuple[str | None, ...]], ...] = (
    ("embed_tokens/embedding", ("vocab", "embed")),
    ("lm_head/kernel", ("embed", "vocab")),
    ("q_b_proj/kernel", (None, "heads")),
    ("kv_b_proj/kernel", (None, "heads")),
    ("o_proj/kernel", ("heads", "embed")),
    ("indexer/wq_b/kernel", (None, "index_heads")),
    ("mlp/gate_proj", ("experts", "embed", None)),          # MoE experts [E, hidden, ffn]
    ("mlp/up_proj", ("experts", "embed", None)),
    ("mlp/down_proj", ("experts", None, "embed")),
    ("gate_proj/kernel", ("embed", "mlp")),                 # dense / shared-expert MLP
    ("up_proj/kernel", ("embed", "mlp")),
    ("down_proj/kernel", ("mlp", "embed")),
)


def param_logical_axes(path: str, ndim: int) -> tuple[str | None, ...]:
    """Logical names of a parameter's dims from its '/'-joined path (unlisted: replicated)."""
    for suffix, names in _PARAM_AXES:
        if path.endswith(suffix) and ndim >= len(names):
            return ("stack",) * (ndim - len(names)) + names
    return ("stack",) * ndim if path.startswith("stacks/") else (None,) * ndim


def _path_str(path) -> str:
    """A pytree path as 'stacks/2/layers/0/self_attn/q_b_proj/kernel' (nnx's trailing 'value' dropped)."""
    parts = [str(getattr(k, "key", getattr(k, "idx", getattr(k, "name", k)))) for k in path]
    return "/".join(parts[:-1] if parts and parts[-1] == "value" else parts)


def param_shardings(state, mesh: Mesh, rules: dict = LOGICAL_AXIS_RULES):
    """A pytree like `state` (nnx.State or any pytree of arrays) of NamedShardings."""
    def one(path, leaf):
        p = _path_str(path)
        return logical_sharding(mesh, param_logical_axes(p, leaf.ndim), tuple(leaf.shape), f"parameter {p}",
                                rules)
    return jax.tree_util.tree_map_with_path(one, state)


def shard_params(state, mesh: Mesh, rules: dict = LOGICAL_AXIS_RULES):
    """Place the parameters with `param_shardings` (checked before any transfer); on a mesh over
    several processes each process fills its own shards."""
    return place(state, param_shardings(state, mesh, rules))


#: Training adds FSDP: the model dimension of every parameter that has one is split over the
#: data axis too (gathered per layer inside the step), so weights and optimizer state shrink
#: with the data-parallel degree.
TRAINING_RULES = {**LOGICAL_AXIS_RULES, "embed": "data"}


def batch_sharding(mesh: Mesh, shape: tuple[int, ...]) -> NamedSharding:
    """Token batches [B, S, ...]: rows over the data axis."""
    return logical_sharding(mesh, ("batch",) + (None,) * (len(shape) - 1), shape, "the batch")


# ------------------------------------------------------------------ KV cache
CACHE_AXES = {
    "latent": ("cache_layers", "cache_pages", "page_rows", "latent"),
    "index_keys": ("cache_layers", "cache_pages", "page_rows", "latent"),
    "page_table": ("batch", None),
    "lengths": ("batch",),
}


def cache_shardings(cache, mesh: Mesh):
    """A KVCache of NamedShardings. Without LayerSplit the layer slots are replicated along
    the `layer` axis (each device keeps every layer)."""
    rules = LOGICAL_AXIS_RULES if cache.split is not None else {**LOGICAL_AXIS_RULES, "cache_layers": None}
    fields = {name: logical_sharding(mesh, CACHE_AXES[name], tuple(getattr(cache, name).shape),
                                     f"cache.{name}", rules) for name in CACHE_AXES}
    return dataclasses.replace(cache, **fields)


def shard_cache(cache, mesh: Mesh):
    return place(cache, cache_shardings(cache, mesh))


def per_device_bytes(tree) -> dict:
    """Bytes each device holds of a pytree of (possibly sharded) arrays: {device: bytes}."""
    out: dict = {}
    for leaf in jax.tree.leaves(tree):
        for shard in leaf.addressable_shards:
            out[shard.device] = out.get(shard.device, 0) + shard.data.size * shard.data.dtype.itemsize
    return out
