"""`decode.py --serve`: the model, tokenizer and engine from decode.py's flags, handed to
`glm_jax.serving.server.serve` (uvicorn with a draining shutdown)."""

from __future__ import annotations

import argparse

from glm_jax import cli


#: Requests the server decodes together unless --max-batch says otherwise.
DEFAULT_SLOTS = 4


def add_server_flags(ap: argparse.ArgumentParser) -> None:
    group = ap.add_argument_group("HTTP server", "--serve answers OpenAI-style /v1/completions requests "
                                  "(docs/serving.md, HTTP endpoint) instead of decoding --prompt")
    group.add_argument("--serve", action="store_true", help="run the HTTP server")
    group.add_argument("--host", default="127.0.0.1", help="address to listen on (0.0.0.0: every interface)")
    group.add_argument("--port", type=int, default=8000, help="port to listen on (0: any free one)")
    group.add_argument("--page-size", type=int, default=16, help="cache rows per page of the engine's pool")
    group.add_argument("--step-token-budget", type=int, default=None, metavar="N",
                       help="at most N tokens (prefill + decode) per engine step while requests decode: bounds "
                            "their inter-token latency, lengthens long prompts' time to first token (default: no "
                            "budget, whole --prefill-chunk per step; docs/serving.md)")


def serve_from_args(args) -> int:
    """Build what decode.py's flags name and serve it until a signal; -> the exit code."""
    import jax

    from glm_jax.checkpoint import load_model
    from glm_jax.config import load_config
    from glm_jax.data.tokenizer import load_tokenizer
    from glm_jax.sharding import make_mesh

    try:
        from glm_jax.serving.app import make_app
        from glm_jax.serving.server import serve
    except ImportError as e:
        raise cli.UserError(f"--serve needs the serve extra ({e}); install it with pip install -e '.[serve]'") from None

    if jax.process_count() > 1:
        raise cli.UserError("--serve runs in one process; leave out the multi-process flags")
    slots = DEFAULT_SLOTS if args.max_batch is None else args.max_batch
    if slots < 1 or args.page_size < 1:
        raise cli.UserError("--max-batch and --page-size must be >= 1")
    source = cli.model_source(args)
    with cli.user_errors():
        model = load_model(source, config=load_config(args.config) if args.config else None)
        tokenizer = load_tokenizer(source.path)
        max_context = args.max_len or model.cfg.max_position_embeddings
        engine = build_engine(model, slots=slots, page_size=args.page_size, max_context=max_context,
                              prefill_chunk=args.prefill_chunk, step_token_budget=args.step_token_budget,
                              kernels=cli.kernel_choice(args),
                              mesh=make_mesh(args.mesh) if args.mesh else None, collective=args.collective)
    app = make_app(engine, tokenizer, model_name=model.cfg.name, max_context=max_context,
                   stop_token=end_of_text_token(model.cfg, tokenizer))
    budget = "" if args.step_token_budget is None else f", step token budget {args.step_token_budget}"
    return serve(app, host=args.host, port=args.port,
                 about=f"{model.cfg.name} from {source.path}, {slots} slots, context {max_context} tokens{budget}")


def build_engine(model, *, slots: int, page_size: int, max_context: int, prefill_chunk: int,
                 step_token_budget: int | None = None, **placement):
    """A ServingEngine whose pool holds every slot at the full context at once (so no request
    is ever preempted for pages); step_token_budget: as for ServingEngine."""
    from glm_jax.decoding.engine import engine_with_room

    return engine_with_room(model, slots=slots, longest=max_context + prefill_chunk, max_context=max_context,
                            prefill_chunk=prefill_chunk, page_size=page_size, step_token_budget=step_token_budget,
                            **placement)


def end_of_text_token(cfg, tokenizer) -> int | None:
    """The config's eos_token_id (the first of a list) if set, else the tokenizer's end-of-text."""
    from glm_jax.data.tokenizer import eos_id

    eos = cfg.eos_token_id
    if isinstance(eos, (tuple, list)):
        eos = eos[0] if eos else None
    return eos_id(tokenizer) if eos is None else eos
