"""Decoder layers and IndexShare groups.

A group is one Full layer (it owns a lightning indexer) followed by the Shared layers that
reuse its top-k indices. `IndexShareGroup` runs its layers in order; `plan_groups` cuts the
layer list into groups and stacks consecutive groups of identical structure so the model can
`jax.lax.scan` over them (GLM-5.2: 3 scans instead of 78 Python-level layers).

Attention modes for full-sequence calls (`ForwardOptions.mode`, glm_jax.forward_options, holds
them with the call's other static choices):
  "sparse"  attend the indexer's top-k set (what the model does in inference and sparse training)
  "dense"   attend every causal position (the indexer's dense warm-up stage)
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx
from jax.ad_checkpoint import checkpoint_name

from glm_jax import ops
from glm_jax.config import GLMConfig
from glm_jax.forward_options import ForwardOptions, check_options
from glm_jax.layers.checks import check_config, check_hidden, check_rows
from glm_jax.layers.dense_indexer_kl import DenseTarget, dense_group_kl
from glm_jax.layers.indexer import Indexer
from glm_jax.layers.mla import MLAProjection, indices_to_mask
from glm_jax.layers.moe import MLP, MoE
from glm_jax.layers.norms import RMSNorm
from glm_jax.layers.segments import query_rows, segment_table
from glm_jax.layers.selected_kl import add_target, head_summed_target, indexer_kl, selected_set_kl
from glm_jax.logical_axes import check_dtype, explicit_axes, leading_spec, on_auto_axes
from glm_jax.row_chunks import in_row_chunks
from glm_jax.sharding import gather_keys, split_tokens


@dataclasses.dataclass(frozen=True)
class LayerKind:
    is_full: bool
    is_moe: bool


@dataclasses.dataclass(frozen=True)
class GroupStackPlan:
    """`count` consecutive IndexShare groups of identical `kinds`, starting at `first_layer`."""

    first_layer: int
    kinds: tuple[LayerKind, ...]
    count: int

    @property
    def layers(self) -> range:
        return range(self.first_layer, self.first_layer + self.count * len(self.kinds))


def plan_groups(cfg: GLMConfig) -> tuple[GroupStackPlan, ...]:
    """Cut the decoder layers into IndexShare groups and stack identical neighbours."""
    kinds = [LayerKind(f, m) for f, m in zip(cfg.layer_is_full, cfg.layer_is_moe)]
    groups: list[tuple[int, tuple[LayerKind, ...]]] = []
    for i, kind in enumerate(kinds):
        if kind.is_full:
            groups.append((i, (kind,)))
        else:
            start, members = groups[-1]
            groups[-1] = (start, members + (kind,))
    stacks: list[GroupStackPlan] = []
    for start, members in groups:
        if stacks and stacks[-1].kinds == members:
            stacks[-1] = dataclasses.replace(stacks[-1], count=stacks[-1].count + 1)
        else:
            stacks.append(GroupStackPlan(start, members, 1))
    return tuple(stacks)


def _check_layer_args(owner: str, cfg: GLMConfig, kinds: tuple[LayerKind, ...]) -> None:
    """TypeError unless cfg is a GLMConfig and kinds one or more LayerKinds."""
    check_config(owner, cfg)
    if not kinds or not all(isinstance(k, LayerKind) for k in kinds):
        raise TypeError(f"{owner}: the layer kinds must be LayerKind(is_full, is_moe) values, got {kinds!r}")


class DecoderLayer(nnx.Module):
    """One layer: MLA attention (and, in a Full layer, the lightning indexer), then an MLP or
    the MoE. dtype: the computation's dtype (default None: the parameters'); param_dtype: the
    parameters' (default cfg.dtype)."""

    def __init__(self, cfg: GLMConfig, kind: LayerKind, *, rngs: nnx.Rngs, dtype=None, param_dtype=None):
        _check_layer_args("DecoderLayer", cfg, (kind,))
        check_dtype("DecoderLayer", "dtype", dtype)
        check_dtype("DecoderLayer", "param_dtype", param_dtype)
        pd = param_dtype or jnp.dtype(cfg.dtype)
        kw = dict(rngs=rngs, dtype=dtype, param_dtype=pd)
        self.input_layernorm = RMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps, dtype=dtype, param_dtype=pd)
        self.self_attn = MLAProjection(cfg, **kw)
        self.indexer = Indexer(cfg, **kw) if kind.is_full else None
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps, dtype=dtype, param_dtype=pd)
        self.mlp = MoE(cfg, **kw) if kind.is_moe else MLP(cfg.hidden_size, cfg.intermediate_size, **kw)
        self.kind = kind

    def attention_inputs(self, x, positions):
        """x [B, S, hidden] -> (normed h, q_resid, q_nope, q_rope, latent rows [B, S, latent])."""
        h = self.input_layernorm(x)
        q_resid = self.self_attn.query_residual(h)
        q_nope, q_rope = self.self_attn.queries(q_resid, positions)
        return h, q_resid, q_nope, q_rope, self.self_attn.latent(h, positions)

    def finish(self, x, attn_out, dispatch: str | None = None):
        """x + attn_out, then the MLP (MoE: its experts run by `dispatch`, `moe.DISPATCH`)."""
        x = x + attn_out
        h = self.post_attention_layernorm(x)
        return x + (self.mlp(h, dispatch) if self.kind.is_moe else self.mlp(h))


