"""What every API's endpoints share to turn a request's body into what the engine runs: the body
read (size, JSON, Unicode), its common fields (length, stream, sampling, stop, logprobs) into
the checked engine Request (decode/request.build_request), a response format's grammar, the
errors in each API's shape, and the Call an endpoint hands back to the server (app.py).

A request is checked here, whole, before anything is queued: a bad value is a 4xx that never
reaches the engine thread.  The APIs (openai_api.py, responses_api.py, anthropic_api.py) read
their own formats and write their answers; the server runs the Call they return.
"""

import json
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Optional, Protocol

from starlette.requests import Request as HTTPRequest
from starlette.responses import JSONResponse

from ..decode.grammar import Grammar
from ..decode.request import BadValue, Bounds, OutOfRange, Request, build_request
from .protocol import RequestError

MAX_BODY = 8 << 20
SAMPLING_FIELDS = {"temperature", "top_p", "top_k", "seed", "block_size"}
OPENAI_NO_EFFECT = {
    "model",
    "user",
    "metadata",
    "store",
    "service_tier",
    "parallel_tool_calls",
    "stream",
    "stream_options",
}
ANTHROPIC_ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    415: "invalid_request_error",
    429: "rate_limit_error",
    500: "api_error",
    529: "overloaded_error",
}


@dataclass(frozen=True)
class Served:
    """What the APIs read of the served model: its tokenizer, its name, and what a request may
    ask of it (decode/request.Bounds)."""

    tokenizer: Any
    model_id: str
    bounds: Bounds


class Answer(Protocol):
    """How an API writes an answer from the engine's events (`generations`: the Call's requests
    as (index, events), Server.Generations)."""

    async def whole(self, generations) -> dict: ...

    def stream(self, generations) -> AsyncIterator[str]: ...

    def stream_error(self, failure: RequestError) -> str: ...

    def next_turn(self) -> Optional[tuple[list[dict], list, dict]]:
        """Once answered: the conversation with its answer, its tools and template options, as
        the client's next request will send them (None: nothing to prefill)."""


@dataclass
class Call:
    """A request read and checked by its API: what the server runs and how the answer is written."""

    requests: list[Request]  # run in order (an OpenAI request's n choices: queued together)
    answer: Answer
    stream: bool = False
    headers: dict = field(default_factory=dict)
    following: Optional[tuple[list[dict], list, dict]] = None  # a chat prefilled as its answer grows (Server.events)


async def first_events(generations) -> AsyncIterator:
    """The events of a Call's only request."""
    async for _, events in generations:
        async for event in events:
            yield event
        return


# ---------------------------------------------------------------- the body and its common fields


async def read_body(request: HTTPRequest) -> dict:
    """The request's JSON object, or a RequestError (415, 413, 400) naming what is wrong."""
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
    except RecursionError:
        raise RequestError("the body is nested too deeply; send at most a few hundred levels") from None
    if not isinstance(body, dict):
        raise RequestError("the body must be a JSON object")
    try:  # a lone surrogate ("\ud800") is valid JSON but no text a tokenizer can take
        json.dumps(body, ensure_ascii=False).encode("utf-8")
    except UnicodeEncodeError as e:
        bad = e.object[e.start : e.end].encode("unicode_escape").decode()
        raise RequestError(f"the body holds text that is not valid Unicode ({bad}); send UTF-8 text") from None
    return body


def stream_flag(body: dict) -> bool:
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise RequestError("stream must be true or false", param="stream")
    return stream


def engine_request(
    served: Served,
    body: dict,
    prompt: list[int],
    *,
    length: tuple[str, ...],
    default_length: Optional[int],
    ranges: dict,
    out_of_range,
    stop: str = "stop",
    logprobs: Optional[tuple[str, Any]] = None,
    grammar: Optional[Grammar] = None,
) -> Request:
    """The engine Request a body asks for (decode/request.build_request, the one place its values
    are checked): its length from the first of the `length` fields it sets (else
    `default_length`; required when None), cut to the room the context leaves after the prompt;
    sampling within the API's reference `ranges` (`out_of_range`: the API's words for a value
    outside them); stop strings from the `stop` field; `logprobs`: (field, top alternatives)
    when asked."""
    given = next((name for name in length if body.get(name) is not None), None)
    if given is None and default_length is None:
        raise RequestError(f"{length[0]}: field required", param=length[0])
    values = {
        name: body[name]
        for name in ("temperature", "top_p", "top_k", "seed", "block_size")
        if body.get(name) is not None
    }
    logprobs_field, top = logprobs or ("logprobs", None)
    names = {"max_tokens": given or length[0], "stop": stop, "logprobs": logprobs_field}
    try:
        return build_request(
            prompt,
            body[given] if given else default_length,
            served.bounds,
            grammar=grammar,
            cut_to_context=True,
            names=names,
            stop=() if body.get(stop) is None else body[stop],
            logprobs=top,
            ranges=ranges,
            **values,
        )
    except OutOfRange as e:
        raise out_of_range(e) from None
    except BadValue as e:
        raise RequestError(str(e), param=e.field, code=e.code) from None


def format_grammar(served: Served, value, name: str, schema_of) -> Optional[Grammar]:
    """The grammar a response format asks for: None for text, JSON (any object, or a schema)."""
    kind = value.get("type") if isinstance(value, dict) else value
    if value is None or kind == "text":
        return None
    if kind not in ("json_object", "json_schema"):
        raise RequestError(f"{name} type {kind!r} is not one of text, json_object, json_schema", param=name)
    schema = {"type": "object"}
    if kind == "json_schema":
        schema = schema_of(value)
        if not isinstance(schema, dict):
            raise RequestError(f"{name}: json_schema needs a schema object", param=name)
    try:
        return Grammar.json(served.tokenizer, served.bounds.vocab_size, schema, one_line=True)
    except (ValueError, RuntimeError) as e:
        raise RequestError(f"{name}: {e}", param=name) from None


# ---------------------------------------------------------------- what the answers share


def ignored_header(ignored: list[str]) -> dict:
    """The fields a request sent that this API does not know (never silently dropped)."""
    return {"x-dflash-ignored-fields": ", ".join(ignored)} if ignored else {}


def reasoning_tokens(tokenizer, reasoning: str) -> int:
    """The tokens of an answer's reasoning (its text re-tokenized: the markers around it aside)."""
    return len(tokenizer.encode(reasoning, add_special_tokens=False)) if reasoning else 0


def token_logprobs(tokenizer, logprobs: list) -> list[dict]:
    """The target's logprobs as OpenAI chat's logprobs.content and Responses' output_text.logprobs list them."""

    def entry(token, logprob):
        text = tokenizer.decode([token])
        return {"token": text, "logprob": logprob, "bytes": list(text.encode())}

    return [{**entry(lp.token, lp.logprob), "top_logprobs": [entry(t, v) for t, v in lp.top]} for lp in logprobs]


def openai_error(e: RequestError) -> JSONResponse:
    """An error as OpenAI's APIs write one."""
    kind = {404: "not_found_error", 429: "rate_limit_error"}.get(
        e.status, "invalid_request_error" if e.status < 500 else "server_error"
    )
    return JSONResponse({"error": {"message": str(e), "type": kind, "param": e.param, "code": e.code}}, e.status)


def anthropic_error(e: RequestError) -> JSONResponse:
    """An error as Anthropic's API writes one (it names no field)."""
    kind = ANTHROPIC_ERROR_TYPES.get(e.status, "invalid_request_error" if e.status < 500 else "api_error")
    return JSONResponse({"type": "error", "error": {"type": kind, "message": str(e)}}, e.status)
