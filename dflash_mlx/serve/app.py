"""The OpenAI-compatible HTTP API (Starlette): chat and text completions, streamed
or not, models, health and Prometheus metrics.

Every response's `usage` carries a `dflash` object (tau, acceptance histogram,
drafting and plain cycles), so a fallback to plain decoding is never silent.
Bad requests get an OpenAI-style error ({"error": {"message", "type", "param",
"code"}}) with a 4xx status, and the server keeps serving.
"""

import contextlib
import json
import numbers
import time
import uuid
from pathlib import Path
from typing import Any, Optional

import anyio
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, StreamingResponse
from starlette.routing import Route

from ..prompt_cache import PromptCache
from .metrics import Metrics
from .tools import ToolCalls
from .worker import DONE, Job, QueueFull, Worker

MAX_BODY = 8 << 20


class RequestError(Exception):
    def __init__(self, message: str, status: int = 400, param: Optional[str] = None, code: Optional[str] = None):
        super().__init__(message)
        self.status, self.param, self.code = status, param, code


def error_response(message: str, status: int, param=None, code=None) -> JSONResponse:
    kind = {404: "not_found_error", 413: "invalid_request_error", 429: "rate_limit_error"}.get(
        status, "invalid_request_error" if status < 500 else "server_error")
    return JSONResponse({"error": {"message": message, "type": kind, "param": param, "code": code}}, status)


def _number(body: dict, name: str, default, kind=numbers.Real, low=None, high=None):
    value = body.get(name, default)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, kind):
        raise RequestError(f"{name} must be {'an integer' if kind is numbers.Integral else 'a number'}", param=name)
    if (low is not None and value < low) or (high is not None and value > high):
        raise RequestError(f"{name} must be between {low} and {high}, got {value}", param=name)
    return value


