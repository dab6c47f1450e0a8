"""`ServeConfig`: where the HTTP server listens and how its engine is laid out, checked on
construction (`glm_jax.settings`), so a bad value is refused before the model loads."""

from __future__ import annotations

import dataclasses

from glm_jax.settings import Settings, setting

#: Requests the server decodes together unless --max-batch says otherwise.
DEFAULT_SLOTS = 4


@dataclasses.dataclass(frozen=True)
class ServeConfig(Settings):
    host: str = setting("127.0.0.1")
    port: int = setting(8000, at_least=0, at_most=65535)
    slots: int = setting(DEFAULT_SLOTS, at_least=1, flag="--max-batch")
    page_size: int = setting(16, at_least=1)
    step_token_budget: int | None = setting(None, at_least=1)
