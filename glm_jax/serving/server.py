"""uvicorn with a draining shutdown for the app of `make_app`.

The first SIGTERM (or Ctrl-C) stops taking requests (new ones get 503, /health says
"draining") while the requests in flight run to their end; then the server exits with 0. A
second signal stops it at once (exit 1).
"""

from __future__ import annotations

import json
import sys

from glm_jax.extras import require

uvicorn = require("uvicorn")


def serve(app, *, host: str, port: int, about: str = "") -> int:
    """Run `app` (from make_app) until a signal drains it; -> 0 after a drain, 1 after a forced stop."""
    server = DrainingServer(uvicorn.Config(app, host=host, port=port, log_level="info"), about)
    server.run()
    return 1 if server.force_exit else 0


class DrainingServer(uvicorn.Server):
    """uvicorn whose first SIGTERM / SIGINT drains the engine loop before the usual shutdown."""

    def __init__(self, config, about: str):
        super().__init__(config)
        self.about = about

    @property
    def engine_loop(self):
        return self.config.app.state.engine_loop

    async def startup(self, sockets=None):
        await super().startup(sockets)
        if self.started:
            port = self.servers[0].sockets[0].getsockname()[1]
            print(_banner(self.config.host, port, self.about), flush=True)

    def handle_exit(self, sig, frame):
        if self.engine_loop.accepting:
            print("draining: new requests get 503; waiting for the requests in flight "
                  "(signal again to stop at once)", file=sys.stderr, flush=True)
            self.engine_loop.stop_accepting()
        else:
            self.should_exit = self.force_exit = True

    async def on_tick(self, counter: int) -> bool:
        return await super().on_tick(counter) or self.engine_loop.drained


def _banner(host: str, port: int, about: str) -> str:
    url = f"http://{f'[{host}]' if ':' in host else host}:{port}"
    body = json.dumps({"prompt": "def add(a, b):", "max_tokens": 32, "temperature": 0})
    return (f"serving {about} at {url}/v1/completions (also /v1/models, /health); SIGTERM or Ctrl-C drains "
            f"and stops\nexample: curl {url}/v1/completions -H 'Content-Type: application/json' -d '{body}'")
