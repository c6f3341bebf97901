"""The server's access log: one line per HTTP request, uvicorn-style, with the tokens of the
generations that answered it (AccessLog, an ASGI middleware; Server.events reports them
through `record_generation`)."""

import contextvars
import logging
import time
from typing import Optional

from starlette.requests import ClientDisconnect
from starlette.responses import PlainTextResponse

CLIENT_CLOSED = 499  # nginx's status for a request whose client went away before its answer

log = logging.getLogger("dflash_mlx.serve")  # the server's own logger: 5xx and their tracebacks
access_lines = logging.getLogger("dflash_mlx.serve.access")


class _Access:
    """What a request's access line says; the generations answering it add their tokens."""

    def __init__(self, scope: dict):
        client = scope.get("client")
        query = scope.get("query_string") or b""
        path = scope["path"] + ("?" + query.decode("latin-1") if query else "")
        self.client = f"{client[0]}:{client[1]}" if client else "-"
        self.request = f"{scope['method']} {path} HTTP/{scope.get('http_version', '1.1')}"
        self.started = time.monotonic()
        self.status: Optional[int] = None
        self.complete = self.client_gone = False
        self.tokens: Optional[tuple[int, int, int]] = None  # prompt, cached, generated

    def generated(self, last) -> None:
        """A generation (one of n choices) ended; `last`: its final response, or the last one out."""
        generated = last.generation_tokens + (self.tokens[2] if self.tokens else 0)
        self.tokens = (last.prompt_tokens, last.cached_tokens, generated)

    def line(self) -> str:
        status = CLIENT_CLOSED if self.client_gone else self.status or 500
        tokens = "" if self.tokens is None else " prompt=%d cached=%d generated=%d" % self.tokens
        return f'{self.client} - "{self.request}" {status}{tokens} {time.monotonic() - self.started:.3f}s'


# the access line of the request being answered, for `record_generation` (the stream of a StreamingResponse
# runs in a task of its own, which starts with a copy of its request's context: the same line)
_ACCESS: contextvars.ContextVar[_Access] = contextvars.ContextVar("dflash_mlx_access")


def record_generation(last) -> None:
    """A generation answering the current request ended (`last`: its final response, or the last
    one out): its tokens go on the request's access line."""
    access = _ACCESS.get(None)
    if access is not None:
        access.generated(last)


class AccessLog:
    """ASGI middleware: one line per HTTP request on the dflash_mlx.serve.access logger once its
    response is out (a stream's when it ends), uvicorn-style, with the tokens of the generations
    that answered it and the seconds it took; a client gone before the end is logged 499.  An
    exception that escaped the routes (Starlette has sent its 500) is logged here with its traceback."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        access = _Access(scope)
        token = _ACCESS.set(access)

        async def receiving():
            message = await receive()
            if message["type"] == "http.disconnect" and not access.complete:
                access.client_gone = True
            return message

        async def sending(message):
            if message["type"] == "http.response.start":
                access.status = message["status"]
            elif message["type"] == "http.response.body" and not message.get("more_body"):
                access.complete = True
            await send(message)

        try:
            await self.app(scope, receiving, sending)
        except ClientDisconnect:  # gone while its body was read
            access.client_gone = True
        except Exception:
            log.exception("unhandled error answering %s", access.request)  # uvicorn would log it again
            if access.status is None:
                await PlainTextResponse("Internal Server Error", 500)(scope, receiving, sending)
        finally:
            _ACCESS.reset(token)
            access_lines.info(access.line())
