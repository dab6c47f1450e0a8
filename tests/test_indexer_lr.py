"""--indexer-lr-scale: the indexers' AdamW updates scaled by it, every other parameter's as with
plain AdamW; a resumed run cannot change it; the export script restores such a run's state."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from conftest import micro_config
from glm_jax import settings
from glm_jax.model import init_model
from glm_jax.training import run_config
from glm_jax.training.run_config import TrainConfig
from glm_jax.training.step import OptimizerConfig, is_indexer_param, make_optimizer


def _params():
    return nnx.state(init_model(micro_config(), 0), nnx.Param)


def _updates(tx, params, grads):
    """The second step's updates (the first one's learning rate is 0: the warm-up's start)."""
    _, state = tx.update(grads, tx.init(params), params)
    updates, _ = tx.update(grads, state, params)
    return updates


def test_the_indexers_updates_are_scaled_and_no_other():
    params = _params()
    leaves, treedef = jax.tree.flatten(params)
    keys = jax.random.split(jax.random.key(0), len(leaves))
    grads = jax.tree.unflatten(treedef, [0.01 * jax.random.normal(k, x.shape, x.dtype) for k, x in zip(keys, leaves)])
    plain = _updates(make_optimizer(1e-3, 10, 1)[0], params, grads)
    scaled = _updates(make_optimizer(1e-3, 10, 1, indexer_lr_scale=4.0)[0], params, grads)
    mask = jax.tree.leaves(is_indexer_param(params))
    assert 0 < sum(mask) < len(mask)
    indexer_paths = [jax.tree_util.keystr(p) for (p, _), m in zip(jax.tree_util.tree_leaves_with_path(params), mask) if m]
    assert all("indexer" in p for p in indexer_paths) and any("mtp" in p for p in indexer_paths)
    for is_indexer, a, b in zip(mask, jax.tree.leaves(plain), jax.tree.leaves(scaled), strict=True):
        assert float(jnp.max(jnp.abs(a))) > 0
        np.testing.assert_allclose(np.asarray(b), np.asarray(a) * (4.0 if is_indexer else 1.0), rtol=1e-6, atol=1e-12)


def test_scale_one_is_plain_adamw_and_the_config_carries_it():
    assert OptimizerConfig(1e-3, 10, 1).tx is OptimizerConfig(1e-3, 10, 1).tx       # built once per config
    state = make_optimizer(1e-3, 10, 1)[0].init(_params())
    assert not any(isinstance(s, optax.MaskedState) for s in jax.tree.leaves(state, is_leaf=lambda s: isinstance(
        s, optax.MaskedState)))
    schedule = settings.with_values(TrainConfig(), {"indexer_lr_scale": 8.0}).schedule
    assert OptimizerConfig.of(schedule).indexer_lr_scale == 8.0


def test_settings_refuse_a_scale_of_zero_and_a_change_on_resume():
    with pytest.raises(settings.SettingError, match="indexer-lr-scale"):
        settings.with_values(TrainConfig(), {"indexer_lr_scale": 0.0})
    old = settings.with_values(TrainConfig(out="a"), {"indexer_lr_scale": 4.0})
    new = settings.with_values(old, {"resume": True, "indexer_lr_scale": 1.0})
    with pytest.raises(settings.SettingError, match=r"--resume cannot change schedule.indexer_lr_scale"):
        run_config.resume_changes(old, new)
