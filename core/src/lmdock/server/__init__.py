"""``lmdock serve``: an OpenAI-compatible HTTP server over any backend (``pip install "lmdock[serve]"``).

FastAPI, uvicorn and prometheus-client are imported only here, never by ``import lmdock``.
:func:`create_app` builds the ASGI app over ``ServedModel`` entries (loaded ``LLM`` objects, or loaders
called when a request first names the model); :func:`serve` serves the config file's models and runs
until SIGTERM/SIGINT, draining in-flight requests first.
"""

from __future__ import annotations

from lmdock.server._app import create_app
from lmdock.server._pool import ServedModel
from lmdock.server._run import serve

__all__ = ["ServedModel", "create_app", "serve"]
