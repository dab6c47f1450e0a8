"""The block-union counts of benchmarks/_selections.py (selection_overlap.py's) on hand-made selections."""

from __future__ import annotations

import numpy as np

from benchmarks._selections import block_unions, overlap_rows, random_indices


def test_block_unions_count_distinct_valid_rows_per_block():
    idx = np.array([[[0, 1], [1, 2], [5, -1], [5, 6], [9, 9]]], np.int32)     # [1, 5, 2]
    assert block_unions(idx, 2, 0).tolist() == [3.0, 2.0]                      # {0,1,2}, {5,6}
    assert block_unions(idx, 2, 1).tolist() == [3.0, 3.0]                      # {1,2,5}, {5,6,9}
    rows = overlap_rows(idx, 2, [1, 2], 0)
    assert rows[0]["union_over_k"] == 0.8 and rows[1]["reuse"] == (4 / 3 + 2) / 2


def test_random_indices_are_distinct_and_causal():
    idx = random_indices((2, 40, 8), np.random.default_rng(1))
    for b in range(2):
        for s in range(40):
            valid = idx[b, s][idx[b, s] >= 0]
            assert len(valid) == min(8, s + 1) == len(set(valid.tolist())) and valid.max() <= s
