"""How one IndexShare group reads and writes the KV cache inside a cached forward.

`GroupCacheView` holds the two stores (latent [slots, pages, P, latent], index_keys [slots,
pages, P, D]) and the page table, knows which slots are the group's and where they live
(local, or LayerSplit with the owner broadcasting: `layer_split.Placement`), and gives the
decoder the order of work:

    write_latent(j, latent); write_index_keys(keys)   the chunk's rows go to the owner's slots
    indices = select(queries, weights, ...)           the indexer's top-k over the Full layer's
                                                      cached keys, run where they are
                                                      (`ops.paged_indexer_topk`: the kernel
                                                      reads the keys through the page table);
                                                      int32 [B, S, K] shared
    fetch(indices, G)                                 latent rows every layer of the group will
                                                      attend: layer 0 first, layers 1.. in a
                                                      second transfer that overlaps layer 0's
                                                      attention and MLP
    o_lat = attend(j, q_abs, indices, latent, ...)    per layer: the sparse MLA kernel over
                                                      what layer j attends

The decoder layer computes the indexer's queries and head weights and the absorbed queries
and passes them down; the view runs the kernels, so the decode step reads model -> cache view
-> kernels.

Fetch modes (static, chosen by `fetch`):
  "paged"  the group's layers are local (no LayerSplit) and S * K < T: nothing is copied; each
           layer's `ops.paged_sparse_mla` gathers the selected rows from its slot through the
           page table inside the kernel (decode: K rows however long the context)
  "rows"   LayerSplit, S * K < T: the owner gathers only the S * K selected rows per layer and
           broadcasts them; the chunk's own rows come from the local computation (no transfer)
  "slice"  S * K >= T (prefill chunks of short contexts): the whole [B, T, latent] slice, the
           smaller message
An FP8 store (`cache.fp8`) is written quantized per row; "paged" reads it in the kernels, "rows"
and "slice" move its FP8 fields (LayerSplit: the owner sends FP8 bytes) and dequantize them
after the transfer (`pages.as_rows`).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from glm_jax import ops
from glm_jax.cache.layer_split import Placement
from glm_jax.cache.pages import as_rows, gather_stored, read_stored, store_lead, stored_rows, write_rows
from glm_jax.row_chunks import in_row_chunks


def fetch_mode(num_queries: int, topk: int, max_len: int, local: bool, pinned: bool = False) -> str:
    """"paged", "rows" or "slice" (module docstring); local: no LayerSplit. pinned: never
    "slice", so that a call of any size reads the rows the same way (batch-invariant)."""
    if num_queries * topk >= max_len and not pinned:
        return "slice"
    return "paged" if local else "rows"


def by_token(fn, rows: int | None, per_query: tuple, per_sequence: tuple = (), skip: int | None = None):
    """A kernel call with every token a sequence of its own, on chunks of `rows` tokens of one
    shape (`row_chunks.in_row_chunks`), so that no token's result depends on the call's size;
    rows None: fn on the arrays as they are.

    per_query: arrays [B, S, ...]; per_sequence: arrays [B, ...] (page table, lengths), each
    token given its sequence's row. fn(*per_query as [R, S', ...], *per_sequence as [R, ...])
    -> [R, S', ...] with R sequences of S' = 1 query (B and S themselves when rows is None)
    -> [B, S, ...]. skip: the position in per_query of indices that the padding tokens fill
    with -1 (no work for the kernel; lengths in per_sequence are 0 there)."""
    if rows is None:
        return fn(*per_query, *per_sequence)
    b, s = per_query[0].shape[:2]
    spread = tuple(jnp.broadcast_to(a[:, None], (b, s) + a.shape[1:]) for a in per_sequence)
    nq = len(per_query)

    def chunk(*arrays):
        queries = [a[0][:, None] for a in arrays[:nq]]
        return fn(*queries, *(a[0] for a in arrays[nq:]))[:, 0][None]

    fills = tuple(-1 if i == skip else 0 for i in range(nq + len(spread)))
    return in_row_chunks(chunk, *per_query, *spread, rows=rows, fills=fills)


class GroupCacheView:
    """The cache seen by one IndexShare group (layers first_layer .. first_layer + G - 1, whose
    Full layer is number full_index) while tokens at positions int32 [B, S] run through it.

    Holds the stores latent [slots, pages, P, latent] and index_keys [slots, pages, P, D];
    methods replace them functionally (`KVCache.with_view` puts them back after the group ran).
    Every method that touches a store runs through `placement.manual` (per device under
    LayerSplit). `kernels`: the kernels the view reads the stores through (its selection and
    attention), and how the group's token-wise work runs (`KernelChoice.batch_invariant`)."""

    def __init__(self, latent, index_keys, page_table, placement: Placement, first_layer, full_index, positions,
                 kernels: ops.KernelChoice = ops.KernelChoice()):
        self.latent, self.index_keys, self.page_table = latent, index_keys, page_table
        self.kernels = kernels
        self.placement = placement
        self.first_layer = jnp.asarray(first_layer, jnp.int32)
        self.full_index = jnp.asarray(full_index, jnp.int32)
        self.positions = positions
        self._fetched: list[jnp.ndarray] = []
        self._mode = "slice"

    @property
    def max_len(self) -> int:
        return self.page_table.shape[1] * store_lead(self.latent)[2]

    def _write(self, store, index, rows):
        def fn(store, page_table, positions, rows, index):
            slot, mine = self.placement.locate(index, store_lead(store)[0])
            return (write_rows(store, slot, page_table, positions, rows, mine),)
        return self.placement.manual(fn, (store,), (self.page_table, self.positions, rows), (index,),
                                     out_stores=1, out_rows=0)[0]

    def write_latent(self, j: int, latent: jnp.ndarray) -> None:
        """latent [B, S, latent]: the chunk's rows of layer j of the group."""
        self.latent = self._write(self.latent, self.first_layer + j, latent)

    def write_index_keys(self, keys: jnp.ndarray) -> None:
        """keys [B, S, D]: the chunk's indexer keys of the Full layer."""
        self.index_keys = self._write(self.index_keys, self.full_index, keys)

    def select(self, queries: jnp.ndarray, weights: jnp.ndarray, *, topk: int) -> jnp.ndarray:
        """The indexer's top-k rows over the Full layer's cached keys (the chunk's own keys
        written first), computed where the keys live and shared (keys never move).

        queries [B, S, nh, D] and weights float32 [B, S, nh] (the Full layer's
        `Indexer.queries` / `Indexer.head_weights`) -> int32 [B, S, topk] row indices, -1 in
        unused slots; a query at position p may select rows 0 .. p."""
        kv_len = self.positions[:, -1] + 1                   # rows written once the chunk is
        kernels = self.kernels

        def fn(store, page_table, queries, weights, positions, kv_len, index):
            slot, mine = self.placement.locate(index, store_lead(store)[0])

            def topk_of(queries, weights, positions, kv_len, page_table):
                return ops.paged_indexer_topk(queries, store, page_table, weights, topk=topk, q_pos=positions,
                                              kv_len=kv_len, slot=slot, kernels=kernels)

            indices = by_token(topk_of, kernels.token_rows, (queries, weights, positions), (kv_len, page_table))
            return (self.placement.share(indices, mine),)
        rows = (self.page_table, queries, weights, self.positions, kv_len)
        return self.placement.manual(fn, (self.index_keys,), rows, (self.full_index,), out_stores=0, out_rows=1)[0]

    def read_latent(self, j: int) -> jnp.ndarray:
        """Every row of layer j: [B, T, latent] (e.g. the MTP layer's KVShare draft steps;
        float32 from an FP8 store, which the owner sends as FP8)."""
        def fn(store, page_table, index):
            slot, mine = self.placement.locate(index, store_lead(store)[0])
            return (as_rows(self.placement.share(read_stored(store, slot, page_table), mine)),)
        return self.placement.manual(fn, (self.latent,), (self.page_table,), (self.first_layer + j,),
                                     out_stores=0, out_rows=1)[0]

    def fetch(self, indices: jnp.ndarray, num_layers: int, *, pinned: bool = False) -> None:
        """Bring the latent rows attention of layers 0 .. num_layers-1 will read (nothing in
        "paged" mode: the kernels read them in place); indices int32 [B, S, K]. pinned: the
        same mode for a call of any size (`fetch_mode`)."""
        placement = self.placement
        self._mode = mode = fetch_mode(indices.shape[1], indices.shape[2], self.max_len, placement.split is None,
                                       pinned)
        if mode == "paged":
            return

        def fn(store, page_table, indices, first_layer):
            def owned(j):
                """Layer j's rows in the store's layout (FP8 rows travel as FP8)."""
                slot, mine = placement.locate(first_layer + j, store_lead(store)[0])
                if mode == "rows":
                    latent = gather_stored(store, slot, page_table, indices)
                else:
                    latent = read_stored(store, slot, page_table)
                if mine is True:
                    return latent
                return jax.tree.map(lambda x: jnp.where(mine, x, jnp.zeros_like(x)), latent)

            # Layer 0 is needed at once; layers 1.. travel in one message while layer 0 computes.
            first = as_rows(placement.share(owned(0), True))
            if num_layers == 1:
                return (first,)
            rest = jax.tree.map(lambda *xs: jnp.stack(xs, axis=1), *[owned(j) for j in range(1, num_layers)])
            return first, as_rows(placement.share(rest, True))

        out = placement.manual(fn, (self.latent,), (self.page_table, indices), (self.first_layer,),
                               out_stores=0, out_rows=min(num_layers, 2))
        self._fetched = [out[0]] + ([out[1][:, j] for j in range(num_layers - 1)] if num_layers > 1 else [])

    def attend(self, j: int, q: jnp.ndarray, indices: jnp.ndarray, latent: jnp.ndarray, *, sm_scale: float,
               v_dim: int) -> jnp.ndarray:
        """Sparse MLA of layer j (after `fetch`): q [B, S, H, latent] absorbed queries, indices
        int32 [B, S, K] the group's top-k, latent [B, S, latent] layer j's rows of the running
        chunk (already written) -> o_lat [B, S, H, v_dim].

        "paged": `ops.paged_sparse_mla` reads the rows from layer j's slot through the page
        table; else `ops.sparse_mla` over the fetched rows (`attended_latent`)."""
        if self._mode == "paged":
            return self.attend_cached(j, q, indices, sm_scale=sm_scale, v_dim=v_dim)
        kv, kv_indices = self.attended_latent(j, indices, latent)
        kw = dict(sm_scale=sm_scale, v_dim=v_dim, kernels=self.kernels)
        if self.kernels.token_rows is None:
            return ops.sparse_mla(q, kv.astype(q.dtype), kv_indices, **kw)[0]
        # "rows" (pinned): each token attends its own K gathered rows
        b, s, k = indices.shape
        own_rows = kv.reshape(b, s, k, -1).astype(q.dtype)
        own_slots = jnp.where(indices >= 0, jnp.arange(k, dtype=jnp.int32), -1)
        attend_one = lambda q, rows, slots: ops.sparse_mla(q, rows[:, 0], slots, **kw)[0]
        return by_token(attend_one, self.kernels.token_rows, (q, own_rows, own_slots), skip=2)

    def attend_cached(self, j: int, q: jnp.ndarray, indices: jnp.ndarray, *, sm_scale: float,
                      v_dim: int) -> jnp.ndarray:
        """Sparse MLA of layer j over cached rows only (indices int32 [B, S, K] name written
        rows; e.g. the MTP layer's KVShare draft steps): q [B, S, H, latent] -> [B, S, H, v_dim].
        Local layers: `ops.paged_sparse_mla` through the page table; LayerSplit: over the
        owner's broadcast sequence (`read_latent`)."""
        kw = dict(sm_scale=sm_scale, v_dim=v_dim, kernels=self.kernels)
        if self.placement.split is None:
            def attend_one(q, indices, page_table):
                return ops.paged_sparse_mla(q, self.latent, page_table, indices, slot=self.first_layer + j, **kw)[0]
            return by_token(attend_one, self.kernels.token_rows, (q, indices), (self.page_table,), skip=1)
        return ops.sparse_mla(q, self.read_latent(j).astype(q.dtype), indices, **kw)[0]

    def attended_latent(self, j: int, indices: jnp.ndarray, latent: jnp.ndarray):
        """-> (latent [B, T', latent], indices int32 [B, S, K] into it): what layer j attends in
        "rows" and "slice" modes.

        latent [B, S, latent]: layer j's rows of the running chunk, patched in locally as the
        store gives them back (`stored_rows`: FP8 rows quantized and dequantized)."""
        fetched = self._fetched[j]
        latent = stored_rows(self.latent, latent)
        b, s, k = indices.shape
        if self._mode == "slice":
            return fetched.at[jnp.arange(b)[:, None], self.positions].set(latent, mode="drop"), indices
        rel = indices - self.positions[:, :1, None]
        in_chunk = (indices >= 0) & (rel >= 0) & (rel < s)
        local = jax.vmap(lambda chunk, r: chunk[r])(latent, jnp.clip(rel, 0, s - 1))   # [B, S, K, latent]
        attended = jnp.where(in_chunk[..., None], local, fetched)
        slots = jnp.arange(s, dtype=jnp.int32)[:, None] * k + jnp.arange(k, dtype=jnp.int32)[None, :]
        return attended.reshape(b, s * k, -1), jnp.where(indices >= 0, slots[None], -1)

