"""Device mesh, the logical-axis rules table, and NamedShardings for params and activations
(the KV cache's own axes: `glm_jax.cache.axes`).

    mesh = make_mesh("data=2,tensor=2,layer=2")          # 8 devices
    params = shard_params(nnx.state(model), mesh)          # device_put with the rules below
    cache = shard_cache(create_cache(cfg, b, t, split=LayerSplit(mesh)), mesh)   # glm_jax.cache
    jax.set_mesh(make_mesh("data=2,context=4"))            # training: activations follow the mesh

Mesh axes (always in this order; a missing one has size 1):
    data    batch rows (and the cache pages that hold them)
    context the token dimension of full-sequence activations (context parallelism; "cp" and
            "seq" are aliases): each device holds S / context queries, and the keys every query
            may attend are gathered along it (see `constrain` and `split_queries`)
    tensor  attention heads, MLP columns, routed experts, vocabulary ("expert" is an alias)
    layer   LayerSplit: each device of this axis stores the KV cache of a disjoint subset of
            layers (glm_jax.cache.layer_split); routed experts are split over tensor x layer, the
            other weights and the activations are replicated along it

Layers never name mesh axes: every parameter carries its dimensions' logical names (Flax NNX
sharding metadata, `glm_jax.logical_axes`), every constrained activation names its dimensions,
and one rules table maps the names to mesh axes or to None (replicated): LOGICAL_AXIS_RULES for
this mesh, or your own for a mesh of your own (`make_rules`, `use_rules`, `shard_params(..., rules)`).
"""

from __future__ import annotations

import math
import os
import re

import jax
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from glm_jax.logical_axes import (LOGICAL_AXES, LOGICAL_AXIS_RULES, as_rules, current_rules, make_rules, names_of,
                                  use_rules)
from glm_jax.multihost import place

__all__ = ["LOGICAL_AXES", "LOGICAL_AXIS_RULES", "MESH_AXES", "TRAINING_RULES", "ShardingError", "batch_sharding",
           "checked_spec", "constrain", "context_size", "format_mesh", "gather_keys", "logical_sharding",
           "logical_spec", "make_mesh", "make_rules", "param_shardings", "parse_mesh_spec", "per_device_bytes",
           "shard_params", "simulate_cpu_devices", "split_queries", "split_tokens", "use_rules"]

MESH_AXES = ("data", "context", "tensor", "layer")

AXIS_ALIASES = {"expert": "tensor", "experts": "tensor", "dp": "data", "tp": "tensor", "ep": "tensor",
                "cp": "context", "seq": "context"}


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
                                f"{', '.join(MESH_AXES)} ('expert' = tensor, 'cp' = context)")
        if name in seen:
            raise ShardingError(f"mesh spec {spec!r}: axis {name!r} given twice")
        if int(m.group(2)) < 1:
            raise ShardingError(f"mesh spec {spec!r}: axis {name!r} must have size >= 1")
        seen.add(name)
        sizes[name] = int(m.group(2))
    return sizes


#: The most CPU devices one process simulates for a mesh (4,096 took 14 s and 1.4 GB to start,
#: before any model was placed on them).
MAX_SIMULATED_DEVICES = 1024


def check_host_memory(mesh: Mesh, replicated_bytes: int, what: str = "the model's parameters") -> None:
    """On the CPU platform, where every device of `mesh` lives in this host's memory: raises
    ShardingError when the copies of `replicated_bytes` (one per device along the axes that do
    not split it: data and context) would not fit the memory the host has available."""
    if mesh.devices.flat[0].platform != "cpu":
        return
    copies = mesh.shape.get("data", 1) * mesh.shape.get("context", 1)
    available = _available_host_bytes()
    need = replicated_bytes * (copies + 1)              # + the copy loaded before sharding
    if available is not None and copies > 1 and need > 0.9 * available:
        raise ShardingError(
            f"mesh {format_mesh(dict(mesh.shape))} on simulated CPU devices holds {copies} copies of {what} "
            f"({replicated_bytes / 2**20:,.0f} MiB each), {need / 2**30:,.1f} GiB in all, but this host has "
            f"{available / 2**30:,.1f} GiB available; shrink the data/context axes of the mesh")


