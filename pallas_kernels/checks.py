"""Argument checks of the public ops, run before any kernel is traced.

An op describes its array arguments with dimension letters (`"B S H D"`) and a dtype kind; the
first argument that has a letter binds its size and every later one must agree. Only shapes,
dtypes and Python values are read, so the checks cost nothing under jit. A failed check raises
one error naming the op, the argument, what it got and what was expected: ValueError for a
rank, a size or a value, TypeError for a dtype or a traced static argument.

    sig = Signature("indexer_topk")
    sig.array("q", q, "B S H D", FLOAT)
    sig.array("k", k, "B T D", FLOAT)      # D must equal q's D, B q's B
"""

from __future__ import annotations

import math
import numbers
import operator

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels import fp8

#: Dtype kinds of array arguments (the documented ones; integer arrays are cast to int32).
FLOAT = "float32 or bfloat16"
STORE = "a floating dtype (float32, bfloat16 or float8)"
FLOAT32 = "float32"
INT = "an integer dtype (int32)"
BOOL = "bool"
E4M3 = "float8_e4m3fn"
BF16 = "bfloat16"

_KIND_TEST = {
    FLOAT: lambda d: d in (np.float32, jnp.bfloat16),
    STORE: lambda d: jnp.issubdtype(d, jnp.floating),
    FLOAT32: lambda d: d == np.float32,
    INT: lambda d: jnp.issubdtype(d, jnp.integer),
    BOOL: lambda d: d == np.bool_,
    E4M3: lambda d: d == jnp.float8_e4m3fn,
    BF16: lambda d: d == jnp.bfloat16,
}


def _shape_dtype(x) -> tuple[tuple[int, ...], np.dtype]:
    """The shape and dtype of an array, a tracer, a ShapeDtypeStruct or a Python value."""
    if hasattr(x, "shape") and hasattr(x, "dtype"):
        return tuple(x.shape), np.dtype(x.dtype)
    value = np.asarray(x)
    return value.shape, value.dtype


class Signature:
    """The array arguments of one call of `op`, checked one at a time against dimension letters
    shared between them."""

    def __init__(self, op: str):
        self.op = op
        self._sizes: dict[str, tuple[int, str]] = {}    # letter -> (size, the argument that set it)

    def fail(self, message: str, error: type[Exception] = ValueError):
        raise error(f"pallas_kernels.{self.op}: {message}")

    def array(self, name: str, x, dims: str, kind: str) -> None:
        """Checks x against dims (letters separated by spaces, one per axis) and kind (`FLOAT`,
        `FLOAT32`, `INT`, ...); binds the letters not seen yet."""
        shape, dtype = _shape_dtype(x)
        letters = dims.split()
        if len(shape) != len(letters):
            self.fail(f"{name} must be [{', '.join(letters)}] (rank {len(letters)}), got shape {shape}")
        for letter, size in zip(letters, shape):
            bound = self._sizes.setdefault(letter, (size, name))
            if bound[0] != size:
                self.fail(f"{name} has shape {shape} for [{', '.join(letters)}], so {letter}={size}, but "
                          f"{bound[1]} has {letter}={bound[0]}; they must agree")
        if not _KIND_TEST[kind](dtype):
            self.fail(f"{name} must have {kind}, got {dtype} (shape {shape})", TypeError)

    def optional(self, name: str, x, dims: str, kind: str) -> None:
        """`array` for an argument that may be None."""
        if x is not None:
            self.array(name, x, dims, kind)

    def size(self, letter: str) -> int:
        return self._sizes[letter][0]

    def static_int(self, name: str, value, *, low: int = 1, high: int | None = None) -> int:
        """A static Python int in [low, high] (TypeError if traced or not an int)."""
        _not_traced(self, name, value, "a Python int")
        try:
            result = operator.index(value)
        except TypeError:
            self.fail(f"{name} must be a Python int, got {value!r} ({type(value).__name__})", TypeError)
        if result < low or (high is not None and result > high):
            bounds = f"in [{low}, {high}]" if high is not None else f">= {low}"
            self.fail(f"{name}={result} must be {bounds}")
        return result

    def static_float(self, name: str, value) -> float:
        """A static, finite Python number (TypeError if traced or not a number)."""
        _not_traced(self, name, value, "a Python float")
        scalar_array = hasattr(value, "dtype") and tuple(getattr(value, "shape", (0,))) == ()
        if not (isinstance(value, numbers.Real) or scalar_array):
            self.fail(f"{name} must be a Python float, got {value!r} ({type(value).__name__})", TypeError)
        result = float(value)
        if not math.isfinite(result):
            self.fail(f"{name} must be finite, got {result}")
        return result

    def static_bool(self, name: str, value) -> None:
        _not_traced(self, name, value, "True or False")
        if not isinstance(value, (bool, np.bool_)):
            self.fail(f"{name} must be True or False, got {value!r}", TypeError)


