"""Abuse without growth: rounds of streamed and whole requests, clients vanishing mid-stream,
oversized, malformed and deeply nested bodies between them, against a live server on a tiny
model.  After a warm-up, the process's RSS and MLX's memory stay flat, every answer that
completes is exact, and no request gets a 5xx."""

import http.client
import json
import resource

import mlx.core as mx
import pytest

pytest.importorskip("uvicorn", reason="the serve extra installs the server")

from dflash_mlx import generate, load  # noqa: E402
from dflash_mlx.api import format_prompt  # noqa: E402
from dflash_mlx.serve import make_app, serve_in_background  # noqa: E402

pytestmark = pytest.mark.slow  # a live server and a few hundred requests

WARM_ROUNDS, ROUNDS = 3, 12
QUESTIONS = ["hello world", "the cat", "what is two and two", "a poem please"]


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize()


def post(port: int, path: str, body: bytes, read: bool = True) -> tuple[int, bytes]:
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
    connection.request("POST", path, body=body, headers={"Content-Type": "application/json"})
    response = connection.getresponse()
    if not read:  # a client that reads the first bytes of a stream and vanishes
        response.read(64)
        connection.sock.close()
        return response.status, b""
    data = response.read()
    connection.close()
    return response.status, data


def chat(question: str, max_tokens: int, stream: bool) -> bytes:
    messages = [{"role": "user", "content": question}]
    return json.dumps({"messages": messages, "max_tokens": max_tokens, "stream": stream}).encode()


def streamed_text(data: bytes) -> str:
    lines = [line[6:] for line in data.decode().split("\n") if line.startswith("data: {")]
    return "".join((json.loads(line)["choices"] or [{}])[0].get("delta", {}).get("content") or "" for line in lines)


def test_memory_stays_flat_under_abuse(tiny_dirs):
    model_dir, draft_dir = tiny_dirs
    model, tokenizer = load(str(model_dir), str(draft_dir))
    expected = {q: generate(model, tokenizer, format_prompt(tokenizer, q), max_tokens=24) for q in QUESTIONS}
    server = make_app(model, tokenizer, "tiny", max_queue=8, prompt_cache_bytes=64 << 20)
    http_server, port = serve_in_background(server)
    oversized = b'{"messages": [{"role": "user", "content": "' + b"x" * (9 << 20) + b'"}]}'
    nested = b"[" * 50_000 + b"]" * 50_000
    memory = []
    try:
        for round_ in range(WARM_ROUNDS + ROUNDS):
            for i, question in enumerate(QUESTIONS):
                status, data = post(port, "/v1/chat/completions", chat(question, 24, stream=i % 2 == 0))
                assert status == 200
                text = streamed_text(data) if i % 2 == 0 else json.loads(data)["choices"][0]["message"]["content"]
                assert text == expected[question]
                assert post(port, "/v1/chat/completions", chat(question, 400, stream=True), read=False)[0] == 200
                assert post(port, "/v1/chat/completions", oversized)[0] == 413
                assert post(port, "/v1/completions", b'{"prompt": "hi", "max_tokens": ')[0] == 400
                assert post(port, "/v1/messages", nested)[0] == 400
            if round_ >= WARM_ROUNDS - 1:
                memory.append((rss_bytes(), mx.get_active_memory()))
    finally:
        http_server.should_exit = True
    (rss0, mlx0), (rss1, mlx1) = memory[0], memory[-1]
    assert rss1 < rss0 * 1.10, f"RSS grew from {rss0 >> 20} MB to {rss1 >> 20} MB"
    assert mlx1 < mlx0 * 1.10 + (8 << 20), f"MLX memory grew from {mlx0 >> 20} MB to {mlx1 >> 20} MB"
