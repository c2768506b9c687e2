"""`server.*`: the HTTP front end of `dsaflow serve` (docs/serving.md, "Online serving"). The engine's own knobs
(batch, context, chunking, graphs) stay under `serve.*`; these say how the server meets its clients."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from .fields import num

API_KEY_ENV = "DSAFLOW_API_KEY"  # read when server.api_key is unset, so the key need not sit in config.yaml


@dataclass
class ServerConfig:
    host: str = "127.0.0.1"  # the address to bind; 0.0.0.0 serves other machines (set server.api_key then)
    port: int = num(8000, 0, 65535, why="0 picks a free port and prints it")
    # a bearer token every route but /health requires (401 without it); unset: $DSAFLOW_API_KEY, else no auth
    api_key: Optional[str] = None
    # the model name clients send and /v1/models lists; unset: the run dir's model name (e.g. tiny)
    model_name: Optional[str] = None
    # requests admitted but not yet in a cache row, over all replicas; beyond it a request gets 429 + Retry-After
    max_queue: int = num(256, 1, 1 << 20)
    max_body_bytes: int = num(1 << 20, 1024, 1 << 30, why="a larger request body gets 413")
    # after SIGTERM: new requests get 503, those in flight have this long to finish, then they are cancelled
    drain_s: float = num(30.0, 0, 86400)
    # a Jinja chat template file for /v1/chat/completions; unset: the checkpoint's tokenizer_config.json
    # "chat_template" (model.hf_path or the trained run's copy); neither: chat requests get 400
    chat_template: Optional[str] = None
