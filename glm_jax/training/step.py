"""The jitted train step: LM loss + IndexCache indexer KL + MTP cross-entropy, AdamW update.

`train_step(state, batch, config)`: `state` a `TrainState`, `batch` a `data.batch.Batch` of device
arrays (its positions unused), `config` one hashable `StepConfig` (static: the optimizer, the
forward's `ForwardOptions` and the loss weights).

Stages (the mode of `StepConfig.forward`):
  "dense"   dense causal attention; the indexer learns the head-summed attention (warm-up)
  "sparse"  attention over the indexer's top-k; the indexer's KL is restricted to that set
The indexer's inputs are detached in both, so the indexer learns only from its KL and the rest
of the model only from the LM (and MTP) losses.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from glm_jax import ops
from glm_jax.data.batch import Batch
from glm_jax.forward_options import ForwardOptions, check_options
from glm_jax.kernel_configs import configured
from glm_jax.layers.segments import same_segment_ahead
from glm_jax.training.head_losses import linear_cross_entropy, linear_cross_entropy_with_tv, linear_nll_and_tv
from glm_jax.training.losses import end_to_end_tv, head_cross_entropy, masked_mean, shift_left
from glm_jax.training.run_config import EXPANDED_MAX_LEN, LossConfig, ScheduleConfig, TrainConfig


_LOSSES = LossConfig()


@dataclasses.dataclass(frozen=True)
class LossWeights:
    """Loss weights and the MTP training setup.

    mtp: weight of the MTP cross-entropy (averaged over depths); mtp_depth: how many times the
    MTP layer is applied (shared parameters); kv_share: depths >= 2 reuse depth 1's latent KV
    and top-k indices; tv: weight of the end-to-end total-variation loss between the target's
    and the MTP layer's distributions (the target side detached)."""

    indexer: float = _LOSSES.indexer_weight
    mtp: float = _LOSSES.mtp_weight
    mtp_depth: int = _LOSSES.mtp_depth
    kv_share: bool = _LOSSES.mtp_kv_share
    tv: float = _LOSSES.tv_weight

    @classmethod
    def of(cls, losses: LossConfig) -> "LossWeights":
        """The weights of a run's `losses` settings (whose defaults these are)."""
        return cls(indexer=losses.indexer_weight, mtp=losses.mtp_weight, mtp_depth=losses.mtp_depth,
                   kv_share=losses.mtp_kv_share, tv=losses.tv_weight)


@dataclasses.dataclass(frozen=True)
class LearningRateSchedule:
    """The learning rate by optimizer step: a linear warm-up from 0 to `lr` over `warmup_steps`,
    then either a cosine to lr/10 at `total_steps` (decay_steps == 0) or `lr` held until a linear
    decay to lr/10 over the last `decay_steps`. Called with a step count it is the optax schedule
    the optimizer runs on the device; `on_host(count)` gives the same value in plain Python, so
    that logging it neither waits behind the step in flight nor needs a CPU backend (JAX_PLATFORMS
    may name only the accelerator)."""

    lr: float
    total_steps: int
    warmup_steps: int
    decay_steps: int = 0

    @property
    def stable_steps(self) -> int:
        return max(0, self.total_steps - self.warmup_steps - self.decay_steps)

    @functools.cached_property
    def optax(self) -> optax.Schedule:
        if self.decay_steps > 0:
            return optax.join_schedules(
                [optax.linear_schedule(0.0, self.lr, self.warmup_steps), optax.constant_schedule(self.lr),
                 optax.linear_schedule(self.lr, self.lr * 0.1, self.decay_steps)],
                [self.warmup_steps, self.warmup_steps + self.stable_steps])
        return optax.warmup_cosine_decay_schedule(0.0, self.lr, self.warmup_steps,
                                                  max(self.total_steps, self.warmup_steps + 1),
                                                  end_value=self.lr * 0.1)

    def __call__(self, count):
        return self.optax(count)

    def on_host(self, count: int) -> float:
        """The rate at optimizer step `count` (0-based), computed in Python floats."""
        lr, warmup = self.lr, self.warmup_steps
        if count < warmup:
            return lr * count / warmup
        if self.decay_steps > 0:
            into_decay = count - warmup - self.stable_steps
            if into_decay <= 0:
                return lr
            return lr + (lr * 0.1 - lr) * min(into_decay, self.decay_steps) / self.decay_steps
        cosine_steps = max(self.total_steps, warmup + 1) - warmup
        progress = min(count - warmup, cosine_steps) / cosine_steps
        return lr * 0.1 + (lr - lr * 0.1) * 0.5 * (1 + math.cos(math.pi * progress))