def _not_traced(sig: Signature, name: str, value, expected: str) -> None:
    if isinstance(value, jax.core.Tracer):
        sig.fail(f"{name} must be static ({expected}), got a traced value {type(value).__name__}"
                 f"{tuple(value.shape)}: pass a Python value, or mark it static where the caller is "
                 f"jitted (jax.jit(f, static_argnames=('{name}',)))", TypeError)


# ----------------------------------------------------------------------------- the ops


def indexer(op: str, q, k, weights, q_pos, kv_len, kv_start) -> Signature:
    """indexer_scores / indexer_topk: q [B, S, H, D], k [B, T, D], weights float32 [B, S, H],
    q_pos int [B, S], kv_len int [B], kv_start int [B, S] or None."""
    sig = Signature(op)
    sig.array("q", q, "B S H D", FLOAT)
    sig.array("k", k, "B T D", FLOAT)
    _query_side(sig, weights, q_pos, kv_len)
    sig.optional("kv_start", kv_start, "B S", INT)
    return sig


def _query_side(sig: Signature, weights, q_pos, kv_len) -> None:
    sig.array("weights", weights, "B S H", FLOAT32)
    sig.array("q_pos", q_pos, "B S", INT)
    sig.array("kv_len", kv_len, "B", INT)


def paged_indexer(q, k_pages, page_table, weights, q_pos, kv_len, slot) -> Signature:
    """paged_indexer_topk: q [B, S, H, D], k_pages [(slots,) pages, P, D], page_table int [B, n],
    weights float32 [B, S, H], q_pos int [B, S], kv_len int [B], slot an int scalar."""
    sig = Signature("paged_indexer_topk")
    sig.array("q", q, "B S H D", FLOAT)
    _store(sig, "k_pages", k_pages, "D", fp8.Fp8Keys)
    sig.array("page_table", page_table, "B n", INT)
    _query_side(sig, weights, q_pos, kv_len)
    sig.array("slot", slot, "", INT)
    return sig


def _store(sig: Signature, name: str, store, width: str, fp8_type: type = fp8.Fp8Latent) -> None:
    """A paged store [pages, P, width] or [slots, pages, P, width] of any float dtype, or in
    the FP8 layout `fp8_type` (`_fp8_store`)."""
    if fp8.is_fp8(store):
        return _fp8_store(sig, name, store, width, fp8_type)
    if isinstance(store, tuple):
        sig.fail(f"{name} must be an array or a pallas_kernels.fp8.{fp8_type.__name__}, got a "
                 f"{type(store).__name__}", TypeError)
    rank = len(_shape_dtype(store)[0])
    if rank not in (3, 4):
        sig.fail(f"the paged store {name} must be [pages, P, {width}] or [slots, pages, P, {width}], "
                 f"got shape {_shape_dtype(store)[0]}")
    sig.array(name, store, ("slots " if rank == 4 else "") + f"pages P {width}", STORE)


