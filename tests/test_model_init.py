"""`model.init_model`: the model's initialisation as one compiled program gives the weights of the
eager GLMModel(cfg, rngs=nnx.Rngs(seed)) bit for bit, in the same variables, and compiles once
per config in a process."""

from __future__ import annotations

import jax
import numpy as np
from flax import nnx

from conftest import counting_compiles, micro_config
from glm_jax.model import GLMModel, init_model


def test_jitted_init_equals_eager_init_bit_for_bit():
    cfg = micro_config(name="init-test")          # a config no other test initialises in this process
    for seed, programs in ((0, 1), (7, 0)):       # one program per config: another seed reuses it
        eager = nnx.state(GLMModel(cfg, rngs=nnx.Rngs(seed)))
        with counting_compiles() as compiles:
            jitted = nnx.state(init_model(cfg, seed))
        assert compiles["jit(init_model)"] == programs and sum(compiles.values()) <= 3, compiles   # + the key's
        a, b = jax.tree_util.tree_leaves_with_path(eager), jax.tree_util.tree_leaves_with_path(jitted)
        assert [p for p, _ in a] == [p for p, _ in b]
        assert jax.tree.structure(eager) == jax.tree.structure(jitted)      # the same variable types
        for (path, x), (_, y) in zip(a, b, strict=True):
            assert x.dtype == y.dtype and np.array_equal(np.asarray(x), np.asarray(y)), jax.tree_util.keystr(path)