def is_indexer_param(params):
    """A pytree of bools like `params` (an nnx State or its pure dict): True at the indexers'
    parameters (those under an `indexer` key: every Full layer's, the MTP layer's)."""
    return jax.tree_util.tree_map_with_path(
        lambda path, _: any(getattr(k, "key", None) == "indexer" for k in path), params)


@functools.lru_cache(maxsize=16)
def make_optimizer(lr: float, total_steps: int, warmup_steps: int, weight_decay: float = 0.1,
                   decay_steps: int = 0, indexer_lr_scale: float = 1.0
                   ) -> tuple[optax.GradientTransformation, LearningRateSchedule]:
    """AdamW with gradient clipping, and its learning-rate schedule (`LearningRateSchedule`). With
    `decay_steps` > 0 the schedule is warmup-stable-decay: every step before the decay is the same
    whatever `total_steps` is, so a run may be lengthened or shortened on resume while it is still
    stable. The same arguments give the same objects: the optimizer is part of the static StepConfig of
    `train_step`, so runs of one schedule in one process (a run and its resume) share its
    compiled steps. indexer_lr_scale: the indexers' updates multiplied by it (`is_indexer_param`;
    their learning rate, weight decay included, that multiple of the schedule's); at 1 the
    optimizer is plain AdamW, its state that of runs before the option."""
    warmup_steps = max(1, min(warmup_steps, total_steps - 1))
    if decay_steps > 0:
        decay_steps = min(decay_steps, max(1, total_steps - warmup_steps))
    schedule = LearningRateSchedule(lr, total_steps, warmup_steps, decay_steps)
    tx = optax.chain(optax.clip_by_global_norm(1.0),
                     optax.adamw(schedule.optax, b1=0.9, b2=0.95, weight_decay=weight_decay))
    if indexer_lr_scale != 1.0:
        tx = optax.chain(tx, optax.masked(optax.scale(indexer_lr_scale), is_indexer_param))
    return tx, schedule


def loss_terms(model, inputs, targets, *, options: ForwardOptions, weights: LossWeights, segment_ids=None):
    """inputs, targets int32 [B, S] -> (total loss, dict of terms).

    options: the forward's static choices (`ForwardOptions`): the stage is its mode, then the
    attention form, kernels, remat (each layer recomputed in the backward pass), keep_attention
    (except the sparse attention kernels' outputs: more memory, one forward kernel call a layer
    instead of two) and max_segments. Its indexer_loss is set here from the weights
    (weights.indexer > 0).

    The vocabulary-wide terms run through the head's kernel per chunk of positions
    (`head_losses`): the model's [B, S, V] logits are never kept.

    segment_ids int32 [B, S] or None: packed documents (0 = padding, no loss); attention stays
    inside each document and the MTP losses count only targets of the same document.
    options.max_segments: at least the segments of any row (`segments.count_segments`); with it
    dense attention on a GPU runs cuDNN's packed kernel instead of building an [S, S] mask.

    options.form "expanded" builds [B, H, S, S] attention matrices; "absorbed" holds none: dense
    attention runs the fused causal kernel and the dense stage's indexer KL is computed blockwise
    from the attention's per-row log-sum-exp (`layers.dense_indexer_kl`); both give every stage
    and loss (see `attention_form`)."""
    options = check_options("loss_terms", options).replace(indexer_loss=weights.indexer > 0)
    out = model(inputs, options=options, segment_ids=segment_ids)
    s = inputs.shape[1]
    n_full = len(model.cfg.full_layers)
    lm_mask = None if segment_ids is None else segment_ids > 0
    terms = {"lm": linear_cross_entropy(out.hidden, model.lm_head.kernel[...], targets, lm_mask),
             "indexer_kl": out.indexer_kl / (s * n_full)}
    total = terms["lm"] + weights.indexer * terms["indexer_kl"]
    if model.mtp is not None and (weights.mtp > 0 or weights.tv > 0):
        total = total + _mtp_losses(model, out, targets, options, weights, terms, segment_ids)
    terms["loss"] = total
    return total, terms


def _targets_ahead(segment_ids, s: int, d: int):
    """bool [B or 1, S]: the target d tokens ahead exists (and, packed, is of the same document)."""
    if segment_ids is None:
        return jnp.arange(s)[None, :] < s - d
    return same_segment_ahead(segment_ids, d)


