"""The HTTP server (Starlette): one DFlash engine behind the OpenAI API (chat and
text completions: openai_api.py; Responses: responses_api.py) and the Anthropic
Messages API (anthropic_api.py), plus models, health and Prometheus metrics.

Every response says how it was decoded (tau, acceptance histogram, drafting and
plain cycles), so a fallback to plain decoding is never silent.  Bad requests get
a 4xx in the format of the API they called, and the server keeps serving.  Each
request gets an access line (access_log.py), each 5xx is logged with its traceback, and
a request whose client has gone stops generating, streamed or not.  Any
model name is answered by the one model served (local clients often send a
default such as gpt-3.5-turbo); responses name the model that answered.
"""

import contextlib
import logging
import queue
import time
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, AsyncIterator, Awaitable, Callable, Optional

import anyio
from starlette.applications import Starlette
from starlette.background import BackgroundTask
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.routing import Route

from ..api.generation import bounds_of
from ..cache.prompt_cache import PromptCache, default_bytes, machine_memory
from ..decode.learning import kept, widest_verify
from ..decode.request import Request as EngineRequest
from .access_log import CLIENT_CLOSED, AccessLog, record_generation
from .anthropic_api import AnthropicAPI
from .edge import Call, Served, anthropic_error, openai_error, read_body
from .guard import BrowserAccess, Guard
from .metrics import Metrics
from .openai_api import OpenAIAPI
from .protocol import RequestError, answer_message, generation_failure, next_turn_tokens
from .responses_api import ResponsesAPI
from .worker import DONE, Draining, Job, QueueFull, Worker

MAX_BATCH_TOKENS = 32768  # 8 rows of 4k tokens; a longer request runs alone
ANSWER_FOLLOW_EVERY = 128  # answer tokens between looks at how its text so far reads back
ANSWER_TAIL = 16  # an answer's last tokens (and the turn's closing ones) may read back otherwise once more follows
EVENT_WAIT = 1.0  # seconds between looks at whether the engine thread is still there, while a job waits
PREFLIGHT_HINT = (  # an OPTIONS that reaches a route is not a preflight BrowserAccess answers
    " (CORS preflights are answered for pages on localhost and those allowed with --cors-origin <origin>;"
    " a preflight carries the page's Origin and Access-Control-Request-Method)"
)

log = logging.getLogger("dflash_mlx.serve")


@dataclass
class ServerOptions:
    """How a Server runs (make_app takes these as keywords; `dflash-mlx serve` sets them from its flags)."""

    max_queue: int = 16  # requests that may wait for the engine; more get 429
    prompt_cache_bytes: Optional[int] = None  # memory for reusable prefixes (None: sized for the machine; 0: off)
    max_batch: int = 8  # requests decoded together, where the target can batch (Server.batch_refusal)
    max_batch_tokens: Optional[int] = None  # tokens a batch's caches may hold (None: MAX_BATCH_TOKENS)
    prompt_cache_dir: Optional[str] = None  # a folder keeping reusable prefixes across restarts
    prompt_cache_disk_bytes: int = 8 << 30  # bytes that folder may hold
    access: Optional[dict] = None  # who may call (guard.Guard: bind_host, allow_hosts, cors_origins, api_key)
    next_turn_prefill: bool = False  # each chat's next turn prefilled while idle (Server.prefill_next_turn)
    warm_up: bool = False  # a throw-away request first: the first real one pays no first-call set-up


