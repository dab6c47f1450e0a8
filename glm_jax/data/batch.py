"""`Batch`: one training batch, as the data pipeline packs it on the host and as the train step
takes it on the devices (the same fields, numpy arrays or jax arrays)."""

from __future__ import annotations

from typing import NamedTuple

import numpy as np


class Batch(NamedTuple):
    """Rows of tokens, int32 [B, L] each.

    inputs / targets: the tokens and the next ones; segment_ids: each token's document in its
    row, 1, 2, ..., 0 marking padding (no loss there), or None: every row one document without
    padding; positions: each token's position within its document (the packer's), or None (the
    train step derives positions from segment_ids and leaves this out)."""

    inputs: np.ndarray
    targets: np.ndarray
    segment_ids: np.ndarray | None = None
    positions: np.ndarray | None = None

    @property
    def loss_mask(self) -> np.ndarray:
        """bool [B, L]: positions whose target is a real token."""
        if self.segment_ids is None:
            return np.ones(np.shape(self.inputs), bool)
        return np.asarray(self.segment_ids) > 0