def _mtp_losses(model, out, targets, options: ForwardOptions, weights: LossWeights, terms: dict, segment_ids=None):
    """MTP depths d = 1..D with shared parameters. Depth d at position i reads the previous
    depth's normed hidden (the target's for d = 1) and token t_{i+d}, and predicts t_{i+d+1}.
    Adds 'mtp' (mean CE over depths), 'mtp_indexer_kl' and, with a TV weight, 'mtp_tv' to terms;
    returns their weighted sum.

    Each depth's CE and TV (against the target's detached distribution at the same position,
    the main head on out.hidden shifted by d) come from one chunked pass over its logits."""
    s = targets.shape[1]
    kernel = model.lm_head.kernel[...]
    hidden, shared, ces, tvs = out.hidden, None, [], []
    total = jnp.zeros((), jnp.float32)
    for d in range(1, weights.mtp_depth + 1):
        mtp, kv = model.mtp_forward(hidden, shift_left(targets, d - 1), options=options, shared_kv=shared,
                                    segment_ids=segment_ids)
        mask = jnp.broadcast_to(_targets_ahead(segment_ids, s, d), targets.shape)
        p_hidden = jax.lax.stop_gradient(shift_left(out.hidden, d))
        if weights.tv:
            nll, tv = linear_nll_and_tv(mtp.hidden, kernel, shift_left(targets, d), p_hidden)
            ce = masked_mean(nll, mask)
        else:                               # TV reported, not trained: no backward pass through it
            ce, tv = linear_cross_entropy_with_tv(mtp.hidden, kernel, shift_left(targets, d), mask, p_hidden)
        ces.append(ce)
        tvs.append(tv)
        if d == 1:
            terms["mtp_indexer_kl"] = mtp.indexer_kl / s
            total = total + weights.indexer * terms["mtp_indexer_kl"]
            shared = kv if weights.kv_share else None
        hidden = mtp.hidden
    terms["mtp"] = sum(ces) / len(ces)
    terms["mtp_tv"] = end_to_end_tv(tvs, _targets_ahead(segment_ids, s, weights.mtp_depth))
    return total + weights.mtp * terms["mtp"] + weights.tv * terms["mtp_tv"]




def attention_form(form: str, seq_len: int, backend: str | None = None) -> str:
    """"auto" -> "absorbed" on an accelerator (the fused kernels: on an H200 at 16 x 4096 tokens
    the absorbed sparse step ran 2.8x faster than the expanded one, and the dense stage's
    expanded step needs 92 GiB, docs/training.md); on a CPU (`backend`, default JAX's) "expanded"
    up to EXPANDED_MAX_LEN tokens (no fused kernels there), "absorbed" beyond. Else `form`."""
    if form not in ("auto", "expanded", "absorbed"):
        raise ValueError(f"attention form must be 'auto', 'expanded' or 'absorbed', got {form!r}")
    if form == "auto":
        on_cpu = (backend or jax.default_backend()) == "cpu"
        return "expanded" if on_cpu and seq_len <= EXPANDED_MAX_LEN else "absorbed"
    return form


@dataclasses.dataclass(frozen=True)
class OptimizerConfig:
    """The optimizer of `make_optimizer`, as a hashable value: `tx` and `schedule` are the same
    objects for equal configs (make_optimizer's cache), so a step config holding it compiles once."""

    lr: float
    total_steps: int
    warmup_steps: int
    weight_decay: float = 0.1
    decay_steps: int = 0
    indexer_lr_scale: float = 1.0

    @classmethod
    def of(cls, schedule: ScheduleConfig) -> "OptimizerConfig":
        return cls(schedule.lr, schedule.steps, schedule.warmup_steps, decay_steps=schedule.decay_steps,
                   indexer_lr_scale=schedule.indexer_lr_scale)

    def build(self) -> tuple[optax.GradientTransformation, LearningRateSchedule]:
        return make_optimizer(self.lr, self.total_steps, self.warmup_steps, self.weight_decay, self.decay_steps,
                              self.indexer_lr_scale)

    @property
    def tx(self) -> optax.GradientTransformation:
        return self.build()[0]