class Server:
    """One model served over HTTP (`app`, an ASGI app).  The API classes read requests and shape
    answers in their formats; the server holds what they share: the engine thread (`worker`),
    the prompt cache, the metrics, and a request's way from its body to its events."""

    def __init__(self, model, tokenizer, model_id: str, options: ServerOptions):
        self.model, self.tokenizer, self.model_id = model, tokenizer, model_id
        served = Served(tokenizer, model_id, bounds_of(model))
        self.context = served.bounds.context
        self.prompt_cache = prompt_cache_for(model, model_id, options)
        self.next_turn_prefill = options.next_turn_prefill and self.prompt_cache is not None  # nowhere to keep it else
        self.metrics = Metrics(widest_verify(model, kept(model)))
        self.batch_refusal = batch_refusal(model) if options.max_batch > 1 else None  # why one at a time, if so
        self.max_batch = 1 if self.batch_refusal else options.max_batch
        self.max_batch_tokens = options.max_batch_tokens or MAX_BATCH_TOKENS
        self.worker = Worker(
            model,
            tokenizer,
            options.max_queue,
            max_batch=self.max_batch,
            max_batch_tokens=self.max_batch_tokens,
            prompt_cache=self.prompt_cache,
            warm_up=options.warm_up,
            on_step=self.metrics.batch_step,
            on_finish=self.metrics.finished,
        )
        self.draining = False  # stopping: new requests get 503
        self.started = int(time.time())  # the served model's creation time, as the models endpoints give it
        self.openai, self.responses, self.anthropic = OpenAIAPI(served), ResponsesAPI(served), AnthropicAPI(served)
        access = options.access or {}
        guard = Guard(self._routes(), self._refused_early, **access)
        self.app = AccessLog(BrowserAccess(guard, guard.origin_allowed, access.get("cors_origins", ())))

    def _routes(self) -> Starlette:
        return Starlette(
            routes=[
                Route("/v1/chat/completions", self._endpoint(self.openai.chat, openai_error), methods=["POST"]),
                Route("/v1/completions", self._endpoint(self.openai.completions, openai_error), methods=["POST"]),
                Route("/v1/responses", self._endpoint(self.responses.create, openai_error), methods=["POST"]),
                Route("/v1/messages", self._endpoint(self.anthropic.messages, anthropic_error), methods=["POST"]),
                Route("/v1/messages/count_tokens", self.count_tokens, methods=["POST"]),
                Route("/v1/models", self.models, methods=["GET"]),
                Route("/v1/models/{model_id:path}", self.model_info, methods=["GET"]),
                Route("/health", self.health, methods=["GET"]),
                Route("/", self.health, methods=["GET"]),  # Claude Code's HEAD / at start: a server is there
                Route("/metrics", self.prometheus, methods=["GET"]),
            ],
            exception_handlers={HTTPException: self._http_error},
            lifespan=self._lifespan,
        )

    def drain(self, seconds: float) -> None:
        """Stop gracefully: new requests get 503, running ones finish for up to `seconds` and are
        then ended as if at their max_tokens; returns once the engine has stopped."""
        self.draining = True
        self.worker.drain(seconds)

    @contextlib.asynccontextmanager
    async def _lifespan(self, app):
        yield
        self.worker.stop()  # Ctrl-C: the engine thread finishes its cycle and ends
        if self.prompt_cache is not None:
            self.prompt_cache.flush()  # what is in memory survives the restart

    def _refused_early(self, path: str, error: RequestError) -> JSONResponse:
        """A request the Guard refuses, in the format of the API its path belongs to."""
        return self.error(error, anthropic_error if path.startswith("/v1/messages") else openai_error)

    async def _http_error(self, request: Request, exc: HTTPException) -> JSONResponse:
        """Unknown routes and wrong methods, as JSON errors in the format of the API asked."""
        message = {
            404: f"no route {request.url.path}; see GET /v1/models and docs/serving.md",
            405: f"{request.method} is not allowed on {request.url.path}",
        }.get(exc.status_code, exc.detail)
        if exc.status_code == 405 and request.method == "OPTIONS":
            message += PREFLIGHT_HINT
        return self._refused_early(request.url.path, RequestError(message, exc.status_code))

    # ------------------------------------------------------------ plain endpoints

    async def models(self, request: Request) -> JSONResponse:
        """The served model, the list's one entry, in the shape the asking client parses."""
        anthropic_shape = _from_anthropic_client(request)
        entry = model_entry(self, anthropic_shape)
        if anthropic_shape:
            return JSONResponse({"data": [entry], "has_more": False, "first_id": entry["id"], "last_id": entry["id"]})
        return JSONResponse({"object": "list", "data": [entry]})

    async def model_info(self, request: Request) -> JSONResponse:
        """GET /v1/models/{id}: any id is the served model, as any model name in a request is
        (Anthropic's API resolves an alias to the model it names the same way)."""
        return JSONResponse(model_entry(self, _from_anthropic_client(request)))

    async def health(self, request: Request) -> JSONResponse:
        status = "draining" if self.draining else "ok" if self.worker.alive else "unavailable"
        return JSONResponse({"status": status}, 200 if status == "ok" else 503)

    async def prometheus(self, request: Request) -> PlainTextResponse:
        if self.prompt_cache is not None:
            self.metrics.prefix_cache_hits = self.prompt_cache.hits
            self.metrics.prefix_cache_bytes = self.prompt_cache.nbytes
            self.metrics.prefix_cache_entries = len(self.prompt_cache.entries)
        return PlainTextResponse(self.metrics.render(self.worker.depth), media_type="text/plain; version=0.0.4")

    # ------------------------------------------------------------ what every API shares

    def _endpoint(self, read: Callable[[dict], Call], shape: Callable[[RequestError], JSONResponse]):
        """The route of an API endpoint: `read` turns a body into its Call (a RequestError: a 4xx,
        before anything is queued), `shape` writes errors as that API does."""

        async def route(request: Request) -> Response:
            return await self.answer(request, read, shape)

        return route

    async def answer(self, request: Request, read, shape) -> Response:
        """A request read into a Call, run, and answered whole or streamed; once the answer is out,
        its next turn prefilled while the client acts on it (follow_up)."""
        try:
            call = read(await read_body(request))
            generations = Generations(self, call, await self.start(call.requests[0]))
        except RequestError as e:
            return self.error(e, shape)
        follow = BackgroundTask(self._follow, call)
        if call.stream:
            stream = self._stream(call, generations)
            return StreamingResponse(stream, media_type="text/event-stream", headers=call.headers, background=follow)
        response = await self.while_connected(request, self._whole(call, generations, shape))
        response.background = follow
        return response

    async def _whole(self, call: Call, generations: "Generations", shape) -> Response:
        try:
            return JSONResponse(await call.answer.whole(generations), headers=call.headers)
        except Exception as e:
            return self.error(generation_failure(e), shape)
        finally:
            generations.close()  # requests not reached (one failed) or cut short (their client gone)

    async def _stream(self, call: Call, generations: "Generations") -> AsyncIterator[str]:
        try:
            async for chunk in call.answer.stream(generations):
                yield chunk
        except Exception as e:
            yield call.answer.stream_error(self.stream_failed(e))
        finally:
            generations.close()

    def _follow(self, call: Call) -> None:
        turn = call.answer.next_turn()
        if turn is not None:
            self.follow_up(*turn)

    async def count_tokens(self, request: Request) -> JSONResponse:
        try:
            return JSONResponse({"input_tokens": self.anthropic.count_tokens(await read_body(request))})
        except RequestError as e:
            return self.error(e, anthropic_error)

    def error(self, error: RequestError, shape) -> JSONResponse:
        """A refused request (counted; a 5xx logged) answered as its API writes errors (`shape`)."""
        self.refused(error)
        return shape(error)

    async def start(self, request: EngineRequest) -> tuple[Job, Any]:
        """Queue a checked request; its first response.  What the engine fails with before any
        token is a 5xx (a request's own values were checked at the edge)."""
        if self.draining:
            raise RequestError(str(Draining()), 503)
        job = Job(request)
        try:
            self.worker.submit(job)
        except QueueFull as e:
            raise RequestError(str(e), 429, code="queue_full") from None
        except Draining as e:
            raise RequestError(str(e), 503) from None
        try:
            first = await self.next_event(job)
        except BaseException:  # its client gone (a cancelled wait) or the engine stopped: it is dropped
            job.cancelled.set()
            raise
        if isinstance(first, Exception):
            await self.next_event(job)  # DONE
            raise RequestError(str(first), 503 if isinstance(first, Draining) else 500) from first  # a 500 is logged
        return job, first

    async def next_event(self, job: Job):
        """The job's next event, waited for in bounded slices: an engine thread that has ended
        (stopped, or killed by an error) fails the request instead of leaving it waiting for ever."""
        while True:
            try:
                return await anyio.to_thread.run_sync(job.events.get, True, EVENT_WAIT)
            except queue.Empty:
                if self.worker.alive:
                    continue
            try:  # the thread may have put the event just before it ended
                return job.events.get_nowait()
            except queue.Empty:
                raise RequestError("the engine stopped; restart the server", 503) from None

    async def while_connected(self, request: Request, answer: Awaitable[Response]) -> Response:
        """`answer`, a non-streamed response being generated, given up if its client goes away
        first (a client that timed out, say): its job is then cancelled (Server.events), so the
        engine frees its row at the next step, and the request is logged with status 499.  Streams
        need none of this: Starlette stops them when the client goes."""
        async with anyio.create_task_group() as group:

            async def watch_for_disconnect():
                while (await request.receive())["type"] != "http.disconnect":
                    pass
                group.cancel_scope.cancel()

            group.start_soon(watch_for_disconnect)
            response = await answer
            group.cancel_scope.cancel()
            return response
        return Response(status_code=CLIENT_CLOSED)  # no one reads it; the access line says what happened

    async def events(self, job: Job, first, chat: Optional[tuple[list[dict], list, dict]] = None) -> AsyncIterator:
        """The job's responses, one per decode cycle, from `first` to the one with a finish_reason.
        Leaving early (a client gone) frees the engine at its next cycle.  What it generated goes
        on its request's access line (AccessLog).  `chat`: the messages, tools and template options
        of a chat the job answers (prefill_next_turn as its answer grows)."""
        event, text, followed, last = first, "", 0, None
        try:
            while event is not DONE:
                if isinstance(event, Exception):
                    raise event
                last = event
                yield event
                text += event.text
                if (
                    chat is not None
                    and not event.finish_reason
                    and event.generation_tokens >= followed + ANSWER_FOLLOW_EVERY
                ):
                    followed = event.generation_tokens
                    self.prefill_next_turn(chat[0] + [answer_message(text, [])], chat[1], ANSWER_TAIL, chat[2])
                event = await self.next_event(job)
        finally:
            job.cancelled.set()
            if last is not None:
                record_generation(last)

    def prefill_next_turn(
        self, conversation: list[dict], tools: list, tail: int = 0, template: Optional[dict] = None
    ) -> None:
        """A chat answered (`conversation`: its messages, then the answer as the client sends it
        back): while the client acts on it (an agent runs its tools), the engine prefills the
        conversation as the next request will render it.  Its state after the answer
        is kept already, but a client sends the answer back as text, which the tokenizer may
        split otherwise (the model's " chat" + "ting" reads back as " chatting"): from there on,
        and for the turn's closing tokens, the next request would prefill again.  Off by default
        in make_app: the model computes after the answer, which code sharing it in-process (a
        test's offline generate) would race; `dflash-mlx serve` turns it on.

        While the answer is written (events(): its text so far last, `tail` its last tokens,
        which may read back otherwise once more follows, and the turn's closing ones), the same
        is prefilled beside the decoding, all but the tail, so that a client coming back at once
        finds only the answer's last part left; where the text reads back as written, the
        engine finds the answer's own state holds it and prefills nothing."""
        if not self.next_turn_prefill:
            return
        tokens = next_turn_tokens(self.tokenizer, conversation, tools, template)
        if tokens and len(tokens) > tail:
            self.worker.prefill_when_idle(tokens[: len(tokens) - tail])

    def follow_up(self, conversation: list[dict], tools: list, template: dict) -> None:
        """An answer is out (`conversation` ends with it): its next turn prefilled as the next
        request will render it, its template options (thinking switched) included."""
        if template:
            self.prefill_next_turn(conversation, tools, template=template)
        else:  # as two arguments where they are all (what tests watching prefill_next_turn record)
            self.prefill_next_turn(conversation, tools)

    def refused(self, error: RequestError) -> None:
        """A request answered with an error (or a stream ended by one): counted, and logged with
        its reason (a 5xx with the traceback of what caused it, if anything did)."""
        self.metrics.rejected(error.status)
        if error.status >= 500:
            log.error("%d: %s", error.status, error, exc_info=error.__cause__)
        else:  # why, beside the access line (a prompt too long says its tokens and the window)
            log.info("refused %d: %s", error.status, error)

    def stream_failed(self, error: Exception) -> RequestError:
        """A stream ended by `error` (its status sent already): what its last event says, counted
        and logged as a refusal is."""
        failure = generation_failure(error)
        self.refused(failure)
        return failure


