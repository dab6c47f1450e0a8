"""An OpenAI-compatible HTTP front end (/v1/completions) for the serving engine.

    protocol     request bodies -> CompletionRequest or APIError; the response bodies
    text         incremental detokenization and stop strings
    engine_loop  the engine on its own thread; a Ticket per request for the event loop
    app          make_app: the Starlette routes over an EngineLoop
    server       uvicorn with a draining shutdown (SIGTERM)
    engine_setup build_engine (decoding.builders: every slot at the full context), the stop token

decode.py --serve builds these from its flags (`glm_jax.frontends.serve`). Only `app` and
`server` need the serve extra (Starlette, uvicorn); importing this package does not.
"""
