"""Dense causal attention on cuDNN's flash kernel (no [S, S] scores in memory, forward and
backward), and the one place in the project that reaches into JAX's private modules.

The public `jax.nn.dot_product_attention(implementation="cudnn")` covers causal attention with
padding (kv_len) and with a boolean mask. cuDNN's packed layout - several documents in one
row, given by segment offsets and lengths, each attended causally on its own without any mask
in memory - is reachable only through the private `dot_product_attention` of `PRIVATE_MODULE`
(its `q_offsets` / `kv_offsets`). `private_api` imports it and checks that every name and
parameter used here exists; when one is missing, `packed_attention` warns once and packed rows
fall back to the public call with the documents' [S, S] mask (correct, at the mask's memory).
tests/test_cudnn_private_api.py runs `private_api` on the CPU, so a JAX release that moves it
fails the tests instead of silently taking the fallback.
"""

from __future__ import annotations

import functools
import importlib
import inspect
import warnings

import jax
import jax.numpy as jnp

from pallas_kernels._common import NoConfig
from pallas_kernels.causal_attention import xla

#: The private module holding cuDNN's packed attention.
PRIVATE_MODULE = "jax._src.cudnn.fused_attention_stablehlo"
#: Its function, and the parameters of it that the packed call passes.
PRIVATE_FUNCTION = "dot_product_attention"
PRIVATE_PARAMETERS = ("q_seqlen", "kv_seqlen", "q_offsets", "kv_offsets", "scale", "mask_type", "qkv_layout")
#: The mask type it is called with: `MaskType.PADDING_CAUSAL` of the same module.
PRIVATE_MASK_TYPE = ("MaskType", "PADDING_CAUSAL")


class PrivateApiMoved(RuntimeError):
    """JAX's private cuDNN attention is not where, or not what, this module expects."""


def private_api():
    """-> (the private `dot_product_attention`, `MaskType.PADDING_CAUSAL`); raises PrivateApiMoved
    naming the module, function, parameter or enum member that is missing."""
    try:
        module = importlib.import_module(PRIVATE_MODULE)
    except ImportError as e:
        raise PrivateApiMoved(f"{PRIVATE_MODULE} cannot be imported: {e}") from e
    fn = getattr(module, PRIVATE_FUNCTION, None)
    if not callable(fn):
        raise PrivateApiMoved(f"{PRIVATE_MODULE} has no function {PRIVATE_FUNCTION}")
    params = inspect.signature(fn).parameters
    missing = [p for p in PRIVATE_PARAMETERS if p not in params]
    if missing:
        raise PrivateApiMoved(f"{PRIVATE_MODULE}.{PRIVATE_FUNCTION} has no parameter {', '.join(missing)}")
    enum_name, member = PRIVATE_MASK_TYPE
    mask_type = getattr(getattr(module, enum_name, None), member, None)
    if mask_type is None:
        raise PrivateApiMoved(f"{PRIVATE_MODULE} has no {enum_name}.{member}")
    return fn, mask_type


@functools.cache
def packed_attention():
    """cuDNN's packed causal attention as f(q, k, v, offsets, lengths, *, scale), or None (after
    one warning per process) when `private_api` finds it moved."""
    try:
        fn, mask_type = private_api()
    except PrivateApiMoved as e:
        warnings.warn(f"pallas_kernels.causal_attention: cuDNN's packed layout is unavailable ({e}); "
                      f"packed rows use jax.nn.dot_product_attention with an [S, S] document mask",
                      RuntimeWarning, stacklevel=2)
        return None

    def call(q, k, v, offsets, lengths, *, scale):
        return fn(q, k, v, q_seqlen=lengths, kv_seqlen=lengths, q_offsets=offsets, kv_offsets=offsets,
                  scale=scale, mask_type=mask_type, qkv_layout="BTNH")

    return call


def supports(head_width: int, dtype) -> bool:
    """Whether cuDNN's flash attention runs these heads here: on a GPU, bfloat16 or float16, of
    a width that is a multiple of 8, <= 256 from Hopper on and <= 128 before."""
    if jax.default_backend() != "gpu" or head_width % 8 or jnp.dtype(dtype) not in (jnp.bfloat16, jnp.float16):
        return False
    capability = getattr(jax.devices()[0], "compute_capability", "0.0")
    hopper_or_later = tuple(int(x) for x in capability.split(".")[:2]) >= (9, 0)
    return head_width <= (256 if hopper_or_later else 128)


def causal_attention(q: jax.Array, k: jax.Array, v: jax.Array, *, scale: float,
                     kv_len: jax.Array | None = None, mask: jax.Array | None = None,
                     segments: tuple[jax.Array, jax.Array] | None = None, config: NoConfig = NoConfig(),
                     interpret: bool = False) -> jax.Array:
    """Contract of `pallas_kernels.causal_attention` on cuDNN: q, k, v bf16 or fp16
    [B, S, N, d] (d: see `supports`) -> [B, S, N, d].

    With segments, cuDNN's packed layout (needs a Hopper-or-later GPU): no mask is built, and
    kv_len and mask are not read (they describe the same documents); else, or when the
    private API moved, the public cuDNN call with the documents' mask. config, interpret: the
    registry's uniform arguments (nothing to tune; cuDNN has no interpreter, the registry
    refuses interpret=True)."""
    del config, interpret
    if segments is not None:
        packed = packed_attention()
        if packed is not None:
            offsets, lengths = segments
            return packed(q, k, v, offsets, lengths, scale=scale)
    return xla.attend(q, k, v, scale=scale, kv_len=kv_len, mask=mask, segments=segments,
                      implementation="cudnn")
