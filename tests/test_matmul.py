"""glm_jax.layers.matmul.einsum: the gradients of jnp.einsum, from matmuls in the operands' dtype."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from glm_jax.layers.linear import Linear
from glm_jax.layers.matmul import einsum

SPECS = [("...i,io->...o", (2, 3, 8), (8, 5)),          # a projection (Linear)
         ("bshn,chn->bshc", (2, 3, 4, 6), (7, 4, 6)),   # MLA's absorbed queries
         ("bshc,chv->bshv", (2, 3, 4, 7), (7, 4, 5)),   # MLA's absorbed output
         ("nh,hf->nf", (4, 8), (8, 3))]                 # the MoE's dense experts


@pytest.mark.parametrize("spec,shape_a,shape_b", SPECS)
def test_gradients_equal_jnp_einsum_in_float32(spec, shape_a, shape_b):
    ka, kb, kg = jax.random.split(jax.random.key(0), 3)
    a, b = jax.random.normal(ka, shape_a), jax.random.normal(kb, shape_b)
    out = jnp.einsum(spec, a, b, precision="highest")
    g = jax.random.normal(kg, out.shape)
    _, ref_vjp = jax.vjp(lambda a, b: jnp.einsum(spec, a, b, precision="highest"), a, b)
    value, vjp = jax.vjp(lambda a, b: einsum(spec, a, b), a, b)
    np.testing.assert_allclose(value, out, rtol=1e-5, atol=1e-5)
    for got, want in zip(vjp(g), ref_vjp(g)):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


def _dot_operand_types(fn, *args) -> list[str]:
    """The operand types of every dot_general in fn's lowered gradient."""
    text = jax.jit(jax.grad(fn, argnums=tuple(range(len(args))))).lower(*args).as_text()
    return [m.group(1) for m in re.finditer(r"stablehlo.dot_general.*?: \((.*?)\) ->", text)]


def test_bf16_backward_matmuls_stay_in_bf16():
    """jnp.einsum's transpose upcasts both operands to float32 (the reason for this module)."""
    a, b = jnp.ones((16, 32), jnp.bfloat16), jnp.ones((32, 8), jnp.bfloat16)
    loss = lambda f: lambda a, b: f(a, b).astype(jnp.bfloat16).astype(jnp.float32).sum()  # noqa: E731
    plain = _dot_operand_types(loss(lambda a, b: jnp.einsum("mk,kn->mn", a, b, preferred_element_type=jnp.float32)),
                               a, b)
    ours = _dot_operand_types(loss(lambda a, b: einsum("mk,kn->mn", a, b)), a, b)
    assert plain and all("f32" in t and "bf16" not in t for t in plain)
    assert len(ours) == 2 and all("bf16" in t and "f32" not in t for t in ours)


def test_linear_gradients_in_bf16():
    from flax import nnx

    layer = Linear(32, 8, rngs=nnx.Rngs(0), param_dtype=jnp.bfloat16)
    graphdef, state = nnx.split(layer)
    x = jnp.ones((4, 32), jnp.bfloat16)
    types = _dot_operand_types(lambda s, x: nnx.merge(graphdef, s)(x).astype(jnp.float32).sum(), state, x)
    assert types and all("f32" not in t for t in types)


@pytest.mark.parametrize("spec", ["ab,cd->ad", "ab->b", "ab,bc"])
def test_specs_without_an_einsum_gradient_are_refused(spec):
    with pytest.raises(ValueError, match="einsum"):
        einsum(spec, jnp.ones((2, 2)), jnp.ones((2, 2)))
