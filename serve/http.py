"""The OpenAI-compatible HTTP server's public names, where users and `python -m tlaloc_jax.serve` import them:
`create_app(engine, ...)` (serve/openai/app.py) and the guards its command line checks. The server itself lives in
serve/openai/ (protocol, server, responses, app)."""

from .openai.app import DEFAULT_MAX_BODY_BYTES, DEFAULT_MAX_WAITING, create_app
from .openai.guards import LOOPBACK_HOSTS, allowed_host_names, api_key_problem
from .openai.responses import sse as _sse   # tests read the stream framing through this name

__all__ = ["DEFAULT_MAX_BODY_BYTES", "DEFAULT_MAX_WAITING", "LOOPBACK_HOSTS", "allowed_host_names", "api_key_problem",
           "create_app", "_sse"]
