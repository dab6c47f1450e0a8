"""glm_jax.decoding.programs: jitted programs compiled with XLA options (CUDA graphs on a GPU)."""

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from conftest import micro_config
from glm_jax.decoding import programs
from glm_jax.decoding.generate import Generator
from glm_jax.decoding.speculative import SpeculativeGenerator
from glm_jax.model import GLMModel

CPU_OPTION = (("xla_embed_ir_in_executable", False),)     # any option the CPU compiler takes


def test_with_options_is_the_same_program_compiled_with_them():
    @programs.program(static_argnames=("n",), donate_argnames=("x",))
    def scaled(x, n):
        """x times n."""
        return x * n

    assert scaled.__name__ == "scaled" and scaled.__doc__ == "x times n."
    assert scaled.with_options(()) is scaled.with_options(())           # the plain jitted function
    with_option = scaled.with_options(CPU_OPTION)
    assert with_option is scaled.with_options(CPU_OPTION) and with_option is not scaled.with_options(())
    np.testing.assert_array_equal(with_option(jnp.arange(3.0), n=2), scaled(jnp.arange(3.0), 2))


def test_generators_ask_for_cuda_graphs_only_on_a_gpu(monkeypatch):
    model = GLMModel(micro_config(), rngs=nnx.Rngs(0))
    assert Generator(model, cuda_graphs=True).options == ()             # this CPU
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    assert Generator(model, cuda_graphs=True).options == programs.CUDA_GRAPH_OPTIONS
    assert SpeculativeGenerator(model, cuda_graphs=True).options == programs.CUDA_GRAPH_OPTIONS
    assert Generator(model).options == () and SpeculativeGenerator(model).options == ()


def test_generators_with_options_give_the_same_tokens(monkeypatch):
    """The programs compiled with options (here a CPU one in place of the CUDA graphs') decode
    what the plain ones decode."""
    model = GLMModel(micro_config(), rngs=nnx.Rngs(0))
    prompts = np.array([[3, 5, 7, 9, 11], [2, 4, 6, 8, 10]], np.int32)

    def decode(cuda_graphs):
        plain = Generator(model, batch=2, max_len=48, prefill_chunk=8, block_size=4, cuda_graphs=cuda_graphs)
        spec = SpeculativeGenerator(model, batch=2, max_len=48, prefill_chunk=8, num_draft=2, cuda_graphs=cuda_graphs)
        assert plain.options == spec.options == (CPU_OPTION if cuda_graphs else ())
        return np.concatenate(list(plain.generate(prompts, max_new_tokens=8))), spec.generate(prompts, max_new_tokens=8)

    want = decode(False)
    monkeypatch.setattr(programs, "compiler_options", lambda backend, cuda_graphs: CPU_OPTION if cuda_graphs else ())
    monkeypatch.setattr("glm_jax.decoding.runtime.compiler_options", programs.compiler_options)
    got = decode(True)
    for a, b in zip(got, want):
        np.testing.assert_array_equal(a, b)
