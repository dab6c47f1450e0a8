"""Decoding: one runtime (`runtime.DecodeRuntime`: cache, prefill, program builder, stop and cut
rules, stats), its one prefill program (`prefill.prefill_chunk`) and the policies over it (plain
and speculative generators, the serving engine; each answers `completions`); sampling and
rejection sampling."""

from glm_jax.decoding.rejection import rejection_sample
from glm_jax.decoding.sampling import GREEDY, SamplingParams, sample_tokens, sampling_probs

__all__ = ["GREEDY", "SamplingParams", "rejection_sample", "sample_tokens", "sampling_probs"]
