"""`dflash-mlx serve`: an OpenAI-compatible HTTP server over one DFlash engine."""

from .app import Server, make_app, run, serve_in_background

__all__ = ["Server", "make_app", "run", "serve_in_background"]
