"""The jitted train step: LM loss + IndexCache indexer KL + MTP cross-entropy, AdamW update.

Stages (`stage` argument, static):
  "dense"   dense causal attention; the indexer learns the head-summed attention (warm-up)
  "sparse"  attention over the indexer's top-k; the indexer's KL is restricted to that set
The indexer's inputs are detached in both, so the indexer learns only from its KL and the rest
of the model only from the LM (and MTP) losses.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from glm_jax import ops
from glm_jax.layers.decoder import AttentionSettings
from glm_jax.training.losses import cross_entropy, mtp_targets


@dataclasses.dataclass(frozen=True)
class LossWeights:
    indexer: float = 1.0
    mtp: float = 0.3


def make_optimizer(lr: float, total_steps: int, warmup_steps: int, weight_decay: float = 0.1):
    warmup_steps = max(1, min(warmup_steps, total_steps - 1))
    schedule = optax.warmup_cosine_decay_schedule(0.0, lr, warmup_steps, max(total_steps, warmup_steps + 1),
                                                  end_value=lr * 0.1)
    tx = optax.chain(optax.clip_by_global_norm(1.0),
                     optax.adamw(schedule, b1=0.9, b2=0.95, weight_decay=weight_decay))
    return tx, schedule


def loss_terms(model, inputs, targets, *, stage: str, weights: LossWeights, kernels: ops.KernelChoice,
               remat: bool = False):
    """inputs, targets int32 [B, S] -> (total loss, dict of terms)."""
    settings = AttentionSettings(mode=stage, form="expanded", indexer_loss=weights.indexer > 0,
                                 kernels=kernels)
    out = model(inputs, settings=settings, remat=remat)
    s = inputs.shape[1]
    n_full = len(model.cfg.full_layers)
    terms = {"lm": cross_entropy(out.logits, targets), "indexer_kl": out.indexer_kl / (s * n_full)}
    total = terms["lm"] + weights.indexer * terms["indexer_kl"]
    if model.mtp is not None and weights.mtp > 0:
        mtp = model.mtp_forward(out.hidden, targets, settings=settings)
        labels, mask = mtp_targets(targets)
        terms["mtp"] = cross_entropy(mtp.logits, labels, mask)
        terms["mtp_indexer_kl"] = mtp.indexer_kl / s
        total = total + weights.mtp * terms["mtp"] + weights.indexer * terms["mtp_indexer_kl"]
    terms["loss"] = total
    return total, terms


@functools.partial(jax.jit, static_argnames=("graphdef", "tx", "stage", "weights", "kernels", "remat"),
                   donate_argnames=("params", "opt_state"))
def train_step(graphdef, params, rest, opt_state, inputs, targets, *, tx, stage, weights, kernels, remat=False):
    """One optimizer step. -> (params, opt_state, metrics dict of float32 scalars)."""
    def loss_fn(p):
        return loss_terms(nnx.merge(graphdef, p, rest), inputs, targets, stage=stage, weights=weights,
                          kernels=kernels, remat=remat)

    (_, terms), grads = jax.value_and_grad(loss_fn, has_aux=True)(params)
    updates, opt_state = tx.update(grads, opt_state, params)
    params = optax.apply_updates(params, updates)
    terms["grad_norm"] = optax.tree.norm(grads)
    return params, opt_state, terms


@functools.partial(jax.jit, static_argnames=("graphdef", "stage", "kernels"))
def eval_step(graphdef, params, rest, inputs, targets, *, stage, kernels):
    """Validation LM loss (sparse attention, as the model is used)."""
    model = nnx.merge(graphdef, params, rest)
    out = model(inputs, settings=AttentionSettings(mode=stage, form="absorbed", kernels=kernels))
    return cross_entropy(out.logits, targets)
