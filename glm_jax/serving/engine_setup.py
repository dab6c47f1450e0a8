"""The engine and stop token a server runs: `build_engine` (every slot at the full context, so no
request is preempted for pages) and `end_of_text_token`."""

from __future__ import annotations


def build_engine(model, *, slots: int, page_size: int, max_context: int, prefill_chunk: int,
                 step_token_budget: int | None = None, decode_steps: int = 1, **placement):
    """A ServingEngine whose pool holds every slot at the full context at once (so no request
    is ever preempted for pages); step_token_budget, decode_steps: as for ServingEngine."""
    from glm_jax.decoding.engine import engine_with_room

    return engine_with_room(model, slots=slots, longest=max_context + prefill_chunk, max_context=max_context,
                            prefill_chunk=prefill_chunk, page_size=page_size, step_token_budget=step_token_budget,
                            decode_steps=decode_steps, **placement)


def end_of_text_token(cfg, tokenizer) -> int | None:
    """The config's eos_token_id (the first of a list) if set, else the tokenizer's end-of-text."""
    from glm_jax.data.tokenizer import eos_id

    eos = cfg.eos_token_id
    if isinstance(eos, (tuple, list)):
        eos = eos[0] if eos else None
    return eos_id(tokenizer) if eos is None else eos
