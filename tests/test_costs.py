"""Analytic training FLOPs: packed rows count each document's own causal attention."""

from __future__ import annotations

import numpy as np
import pytest

from glm_jax import costs

from conftest import micro_config


@pytest.mark.parametrize("sparse", [False, True])
def test_packed_flops_are_the_documents_flops(sparse):
    cfg = micro_config(index_topk=3)
    lengths = (5, 11)
    positions = np.concatenate([np.arange(n) for n in lengths])
    packed = costs.training_flops_per_token(cfg, sum(lengths), 1000, sparse=sparse, positions=positions)
    alone = [costs.training_flops_per_token(cfg, n, 1000, sparse=sparse) for n in lengths]
    np.testing.assert_allclose(packed, np.average(alone, weights=lengths), rtol=1e-12)
    unpacked = costs.training_flops_per_token(cfg, sum(lengths), 1000, sparse=sparse)
    assert packed < unpacked
