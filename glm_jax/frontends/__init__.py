"""The command-line front ends over the library: what train.py, decode.py and the `python -m`
programs share, and the programs themselves. The library (glm_jax's other packages) imports
none of them.

    cli                the flags train.py, decode.py and the pattern search share; their errors
    settings_cli       parsers generated from the settings dataclasses (tyro), a settings file under the flags
    train              train.py: TrainCommand (TrainConfig's flags, --run-config, processes) -> the run
    decode             decode.py: its flags (DecodeConfig's defaults), prompts, generator or engine, output
    serve              decode.py --serve: its flags, model, tokenizer and engine, then the server
    info               python -m glm_jax.frontends.info CONFIG: size and cost of a configuration
    indexcache_search  python -m glm_jax.frontends.indexcache_search: the IndexShare pattern search
"""
