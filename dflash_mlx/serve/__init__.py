"""`dflash-mlx serve`: one DFlash engine behind the OpenAI (chat, completions, Responses) and
Anthropic (Messages) HTTP APIs."""

from .app import Server, make_app, run, serve_in_background

__all__ = ["Server", "make_app", "run", "serve_in_background"]
