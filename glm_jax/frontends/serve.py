"""`decode.py --serve`: the server's flags (`ServeConfig`), and the model, tokenizer and engine
that decode.py's flags name, handed to `glm_jax.serving.server.serve` (uvicorn with a draining
shutdown)."""

from __future__ import annotations

import argparse

from glm_jax.decoding.decode_config import DecodeConfig
from glm_jax.frontends import cli
from glm_jax.serving.engine_setup import build_engine, end_of_text_token
from glm_jax.serving.serve_config import DEFAULT_SLOTS, ServeConfig


def add_server_flags(ap: argparse.ArgumentParser) -> None:
    group = ap.add_argument_group("HTTP server", "--serve answers OpenAI-style /v1/completions requests "
                                  "(docs/serving.md, HTTP endpoint) instead of decoding --prompt")
    group.add_argument("--serve", action="store_true", help="run the HTTP server")
    group.add_argument("--host", help="address to listen on (0.0.0.0: every interface)")
    group.add_argument("--port", type=int, help="port to listen on (0: any free one)")
    group.add_argument("--page-size", type=int, help="cache rows per page of the engine's pool")
    group.add_argument("--step-token-budget", type=int, metavar="N",
                       help="at most N tokens (prefill + decode) per engine step while requests decode: bounds "
                            "their inter-token latency, lengthens long prompts' time to first token (default: no "
                            "budget, whole --prefill-chunk per step; docs/serving.md)")
    defaults = ServeConfig()        # the defaults are ServeConfig's (slots: decode.py's --max-batch)
    ap.set_defaults(host=defaults.host, port=defaults.port, page_size=defaults.page_size,
                    step_token_budget=defaults.step_token_budget)


def serve_config(args) -> ServeConfig:
    """The ServeConfig of decode.py's flags (checked: a bad port is refused before the model loads)."""
    return ServeConfig(host=args.host, port=args.port, slots=DEFAULT_SLOTS if args.max_batch is None else args.max_batch,
                       page_size=args.page_size, step_token_budget=args.step_token_budget)


def serve(args, settings: DecodeConfig, serving: ServeConfig) -> int:
    """Build the model, tokenizer and engine that decode.py's flags name and serve them until a
    signal; -> the exit code."""
    import jax

    from glm_jax.checkpoint import load_model
    from glm_jax.config import load_config
    from glm_jax.data.tokenizer import load_tokenizer
    from glm_jax.sharding import make_mesh

    try:
        from glm_jax.serving.app import make_app
        from glm_jax.serving.server import serve as run_server
    except ImportError as e:
        raise cli.UserError(f"--serve needs the serve extra ({e}); install it with "
                            f"{cli.python_command()} -m pip install -c constraints.txt -e '.[serve]'") from None

    if jax.process_count() > 1:
        raise cli.UserError("--serve runs in one process; leave out the multi-process flags")
    source = cli.model_source(args)
    with cli.user_errors():
        model = load_model(source, config=load_config(args.config) if args.config else None)
        tokenizer = load_tokenizer(source.path)
        max_context = settings.max_len or model.cfg.max_position_embeddings
        engine = build_engine(model, slots=serving.slots, page_size=serving.page_size, max_context=max_context,
                              prefill_chunk=settings.prefill_chunk, step_token_budget=serving.step_token_budget,
                              decode_steps=settings.decode_steps, kernels=settings.kernels(),
                              mesh=make_mesh(settings.mesh) if settings.mesh else None, collective=settings.collective)
    app = make_app(engine, tokenizer, model_name=model.cfg.name, max_context=max_context,
                   stop_token=end_of_text_token(model.cfg, tokenizer))
    budget = "" if serving.step_token_budget is None else f", step token budget {serving.step_token_budget}"
    blocks = "" if settings.decode_steps == 1 else f", up to {settings.decode_steps} decode steps per call"
    return run_server(app, host=serving.host, port=serving.port,
                      about=f"{model.cfg.name} from {source.path}, {serving.slots} slots, context {max_context} "
                            f"tokens{budget}{blocks}")
