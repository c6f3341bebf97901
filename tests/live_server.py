"""A server on a free loopback port with the official clients pointed at it, for the HTTP tests."""

from contextlib import contextmanager
from types import SimpleNamespace

from dflash_mlx.serve import make_app, serve_in_background


@contextmanager
def live_server(model, tokenizer, model_id: str = "tiny", wrap=None, **options):
    """`make_app(model, tokenizer, model_id, **options)` served in the background (its ASGI app
    wrapped by `wrap` where one is given): its model, tokenizer, server, port, base URL and openai /
    anthropic clients (no retries); stopped on the way out (an engine thread left running at exit
    aborts the process: MLX streams)."""
    import anthropic
    import openai

    server = make_app(model, tokenizer, model_id, **options)
    if wrap is not None:
        server.app = wrap(server.app)
    http, port = serve_in_background(server)
    base = f"http://127.0.0.1:{port}"
    try:
        yield SimpleNamespace(
            model=model,
            tokenizer=tokenizer,
            server=server,
            port=port,
            base=base,
            openai=openai.OpenAI(base_url=base + "/v1", api_key="none", max_retries=0),
            anthropic=anthropic.Anthropic(base_url=base, api_key="none", max_retries=0),
        )
    finally:
        http.should_exit = True
        server.worker.stop()
