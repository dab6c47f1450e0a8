"""Decoding: sampling, the cached generation loop and (later) speculative decoding."""

from glm_jax.decoding.sampling import sample_tokens

__all__ = ["sample_tokens"]