def _available_host_bytes() -> int | None:
    """MemAvailable of /proc/meminfo in bytes (None where it cannot be read)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def simulate_cpu_devices(spec: str, processes: int = 1) -> None:
    """Lets the host platform offer each of `processes` processes its share of the devices the
    mesh `spec` needs. Call it before jax starts a backend; it only affects the CPU platform
    (harmless on GPU and TPU hosts)."""
    sizes = parse_mesh_spec(spec)
    need = -(-math.prod(sizes.values()) // processes)
    if need > MAX_SIMULATED_DEVICES:
        raise ShardingError(
            f"mesh {format_mesh(sizes)} needs {need} devices per process; on a CPU they are simulated, and "
            f"more than {MAX_SIMULATED_DEVICES} simulated devices take minutes to start and a copy of the "
            "model each; shrink the mesh, or compile for a TPU slice of that size ahead of time with "
            "decode.py --compile-only --topology")
    flags = os.environ.get("XLA_FLAGS", "")
    if need > 1 and "xla_force_host_platform_device_count" not in flags:
        os.environ["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count={need}".strip()


def make_mesh(spec: str | dict[str, int], devices=None) -> Mesh:
    """A Mesh with axes (data, context, tensor, layer) over the first prod(sizes) devices."""
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
    return ",".join(f"{a}={shape.get(a, 1)}" for a in MESH_AXES)


def _axes(entry) -> tuple[str, ...]:
    """A rule's value (a mesh axis, a tuple of them, or None) as a tuple of mesh axes."""
    return (entry,) if isinstance(entry, str) else tuple(entry or ())


def _rules(rules) -> dict:
    return current_rules() if rules is None else as_rules(rules)


def logical_spec(names: tuple[str | None, ...], rules=None) -> PartitionSpec:
    """Logical dimension names (None = unnamed, replicated) -> PartitionSpec of mesh axes by
    `rules` (default: those of `use_rules`, else LOGICAL_AXIS_RULES)."""
    rules = _rules(rules)
    for n in names:
        if n is not None and n not in rules:
            raise ShardingError(f"logical axis {n!r} has no rule; add {n!r}: <mesh axis or None> to the rules "
                                "(glm_jax.sharding.make_rules / use_rules, or shard_params(..., rules))")
    return PartitionSpec(*(None if n is None else rules[n] for n in names))


def logical_sharding(mesh: Mesh, names: tuple[str | None, ...], shape: tuple[int, ...], what: str,
                     rules=None) -> NamedSharding:
    """NamedSharding for an array of `shape` whose dims are named `names`; checks divisibility.

    Raises ShardingError naming the array (`what`), the dimension and the fix."""
    return NamedSharding(mesh, checked_spec(mesh.shape, names, shape, what, rules))


def checked_spec(mesh_shape, names: tuple[str | None, ...], shape: tuple[int, ...], what: str,
                 rules=None) -> PartitionSpec:
    """`logical_spec(names)` on a mesh of `mesh_shape` ({axis: size} of a Mesh or AbstractMesh),
    checking that every mesh axis a rule names is one of the mesh's (the library's own axes
    data/context/tensor/layer may be left out of a mesh that has some of them: size 1, dropped)
    and divides the dimension it splits, and that no mesh axis splits two dimensions."""
    if len(names) != len(shape):
        raise ShardingError(f"{what}: {len(names)} logical names {names} for shape {shape}")
    mesh_shape = dict(mesh_shape)
    library_mesh = any(a in mesh_shape for a in MESH_AXES)
    spec, used = [], {}
    for name, size, axis in zip(names, shape, logical_spec(names, rules)):
        kept = []
        for a in _axes(axis):
            if a in mesh_shape:
                kept.append(a)
            elif not (library_mesh and a in MESH_AXES):
                raise ShardingError(
                    f"{what}: logical axis {name!r} maps to mesh axis {a!r}, which the mesh lacks (its axes: "
                    f"{', '.join(mesh_shape)}); map {name!r} to one of them or None in the rules "
                    "(glm_jax.sharding.make_rules)")
        for a in kept:
            if a in used:
                raise ShardingError(f"{what}: mesh axis {a!r} would split both {used[a]!r} and {name!r}; "
                                    f"map one of them to another mesh axis or None in the rules")
            used[a] = name
        n = math.prod(mesh_shape[a] for a in kept)
        if size % n:
            shown = kept[0] if len(kept) == 1 else tuple(kept)
            raise ShardingError(
                f"{what}: dimension {name!r} of size {size} (shape {shape}) is split over mesh axis "
                f"{shown!r} of size {n}, which does not divide it; use a mesh whose {shown!r} size divides "
                f"{size} (mesh is {format_mesh(mesh_shape)}), or change the rule for {name!r} in the rules "
                "(LOGICAL_AXIS_RULES, or your own: glm_jax.sharding.make_rules)")
        spec.append(kept[0] if len(kept) == 1 else (tuple(kept) or None))
    return PartitionSpec(*spec)


