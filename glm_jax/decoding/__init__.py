"""Decoding: sampling, the cached generation loop, rejection sampling and speculative decoding."""

from glm_jax.decoding.rejection import rejection_sample
from glm_jax.decoding.sampling import sample_tokens

__all__ = ["rejection_sample", "sample_tokens"]