_TOPK_NAME = "indexer_topk"
#: Remat policy of a layer: keep the top-k indices and their sorted backward index (integers,
#: costly to select or sort again).
_SAVE_TOPK = jax.checkpoint_policies.save_only_these_names(_TOPK_NAME)
#: The same, also keeping the sparse attention's outputs (`ForwardOptions.keep_attention`).
_SAVE_TOPK_AND_ATTENTION = jax.checkpoint_policies.save_only_these_names(_TOPK_NAME, ops.SPARSE_MLA_SAVED)


class _IndexerOutputs(NamedTuple):
    """What a group's Full layer computes for all of its layers (None where unused):
    indices int32 [B, S, topk] (sparse mode), index_logits float32 [B, S, T] (expanded-form
    indexer loss), index_inputs (indexer queries, keys, head weights; absorbed-form loss),
    tindex (absorbed sparse mode: the attention backward's index of `indices`, sorted once per
    group; None where the kernel takes none)."""

    indices: jax.Array | None = None
    index_logits: jax.Array | None = None
    index_inputs: tuple | None = None
    tindex: Any = None


@dataclasses.dataclass(frozen=True)
class _Rows:
    """Where a full-sequence call's tokens sit: length S, positions int32 [B, S], kv_len int32
    [B], kv_start int32 [B, S] or None (see `IndexShareGroup.forward`)."""

    length: int
    positions: jax.Array
    kv_len: jax.Array
    kv_start: jax.Array | None

    def causal(self) -> jax.Array:
        """bool [B, S, S]: key t is visible to query s (causal, valid, same document)."""
        t = jnp.arange(self.length)[None, None, :]
        mask = (t <= query_rows(self.positions, self.kv_start)[:, :, None]) & (t < self.kv_len[:, None, None])
        if self.kv_start is not None:
            mask = mask & (t >= self.kv_start[:, :, None])
        return mask


class GroupOutput(NamedTuple):
    """What `IndexShareGroup` returns for a full sequence."""

    x: jax.Array                  # [B, S, hidden]
    indexer_kl: jax.Array         # scalar float32: the indexer KL summed over the group's layers (0 unless asked)
    latent: jax.Array             # [B, S, kv_lora_rank + qk_rope_head_dim]: the Full layer's latent rows
    indices: jax.Array | None     # int32 [B, S, index_topk]: the Full layer's top-k (None in dense mode)


