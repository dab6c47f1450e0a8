"""The model's calls as jitted programs, shared by the tests of the model and its caches: run
eagerly, each call traces and compiles its layer scans again (about 1.5 s a call for the micro
model), where one jitted program per shape and setting compiles once in the test process."""

from __future__ import annotations

from flax import nnx

from glm_jax.layers.decoder import AttentionSettings


@nnx.jit(static_argnames="settings")
def forward_logits(model, tokens, settings: AttentionSettings = AttentionSettings()):
    """model(tokens [B, S], settings=settings).logits -> [B, S, V]."""
    return model(tokens, settings=settings).logits


@nnx.jit(static_argnames="kernels")
def forward_cached(model, tokens, cache, num_valid=None, kernels=None):
    """model.forward_cached(tokens [B, S], cache, num_valid [B] or None, kernels) -> (logits
    [B, S, V], normed hidden [B, S, hidden], the advanced cache); kernels None: the default."""
    extra = {} if kernels is None else {"kernels": kernels}
    return model.forward_cached(tokens, cache, num_valid=num_valid, **extra)
