"""The OpenAI-compatible HTTP server: `jserve serve`."""

from jserve.server.app import ServerSettings, build_app
from jserve.server.run import serve

__all__ = ["ServerSettings", "build_app", "serve"]
