"""LayerSplit: each device along the mesh's `layer` axis stores the KV cache of a disjoint
subset of layers, so the per-device cache shrinks as 1/n with n devices on that axis.

Ownership is by blocks of the flat layer index: with m = ceil(layers / n) slots per device,
layer l lives on device l // m of the axis, in its local slot l % m (the latent cache has one
slot per decoder layer, the indexer-key cache one per Full layer; the padding slots of the
last device are never written). Weights and activations are replicated along the axis, so
every device runs every layer; what moves is the owner's cache, and only what attention
needs (see `cache_view.GroupCacheView`):

* the Full layer's top-k indices: the owner runs the indexer over its keys; the int32
  [B, S, topk] result is broadcast (keys never move);
* the latent rows those indices select, for every layer of the IndexShare group, fetched
  right after the indices exist so the transfers for layers 1.. overlap layer 0's compute;
  a prefill chunk whose S * topk rows would exceed the context fetches the whole slice.

`collective` picks how the owner's value reaches the other devices:
  "permute"  n-1 ring-shift collective permutes of the owner-masked value; XLA runs them as
             async collective-permute-start/done pairs overlapped with compute (the default)
  "psum"     one all-reduce of the owner-masked value (less bandwidth for big messages; on TPU
             it is scheduled synchronously)
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jax.sharding import Mesh

COLLECTIVES = ("permute", "psum")


@dataclasses.dataclass(frozen=True)
class LayerSplit:
    """Static description of a layer-split cache: the mesh, its axis, the broadcast collective."""

    mesh: Mesh
    axis: str = "layer"
    collective: str = "permute"

    def __post_init__(self):
        if self.axis not in self.mesh.shape:
            raise ValueError(f"LayerSplit axis {self.axis!r} is not a mesh axis ({tuple(self.mesh.shape)})")
        if self.collective not in COLLECTIVES:
            raise ValueError(f"LayerSplit collective must be one of {COLLECTIVES}, got {self.collective!r}")

    @property
    def size(self) -> int:
        return self.mesh.shape[self.axis]

    def slots_per_device(self, count: int) -> int:
        """Local slots each device keeps for `count` layers."""
        return -(-count // self.size)

    def padded(self, count: int) -> int:
        """Global slot count: `count` rounded up to a whole number of slots on every device."""
        return self.slots_per_device(count) * self.size


def padded_slots(split: LayerSplit | None, count: int) -> int:
    return count if split is None else split.padded(count)


class Placement:
    """Inside a traced forward: where layer l's rows live and how the owner shares a value.

    Without a split every layer is local (slot l, owned here). With one, the code runs inside
    `jax.shard_map` over `split.axis` and sees only the local slots."""

    def __init__(self, split: LayerSplit | None, latent_slots: int, key_slots: int):
        self.split = split
        self.latent_slots, self.key_slots = latent_slots, key_slots   # local slots per device

    def locate(self, index, slots: int):
        """Global layer index (int or int32 scalar) -> (local slot, owned by this device: bool)."""
        if self.split is None:
            return index, True
        return index % slots, jax.lax.axis_index(self.split.axis) == index // slots

    def share(self, x: jnp.ndarray, mine) -> jnp.ndarray:
        """The owner's x on every device (x computed everywhere, valid only where mine)."""
        if self.split is None:
            return x
        return broadcast_from_owner(x, mine, self.split.axis, self.split.size, self.split.collective)


def broadcast_from_owner(x: jnp.ndarray, mine, axis: str, size: int, collective: str = "permute") -> jnp.ndarray:
    """Inside shard_map over `axis`: the value of x on the one device where `mine` is True.

    Exact: the other devices contribute zeros, and x + 0 == x."""
    own = jnp.where(mine, x, jnp.zeros_like(x))
    if collective == "psum":
        return jax.lax.psum(own, axis)
    total = own
    for shift in range(1, size):
        total = total + jax.lax.ppermute(own, axis, [(i, (i + shift) % size) for i in range(size)])
    return total
