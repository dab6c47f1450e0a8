"""The same weights under another IndexShare pattern (for the IndexCache pattern search).

    shared = with_pattern(model, "FFSSFSSS...")

Layers the new pattern makes Shared drop their indexer; every layer it makes Full must already
own one. Arrays are re-cut and re-stacked on the device (the group stacks of plan_groups
change with the pattern); nothing goes through host memory.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
from flax import nnx

from glm_jax.convert.load import assemble_model
from glm_jax.convert.names import lookup, param_specs


def with_pattern(model, pattern: str):
    """-> a new GLMModel with model's weights and config index_topk_pattern=pattern."""
    cfg = model.cfg.replace(index_topk_pattern=pattern)  # validates the pattern
    gained = [i for i, (old, new) in enumerate(zip(model.cfg.layer_is_full, cfg.layer_is_full)) if new and not old]
    if gained:
        raise ValueError(f"pattern {pattern} makes layers {gained} Full, but the model has no indexer weights "
                         f"there (its pattern is {model.cfg.pattern}); only Full -> Shared flips are possible")
    state = nnx.to_pure_dict(nnx.state(model))
    slots = {}
    for spec in param_specs(model.cfg):
        value = lookup(state, spec.path)
        for pos in np.ndindex(spec.names.shape):
            slots[spec.names[pos]] = value[pos] if pos else value
    arrays = {}
    for spec in param_specs(cfg):
        parts = [slots[n] for n in spec.names.flat]
        arrays[spec.path] = parts[0] if spec.names.ndim == 0 else jnp.stack(parts).reshape(spec.shape)
    return assemble_model(cfg, arrays)