class Generations:
    """A Call's requests run, as (index, events) in order: the first started already, the others
    queued together when the answer first asks (a batching engine decodes them together)."""

    def __init__(self, server: Server, call: Call, started: tuple[Job, Any]):
        self.server, self.call, self.started = server, call, [started]

    @property
    def first(self):
        """The first request's first response."""
        return self.started[0][1]

    async def __aiter__(self):
        for request in self.call.requests[len(self.started) :]:
            self.started.append(await self.server.start(request))
        for index, (job, first) in enumerate(self.started):
            yield index, self.server.events(job, first, self.call.following)

    def close(self) -> None:
        for job, _ in self.started:
            job.cancelled.set()


def model_entry(server: Server, anthropic_shape: bool) -> dict:
    """The served model as Anthropic's models API describes one (to its SDK, which sends
    anthropic-version) or OpenAI's, with what it is and does here (`dflash`)."""
    draft = server.model.draft
    facts = {
        "drafter": draft is not None,
        "block_size": draft.block_size if draft else 1,
        "adaptive_width": kept(server.model).planner is not None,
        "batching": server.max_batch > 1,
        "max_batch": server.max_batch,
        "max_batch_tokens": server.max_batch_tokens if server.max_batch > 1 else None,
        "prefix_cache": server.prompt_cache is not None,
        "prefix_cache_bytes": server.prompt_cache.max_bytes if server.prompt_cache else 0,
        "pipeline_ranks": getattr(server.model.target, "size", 1),
    }
    if not anthropic_shape:
        return {
            "id": server.model_id,
            "object": "model",
            "created": server.started,
            "owned_by": "dflash-mlx",
            "dflash": facts,
        }
    created = datetime.fromtimestamp(server.started, timezone.utc).isoformat().replace("+00:00", "Z")
    context = {"max_input_tokens": server.context, "max_tokens": server.context} if server.context else {}
    return {
        "type": "model",
        "id": server.model_id,
        "display_name": server.model_id,
        "created_at": created,
        "lifecycle": "active",
        **context,
        "dflash": facts,
    }