# ------------------------------------------------------------------ parameters
# Each parameter carries its dims' logical names (`glm_jax.logical_axes.param`); a leaf that
# carries none (a plain array, an unannotated Variable) is replicated.

def _path_str(path) -> str:
    """A pytree path as 'stacks/2/layers/0/self_attn/q_b_proj/kernel' (nnx's trailing 'value' dropped)."""
    parts = [str(getattr(k, "key", getattr(k, "idx", getattr(k, "name", k)))) for k in path]
    return "/".join(parts[:-1] if parts and parts[-1] == "value" else parts)


def param_shardings(state, mesh: Mesh, rules=None):
    """A pytree like `state` (nnx.State, or any pytree of arrays and nnx Variables) of
    NamedShardings: each Variable's by its logical names (`nnx.get_partition_spec`'s) through
    `rules` (default: those of `use_rules`, else LOGICAL_AXIS_RULES); unannotated leaves replicated."""
    rules = _rules(rules)

    def one(path, leaf):
        p, value = _path_str(path), leaf.get_value() if isinstance(leaf, nnx.Variable) else leaf
        names = names_of(leaf) or (None,) * value.ndim
        sharding = logical_sharding(mesh, names, tuple(value.shape), f"parameter {p}", rules)
        return leaf.replace(sharding) if isinstance(leaf, nnx.Variable) else sharding

    return jax.tree_util.tree_map_with_path(one, state, is_leaf=lambda x: isinstance(x, nnx.Variable))


def shard_params(state, mesh: Mesh, rules=None):
    """Place the parameters with `param_shardings` (checked before any transfer); on a mesh over
    several processes each process fills its own shards."""
    return place(state, param_shardings(state, mesh, rules))


#: Training adds FSDP: the model dimension of every parameter that has one is split over the
#: data axis too (gathered per layer inside the step), so weights and optimizer state shrink
#: with the data-parallel degree.
TRAINING_RULES = {**LOGICAL_AXIS_RULES, "embed": "data"}


def batch_sharding(mesh: Mesh, shape: tuple[int, ...], rules=None) -> NamedSharding:
    """Token batches [B, S, ...]: rows over the batch rule's axis, tokens over the
    activation_length rule's (context parallelism)."""
    rules = _rules(rules)
    context = math.prod(mesh.shape.get(a, 1) for a in _axes(rules.get("activation_length")))
    if len(shape) > 1 and shape[1] % context:
        raise ShardingError(
            f"the batch: sequence length {shape[1]} is not a multiple of the context-parallel size "
            f"{context} (mesh is {format_mesh(mesh)}); use a sequence length that is a multiple of "
            f"{context} (--seq-len) or a context axis that divides {shape[1]}")
    return logical_sharding(mesh, ("batch", "activation_length") + (None,) * (len(shape) - 2), shape,
                            "the batch", rules)


# ------------------------------------------------------------------ activations in the program
# Context parallelism: full-sequence activations [B, S, ...] are split over `activation_length`
# (the context axis); the key rows every query may attend are gathered (`kv_length`). These act
# on the mesh set with `jax.set_mesh`, by the rules of `use_rules`, and do nothing without a mesh.

def _ambient_mesh():
    mesh = jax.sharding.get_abstract_mesh()
    return None if mesh.empty else mesh


def _free_axes(mesh) -> dict[str, int]:
    """{axis: size} of the mesh axes still to partition (not manual: not inside a shard_map over them)."""
    return {a: n for a, n, t in zip(mesh.axis_names, mesh.axis_sizes, mesh.axis_types)
            if t != jax.sharding.AxisType.Manual}