class IndexShareGroup(nnx.Module):
    """One Full layer and the Shared layers that reuse its indices.

    group = IndexShareGroup(cfg, kinds, rngs=nnx.Rngs(0))
    out = group(x, options=ForwardOptions())     # GroupOutput(x, indexer_kl, latent, indices)

    dtype: the computation's dtype (default None: the parameters'); param_dtype: the
    parameters' (default cfg.dtype)."""

    def __init__(self, cfg: GLMConfig, kinds: tuple[LayerKind, ...], *, rngs: nnx.Rngs, dtype=None,
                 param_dtype=None):
        kinds = tuple(kinds)
        _check_layer_args("IndexShareGroup", cfg, kinds)
        if not kinds[0].is_full or any(k.is_full for k in kinds[1:]):
            raise ValueError(f"IndexShareGroup: a group is one Full layer followed by Shared ones; got is_full "
                             f"{[k.is_full for k in kinds]}")
        self.layers = nnx.List([DecoderLayer(cfg, k, rngs=rngs, dtype=dtype, param_dtype=param_dtype)
                                for k in kinds])
        self.cfg = cfg

    def __call__(self, x, positions=None, kv_len=None, options: ForwardOptions | None = None, *,
                 shared_kv=None, kv_start=None) -> GroupOutput:
        """Full-sequence forward. x [B, S, hidden]; positions int32 [B, S] (default 0..S-1 in
        every row), kv_len int32 [B] (default S: every token valid), options (default
        ForwardOptions()).

        kv_start: optional int32 [B, S] for packed rows (`segments`): the row where each token's
        document starts; positions then count from it, and no query attends (or, through the
        indexer, selects) a key of another document.

        shared_kv: optional (latent [B, S, latent], indices [B, S, topk] or None in dense mode)
        of an earlier pass (KVShare training of MTP depths >= 2): the Full layer then attends
        those latent rows with those indices instead of its own, and runs no indexer.

        options.remat: each layer is rematerialised in the backward pass; between the forward
        and the backward pass only its input and the Full layer's indexer outputs are kept, and
        the top-k is not recomputed. The absorbed form's dense-stage indexer loss also keeps
        each layer's `DenseTarget` (its absorbed queries and latent rows: per token
        (H + 1) * (kv_lora + rope) values a layer, in the activation dtype).

        Context parallelism (`sharding`): x, positions and every per-query array stay split along
        S; each layer's latent rows and the indexer keys are gathered, so every query shard
        attends (and selects from) its whole causal prefix.
        -> (x [B, S, hidden], indexer KL summed over the group's layers (scalar float32),
            the Full layer's latent rows [B, S, latent], its indices [B, S, topk] or None) as a
            `GroupOutput`."""
        x, positions, kv_len, options = _group_inputs(self.cfg, x, positions, kv_len, options, kv_start)
        if explicit_axes():
            rows = leading_spec(x, 3, 2)
            out = GroupOutput(rows, jax.sharding.PartitionSpec(), rows, rows if options.mode == "sparse" else None)
            call = lambda group, x, positions, kv_len, shared_kv, kv_start: group(
                x, positions, kv_len, options, shared_kv=shared_kv, kv_start=kv_start)
            return on_auto_axes(self, call, (x, positions, kv_len, shared_kv, kv_start), out)
        if x.shape[1] > self.cfg.max_position_embeddings:
            raise ValueError(f"a sequence of {x.shape[1]} tokens is longer than max_position_embeddings="
                             f"{self.cfg.max_position_embeddings}; shorten it or raise max_position_embeddings")
        rows = _Rows(x.shape[1], positions, kv_len, kv_start)
        x = split_tokens(x)
        found = _IndexerOutputs() if shared_kv is None else _IndexerOutputs(indices=shared_kv[1])
        kl, first_latent, targets, dense_targets = jnp.zeros((), jnp.float32), None, None, []
        share = 1.0 / len(self.layers)
        for j, layer in enumerate(self.layers):
            forward = functools.partial(_layer_forward, j=j, share=share, rows=rows, options=options,
                                        shared_kv=shared_kv)
            if options.remat:
                forward = _rematerialised(forward, options.keep_attention)
            x, layer_kl, target, latent, found = forward(layer, x, found)
            kl = kl + layer_kl
            if isinstance(target, DenseTarget):
                dense_targets.append(target)
            elif target is not None:
                targets = add_target(targets, target, share)
            if j == 0:
                first_latent = latent
        if targets is not None:          # the absorbed form's KL: the indexer side once per group
            idx_q, idx_keys, idx_w = found.index_inputs
            kl = kl + selected_set_kl(targets, idx_q=idx_q, idx_keys=idx_keys, idx_w=idx_w,
                                      indices=found.indices, options=options)
        if dense_targets:
            idx_q, idx_keys, idx_w = found.index_inputs
            kl = kl + dense_group_kl(dense_targets, idx_q=idx_q, idx_keys=idx_keys, idx_w=idx_w,
                                     sm_scale=self.layers[0].self_attn.sm_scale, kv_len=kv_len, kv_start=kv_start,
                                     options=options)
        return GroupOutput(split_tokens(x), kl, first_latent, found.indices)

    #: The same as calling the group (the name earlier code uses).
    forward = __call__

    def forward_cached(self, x, positions, view):
        """Forward of new tokens against the cache, through `view` (glm_jax.cache.GroupCacheView,
        which holds the kernels it is read through).

        The Full layer writes its latent rows and indexer keys and hands its indexer queries to
        the view, which selects the top-k where the keys live; then the latent rows every layer
        will attend are fetched at once (or, with the layers local, read by the kernel through
        the page table); each layer writes its chunk rows to its cache slot and hands its
        absorbed queries to the view, which runs the attention kernel. The token-wise work
        before and after attention runs in fixed row chunks when the view's kernels are
        batch-invariant (`_CachedInputs`, `_cached_outputs`).
        x [B, S, hidden]; positions int32 [B, S] (the view's)
        -> (x [B, S, hidden], the Full layer's indices int32 [B, S, topk])."""
        kernels = view.kernels
        indices = None
        for j, layer in enumerate(self.layers):
            inputs = in_row_chunks(functools.partial(_cached_inputs, layer, indexer=j == 0), x, positions,
                                   rows=kernels.token_rows)
            view.write_latent(j, inputs.latent)
            if j == 0:
                view.write_index_keys(inputs.index_keys)
                indices = view.select(inputs.index_queries, inputs.index_weights, topk=self.cfg.index_topk)
                view.fetch(indices, len(self.layers), pinned=kernels.batch_invariant)
            o_lat = view.attend(j, inputs.q_abs, indices, inputs.latent, sm_scale=layer.self_attn.sm_scale,
                                v_dim=self.cfg.kv_lora_rank)
            x = _cached_outputs(layer, x, o_lat, view)
        return x, indices

    def forward_reusing_indices(self, x, positions, view, indices):
        """KVShare draft step: attend the cached latent rows named by `indices` (computed
        earlier), running no indexer and writing nothing. x [B, S, hidden], view: the group's
        cache (glm_jax.cache.GroupCacheView), indices int32 [B, S, topk] -> x [B, S, hidden]."""
        kernels = view.kernels
        for j, layer in enumerate(self.layers):
            inputs = in_row_chunks(functools.partial(_cached_inputs, layer, indexer=False), x, positions,
                                   rows=kernels.token_rows)
            o_lat = view.attend_cached(j, inputs.q_abs, indices, sm_scale=layer.self_attn.sm_scale,
                                       v_dim=self.cfg.kv_lora_rank)
            x = _cached_outputs(layer, x, o_lat, view)
        return x


