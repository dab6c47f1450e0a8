"""Logical axes: the names every parameter and activation dimension of the layers carries, and
the rules that map them to the axes of a mesh (as Flax and MaxText do it).

Each parameter of the library's layers holds its dimensions' logical names as Flax NNX sharding
metadata (`nnx.Param(..., out_sharding=names)`, read by `nnx.get_partition_spec`); one rules
table {logical name: mesh axis, tuple of mesh axes (split over their product), or None
(replicated)} maps them onto a mesh. `glm_jax.sharding.shard_params` places a model's state by
its annotations through the rules, and the activation constraints inside the layers go through
the same rules. A parameter of your own layer annotated the same way (`param`, or
`nnx.with_partitioning(init, names, eager_sharding=False)`) is sharded by its own annotation.

    rules = make_rules(batch="batch", heads="model", mlp="model", vocab="model")  # the rest replicated
    params = shard_params(nnx.state(model), mesh, rules)
    with use_rules(rules):          # (or use_rules(rules) once) the layers' activation constraints
        ...

`LOGICAL_AXIS_RULES` are the library's defaults for its own mesh (`glm_jax.sharding.make_mesh`:
data, context, tensor, layer).
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Mapping

import jax
import jax.numpy as jnp
from flax import nnx
from flax.core import spmd as core_spmd

#: The logical names, each with what it names.
LOGICAL_AXES: dict[str, str] = {
    # activations
    "batch": "rows of a batch",
    "activation_length": "tokens of full-sequence activations (the queries)",
    "kv_length": "key rows every query may attend (latent rows, indexer keys)",
    # parameters
    "vocab": "the vocabulary (embedding rows, head columns)",
    "embed": "the model dimension of the large matrices (embedding, head, o_proj, MLPs, experts)",
    "hidden": "the model dimension kept whole (norm scales, low-rank and indexer input projections, router)",
    "heads": "attention heads (q_b, kv_b outputs; o_proj input)",
    "index_heads": "the lightning indexer's query heads",
    "index_weights": "the indexer's per-head weights (weights_proj output)",
    "q_lora": "the query's low-rank dimension",
    "kv_lora": "the key-value low-rank dimension",
    "latent": "a cached latent row (kv_lora + rope) or the indexer's head dimension",
    "mlp": "dense FFN columns (the MLP and the shared experts)",
    "experts": "routed experts",
    "expert_mlp": "the FFN columns of one routed expert",
    "router_experts": "the router's expert scores (router rows, correction bias)",
    "mtp_concat": "the MTP layer's joined [embedding ; hidden] input",
    "stack": "stacked IndexShare groups (the scan axis of parameters)",
    # the KV cache (glm_jax.cache.axes)
    "cache_layers": "LayerSplit: one slot per layer (latent) / per Full layer (keys)",
    "cache_pages": "pages of the cache pool (contiguous cache: one page per row)",
    "page_rows": "token rows inside a page",
}

Rules = Mapping[str, "str | tuple[str, ...] | None"]

#: The library's defaults: logical name -> axis of its own mesh (data, context, tensor, layer).
LOGICAL_AXIS_RULES: dict[str, str | tuple[str, ...] | None] = {
    "batch": "data",
    "activation_length": "context",  # context parallelism: each device holds S / context queries
    "kv_length": None,          # gathered: every query shard sees its whole causal prefix
    "vocab": "tensor",
    "embed": None,
    "hidden": None,
    "heads": "tensor",
    "index_heads": "tensor",
    "index_weights": None,
    "q_lora": None,
    "kv_lora": None,
    "latent": None,
    "mlp": "tensor",
    "experts": ("tensor", "layer"),  # expert parallelism over tensor x layer devices
    "expert_mlp": None,
    "router_experts": None,
    "mtp_concat": None,
    "stack": None,
    "cache_layers": "layer",
    "cache_pages": "data",
    "page_rows": None,
}


def make_rules(**mesh_axes) -> dict:
    """Rules for a mesh of your own: every logical name replicated (None) except those given,
    e.g. make_rules(batch="batch", heads="model", mlp="model", vocab="model")."""
    unknown = sorted(set(mesh_axes) - set(LOGICAL_AXES))
    if unknown:
        raise ValueError(f"make_rules: {unknown[0]!r} is not a logical axis; the logical axes are "
                         f"{', '.join(LOGICAL_AXES)} (a name of your own layers: add it to the dict make_rules returns)")
    return {**dict.fromkeys(LOGICAL_AXES), **mesh_axes}


def as_rules(rules) -> dict:
    """A rules dict from a dict or Flax's sequence of (logical name, mesh axis) pairs."""
    if isinstance(rules, Mapping):
        out = dict(rules)
    else:
        try:
            out = {name: axis for name, axis in rules}
        except (TypeError, ValueError):
            raise TypeError(f"rules must be a dict {{logical name: mesh axis or None}} or (name, axis) pairs, "
                            f"got {type(rules).__name__}") from None
    for name, axis in out.items():
        axes = axis if isinstance(axis, tuple) else (axis,)
        if not all(isinstance(a, str) for a in axes) and axis is not None:
            raise TypeError(f"rules: {name!r} maps to {axis!r}; a rule's value is a mesh axis name, a tuple of "
                            "them, or None (replicated)")
    return out