def constrain(x: jax.Array, names: tuple[str | None, ...], rules=None) -> jax.Array:
    """x with its dims (logical `names`) laid out by `rules` (default: `use_rules`'s) on the
    ambient mesh; manual mesh axes (inside a shard_map) are dropped. A logical name without a
    rule, a rule naming an axis the mesh lacks, or a dimension the mesh does not divide raises
    ShardingError. On Explicit mesh axes the layout is changed with `jax.sharding.reshard`."""
    mesh = _ambient_mesh()
    if mesh is None:
        return x
    free = _free_axes(mesh)
    sizes = {a: free.get(a, 1) for a in mesh.axis_names}
    spec = checked_spec(sizes, names, tuple(x.shape), f"activation {tuple(names)}", rules)
    spec = PartitionSpec(*(_on_mesh(a, mesh) for a in spec))
    explicit = {a for a, t in zip(mesh.axis_names, mesh.axis_types) if t == jax.sharding.AxisType.Explicit}
    if explicit & {a for entry in spec for a in _axes(entry)} or explicit & set(_typed_axes(x)):
        return jax.sharding.reshard(x, spec)
    return jax.lax.with_sharding_constraint(x, spec)


def _typed_axes(x) -> tuple[str, ...]:
    """The mesh axes x's type is split over (Explicit axes)."""
    spec = getattr(getattr(jax.typeof(x), "sharding", None), "spec", ())
    return tuple(a for entry in spec for a in _axes(entry))


def _on_mesh(axis, mesh):
    """A PartitionSpec entry without the mesh axes `mesh` lacks or has made manual."""
    kept = tuple(a for a in _axes(axis) if a in _free_axes(mesh))
    return kept[0] if len(kept) == 1 else (kept or None)


def split_tokens(x: jax.Array) -> jax.Array:
    """x [B, S, ...] (activations, positions, masks of the queries): S over the context axis.
    Without context parallelism x is left to XLA's sharding propagation."""
    if context_size() == 1:
        return x
    return constrain(x, ("batch", "activation_length") + (None,) * (x.ndim - 2))


def gather_keys(x: jax.Array) -> jax.Array:
    """x [B, T, ...] (latent rows, indexer keys): all T rows on every device of the context axis.
    Without context parallelism x is left to XLA's sharding propagation."""
    if context_size() == 1:
        return x
    return constrain(x, ("batch", "kv_length") + (None,) * (x.ndim - 2))


def context_size() -> int:
    """Devices the ambient mesh splits the sequence over by the activation_length rule (1
    without a mesh, or where the mesh lacks the rule's axes)."""
    mesh = _ambient_mesh()
    if mesh is None:
        return 1
    free = _free_axes(mesh)
    return math.prod(free.get(a, 1) for a in _axes(current_rules().get("activation_length")))


def split_queries(fn, per_query: dict, whole: dict):
    """fn(**per_query, **whole), each device running it for its own batch rows and queries only.

    per_query: arrays [B, S, ...] indexed by query (queries, their positions, their top-k
    indices), split along B over the data axis and along S over the context axis, as is every
    output of fn; whole: arrays every query needs (keys [B, T, ...], lengths [B]), split along
    B only, so complete along T on each device. None values are passed through. Valid for
    functions whose output row (b, s) depends only on row (b, s) of the per_query arrays and
    row b of the others (the kernel contracts of `glm_jax.ops`); without context parallelism
    this is fn(**per_query, **whole)."""
    if context_size() == 1:
        return fn(**per_query, **whole)
    mesh, rules = _ambient_mesh(), current_rules()
    batch, length = (_on_mesh(rules.get(n), mesh) for n in ("batch", "activation_length"))
    manual = {a for axis in (batch, length) for a in _axes(axis)}
    given = lambda d: {k: v for k, v in d.items() if v is not None}
    absent = {k: None for k, v in {**per_query, **whole}.items() if v is None}
    local = lambda q, w: fn(**q, **w, **absent)
    return jax.shard_map(local, in_specs=(PartitionSpec(batch, length), PartitionSpec(batch)),
                         out_specs=PartitionSpec(batch, length), axis_names=manual,
                         check_vma=False)(given(per_query), given(whole))


def per_device_bytes(tree) -> dict:
    """Bytes each device holds of a pytree of (possibly sharded) arrays: {device: bytes}."""
    out: dict = {}
    for leaf in jax.tree.leaves(tree):
        for shard in leaf.addressable_shards:
            out[shard.device] = out.get(shard.device, 0) + shard.data.size * shard.data.dtype.itemsize
    return out