def _group_inputs(cfg: GLMConfig, x, positions, kv_len, options, kv_start):
    """IndexShareGroup's arguments checked, with their defaults -> (x, positions, kv_len, options)."""
    owner = "IndexShareGroup"
    options = check_options(owner, ForwardOptions() if options is None else options)
    check_hidden(owner, cfg, x)
    b, s = x.shape[:2]
    if positions is None:
        positions = jnp.broadcast_to(jnp.arange(s, dtype=jnp.int32), (b, s))
    check_rows(owner, "positions", positions, (b, s))
    if kv_len is None:
        kv_len = jnp.full((b,), s, jnp.int32)
    check_rows(owner, "kv_len", kv_len, (b,))
    if kv_start is not None:
        check_rows(owner, "kv_start", kv_start, (b, s))
    return x, positions, kv_len, options


class _CachedInputs(NamedTuple):
    """A layer's token-wise work before attention in a cached forward, per token [B, S, ...]:
    its absorbed queries q_abs [B, S, nh, kv_lora + rope] and latent rows [B, S, latent]; for
    the Full layer also the indexer's keys [B, S, D], queries [B, S, Hi, D] and head weights
    float32 [B, S, Hi] (else None)."""

    q_abs: jax.Array
    latent: jax.Array
    index_keys: jax.Array | None = None
    index_queries: jax.Array | None = None
    index_weights: jax.Array | None = None


