"""train.py's static segment bound: only dense absorbed steps use one, and it never goes down."""

import numpy as np

from glm_jax.training.run import SegmentBounds


def rows_with_segments(n: int) -> np.ndarray:
    """int32 [2, 8n]: row 0 holds n segments of 8 tokens, row 1 one segment."""
    row = np.repeat(np.arange(1, n + 1), 8)
    return np.stack([row, np.ones(row.size, row.dtype)]).astype(np.int32)


def test_the_bound_grows_to_the_largest_batch_and_stays():
    bounds = SegmentBounds()
    assert bounds.for_step(rows_with_segments(3), "dense", "absorbed") == 4
    assert bounds.for_step(rows_with_segments(9), "dense", "absorbed") == 16
    assert bounds.for_step(rows_with_segments(2), "dense", "absorbed") == 16    # no recompile for fewer


def test_no_bound_outside_dense_absorbed_steps():
    bounds = SegmentBounds()
    assert bounds.for_step(rows_with_segments(9), "sparse", "absorbed") is None
    assert bounds.for_step(rows_with_segments(9), "dense", "expanded") is None
