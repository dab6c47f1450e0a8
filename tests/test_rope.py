import jax
import jax.numpy as jnp
import numpy as np
import pytest

from glm_jax.layers.rope import apply_rope, rope_inv_freq, softmax_scale_factor


@pytest.mark.parametrize("interleave", [True, False])
def test_rope_scores_depend_only_on_relative_position(interleave):
    inv = rope_inv_freq(16, 10000.0)
    q = jax.random.normal(jax.random.key(0), (1, 1, 16))
    k = jax.random.normal(jax.random.key(1), (1, 1, 16))

    def score(m, n):
        qm = apply_rope(q[:, :, None], jnp.array([[m]]), inv, interleave=interleave)[0, 0, 0]
        kn = apply_rope(k[:, :, None], jnp.array([[n]]), inv, interleave=interleave)[0, 0, 0]
        return float(qm @ kn)

    assert score(7, 3) == pytest.approx(score(104, 100), rel=1e-4, abs=1e-4)
    assert score(7, 3) != pytest.approx(score(9, 3), rel=1e-3)
    assert score(0, 0) == pytest.approx(float(q[0, 0] @ k[0, 0]), rel=1e-5)


def test_layouts_rotate_different_pairs():
    x = jnp.arange(8, dtype=jnp.float32).reshape(1, 1, 1, 8)
    inv = rope_inv_freq(8, 10000.0)
    a = apply_rope(x, jnp.array([[3]]), inv, interleave=True)
    b = apply_rope(x, jnp.array([[3]]), inv, interleave=False)
    assert not np.allclose(a, b)
    # the interleaved form equals the half-split form applied to de-interleaved dims
    perm = np.r_[0:8:2, 1:8:2]
    np.testing.assert_allclose(a[..., perm], apply_rope(x[..., perm], jnp.array([[3]]), inv, interleave=False),
                               atol=1e-5)


def test_yarn_blends_frequencies_and_scales_softmax():
    scaling = {"rope_type": "yarn", "factor": 40, "original_max_position_embeddings": 4096,
               "beta_fast": 32, "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0}
    plain, yarn = rope_inv_freq(64, 10000.0), rope_inv_freq(64, 10000.0, scaling)
    assert yarn[0] == pytest.approx(plain[0])            # high frequencies kept
    assert yarn[-1] == pytest.approx(plain[-1] / 40)     # low frequencies interpolated
    assert softmax_scale_factor(scaling) == pytest.approx((0.1 * np.log(40) + 1) ** 2)
