"""`dflash-mlx serve`: one DFlash engine behind the OpenAI (chat, completions, Responses) and
Anthropic (Messages) HTTP APIs."""

from .app import Server, batch_refusal, make_app, run, serve_in_background

__all__ = ["Server", "batch_refusal", "make_app", "run", "serve_in_background"]
