"""Block-wise fp8 weights: `float8_e4m3fn` values with one float32 `weight_scale_inv` per block.

A weight [out, in] quantised in blocks of [bo, bi] (128 x 128 in GLM-5.x and DeepSeek-V3.x
FP8 checkpoints) carries scale_inv [ceil(out / bo), ceil(in / bi)]; the real weight is
value * scale_inv of its block.
"""

from __future__ import annotations

import numpy as np

SCALE_SUFFIX = "_scale_inv"
DEFAULT_BLOCK = (128, 128)


def scale_shape(shape: tuple[int, ...], block: tuple[int, int] = DEFAULT_BLOCK) -> tuple[int, int]:
    """The scale_inv shape a quantised weight of `shape` [out, in] carries."""
    return (-(-shape[0] // block[0]), -(-shape[1] // block[1]))


def dequantize(values: np.ndarray, scale_inv: np.ndarray, block: tuple[int, int] = DEFAULT_BLOCK) -> np.ndarray:
    """values float8 [out, in], scale_inv float32 [ceil(out/bo), ceil(in/bi)] -> float32 [out, in]."""
    out, cols = values.shape
    scale = np.repeat(np.repeat(np.asarray(scale_inv, np.float32), block[0], axis=0), block[1], axis=1)
    return np.asarray(values).astype(np.float32) * scale[:out, :cols]