class _Current(threading.local):
    rules: dict | None = None


_current = _Current()


class use_rules:
    """Sets the rules the layers' activation constraints (and `shard_params` without rules)
    follow: `use_rules(rules)` from now on, or `with use_rules(rules):` for a block.
    use_rules(None) goes back to the library's LOGICAL_AXIS_RULES."""

    def __init__(self, rules):
        self._previous = _current.rules
        _current.rules = None if rules is None else as_rules(rules)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        _current.rules = self._previous


def current_rules() -> dict:
    """The rules set by `use_rules`, else LOGICAL_AXIS_RULES."""
    return LOGICAL_AXIS_RULES if _current.rules is None else _current.rules


# ------------------------------------------------------------------ parameter annotations
def param(value, names: tuple[str | None, ...], kind=nnx.Param) -> nnx.Variable:
    """nnx.Param(value) (or another Variable `kind`) whose dimensions carry the logical `names`
    (Flax NNX sharding metadata; placed later by `shard_params`, not when created)."""
    names = tuple(names)
    if len(names) != jnp.ndim(value):
        raise ValueError(f"{len(names)} logical names {names} for a parameter of shape {jnp.shape(value)}")
    return kind(value, out_sharding=names, eager_sharding=False)


def names_of(variable) -> tuple[str | None, ...] | None:
    """The logical names a Variable carries (None where it carries none)."""
    if not isinstance(variable, nnx.Variable):
        return None
    names = variable.get_metadata().get("out_sharding")
    return tuple(names) if names else None


def add_stack_axis(module) -> None:
    """Prefix "stack" to the names of every annotated Variable of `module`, whose values carry
    a leading axis of stacked groups (`glm_jax.model`)."""
    for _, variable in nnx.iter_graph(module):
        if isinstance(variable, nnx.Variable) and (names := names_of(variable)) is not None:
            variable.set_metadata(out_sharding=("stack",) + names)


def check_dtype(owner: str, name: str, dtype) -> None:
    """TypeError unless dtype is None or a JAX floating dtype."""
    if dtype is None:
        return
    try:
        ok = jnp.issubdtype(jnp.dtype(dtype), jnp.floating)
    except TypeError:
        ok = False
    if not ok:
        raise TypeError(f"{owner}: {name} must be a floating dtype (e.g. jnp.bfloat16) or None, got {dtype!r}")


def explicit_axes() -> bool:
    """Whether the ambient mesh (`jax.set_mesh`) has Explicit axes."""
    mesh = jax.sharding.get_abstract_mesh()
    return not mesh.empty and any(t == jax.sharding.AxisType.Explicit for t in mesh.axis_types)


def leading_spec(x, rank: int, keep: int) -> jax.sharding.PartitionSpec:
    """A PartitionSpec of `rank` entries: x's type's first `keep` entries (its Explicit
    sharding), the rest None (replicated)."""
    spec = tuple(getattr(getattr(jax.typeof(x), "sharding", None), "spec", ()) or ())
    spec = (spec + (None,) * keep)[:keep]
    return jax.sharding.PartitionSpec(*(spec + (None,) * (rank - keep))[:rank])


def on_auto_axes(module, fn, args: tuple, out_sharding):
    """fn(module, *args) with the ambient mesh's Explicit axes made Auto inside
    (`jax.sharding.auto_axes`): the layers' insides leave the layout to XLA's propagation, as on
    an Auto mesh, and the outputs come back laid out by `out_sharding`."""
    graphdef, state = nnx.split(module)

    def pure(state, args):
        return fn(nnx.merge(graphdef, state), *args)

    return jax.sharding.auto_axes(pure, out_sharding=out_sharding)(state, args)


def _present(entry, axes: set[str]):
    """A rule's value with the mesh axes outside `axes` dropped (None where none is left)."""
    kept = tuple(a for a in ((entry,) if isinstance(entry, str) else entry or ()) if a in axes)
    return kept[0] if len(kept) == 1 else (kept or None)


@contextlib.contextmanager
def flax_rules(rules=None):
    """Within: Flax's logical-axis rules (`flax.core.spmd.logical_axis_rules`) are `rules`
    (default `current_rules()`) on the ambient mesh, so that Flax's own machinery that places
    annotated Variables on that mesh (`nnx.eval_shape`, `nnx.get_abstract_model`,
    `nnx.get_partition_spec`) resolves the layers' logical names to its axes."""
    mesh = jax.sharding.get_abstract_mesh()
    axes = set() if mesh.empty else set(mesh.axis_names)
    rules = current_rules() if rules is None else as_rules(rules)
    with core_spmd.logical_axis_rules(tuple((name, _present(entry, axes)) for name, entry in rules.items())):
        yield


def eval_shape(fn):
    """nnx.eval_shape(fn) (a module of ShapeDtypeStructs) under `flax_rules()`: on a mesh set
    with `jax.set_mesh` Flax gives each annotated Variable the sharding its logical names map to."""
    with flax_rules():
        return nnx.eval_shape(fn)
