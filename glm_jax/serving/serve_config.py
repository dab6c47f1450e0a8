"""`ServeConfig`: where the HTTP server listens and how its engine is laid out, checked on
construction (`glm_jax.settings`), so a bad value is refused before the model loads."""

from __future__ import annotations

import dataclasses

from glm_jax.settings import Settings, setting

#: Requests the server decodes together unless --max-batch says otherwise.
DEFAULT_SLOTS = 4


@dataclasses.dataclass(frozen=True)
class ServeConfig(Settings):
    host: str = setting("127.0.0.1", help="address to listen on (0.0.0.0: every interface)")
    port: int = setting(8000, at_least=0, at_most=65535, help="port to listen on (0: any free one)")
    slots: int = setting(DEFAULT_SLOTS, at_least=1, flag="--max-batch", cli=False)   # decode.py's --max-batch
    page_size: int = setting(16, at_least=1, help="cache rows per page of the engine's pool")
    kv_cache_memory_bytes: int | None = setting(
        None, at_least=1, metavar="BYTES",
        help="the engine's KV cache pool: the whole pages this many bytes hold in the --kv-cache-dtype layout (fp8 "
             "pages are 1.77x smaller at GLM-5.2's shape, so more requests are admitted); requests then wait for "
             "pages (default: every slot at the full context)")
    step_token_budget: int | None = setting(None, at_least=1, metavar="N",
                                            help="at most N tokens (prefill + decode) per engine step while requests "
                                                 "decode: bounds their inter-token latency, lengthens long prompts' "
                                                 "time to first token (default: no budget, whole --prefill-chunk per "
                                                 "step; docs/serving.md)")
