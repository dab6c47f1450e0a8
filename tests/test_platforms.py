"""train.py's host-side helpers with JAX_PLATFORMS naming only the accelerator: no cpu backend."""

import jax
import numpy as np
import pytest

from glm_jax.training.step import make_optimizer


@pytest.fixture
def no_cpu_backend(monkeypatch):
    """jax.devices("cpu") fails as it does under JAX_PLATFORMS=cuda (or tpu)."""
    real = jax.devices

    def devices(backend=None):
        if backend == "cpu":
            raise RuntimeError("Unknown backend cpu. Available backends are ['cuda']")
        return real(backend)

    monkeypatch.setattr(jax, "devices", devices)


@pytest.mark.parametrize("decay_steps", [0, 7])
def test_learning_rate_on_host_equals_the_optimizers(decay_steps):
    _, schedule = make_optimizer(3e-3, 40, 5, decay_steps=decay_steps)
    on_device = np.asarray(jax.vmap(schedule)(np.arange(45)))
    on_host = np.array([schedule.on_host(c) for c in range(45)])
    np.testing.assert_allclose(on_host, on_device, rtol=2e-6, atol=1e-12)
    assert on_host[0] == 0.0 and on_host[5] == pytest.approx(3e-3) and on_host[44] == pytest.approx(3e-4)


def test_learning_rate_read_needs_no_cpu_backend(no_cpu_backend):
    with pytest.raises(RuntimeError, match="Unknown backend cpu"):
        jax.devices("cpu")
    _, schedule = make_optimizer(1e-3, 10, 2)
    assert schedule.on_host(1) == pytest.approx(5e-4)