def _fp8_store(sig: Signature, name: str, store, width: str, fp8_type: type) -> None:
    """An FP8 store (`pallas_kernels.fp8`): fields sharing [(slots,) pages, P]; values e4m3
    [.., C]; Fp8Latent: scales float32 [.., C / 128], rope bfloat16 [.., R], C + R = width;
    Fp8Keys: scales float32 [..] (one per key), C = width."""
    if type(store) is not fp8_type:
        sig.fail(f"{name} is a pallas_kernels.fp8.{type(store).__name__}, but this op reads a "
                 f"{fp8_type.__name__}", TypeError)
    if fp8_type is fp8.Fp8Keys:
        rank = len(_shape_dtype(store.values)[0])
        if rank not in (3, 4) or len(_shape_dtype(store.scales)[0]) != rank - 1:
            sig.fail(f"the FP8 store {name} must be values [(slots,) pages, P, {width}] and scales [(slots,) "
                     f"pages, P], got shapes {[_shape_dtype(x)[0] for x in store]}")
        lead = ("slots " if rank == 4 else "") + "pages P"
        sig.array(f"{name}.values", store.values, f"{lead} {width}", E4M3)
        sig.array(f"{name}.scales", store.scales, lead, FLOAT32)
        return
    ranks = {len(_shape_dtype(x)[0]) for x in store}
    if len(ranks) != 1 or ranks - {3, 4}:
        sig.fail(f"the fields of the FP8 store {name} must all be [pages, P, .] or [slots, pages, P, .], got "
                 f"shapes {[_shape_dtype(x)[0] for x in store]}")
    lead = ("slots " if ranks == {4} else "") + "pages P "
    sig.array(f"{name}.values", store.values, lead + "C", E4M3)
    sig.array(f"{name}.scales", store.scales, lead + "G", FLOAT32)
    sig.array(f"{name}.rope", store.rope, lead + "R", BF16)
    c, g, r = sig.size("C"), sig.size("G"), sig.size("R")
    if c != g * fp8.GROUP:
        sig.fail(f"{name}.scales must hold one scale per {fp8.GROUP} values ([.., {c // fp8.GROUP}] for "
                 f"{c} values), got [.., {g}]")
    if c + r != sig.size(width):
        sig.fail(f"{name} holds rows of {c} + {r} = {c + r} values, but q has {width}={sig.size(width)}")


def sparse_mla(op: str, q, kv, indices, sm_scale, v_dim, *, width: str = "Dk") -> Signature:
    """sparse_mla: q [B, S, H, Dk], kv [B, T, Dk], indices int [B, S, K]; sm_scale a float,
    v_dim an int in [1, Dk] (both static)."""
    sig = Signature(op)
    sig.array("q", q, f"B S H {width}", FLOAT)
    if op == "paged_sparse_mla":
        _store(sig, "kv_pages", kv, width)
    else:
        sig.array("kv", kv, f"B T {width}", FLOAT)
    sig.array("indices", indices, "B S K", INT)
    sig.static_float("sm_scale", sm_scale)
    sig.static_int("v_dim", v_dim, high=sig.size(width))
    return sig


def paged_sparse_mla(q, kv_pages, page_table, indices, sm_scale, v_dim, slot) -> Signature:
    """paged_sparse_mla: as `sparse_mla` with kv_pages [(slots,) pages, P, Dk], page_table
    int [B, n] and slot an int scalar."""
    sig = sparse_mla("paged_sparse_mla", q, kv_pages, indices, sm_scale, v_dim)
    sig.array("page_table", page_table, "B n", INT)
    sig.array("slot", slot, "", INT)
    return sig


def backward_index(indices, num_keys, dk) -> None:
    """sparse_mla_backward_index: indices int [B, S, K]; num_keys and dk static positive ints."""
    sig = Signature("sparse_mla_backward_index")
    sig.array("indices", indices, "B S K", INT)
    sig.static_int("num_keys", num_keys)
    sig.static_int("dk", dk)


def cross_entropy(q, k, weights, indices, target) -> None:
    """indexer_cross_entropy: q [B, S, H, D], k [B, T, D], weights float32 [B, S, H], indices
    int [B, S, K], target float32 [B, S, K]."""
    sig = Signature("indexer_cross_entropy")
    sig.array("q", q, "B S H D", FLOAT)
    sig.array("k", k, "B T D", FLOAT)
    sig.array("weights", weights, "B S H", FLOAT32)
    sig.array("indices", indices, "B S K", INT)
    sig.array("target", target, "B S K", FLOAT32)


