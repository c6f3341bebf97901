"""The Anthropic Messages API: POST /v1/messages (streamed or not) and
/v1/messages/count_tokens, in the shapes the `anthropic` client parses.

Sampling: the `anthropic` SDK sends no sampling fields unless the caller sets
them, so the default is this server's default everywhere: greedy (temperature 0),
the most reproducible and the fastest with DFlash.  temperature / top_p / top_k
are honoured when sent; `seed` and `block_size` can be sent through `extra_body`.
Thinking blocks of earlier assistant turns are dropped (the Anthropic API does the
same with prior turns); everything else a request carries is used or refused by
name with an Anthropic-style error.
"""

import json
import numbers
import time
import uuid

from starlette.background import BackgroundTask
from starlette.requests import Request
from starlette.responses import JSONResponse, StreamingResponse

from .protocol import (
    RequestError,
    answer_message,
    check_tools,
    decoding_stats,
    generation_failure,
    number,
    prompt_tokens,
    sampling,
    text_of,
    unknown_fields,
)
from .tools import with_tool_calls
from .validation import check_anthropic_ranges, check_anthropic_tool_results

ERROR_TYPES = {
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
FIELDS = {
    "model",
    "messages",
    "system",
    "max_tokens",
    "stop_sequences",
    "temperature",
    "top_p",
    "top_k",
    "stream",
    "tools",
    "tool_choice",
    "metadata",
    "service_tier",
    "thinking",
    "seed",
    "block_size",
}
DROPPED_BLOCKS = ("thinking", "redacted_thinking")


def _blocks(content, where: str) -> list[dict]:
    if isinstance(content, str):
        return [{"type": "text", "text": content}]
    if not isinstance(content, list):
        raise RequestError(f"{where} must be a string or a list of content blocks")
    for i, block in enumerate(content):
        if not isinstance(block, dict) or not isinstance(block.get("type"), str):
            raise RequestError(f"{where}[{i}] must be an object with a type")
    return content


def conversation(body: dict) -> tuple[list[dict], list[dict]]:
    """The request as OpenAI chat messages and function tools (protocol.py's shape)."""
    messages = []
    system = body.get("system")
    if system is not None:
        messages.append({"role": "system", "content": text_of(_blocks(system, "system"), "system")})
    turns = body.get("messages")
    if not isinstance(turns, list) or not turns:
        raise RequestError("messages must be a non-empty list")
    for i, turn in enumerate(turns):
        role = turn.get("role") if isinstance(turn, dict) else None
        if role not in ("user", "assistant"):
            raise RequestError(f"messages[{i}].role must be user or assistant, got {role!r}")
        text, calls, results = [], [], []
        for j, block in enumerate(_blocks(turn.get("content"), f"messages[{i}].content")):
            kind, where = block["type"], f"messages[{i}].content[{j}]"
            if kind == "text":
                text.append(block)
            elif kind == "tool_use" and role == "assistant":
                calls.append(
                    {
                        "id": block.get("id"),
                        "type": "function",
                        "function": {
                            "name": block.get("name"),
                            "arguments": json.dumps(block.get("input") or {}, ensure_ascii=False),
                        },
                    }
                )
            elif kind == "tool_result" and role == "user":
                content = block.get("content")
                result = text_of(_blocks(content, where) if content is not None else None, where)
                results.append(
                    {
                        "role": "tool",
                        "tool_call_id": block.get("tool_use_id"),
                        "content": ("Error: " + result) if block.get("is_error") else result,
                    }
                )
            elif kind in DROPPED_BLOCKS and role == "assistant":
                continue
            elif kind in ("tool_use", "tool_result", *DROPPED_BLOCKS):
                raise RequestError(f"{where}: a {kind} block does not belong in a {role} turn")
            else:
                text_of([block], where)  # refuses images, documents and other non-text blocks by name
        messages += results
        if text or calls or not results:
            message = {"role": role, "content": text_of(text, f"messages[{i}].content")}
            if calls:
                message["tool_calls"] = calls
            messages.append(message)
    tools = []
    for k, tool in enumerate(body.get("tools") or []):
        if not isinstance(tool, dict) or tool.get("type") not in (None, "custom") or "name" not in tool:
            kind = tool.get("type") if isinstance(tool, dict) else None
            raise RequestError(
                f"tools[{k}]: only custom tools (name, description, input_schema) are supported here, got {kind!r}"
            )
        tools.append(
            {
                "type": "function",
                "function": {
                    "name": tool["name"],
                    "description": tool.get("description", ""),
                    "parameters": tool.get("input_schema") or {},
                },
            }
        )
    choice = (body.get("tool_choice") or {}).get("type", "auto")
    if choice == "none":
        tools = []
    elif choice != "auto":
        raise RequestError(f"tool_choice {choice!r}: forcing a tool call is not supported here (auto or none)")
    return messages, check_tools(tools)


class AnthropicAPI:
    def __init__(self, server):
        self.server = server

    def error(self, e: RequestError) -> JSONResponse:
        self.server.refused(e)
        kind = ERROR_TYPES.get(e.status, "invalid_request_error" if e.status < 500 else "api_error")
        return JSONResponse({"type": "error", "error": {"type": kind, "message": str(e)}}, e.status)

    def _prompt(self, body: dict):
        if body.get("thinking") and body["thinking"].get("type") == "enabled":
            raise RequestError("thinking: the served model has no extended thinking mode; remove it")
        messages, tools = conversation(body)
        check_anthropic_tool_results(body["messages"])
        return prompt_tokens(self.server.tokenizer, messages, tools), messages, tools

    async def count_tokens(self, request: Request):
        try:
            body = await self.server.body(request)
            prompt, _, _ = self._prompt(body)
        except RequestError as e:
            return self.error(e)
        return JSONResponse({"input_tokens": len(prompt)})

    async def messages(self, request: Request):
        try:
            body = await self.server.body(request)
            prompt, messages, tools = self._prompt(body)
            max_tokens = self.server.max_tokens(body, ("max_tokens",), None)
            check_anthropic_ranges(body)
            options = sampling(body, {"stop": "stop_sequences"})
            number(body, "top_k", 0, numbers.Integral, low=0)
            stream = body.get("stream", False)
            if not isinstance(stream, bool):
                raise RequestError("stream must be true or false")
            ignored = unknown_fields(body, FIELDS)
            job, first = await self.server.start(prompt, max_tokens, options)
        except RequestError as e:
            return self.error(e)
        message = _Message(self.server, messages, tools, ignored)
        headers = {"x-dflash-ignored-fields": ", ".join(ignored)} if ignored else {}
        follow = BackgroundTask(message.prefill_next_turn)
        if stream:
            return StreamingResponse(
                message.stream(job, first), media_type="text/event-stream", headers=headers, background=follow
            )
        return await self.server.while_connected(request, self._whole(message, job, first, headers, follow))

    async def _whole(self, message: "_Message", job, first, headers: dict, follow: BackgroundTask) -> JSONResponse:
        try:
            async for _ in message.run(job, first):
                pass
        except Exception as e:
            return self.error(generation_failure(e))
        return JSONResponse(message.snapshot(), headers=headers, background=follow)


class _Message:
    """One assistant message built from the engine's events: the final object, or the event
    stream (message_start, content_block_start / delta / stop, ping, message_delta, message_stop)."""

    def __init__(self, server, messages: list[dict], tools: list, ignored: list[str]):
        self.server, self.messages, self.tools, self.ignored = server, messages, tools, ignored
        self.id = "msg_" + uuid.uuid4().hex
        self.text, self.calls, self.last, self.prompt_tokens = "", [], None, 0

    def _usage(self) -> dict:
        last = self.last
        usage = {
            "input_tokens": last.prompt_tokens if last else self.prompt_tokens,
            "output_tokens": last.generation_tokens if last else 0,
            "cache_read_input_tokens": last.cached_tokens if last else 0,
            "cache_creation_input_tokens": 0,
        }
        if last is not None:
            usage["dflash"] = decoding_stats(last)
            if self.ignored:
                usage["dflash"]["ignored_fields"] = self.ignored
        return usage

    def _stop(self) -> tuple[str, object]:
        last = self.last
        if self.calls:
            return "tool_use", None
        if last.finish_reason == "length":
            return "max_tokens", None
        if last.stop_sequence is not None:
            return "stop_sequence", last.stop_sequence
        return "end_turn", None

    def _tool_blocks(self) -> list[dict]:
        return [
            {
                "type": "tool_use",
                "id": "toolu_" + call["id"].removeprefix("call_"),
                "name": call["function"]["name"],
                "input": json.loads(call["function"]["arguments"]),
            }
            for call in self.calls
        ]

    def snapshot(self) -> dict:
        stop_reason, stop_sequence = self._stop()
        content = ([{"type": "text", "text": self.text}] if self.text or not self.calls else []) + self._tool_blocks()
        return {
            "id": self.id,
            "type": "message",
            "role": "assistant",
            "model": self.server.model_id,
            "content": content,
            "stop_reason": stop_reason,
            "stop_sequence": stop_sequence,
            "usage": self._usage(),
        }

    async def run(self, job, first):
        """Consume the engine's events; yields the text shown at each."""
        self.prompt_tokens = first.prompt_tokens
        async for self.last, shown, self.calls in with_tool_calls(
            self.server.events(job, first, (self.messages, self.tools)), self.server.tokenizer, self.tools
        ):
            self.text += shown
            yield shown

    def prefill_next_turn(self) -> None:
        """Once the answer is out (a background task of its response): its next turn prefilled
        while the client acts on it (Server.prefill_next_turn)."""
        if self.last is not None and self.last.finish_reason:
            self.server.prefill_next_turn(self.messages + [answer_message(self.text, self.calls)], self.tools)

    @staticmethod
    def _event(kind: str, **fields) -> str:
        return f"event: {kind}\ndata: " + json.dumps({"type": kind, **fields}) + "\n\n"

    async def stream(self, job, first):
        try:
            start = {
                "id": self.id,
                "type": "message",
                "role": "assistant",
                "model": self.server.model_id,
                "content": [],
                "stop_reason": None,
                "stop_sequence": None,
                "usage": {
                    "input_tokens": first.prompt_tokens,
                    "output_tokens": 0,
                    "cache_read_input_tokens": first.cached_tokens,
                    "cache_creation_input_tokens": 0,
                },
            }
            yield self._event("message_start", message=start)
            yield self._event("ping")
            index, opened, last_ping = 0, False, time.monotonic()
            async for shown in self.run(job, first):
                if shown and not opened:
                    opened = True
                    yield self._event("content_block_start", index=0, content_block={"type": "text", "text": ""})
                if shown:
                    yield self._event("content_block_delta", index=0, delta={"type": "text_delta", "text": shown})
                elif time.monotonic() - last_ping > 10:  # long silences keep proxies from closing the stream
                    last_ping = time.monotonic()
                    yield self._event("ping")
            if not opened and not self.calls:  # an empty answer is still a text block
                opened = True
                yield self._event("content_block_start", index=0, content_block={"type": "text", "text": ""})
            if opened:
                yield self._event("content_block_stop", index=0)
                index = 1
            for block in self._tool_blocks():
                yield self._event("content_block_start", index=index, content_block={**block, "input": {}})
                yield self._event(
                    "content_block_delta",
                    index=index,
                    delta={"type": "input_json_delta", "partial_json": json.dumps(block["input"], ensure_ascii=False)},
                )
                yield self._event("content_block_stop", index=index)
                index += 1
            stop_reason, stop_sequence = self._stop()
            yield self._event(
                "message_delta", delta={"stop_reason": stop_reason, "stop_sequence": stop_sequence}, usage=self._usage()
            )
            yield self._event("message_stop")
        except Exception as e:
            failure = self.server.stream_failed(e)
            yield self._event("error", error={"type": "api_error", "message": str(failure)})
        finally:
            job.cancelled.set()
