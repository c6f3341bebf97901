"""`dflash-mlx serve`: one DFlash engine behind the OpenAI (chat, completions, Responses) and
Anthropic (Messages) HTTP APIs."""

from .app import Server, ServerOptions, make_app, run, serve_in_background

__all__ = ["Server", "ServerOptions", "make_app", "run", "serve_in_background"]
