"""The GLM-5.2-style model: embeddings -> scanned IndexShare group stacks -> norm -> lm_head (+ MTP).

    model = init_model(cfg, seed=0)        # GLMModel(cfg, rngs=nnx.Rngs(0)), compiled as one program
    logits, hidden, aux = model(tokens)                       # full sequence (training, scoring)
    logits, hidden, cache = model.forward_cached(tokens, cache)  # prefill chunk or decode step

Every call's static choices are one `ForwardOptions` (`options=`, glm_jax.forward_options):
the full-sequence calls read all of its fields, the cached calls only its kernels.

Decoder layers live in `stacks`: stack k holds `plan[k].count` groups of identical structure
with their parameters stacked on a leading axis and is run with `jax.lax.scan`.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import nnx

from glm_jax.cache import KVCache
from glm_jax.config import GLMConfig
from glm_jax.forward_options import ForwardOptions, check_cached, check_options
from glm_jax.layers.decoder import GroupStackPlan, IndexShareGroup, plan_groups
from glm_jax.layers.embedding import Embed
from glm_jax.layers.linear import Linear
from glm_jax.layers.mtp import MTPLayer
from glm_jax.layers.norms import RMSNorm
from glm_jax.layers.segments import segment_layout
from glm_jax.row_chunks import in_row_chunks
from glm_jax.logical_axes import add_stack_axis, eval_shape
from glm_jax.sharding import split_tokens


def _stacked_groups(cfg: GLMConfig, plan: GroupStackPlan, key: jax.Array, dtype) -> IndexShareGroup:
    """An IndexShareGroup whose variables carry a leading axis of plan.count independent inits
    (their logical names a leading "stack")."""
    def init_one(k):
        return nnx.state(IndexShareGroup(cfg, plan.kinds, rngs=nnx.Rngs(params=k), param_dtype=dtype))

    states = jax.vmap(init_one)(jax.random.split(key, plan.count))
    group = eval_shape(lambda: IndexShareGroup(cfg, plan.kinds, rngs=nnx.Rngs(0), param_dtype=dtype))
    nnx.update(group, states)
    add_stack_axis(group)
    return group


@dataclasses.dataclass(frozen=True)
class ForwardOutput:
    logits: jnp.ndarray                # [B, S, vocab] float32
    hidden: jnp.ndarray                # [B, S, hidden], final-normed (what the MTP layer takes)
    indexer_kl: jnp.ndarray            # scalar: IndexCache KL summed over groups (0 unless asked)


class GLMModel(nnx.Module):
    def __init__(self, cfg: GLMConfig, *, rngs: nnx.Rngs):
        dtype = jnp.dtype(cfg.dtype)
        self.cfg = cfg
        self.plan = plan_groups(cfg)
        self.embed_tokens = Embed(cfg.vocab_size, cfg.hidden_size, dtype=dtype, param_dtype=dtype,
                                  embedding_init=jax.nn.initializers.normal(1.0), rngs=rngs)
        self.stacks = nnx.List([_stacked_groups(cfg, p, rngs.params(), dtype) for p in self.plan])
        self.norm = RMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps, param_dtype=dtype)
        self.lm_head = Linear(cfg.hidden_size, cfg.vocab_size, rngs=rngs, param_dtype=dtype, axes=("embed", "vocab"))
        self.mtp = MTPLayer(cfg, rngs=rngs, param_dtype=dtype) if cfg.num_nextn_predict_layers else None

    def logits(self, hidden_normed: jnp.ndarray) -> jnp.ndarray:
        return self.lm_head(hidden_normed).astype(jnp.float32)

    # ------------------------------------------------------------------ full sequence
    def __call__(self, tokens: jnp.ndarray, *, options: ForwardOptions = ForwardOptions(),
                 lengths: jnp.ndarray | None = None, segment_ids: jnp.ndarray | None = None) -> ForwardOutput:
        """tokens int32 [B, S] starting at position 0; lengths int32 [B] valid tokens (default S);
        options: the call's static choices (mode, form, kernels, remat, ...: `ForwardOptions`).

        segment_ids int32 [B, S]: packed rows (`layers/segments.py`): tokens attend only their
        own segment, and positions restart at each segment's first token.

        On a mesh set with `jax.set_mesh` whose context axis splits S (context parallelism,
        `glm_jax.sharding`), each device computes the activations of its S / context tokens; the
        results are those of one device."""
        _check_call("GLMModel", tokens, options)
        b, s = tokens.shape
        positions, kv_start = _layout(b, s, segment_ids)
        kv_len = jnp.full((b,), s, jnp.int32) if lengths is None else lengths.astype(jnp.int32)
        x = self.embed_tokens(tokens)
        kl = jnp.zeros((), jnp.float32)
        for stack in self.stacks:
            graphdef, state = nnx.split(stack)

            def body(carry, group_state, graphdef=graphdef):
                x, kl = carry
                x, group_kl, _, _ = nnx.merge(graphdef, group_state)(x, positions, kv_len, options,
                                                                     kv_start=kv_start)
                return (x, kl + group_kl), None

            (x, kl), _ = jax.lax.scan(body, (x, kl), state)
        hidden = self.norm(x)
        return ForwardOutput(self.logits(hidden), hidden, kl)

    def mtp_forward(self, hidden: jnp.ndarray, next_tokens: jnp.ndarray, *,
                    options: ForwardOptions = ForwardOptions(), lengths=None, shared_kv=None,
                    segment_ids=None):
        """One MTP depth over a sequence: hidden [B, S, hidden] (normed h_i, or the previous
        depth's output), next_tokens [B, S] (the tokens one further ahead); options and
        segment_ids as in `__call__`.

        shared_kv: (latent, indices) of depth 1, reused by depths >= 2 (KVShare training).
        -> (ForwardOutput, (latent [B, S, latent], indices [B, S, topk] or None)) of this depth."""
        _check_call("GLMModel.mtp_forward", next_tokens, options, name="next_tokens")
        b, s = next_tokens.shape
        positions, kv_start = _layout(b, s, segment_ids)
        kv_len = jnp.full((b,), s, jnp.int32) if lengths is None else lengths.astype(jnp.int32)
        out, kl, latent, indices = self.mtp.forward(self.embed_tokens(next_tokens), hidden, positions,
                                                    kv_len, options, shared_kv=shared_kv, kv_start=kv_start)
        return ForwardOutput(self.logits(out), out, kl), (latent, indices)

    # ------------------------------------------------------------------ with a KV cache
    def forward_cached(self, tokens: jnp.ndarray, cache: KVCache, *,
                       options: ForwardOptions = ForwardOptions(),
                       num_valid: jnp.ndarray | None = None) -> tuple[jnp.ndarray, jnp.ndarray, KVCache]:
        """Run tokens int32 [B, S] at the cache's next positions (its lengths + [0, S)).

        options: only its kernels are read (sparse attention in the absorbed form; any other
        field set is a ValueError, `forward_options.check_cached`).
        num_valid int32 [B] (default S): how many of the S tokens are real; the cache length
        advances by it (padding rows are written but never attended by real queries).
        -> (logits float32 [B, S, vocab], hidden normed [B, S, hidden], updated cache)."""
        options = check_cached("GLMModel.forward_cached", options)
        s = tokens.shape[1]
        positions = cache.positions(s)
        x, cache = self._cached_stacks(self.embed_tokens(tokens), positions, cache, options)
        logits, hidden = self._cached_head(self.norm, x, options)
        return logits, hidden, cache.advance(_advance(s, num_valid))

    def _cached_head(self, norm: RMSNorm, x, options: ForwardOptions):
        """x [B, S, hidden] -> (logits float32 [B, S, vocab], norm(x)), in fixed row chunks when
        options' kernels are batch-invariant (`row_chunks`)."""
        def head(x):
            hidden = norm(x)
            return self.logits(hidden), hidden

        return in_row_chunks(head, x, rows=options.kernels.token_rows)

    def _cached_stacks(self, x, positions, cache: KVCache, options: ForwardOptions):
        """Every group stack against the cache: x [B, S, hidden] at positions int32 [B, S]
        -> (x, the cache with the rows written).

        Each group works through its view of the cache (`KVCache.group_view`); with a LayerSplit
        cache only the cache accesses run per device (see `cache.layer_split.Placement.manual`);
        everything else is ordinary sharded XLA."""
        full_base = 0
        for stack, p in zip(self.stacks, self.plan):
            graphdef, state = nnx.split(stack)

            def body(carry, xs, graphdef=graphdef, p=p, full_base=full_base):
                x, cache = carry
                group_state, g = xs
                view = cache.group_view(p.first_layer + g * len(p.kinds), full_base + g, positions,
                                        options.kernels)
                x, _ = nnx.merge(graphdef, group_state).forward_cached(x, positions, view)
                return (x, cache.with_view(view)), None

            (x, cache), _ = jax.lax.scan(body, (x, cache), (state, jnp.arange(p.count, dtype=jnp.int32)))
            full_base += p.count
        return x, cache

    # ------------------------------------------------------------------ MTP with a cache
    def mtp_forward_cached(self, next_tokens, hidden, cache: KVCache, *,
                           options: ForwardOptions = ForwardOptions(), num_valid=None):
        """MTP over the MTP cache's next positions (its lengths + [0, S)): row i takes the
        target's normed hidden h_i [B, S, hidden] and the token t_{i+1} int32 [B, S]; its KV is
        written to the MTP cache (`create_mtp_cache`); options as in `forward_cached`.
        -> (logits [B, S, V], normed hidden [B, S, hidden], cache, indices int32 [B, S, topk]
        the MTP indexer chose)."""
        options = check_cached("GLMModel.mtp_forward_cached", options)
        s = next_tokens.shape[1]
        positions = cache.positions(s)
        x = self._mtp_inputs(next_tokens, hidden, options)
        view = _mtp_view(cache, positions, options)
        x, indices = self.mtp.block.forward_cached(x, positions, view)
        logits, out = self._cached_head(self.mtp.shared_head.norm, x, options)
        return logits, out, cache.with_view(view).advance(_advance(s, num_valid)), indices

    def mtp_draft_step(self, next_tokens, hidden, positions, cache: KVCache, indices, *,
                       options: ForwardOptions = ForwardOptions()):
        """A KVShare draft step (2..K): reuse `indices` [B, 1, topk] from draft step 1, so only KV
        computed from the target's hidden states is read; nothing is written; options as in
        `forward_cached`.
        next_tokens [B, 1], hidden [B, 1, hidden], positions [B, 1] -> (logits [B, 1, V], hidden)."""
        options = check_cached("GLMModel.mtp_draft_step", options)
        x = self._mtp_inputs(next_tokens, hidden, options)
        x = self.mtp.block.forward_reusing_indices(x, positions, _mtp_view(cache, positions, options), indices)
        return self._cached_head(self.mtp.shared_head.norm, x, options)

    def _mtp_inputs(self, next_tokens, hidden, options: ForwardOptions):
        """next_tokens int32 [B, S], hidden [B, S, hidden] -> the MTP block's input [B, S, hidden]
        (`MTPLayer.inputs`), in fixed row chunks when batch-invariant."""
        return in_row_chunks(self.mtp.inputs, self.embed_tokens(next_tokens), hidden, rows=options.kernels.token_rows)


def _check_call(owner: str, tokens, options, name: str = "tokens") -> None:
    """TypeError / ValueError naming the argument unless tokens are int [B, S] and options a
    ForwardOptions."""
    check_options(owner, options)
    if getattr(tokens, "ndim", None) != 2 or not jnp.issubdtype(tokens.dtype, jnp.integer):
        raise ValueError(f"{owner}: {name} must be token ids int32 [batch, sequence], got "
                         f"{getattr(tokens, 'dtype', type(tokens).__name__)} {tuple(getattr(tokens, 'shape', ()))}")


def _mtp_view(cache: KVCache, positions, options: ForwardOptions):
    """The MTP layer's cache (`create_mtp_cache`: one local Full layer) as a group view read
    through options' kernels."""
    return cache.group_view(0, 0, positions, options.kernels)


def _advance(num_tokens: int, num_valid: jnp.ndarray | None):
    """How far a cached forward of num_tokens tokens moves the lengths: num_valid int32 [B], or all."""
    return num_tokens if num_valid is None else num_valid.astype(jnp.int32)


def _layout(b: int, s: int, segment_ids):
    """-> (positions int32 [B, S], kv_start int32 [B, S] or None) of a full sequence, split
    along S under context parallelism."""
    if segment_ids is None:
        return split_tokens(jnp.broadcast_to(jnp.arange(s, dtype=jnp.int32), (b, s))), None
    positions, kv_start = segment_layout(segment_ids)
    return split_tokens(positions), split_tokens(kv_start)


def count_params(model_or_state) -> int:
    """Trainable parameters (nnx.Param), excluding router correction biases."""
    state = nnx.state(model_or_state, nnx.Param)
    return sum(int(x.size) for x in jax.tree.leaves(state))


def params_by_part(model) -> dict[str, int]:
    """Parameter counts of a (possibly abstract) model: total, routed-expert weights, embedding, MTP."""
    parts = {"total": 0, "routed": 0, "embedding": 0, "mtp": 0, "mtp_routed": 0}
    for path, leaf in jax.tree_util.tree_leaves_with_path(nnx.state(model, nnx.Param)):
        names = [str(p.key) for p in path if isinstance(p, jax.tree_util.DictKey)]
        n = int(leaf.size)
        parts["total"] += n
        routed = names[-1] in ("gate_proj", "up_proj", "down_proj")  # MoE's stacked expert weights
        parts["routed"] += n if routed else 0
        parts["embedding"] += n if names[0] == "embed_tokens" else 0
        if names[0] == "mtp":
            parts["mtp"] += n
            parts["mtp_routed"] += n if routed else 0
    return parts


def init_model(cfg: GLMConfig, seed: int = 0) -> GLMModel:
    """GLMModel(cfg, rngs=nnx.Rngs(seed)), its weights (bit for bit the same) made by one compiled
    program. Run eagerly, the initialisers dispatch op by op and each distinct op compiles on its
    own: about 150 small programs (tiny.yaml: 14 s on a CPU), each under the persistent compilation
    cache's minimum compile time, so every process compiles them again. The one program costs
    about as much to compile cold, but a cache keeps it: a later process loads it in about 1 s,
    and within a process it compiles once per config (a second run or model of the config, any
    seed, reuses it)."""
    return _init_program(cfg, jax.random.key(seed))


def _init(cfg: GLMConfig, key) -> GLMModel:
    return GLMModel(cfg, rngs=nnx.Rngs(key))


_init.__name__ = _init.__qualname__ = "init_model"        # compiles as jit(init_model)
_init_program = nnx.jit(_init, static_argnums=0)


def abstract_model(cfg: GLMConfig) -> GLMModel:
    """The module tree with ShapeDtypeStructs instead of arrays: no memory, for counting and planning."""
    return eval_shape(lambda: GLMModel(cfg, rngs=nnx.Rngs(0)))
