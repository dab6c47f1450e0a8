"""Decoding: sampling, the cached generation loop, rejection sampling and speculative decoding."""

from glm_jax.decoding.rejection import rejection_sample
from glm_jax.decoding.sampling import GREEDY, SamplingParams, sample_tokens, sampling_probs

__all__ = ["GREEDY", "SamplingParams", "rejection_sample", "sample_tokens", "sampling_probs"]