def dense_indexer_kl(qs, latents, idx_q, idx_keys, idx_w, sm_scale, kv_len, kv_start, shares) -> tuple[float, ...]:
    """dense_indexer_kl: L >= 1 queries [B, S, H, Dk] and as many latents [B, S, Dk]; idx_q
    [B, S, Hi, Di], idx_keys [B, S, Di], idx_w [B, S, Hi]; kv_len int [B]; kv_start int [B, S]
    or None; sm_scale a static float; shares None or one static float a layer -> the shares
    (1 / L each by default)."""
    sig = Signature("dense_indexer_kl")
    if not qs or len(latents) != len(qs):
        sig.fail(f"one latent array per layer's queries and at least one layer, got {len(qs)} queries and "
                 f"{len(latents)} latents")
    sig.array("idx_q", idx_q, "B S Hi Di", FLOAT)
    for j, (q, latent) in enumerate(zip(qs, latents)):
        sig.array(f"qs[{j}]", q, "B S H Dk", FLOAT)
        sig.array(f"latents[{j}]", latent, "B S Dk", FLOAT)
    rows = (sig.size("B"), sig.size("S"))
    if tuple(_shape_dtype(idx_keys)[0][:2]) != rows:
        sig.fail(f"the indexer keys must be [{rows[0]}, {rows[1]}, Di] (one per query row), got "
                 f"{_shape_dtype(idx_keys)[0]}")
    sig.array("idx_keys", idx_keys, "B S Di", FLOAT)
    sig.array("idx_w", idx_w, "B S Hi", FLOAT)
    sig.array("kv_len", kv_len, "B", INT)
    sig.optional("kv_start", kv_start, "B S", INT)
    sig.static_float("sm_scale", sm_scale)
    if shares is None:
        return (1.0 / len(qs),) * len(qs)
    shares = tuple(sig.static_float("shares", s) for s in shares)
    if len(shares) != len(qs):
        sig.fail(f"{len(shares)} shares for {len(qs)} layers")
    return shares


def causal_attention(q, k, v, scale, kv_len, mask, segments) -> None:
    """causal_attention: q, k, v [B, S, N, d]; scale a static float; kv_len int [B] or None;
    mask bool [B, S, S] or None; segments (offsets int [B, M + 1], lengths int [B, M]) or None."""
    sig = Signature("causal_attention")
    for name, x in (("q", q), ("k", k), ("v", v)):
        sig.array(name, x, "B S N d", FLOAT)
    sig.static_float("scale", scale)
    sig.optional("kv_len", kv_len, "B", INT)
    sig.optional("mask", mask, "B S S", BOOL)
    if segments is None:
        return
    if not isinstance(segments, (tuple, list)) or len(segments) != 2:
        sig.fail(f"segments must be a pair (offsets [B, M + 1], lengths [B, M]) or None, got "
                 f"{type(segments).__name__}")
    offsets, lengths = segments
    sig.array("segments' offsets", offsets, "B M1", INT)
    sig.array("segments' lengths", lengths, "B M", INT)
    if sig.size("M1") != sig.size("M") + 1:
        sig.fail(f"segments' offsets must be [B, M + 1] for lengths [B, M={sig.size('M')}], got "
                 f"M + 1 = {sig.size('M1')}")


def runnable(op: str, impl: str, platform: str | None, interpretable: bool, interpret: bool) -> None:
    """Raises ValueError for an implementation that cannot run where it is called: one for
    another platform (a Pallas kernel, a vendor library) called on the CPU without interpret=True.
    The target is the ambient mesh's device kind if one is set, else the default backend."""
    if platform is None or interpret:
        return
    target = _target_platform()
    if target != "cpu":
        return
    fix = "pass interpret=True to run it in the Pallas interpreter, or " if interpretable else ""
    raise ValueError(f"pallas_kernels.{op}: impl={impl!r} compiles for {platform}, but this runs on the CPU (the "
                     f"default backend, and no mesh of {platform} devices is set): {fix}pick impl='xla' (or 'auto')")


def _target_platform() -> str:
    mesh = jax.sharding.get_abstract_mesh()
    device = None if mesh.empty else getattr(mesh, "abstract_device", None)
    return device.platform if device is not None else jax.default_backend()
