"""`DecodeConfig`: the settings of a decode (decode.py's numbers, sampling, speculation,
placement and kernels), checked on construction (`glm_jax.settings`): a bad value is one
SettingError naming the setting and its flag, before any model is loaded. `build_generator`:
the generator they describe."""

from __future__ import annotations

import dataclasses

from glm_jax import ops
from glm_jax.kernel_configs import configured
from glm_jax.decoding.sampling import SamplingError, SamplingParams
from glm_jax.settings import FrozenDict, Settings, SettingError, setting


@dataclasses.dataclass(frozen=True)
class DecodeConfig(Settings):
    max_new_tokens: int = setting(128, above=0)
    max_len: int | None = setting(None, at_least=1)
    # Sampling: chosen by benchmarks/repetition.py (docs/default-model.md, "Default sampling"): at
    # temperature 0.7 / top-p 0.9 the default model repeated a line more than 3 times in 8 of 20
    # held-out completions, at temperature 1 / top-k 40 in 1 of 20.
    temperature: float = setting(1.0)
    top_p: float = setting(1.0)
    top_k: int = setting(40)
    min_p: float = setting(0.0)
    seed: int = setting(0)
    speculative: int | None = setting(None, at_least=0)
    kv_share: bool = setting(True, flag="--no-kv-share")
    prefill_chunk: int = setting(256, at_least=1)
    max_batch: int | None = setting(None, at_least=1)
    mesh: str | None = setting(None)
    collective: str = setting("permute")
    attention_impl: str = setting("auto")
    indexer_impl: str = setting("auto")
    kernel_config: FrozenDict = setting(FrozenDict())
    batch_invariant: bool = setting(False)
    decode_steps: int = setting(1, at_least=1)

    def __post_init__(self) -> None:
        super().__post_init__()
        self.sampling()               # its rules are SamplingParams'

    def sampling(self) -> SamplingParams:
        try:
            return SamplingParams(temperature=self.temperature, top_p=self.top_p, top_k=self.top_k, min_p=self.min_p)
        except SamplingError as e:
            raise SettingError(f"--{e.field.replace('_', '-')} must be {e.rule}, got {e.value!r}") from None

    def kernels(self) -> ops.KernelChoice:
        """The kernels, their configs set (`kernel_configs.configured`: resolves "auto" on this backend)."""
        return configured(ops.KernelChoice(indexer=self.indexer_impl, attention=self.attention_impl,
                                           batch_invariant=self.batch_invariant), self.kernel_config)


def build_generator(model, settings: DecodeConfig, *, batch: int, mesh=None):
    """The generator for `batch` prompts that `settings` describe -> (generator, the
    `policy.Choice` saying why it speculates or not): speculative with settings.speculative
    drafts, or when that is None where it measured faster (`policy.choose`); plain otherwise."""
    import jax

    from glm_jax.decoding.generate import Generator
    from glm_jax.decoding.policy import Choice, choose
    from glm_jax.decoding.speculative import SpeculativeGenerator

    if model.mtp is None:
        choice = Choice(0, "plain decoding: the model has no MTP layer to draft with")
    elif settings.speculative is not None:
        choice = Choice(settings.speculative, f"{'plain' if settings.speculative == 0 else 'speculative'} decoding: "
                                              f"--speculative {settings.speculative}")
    else:
        choice = choose(jax.default_backend(), batch)
    common = dict(mesh=mesh, collective=settings.collective, kernels=settings.kernels(), batch=batch,
                  max_len=settings.max_len, prefill_chunk=settings.prefill_chunk)
    if choice.num_draft:
        return SpeculativeGenerator(model, num_draft=choice.num_draft, kv_share=settings.kv_share, **common), choice
    return Generator(model, **common), choice