class Server:
    def __init__(self, model, tokenizer, model_id: str, max_queue: int = 16, context: Optional[int] = None,
                 prompt_cache_bytes: int = 1 << 30):
        self.model, self.tokenizer, self.model_id = model, tokenizer, model_id
        self.prompt_cache = PromptCache(prompt_cache_bytes) if prompt_cache_bytes > 0 else None
        self.metrics = Metrics(model.draft.block_size if model.draft is not None else 1)
        self.worker = Worker(model, tokenizer, max_queue, on_finish=self.metrics.finished)
        self.context = context
        self.app = Starlette(routes=[
            Route("/v1/chat/completions", self.chat, methods=["POST"]),
            Route("/v1/completions", self.completions, methods=["POST"]),
            Route("/v1/models", self.models, methods=["GET"]),
            Route("/health", self.health, methods=["GET"]),
            Route("/metrics", self.prometheus, methods=["GET"]),
        ], lifespan=self._lifespan)

    @contextlib.asynccontextmanager
    async def _lifespan(self, app):
        yield
        self.worker.stop()  # Ctrl-C: the engine thread finishes its cycle and ends

    # ------------------------------------------------------------ plain endpoints

    async def models(self, request: Request) -> JSONResponse:
        draft = self.model.draft
        return JSONResponse({"object": "list", "data": [{
            "id": self.model_id, "object": "model", "created": int(time.time()), "owned_by": "dflash-mlx",
            "dflash": {"drafter": draft is not None, "block_size": draft.block_size if draft else 1,
                       "adaptive_width": self.model.chooser is not None,
                       "batching": False,  # one request at a time (FIFO); said here so nobody has to guess
                       "prefix_cache": self.prompt_cache is not None,
                       "pipeline_ranks": getattr(self.model.target, "size", 1)},
        }]})

    async def health(self, request: Request) -> JSONResponse:
        ok = self.worker.alive
        return JSONResponse({"status": "ok" if ok else "unavailable"}, 200 if ok else 503)

    async def prometheus(self, request: Request) -> PlainTextResponse:
        if self.prompt_cache is not None:
            self.metrics.prefix_cache_hits = self.prompt_cache.hits
        return PlainTextResponse(self.metrics.render(self.worker.depth), media_type="text/plain; version=0.0.4")

    # ------------------------------------------------------------ completions

    async def chat(self, request: Request):
        return await self._complete(request, chat=True)

    async def completions(self, request: Request):
        return await self._complete(request, chat=False)

    async def _complete(self, request: Request, chat: bool):
        try:
            body = await self._body(request)
            job, stream, include_usage, tools = self._job(body, chat)
            self.worker.submit(job)
        except RequestError as e:
            self.metrics.rejected(e.status)
            return error_response(str(e), e.status, e.param, e.code)
        except QueueFull as e:
            self.metrics.rejected(429)
            return error_response(str(e), 429, code="queue_full")
        first = await anyio.to_thread.run_sync(job.events.get)
        if isinstance(first, Exception):  # refused before any token: a 4xx, not a broken stream
            await anyio.to_thread.run_sync(job.events.get)  # DONE
            status = 400 if isinstance(first, (ValueError, TypeError)) else 500
            self.metrics.rejected(status)
            return error_response(str(first), status)
        ident = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
        calls = ToolCalls(self.tokenizer, tools if chat else None)
        if stream:
            return StreamingResponse(self._sse(job, first, ident, chat, include_usage, calls),
                                     media_type="text/event-stream")
        return await self._whole(job, first, ident, chat, calls)

    async def _body(self, request: Request) -> dict:
        if "application/json" not in request.headers.get("content-type", ""):
            raise RequestError("send a JSON body with Content-Type: application/json", 415)
        if int(request.headers.get("content-length") or 0) > MAX_BODY:
            raise RequestError(f"the request body is larger than {MAX_BODY >> 20} MB", 413)
        raw = await request.body()
        if len(raw) > MAX_BODY:
            raise RequestError(f"the request body is larger than {MAX_BODY >> 20} MB", 413)
        try:
            body = json.loads(raw)
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise RequestError(f"the body is not valid JSON ({e})") from None
        if not isinstance(body, dict):
            raise RequestError("the body must be a JSON object")
        return body

    def _job(self, body: dict, chat: bool) -> tuple[Job, bool, bool]:
        name = body.get("model")
        if name is not None and name not in (self.model_id, Path(self.model_id).name, "default"):
            raise RequestError(f"model {name!r} is not served here; this server serves {self.model_id!r}",
                               404, "model", "model_not_found")
        prompt = self._chat_prompt(body) if chat else self._text_prompt(body)
        limit = self.context or 1 << 30
        max_tokens = _number(body, "max_completion_tokens", None, numbers.Integral, 1, limit)
        max_tokens = max_tokens or _number(body, "max_tokens", 512 if chat else 16, numbers.Integral, 1, limit)
        stop = body.get("stop")
        if stop is not None and not (isinstance(stop, str) or (isinstance(stop, list) and
                                                                all(isinstance(s, str) for s in stop))):
            raise RequestError("stop must be a string or a list of strings", param="stop")
        options = {
            "temp": _number(body, "temperature", 0.0, low=0, high=100),
            "top_p": _number(body, "top_p", 1.0, low=0, high=1),
            "top_k": _number(body, "top_k", 0, numbers.Integral, low=0),
            "seed": _number(body, "seed", None, numbers.Integral),
            "block_size": _number(body, "block_size", None, numbers.Integral, low=1),
            "stop": stop or (),
            "prompt_cache": self.prompt_cache,
        }
        if options["top_p"] == 0:
            raise RequestError("top_p must be > 0", param="top_p")
        stream = body.get("stream", False)
        if not isinstance(stream, bool):
            raise RequestError("stream must be true or false", param="stream")
        stream_options = body.get("stream_options") or {}
        if not isinstance(stream_options, dict):
            raise RequestError("stream_options must be an object", param="stream_options")
        return Job(prompt, max_tokens, options), stream, bool(stream_options.get("include_usage")), body.get("tools")

    def _chat_prompt(self, body: dict) -> list[int]:
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            raise RequestError("messages must be a non-empty list", param="messages")
        for m in messages:
            if not isinstance(m, dict) or not isinstance(m.get("role"), str):
                raise RequestError("every message needs a role and content", param="messages")
            content = m.get("content")
            if isinstance(content, list):  # OpenAI content parts: keep the text ones
                m["content"] = "".join(p.get("text", "") for p in content if isinstance(p, dict))
            elif content is not None and not isinstance(content, str):
                raise RequestError("message content must be a string or a list of text parts", param="messages")
        tools = body.get("tools")
        if tools is not None and not isinstance(tools, list):
            raise RequestError("tools must be a list", param="tools")
        if not self.tokenizer.has_chat_template:
            text = "\n".join(m.get("content") or "" for m in messages)
            return self.tokenizer.encode(text)
        try:
            text = self.tokenizer.apply_chat_template(messages, tools=tools, tokenize=False,
                                                      add_generation_prompt=True)
        except Exception as e:  # the template's own checks (roles, order)
            raise RequestError(f"the chat template refused these messages ({e})", param="messages") from None
        return self.tokenizer.encode(text, add_special_tokens=False)

    def _text_prompt(self, body: dict) -> list[int]:
        prompt = body.get("prompt")
        if isinstance(prompt, str) and prompt.strip():
            return self.tokenizer.encode(prompt)
        if isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool)
                                                        for t in prompt):
            return prompt
        raise RequestError("prompt must be a non-empty string or a list of token ids", param="prompt")

    # ------------------------------------------------------------ responses

    def _usage(self, last) -> dict:
        return {
            "prompt_tokens": last.prompt_tokens, "completion_tokens": last.generation_tokens,
            "total_tokens": last.prompt_tokens + last.generation_tokens,
            "prompt_tokens_details": {"cached_tokens": last.cached_tokens},
            "dflash": {"tau": round(last.tau, 3), "acceptance_histogram": last.acceptance_histogram,
                       "draft_cycles": last.sources.count("dflash"), "lookup_cycles": last.sources.count("lookup"),
                       "plain_cycles": last.sources.count("plain"), "block_size": last.block_size,
                       "generation_tps": round(last.generation_tps, 2)},
        }

    def _choice(self, chat: bool, text: Optional[str], finish: Optional[str], delta: bool,
                tool_calls: Optional[list] = None) -> dict:
        if not chat:
            return {"index": 0, "text": text, "finish_reason": finish, "logprobs": None}
        message = {"role": "assistant", "content": text}
        if tool_calls:
            message["tool_calls"] = [{"index": i, **c} for i, c in enumerate(tool_calls)] if delta else tool_calls
            finish = finish and "tool_calls"
        return {"index": 0, "delta" if delta else "message": message, "finish_reason": finish}

    async def _events(self, job: Job, first):
        event = first
        while event is not DONE:
            if isinstance(event, Exception):
                raise event
            yield event
            event = await anyio.to_thread.run_sync(job.events.get)

    async def _whole(self, job: Job, first, ident: str, chat: bool, calls: ToolCalls) -> JSONResponse:
        text, last = "", None
        try:
            async for last in self._events(job, first):
                text += calls.push(last.text)
        except Exception as e:
            return error_response(f"generation failed: {e}", 500)
        rest, tool_calls = calls.finish()
        text += rest
        choice = self._choice(chat, text or (None if tool_calls else ""), last.finish_reason, False, tool_calls)
        return JSONResponse({
            "id": ident, "object": "chat.completion" if chat else "text_completion", "created": int(time.time()),
            "model": self.model_id, "choices": [choice], "usage": self._usage(last),
        })

    async def _sse(self, job: Job, first, ident: str, chat: bool, include_usage: bool, calls: ToolCalls):
        kind = "chat.completion.chunk" if chat else "text_completion"
        created = int(time.time())

        def chunk(choices: list, **extra) -> str:
            return "data: " + json.dumps({"id": ident, "object": kind, "created": created,
                                          "model": self.model_id, "choices": choices, **extra}) + "\n\n"

        last = None
        try:
            async for last in self._events(job, first):
                text = calls.push(last.text)
                if last.finish_reason:
                    rest, tool_calls = calls.finish()
                    yield chunk([self._choice(chat, text + rest, last.finish_reason, True, tool_calls)])
                elif text:
                    yield chunk([self._choice(chat, text, None, True)])
            if include_usage and last is not None:
                yield chunk([], usage=self._usage(last))
            yield "data: [DONE]\n\n"
        except Exception as e:
            yield "data: " + json.dumps({"error": {"message": f"generation failed: {e}", "type": "server_error"}}) \
                  + "\n\n"
        finally:
            job.cancelled.set()  # a client gone mid-stream frees the engine at its next cycle


def make_app(model, tokenizer, model_id: str, max_queue: int = 16, prompt_cache_bytes: int = 1 << 30) -> Server:
    from ..api import _context_limit

    return Server(model, tokenizer, model_id, max_queue, _context_limit(model.target), prompt_cache_bytes)


def run(server: Server, host: str = "127.0.0.1", port: int = 8080) -> None:
    import uvicorn

    uvicorn.run(server.app, host=host, port=port, log_level="warning")


def serve_in_background(server: Server, host: str = "127.0.0.1"):
    """Run `server` on a free port in a daemon thread (benchmarks, tests); returns
    (uvicorn server, port) once it accepts connections.  Set .should_exit to stop it."""
    import socket
    import threading

    import uvicorn

    with socket.socket() as s:
        s.bind((host, 0))
        port = s.getsockname()[1]
    http = uvicorn.Server(uvicorn.Config(server.app, host=host, port=port, log_level="error"))
    threading.Thread(target=http.run, daemon=True).start()
    while not http.started:
        time.sleep(0.05)
    return http, port


__all__: list[Any] = ["Server", "make_app", "run", "serve_in_background"]
