"""Products of low-precision operands whose backward pass stays in the operands' dtype.

`jnp.einsum(spec, a, b, preferred_element_type=float32)` on bf16 operands runs its forward
matmul on bf16 tensor cores with float32 accumulation, but JAX's transpose of it multiplies the
float32 cotangent by the operands upcast to float32: both backward matmuls run in float32 (TF32
on a GPU, several bf16 passes on a TPU) and read twice the bytes. `einsum` here rounds the
cotangent to the operands' dtype first, so all three matmuls of the product run in that dtype
with float32 accumulation. Where the product's output is itself rounded to the operands' dtype
(a projection), the cotangent arrives in that dtype and nothing is lost.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp


def _terms(spec: str) -> tuple[str, str, str]:
    """'ab,bc->ac' -> ('ab', 'bc', 'ac'), checking that every index of an operand also appears
    in the other operand or the output (else its gradient is not one einsum)."""
    inputs, arrow, out = spec.replace(" ", "").partition("->")
    a, comma, b = inputs.partition(",")
    if not (arrow and comma) or "," in b:
        raise ValueError(f"einsum needs a spec of two operands and an explicit output ('ab,bc->ac'), got {spec!r}")
    for name, term, others in (("first", a, b + out), ("second", b, a + out)):
        lone = set(term.replace("...", "")) - set(others)
        if lone:
            raise ValueError(f"einsum {spec!r}: index {sorted(lone)} of the {name} operand appears nowhere else")
    return a, b, out


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def einsum(spec: str, a: jnp.ndarray, b: jnp.ndarray) -> jnp.ndarray:
    """jnp.einsum(spec, a, b) in float32 (accumulated in float32 from operands in their own
    dtype); its gradients come from matmuls in the operands' common dtype (module docstring)
    and are returned in each operand's dtype."""
    _terms(spec)
    return jnp.einsum(spec, a, b, preferred_element_type=jnp.float32)


def _einsum_fwd(spec, a, b):
    return einsum(spec, a, b), (a, b)


def _einsum_bwd(spec, residuals, g):
    a, b = residuals
    ta, tb, out = _terms(spec)
    g = g.astype(jnp.result_type(a, b))
    da = jnp.einsum(f"{out},{tb}->{ta}", g, b.astype(g.dtype), preferred_element_type=jnp.float32)
    db = jnp.einsum(f"{ta},{out}->{tb}", a.astype(g.dtype), g, preferred_element_type=jnp.float32)
    return da.astype(a.dtype), db.astype(b.dtype)


einsum.defvjp(_einsum_fwd, _einsum_bwd)