def _from_anthropic_client(request: Request) -> bool:
    """Whether an Anthropic client asks (its SDK, and Claude Code, send anthropic-version)."""
    return "anthropic-version" in request.headers


def make_app(model, tokenizer, model_id: str, **options) -> Server:
    """The server; `options`: ServerOptions' fields, as keywords.  With max_batch > 1, requests
    are decoded in batches when the target allows (else `Server.batch_refusal` says why not; the
    caller tells the user)."""
    return Server(model, tokenizer, model_id, ServerOptions(**options))


def prompt_cache_for(model, model_id: str, options: ServerOptions) -> Optional[PromptCache]:
    """The prompt cache the options ask for (None: off), sized for the machine and the model
    unless they say how large."""
    size = options.prompt_cache_bytes
    if size is None:
        size = default_bytes(model.weight_bytes, machine_memory())
    if size <= 0:
        return None
    return PromptCache(
        size,
        options.prompt_cache_dir and Path(options.prompt_cache_dir),
        options.prompt_cache_disk_bytes,
        fingerprint=f"{model_id}:{model.fingerprint}",
    )


def batch_refusal(model) -> Optional[str]:
    """Why this model's requests are decoded one at a time (None: they are batched)."""
    if getattr(model.target, "size", 1) > 1:
        return "the pipeline-parallel mode decodes one request at a time"
    return model.target.batch_refusal()


