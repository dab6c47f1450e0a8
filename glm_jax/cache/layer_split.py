"""LayerSplit: each device along the mesh's `layer` axis stores the KV cache of a disjoint
subset of layers, so the per-device cache shrinks as 1/n with n devices on that axis.

Ownership is by blocks of the flat layer index: with m = ceil(layers / n) slots per device,
layer l lives on device l // m of the axis, in its local slot l % m (the latent cache has one
slot per decoder layer, the indexer-key cache one per Full layer; the padding slots of the
last device are never written). Weights and activations are replicated along the axis, so
every device runs every layer; what moves is the owner's cache, and only what attention
needs (see `view.GroupCacheView`):

* the Full layer's top-k indices: the owner runs the indexer top-k over its keys; the int32
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
from jax.sharding import Mesh, PartitionSpec

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
    """Where layer l's rows live, and how code that touches the cache runs.

    Without a split every layer is local (slot l, owned here) and `manual` just calls. With
    one, `manual` runs its function under `jax.shard_map`, manual over the split axis and the
    `data` axis: the function sees this device's cache slots [local slots, local pages, P, D],
    its batch rows, and page ids made local; the other mesh axes (tensor) stay automatic. Only
    cache access runs there: the weights outside may be sharded over the `layer` axis too."""

    def __init__(self, split: LayerSplit | None):
        self.split = split

    def manual(self, fn, stores: tuple, rows: tuple, scalars: tuple = (), *, out_stores: int, out_rows: int):
        """fn(*local_stores, local_page_table..., *rows, *scalars) -> (stores..., rows...).

        stores: cache stores [slots, pages, P, D] (or FP8 NamedTuples of such fields); rows:
        arrays with a leading batch dim (the page table first); scalars: replicated int32 values."""
        if self.split is None:
            return fn(*stores, *rows, *scalars)
        mesh, axis = self.split.mesh, self.split.axis
        data = "data" if mesh.shape.get("data", 1) > 1 else None

        def local(*args):
            st, rw, sc = args[:len(stores)], list(args[len(stores):len(stores) + len(rows)]), args[len(stores) + len(rows):]
            if data is not None:          # page ids are global; this device holds a contiguous range
                rw[0] = rw[0] - jax.lax.axis_index(data) * jax.tree.leaves(st[0])[0].shape[1]
            return fn(*st, *rw, *sc)

        store_spec, row_spec = PartitionSpec(axis, data), PartitionSpec(data)
        out = jax.shard_map(local, mesh=mesh,
                            in_specs=(store_spec,) * len(stores) + (row_spec,) * len(rows) + (PartitionSpec(),) * len(scalars),
                            out_specs=(store_spec,) * out_stores + (row_spec,) * out_rows,
                            axis_names={axis} | ({data} - {None}), check_vma=False)(*stores, *rows, *scalars)
        return out

    def locate(self, index, slots: int):
        """Global layer index (int or int32 scalar) -> (local slot, owned by this device: bool).
        slots: local slots per device. Inside `manual` only."""
        if self.split is None:
            return index, True
        return index % slots, jax.lax.axis_index(self.split.axis) == index // slots

    def share(self, x: jnp.ndarray, mine) -> jnp.ndarray:
        """The owner's x (an array or a pytree of them, e.g. FP8 rows) on every device (x computed
        everywhere, valid only where mine). Inside `manual`."""
        if self.split is None:
            return x
        return jax.tree.map(lambda a: broadcast_from_owner(a, mine, self.split.axis, self.split.size,
                                                           self.split.collective), x)


def broadcast_from_owner(x: jnp.ndarray, mine, axis: str, size: int, collective: str = "permute") -> jnp.ndarray:
    """Inside shard_map over `axis`: the value of x on the one device where `mine` is True.

    Exact: the other devices contribute zeros, and x + 0 == x. One-byte floats (FP8 rows) travel
    as their uint8 bits, summed as integers."""
    if jnp.issubdtype(x.dtype, jnp.floating) and jnp.dtype(x.dtype).itemsize == 1:
        bits = broadcast_from_owner(jax.lax.bitcast_convert_type(x, jnp.uint8), mine, axis, size, collective)
        return jax.lax.bitcast_convert_type(bits, x.dtype)
    own = jnp.where(mine, x, jnp.zeros_like(x))
    if collective == "psum":
        return jax.lax.psum(own, axis)
    total = own
    for shift in range(1, size):
        total = total + jax.lax.ppermute(own, axis, [(i, (i + shift) % size) for i in range(size)])
    return total