def _cached_inputs(layer: DecoderLayer, x, positions, *, indexer: bool) -> _CachedInputs:
    """x [B, S, hidden], positions int32 [B, S] -> the layer's `_CachedInputs` (token-wise)."""
    h, q_resid, q_nope, q_rope, latent = layer.attention_inputs(x, positions)
    q_abs = layer.self_attn.absorbed_queries(q_nope, q_rope)
    if not indexer:
        return _CachedInputs(q_abs, latent)
    idx = layer.indexer
    return _CachedInputs(q_abs, latent, idx.keys(h, positions), idx.queries(q_resid, positions), idx.head_weights(h))


def _cached_outputs(layer: DecoderLayer, x, o_lat, view):
    """The token-wise work after attention: x [B, S, hidden], o_lat [B, S, nh, kv_lora] the
    attention output in the latent space -> x [B, S, hidden] after W_UV, o_proj, the residual
    and the MLP; in fixed row chunks with the MoE's "dense" dispatch where the kernels of `view`
    (the group's `glm_jax.cache.GroupCacheView`) are batch-invariant."""
    kernels = view.kernels
    dispatch = "dense" if kernels.batch_invariant else None

    def finish(x, o_lat):
        return layer.finish(x, layer.self_attn.absorbed_output(o_lat, x.dtype), dispatch)

    return in_row_chunks(finish, x, o_lat, rows=kernels.token_rows)


def _rematerialised(forward, keep_attention: bool):
    """forward(layer, x, found) recomputed in the backward pass, keeping only its inputs and
    the top-k indices it selects (`_SAVE_TOPK`), and with keep_attention the sparse attention's
    outputs: the layer's output in the latent space, its lse and indexer target (per token
    nh * kv_lora activation-dtype values, nh + topk float32)."""
    policy = _SAVE_TOPK_AND_ATTENTION if keep_attention else _SAVE_TOPK

    def run(layer, x, found):
        graphdef, state = nnx.split(layer)
        pure = lambda state, x, found: forward(nnx.merge(graphdef, state), x, found)
        return jax.checkpoint(pure, policy=policy)(state, x, found)

    return run


def _layer_forward(layer: DecoderLayer, x, found: _IndexerOutputs, *, j: int, share: float, rows: _Rows,
                   options: ForwardOptions, shared_kv):
    """Layer j of an IndexShare group whose layers each weigh `share` in its indexer KL
    (`IndexShareGroup.forward`). The Full layer (j = 0) runs the indexer unless shared_kv is
    given; the later layers read its outputs from `found`. The attention runs in the form of
    `options` (`_ATTEND`).
    -> (x [B, S, hidden], this layer's weighted indexer KL (expanded form; else 0), its part
        of the group's KL (absorbed form with the indexer loss: sparse mode its selected-set
        target float32 [B, S, K], dense mode its `DenseTarget`; else None), its latent rows
        (gathered), the indexer outputs)."""
    h, q_resid, q_nope, q_rope, latent = layer.attention_inputs(x, rows.positions)
    if j == 0 and shared_kv is not None:
        latent = shared_kv[0]
    elif j == 0:
        found = _run_indexer(layer, h, q_resid, rows, options)
    latent = gather_keys(latent)
    form = options.form if options.form == "expanded" else f"{options.form} {options.mode}"
    out, kl, target, found = _ATTEND[form](layer, q_nope, q_rope, latent, found, j=j, share=share, rows=rows,
                                           options=options)
    return layer.finish(x, out), kl, target, latent, found