LOG_LEVELS = ("debug", "info", "warning", "error")


def configure_logging(level: str = "info") -> None:
    """Timestamped lines on stderr for the server's loggers (dflash_mlx.serve, its .access lines)
    and uvicorn's, at `level` (one of LOG_LEVELS)."""
    logging.basicConfig(level=level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")


def run(
    server: Server, host: str = "127.0.0.1", port: int = 8080, drain_seconds: float = 10.0, log_level: str = "info"
) -> None:
    """Serve until SIGTERM or Ctrl-C, then drain (Server.drain) and return; a second signal
    stops at once.  The signal is not re-raised: a drained server exits 0.  Logging is the
    caller's (configure_logging): uvicorn's loggers propagate to it, and its access log is off
    (AccessLog writes the server's own)."""
    import threading

    import uvicorn

    class Draining(uvicorn.Server):
        def handle_exit(self, sig, frame) -> None:
            if server.draining:
                self.should_exit = self.force_exit = True
                return
            server.draining = True  # before the thread starts: no request slips in

            def drain_then_exit():
                server.drain(drain_seconds)
                self.should_exit = True

            threading.Thread(target=drain_then_exit, name="dflash-drain", daemon=True).start()

    server.worker.warmed.wait()  # the port opens once the model is warm: no first request waits behind it
    config = uvicorn.Config(server.app, host=host, port=port, log_level=log_level, access_log=False, log_config=None)
    Draining(config).run()


def serve_in_background(server: Server, host: str = "127.0.0.1"):
    """Run `server` on a free port in a daemon thread (benchmarks, tests); returns
    (uvicorn server, port) once it accepts connections.  Set .should_exit to stop it."""
    import socket
    import threading

    import uvicorn

    with socket.socket() as s:
        s.bind((host, 0))
        port = s.getsockname()[1]
    http = uvicorn.Server(uvicorn.Config(server.app, host=host, port=port, log_level="error", access_log=False))
    threading.Thread(target=http.run, daemon=True).start()
    while not http.started:
        time.sleep(0.05)
    return http, port


__all__: list[Any] = ["Server", "ServerOptions", "configure_logging", "make_app", "run", "serve_in_background"]
