"""The engine and stop token a server runs: `build_engine` (`decoding.builders`: every slot at
the full context, so no request is preempted for pages) and `end_of_text_token`."""

from __future__ import annotations


def build_engine(model, **settings):
    """`decoding.builders.build_engine` (imported on first use: the front end's --help loads no jax)."""
    from glm_jax.decoding import builders

    return builders.build_engine(model, **settings)


def end_of_text_token(cfg, tokenizer) -> int | None:
    """The token that ends a completion: the one stop-token rule, `data.tokenizer.stop_token`."""
    from glm_jax.data.tokenizer import stop_token

    return stop_token(cfg, tokenizer)
