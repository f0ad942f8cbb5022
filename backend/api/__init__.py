"""The HTTP API: ``create_app(studio, api_key=None) -> FastAPI`` and ``serve(...)``."""
from .app import create_app
from .server import serve, start_in_thread

__all__ = ["create_app", "serve", "start_in_thread"]
