"""The model's calls as jitted programs, shared by the tests of the model and its caches: run
eagerly, each call traces and compiles its layer scans again (about 1.5 s a call for the micro
model), where one jitted program per shape and setting compiles once in the test process."""

from __future__ import annotations

from flax import nnx

from glm_jax.forward_options import ForwardOptions


@nnx.jit(static_argnames="options")
def forward_logits(model, tokens, options: ForwardOptions = ForwardOptions()):
    """model(tokens [B, S], options=options).logits -> [B, S, V]."""
    return model(tokens, options=options).logits


@nnx.jit(static_argnames="options")
def forward_cached(model, tokens, cache, num_valid=None, options: ForwardOptions = ForwardOptions()):
    """model.forward_cached(tokens [B, S], cache, num_valid [B] or None, options) -> (logits
    [B, S, V], normed hidden [B, S, hidden], the advanced cache)."""
    return model.forward_cached(tokens, cache, num_valid=num_valid, options=options)
