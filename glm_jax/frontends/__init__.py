"""The command-line front ends over the library: what train.py, decode.py and the `python -m`
programs share, and the programs themselves. The library (glm_jax's other packages) imports
none of them.

    cli                the flags train.py, decode.py and the pattern search share; their errors
    serve              decode.py --serve: its flags, model, tokenizer and engine, then the server
    info               python -m glm_jax.frontends.info CONFIG: size and cost of a configuration
    indexcache_search  python -m glm_jax.frontends.indexcache_search: the IndexShare pattern search
"""