def _run_indexer(layer: DecoderLayer, h, q_resid, rows: _Rows, options: ForwardOptions) -> _IndexerOutputs:
    """The Full layer's indexer on its detached inputs h [B, S, hidden], q_resid [B, S, q_lora]:
    the top-k (sparse mode) and what the indexer loss of the form needs."""
    positions, kv_len, kv_start = rows.positions, rows.kv_len, rows.kv_start
    hd, qd = jax.lax.stop_gradient(h), jax.lax.stop_gradient(q_resid)
    keys = gather_keys(layer.indexer.keys(hd, positions))
    indices = index_logits = index_inputs = None
    if options.mode == "sparse":
        indices = checkpoint_name(layer.indexer.select(hd, qd, positions, keys, kv_len, options, kv_start),
                                  _TOPK_NAME)
    if options.indexer_loss and options.form == "expanded":
        index_logits = layer.indexer.scores(hd, qd, positions, keys, kv_len, options, kv_start)
    elif options.indexer_loss:
        index_inputs = (layer.indexer.queries(qd, positions), keys, layer.indexer.head_weights(hd))
    return _IndexerOutputs(indices, index_logits, index_inputs)


def _attend_expanded(layer: DecoderLayer, q_nope, q_rope, latent, found: _IndexerOutputs, *, j: int, share: float,
                     rows: _Rows, options: ForwardOptions):
    """Per-head K and V over the causal (dense mode) or selected (sparse mode) keys; the layer's
    indexer KL from its probabilities. -> (out, weighted KL, None, found)."""
    mask = rows.causal()
    if options.mode == "sparse":
        mask = split_tokens(indices_to_mask(found.indices, rows.length)) & mask
    out, probs = layer.self_attn.attend_expanded(q_nope, q_rope, latent, mask, return_probs=True)
    kl = jnp.zeros((), jnp.float32)
    if found.index_logits is not None:
        kl = indexer_kl(head_summed_target(probs), found.index_logits, mask) * share
    return out, kl, None, found


def _attend_dense_causal(layer: DecoderLayer, q_nope, q_rope, latent, found: _IndexerOutputs, *, j: int,
                         share: float, rows: _Rows, options: ForwardOptions):
    """Dense causal attention over every visible key (`attend_causal`); with the indexer loss
    the layer's `DenseTarget` for the group's dense KL. -> (out, 0, target or None, found)."""
    packed = rows.kv_start is not None
    segments = segment_table(rows.positions, options.max_segments) if packed and options.max_segments else None
    out = layer.self_attn.attend_causal(q_nope, q_rope, latent, rows.kv_len, mask=rows.causal() if packed else None,
                                        segments=segments, options=options)
    target = None
    if found.index_inputs is not None:
        q_abs = layer.self_attn.absorbed_queries(q_nope, q_rope)
        target = jax.lax.stop_gradient(DenseTarget(q_abs, latent.astype(q_abs.dtype)))
    return out, jnp.zeros((), jnp.float32), target, found


def _attend_absorbed_sparse(layer: DecoderLayer, q_nope, q_rope, latent, found: _IndexerOutputs, *, j: int,
                            share: float, rows: _Rows, options: ForwardOptions):
    """Sparse attention over the selected latent rows (`ops.sparse_mla`); the Full layer sorts
    the backward's index once for the group. With the indexer loss the layer's selected-set
    target. -> (out, 0, target or None, found)."""
    if j == 0:
        tindex = layer.self_attn.backward_index(found.indices, rows.length, q_nope.dtype, options)
        found = found._replace(tindex=jax.tree.map(lambda a: checkpoint_name(a, _TOPK_NAME), tindex))
    attend = functools.partial(layer.self_attn.attend_absorbed, q_nope, q_rope, latent, found.indices,
                               options, tindex=found.tindex)
    if found.index_inputs is None:
        return attend(), jnp.zeros((), jnp.float32), None, found
    out, target = attend(return_target=True)
    return out, jnp.zeros((), jnp.float32), target, found


#: The attention of `_layer_forward` by form ("expanded", or "absorbed" and the mode).
_ATTEND = {"expanded": _attend_expanded, "absorbed dense": _attend_dense_causal,
           "absorbed sparse": _attend_absorbed_sparse}