@dataclasses.dataclass(frozen=True)
class StepConfig:
    """Everything static about one train step (hashable: `train_step`'s static argument).

    optimizer: the `OptimizerConfig`; forward: the model call's `ForwardOptions` (the stage is
    its mode; its form and kernels resolved for the backend, `attention_form`); weights: the
    `LossWeights`. forward.indexer_loss follows the weights (weights.indexer > 0), as in
    `loss_terms`. `of(settings, ...)` builds one from a run's `TrainConfig`; `with_forward(...)`
    changes forward options (the loop sets the stage and max_segments per step)."""

    optimizer: OptimizerConfig
    forward: ForwardOptions
    weights: LossWeights = LossWeights()

    def __post_init__(self):
        forward = check_options("StepConfig", self.forward, name="forward")
        object.__setattr__(self, "forward", forward.replace(indexer_loss=self.weights.indexer > 0))

    @classmethod
    def of(cls, settings: TrainConfig, *, stage: str = "sparse", max_segments: int | None = None) -> "StepConfig":
        """The step of a run's settings, its kernels and attention form resolved for this backend
        (the settings may say "auto": `kernel_configs.configured`, which refuses a config the
        kernels do not take, and `attention_form` at the run's sequence length)."""
        choice = settings.kernels
        kernels = configured(ops.KernelChoice(indexer_topk=choice.indexer_impl, sparse_mla=choice.attention_impl),
                             choice.kernel_config)
        forward = ForwardOptions(mode=stage, form=attention_form(choice.attention_form, settings.data.seq_len),
                                 kernels=kernels, remat=choice.remat, keep_attention=choice.keep_attention,
                                 max_segments=max_segments)
        return cls(optimizer=OptimizerConfig.of(settings.schedule), forward=forward,
                   weights=LossWeights.of(settings.losses))

    def with_forward(self, **changes) -> "StepConfig":
        """A copy whose forward options have the named fields changed."""
        return dataclasses.replace(self, forward=self.forward.replace(**changes))

    @property
    def tx(self) -> optax.GradientTransformation:
        return self.optimizer.tx

    @property
    def schedule(self) -> LearningRateSchedule:
        return self.optimizer.build()[1]


class TrainState(NamedTuple):
    """What a train step advances: the model split by `nnx.split(model, nnx.Param, ...)`, the
    optimizer state of its params and `step`, the optimizer steps taken (0: a new run). The
    loop holds one and each step returns the next; nothing else of a run changes per step
    (the data position is the batch source's: `pipeline.PackedBatches.state`)."""

    graphdef: nnx.GraphDef
    params: nnx.State
    rest: nnx.State
    opt_state: optax.OptState
    step: int = 0


def _step(graphdef, params, rest, opt_state, batch: Batch, *, config: StepConfig):
    def loss_fn(p):
        return loss_terms(nnx.merge(graphdef, p, rest), batch.inputs, batch.targets, options=config.forward,
                          weights=config.weights, segment_ids=batch.segment_ids)

    (_, terms), grads = jax.value_and_grad(loss_fn, has_aux=True)(params)
    updates, opt_state = config.tx.update(grads, opt_state, params)
    params = optax.apply_updates(params, updates)
    terms["grad_norm"] = optax.tree.norm(grads)
    return params, opt_state, terms


_step.__name__ = _step.__qualname__ = "train_step"       # compiles as jit(train_step)
_JIT = dict(static_argnames=("graphdef", "config"), donate_argnames=("params", "opt_state"))
#: The jitted step on the split state: (graphdef, params, rest, opt_state, batch, *, config) ->
#: (params, opt_state, metrics); params and opt_state donated. For `.trace(...).lower()`.
train_step_program = jax.jit(_step, **_JIT)


def train_step(state: TrainState, batch: Batch | tuple, config: StepConfig, *,
               program=train_step_program) -> tuple[TrainState, dict]:
    """One optimizer step -> (the next state, its step one more, and a metrics dict of float32
    scalars). The state's params and optimizer state are donated: use the returned ones."""
    params, opt_state, terms = program(state.graphdef, state.params, state.rest, state.opt_state,
                                       Batch(*batch)._replace(positions=None), config=config)
    return state._replace(params=params, opt_state=opt_state, step=state.step + 1), terms


def train_step_keeping(param_shardings, opt_shardings):
    """`train_step` that returns params and opt_state in the given shardings (pytrees like them),
    for a run on a mesh to pass those they are placed in.

    Without out_shardings XLA chooses the layout of the new params and optimizer state: for the
    parameters the sharding rules leave replicated (norms, the low-rank and indexer projections,
    routers) it returns them split over the data axis, so the second step, receiving them so,
    would compile the step again. Pinned, every step of a stage gets the layouts of the first and
    the step compiles once per stage (fresh or resumed: a checkpoint restores the placed layouts)."""
    return functools.partial(train_step, program=jax.jit(_step, **_JIT,
                                                         out_shardings=(param_shardings, opt_shardings, None)))


@functools.partial(jax.jit, static_argnames=("graphdef", "options"))
def eval_step(graphdef, params, rest, inputs, targets, *, options: ForwardOptions = ForwardOptions()):
    """Validation LM loss of inputs / targets int32 [B, S] -> float32 scalar, the model called
    with `options` (default: sparse attention, as the model is used)."""
    model = nnx.merge(graphdef, params, rest)
    out = model(inputs, options=options)
    return head_cross_entropy(model.logits, out.hidden, targets)
