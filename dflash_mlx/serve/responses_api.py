"""The OpenAI Responses API: POST /v1/responses, streamed (the typed events the `openai`
client parses) or not.  Stateless: a request carries its whole conversation as input items
(previous_response_id is refused).  What it shares with chat and text completions (errors,
ignored fields, tools, text.format, logprobs) is in openai_api.py.
"""

import json
import numbers
import time
import uuid
from typing import Optional

from starlette.background import BackgroundTask
from starlette.requests import Request
from starlette.responses import JSONResponse, StreamingResponse

from .openai_api import NO_EFFECT, SAMPLING_FIELDS, OpenAIEndpoints, format_grammar, offered_tools
from .protocol import (
    RequestError,
    arguments_json,
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
from .validation import check_function_call_outputs, check_openai_ranges

RESPONSES_FIELDS = (
    SAMPLING_FIELDS
    | NO_EFFECT
    | {
        "input",
        "instructions",
        "max_output_tokens",
        "tools",
        "tool_choice",
        "text",
        "top_logprobs",
        "include",
        "previous_response_id",
        "truncation",
        "background",
        "reasoning",
    }
)


class ResponsesAPI(OpenAIEndpoints):
    """POST /v1/responses: a request's input items as a conversation, answered as one response."""

    def _request(self, body: dict):
        if body.get("previous_response_id") is not None:
            raise RequestError(
                "previous_response_id: this server keeps no responses; send the whole conversation in input",
                param="previous_response_id",
                code="unsupported_parameter",
            )
        if body.get("background"):
            raise RequestError("background responses are not supported here", param="background")
        if body.get("reasoning"):
            raise RequestError("reasoning: the served model has no reasoning mode", param="reasoning")
        grammar = format_grammar(
            self.server, (body.get("text") or {}).get("format"), "text.format", lambda value: value.get("schema")
        )
        include = body.get("include") or []
        if any(item != "message.output_text.logprobs" for item in include):
            raise RequestError("include: only message.output_text.logprobs is available here", param="include")
        messages = []
        if body.get("instructions") is not None:
            if not isinstance(body["instructions"], str):
                raise RequestError("instructions must be a string", param="instructions")
            messages.append({"role": "system", "content": body["instructions"]})
        items = body.get("input")
        if isinstance(items, str) and items.strip():
            items = [{"role": "user", "content": items}]
        if not isinstance(items, list) or not items:
            raise RequestError("input must be a non-empty string or a list of items", param="input")
        messages += input_messages(items)
        check_function_call_outputs(items)
        raw_tools = body.get("tools") or []
        if not isinstance(raw_tools, list):
            raise RequestError("tools must be a list", param="tools")
        tools = check_tools(
            [
                {"type": t.get("type"), "function": {k: v for k, v in t.items() if k != "type"}}
                if isinstance(t, dict)
                else t
                for t in raw_tools
            ]
        )
        tools = offered_tools(tools, body.get("tool_choice"))
        logprobs = number(body, "top_logprobs", 0, numbers.Integral, 0, 20) if include else None
        return prompt_tokens(self.server.tokenizer, messages, tools), messages, tools, logprobs, grammar

    async def create(self, request: Request):
        try:
            body = await self.server.body(request)
            prompt, messages, tools, logprobs, grammar = self._request(body)
            check_openai_ranges(body)
            options = {**sampling(body, {"stop": "stop"}), "logprobs": logprobs, "grammar": grammar}
            max_tokens, stream, _ = self._length_and_stream(body, 512, ("max_output_tokens",))
            ignored = unknown_fields(body, RESPONSES_FIELDS)
            job, first = await self.server.start(prompt, max_tokens, options)
        except RequestError as e:
            return self.error(e)
        response = _Response(self, body, messages, tools, ignored)
        follow = BackgroundTask(response.prefill_next_turn)
        if stream:
            return StreamingResponse(
                response.stream(job, first),
                media_type="text/event-stream",
                headers=self._headers(ignored),
                background=follow,
            )
        return await self.server.while_connected(request, self._whole(response, job, first, follow))

    async def _whole(self, response: "_Response", job, first, follow: BackgroundTask) -> JSONResponse:
        try:
            async for _ in response.run(job, first):
                pass
        except Exception as e:
            return self.error(generation_failure(e))
        return JSONResponse(response.snapshot(), headers=self._headers(response.ignored), background=follow)


def input_messages(items: list) -> list[dict]:
    """Responses API input items as chat messages (a function call joins the assistant message
    before it when that has no text)."""
    messages = []
    for i, item in enumerate(items):
        kind = item.get("type", "message") if isinstance(item, dict) else None
        if kind == "message":
            messages.append({"role": item.get("role"), "content": text_of(item.get("content"), f"input[{i}].content")})
        elif kind == "function_call":
            call = {
                "id": item.get("call_id"),
                "type": "function",
                "function": {"name": item.get("name"), "arguments": arguments_json(item.get("arguments"))},
            }
            if messages and messages[-1]["role"] == "assistant" and not messages[-1]["content"]:
                messages[-1].setdefault("tool_calls", []).append(call)
            else:
                messages.append({"role": "assistant", "content": "", "tool_calls": [call]})
        elif kind == "function_call_output":
            output = item.get("output")
            messages.append(
                {
                    "role": "tool",
                    "tool_call_id": item.get("call_id"),
                    "content": output if isinstance(output, str) else text_of(output, f"input[{i}]"),
                }
            )
        else:
            raise RequestError(
                f"input[{i}] is a {kind!r} item; this server reads message, function_call and "
                "function_call_output items",
                param="input",
            )
    return messages


class _Response:
    """One Responses API response, built from the engine's events: the final object, or the
    stream of typed events the openai client parses."""

    def __init__(self, api: ResponsesAPI, body: dict, messages: list[dict], tools: list, ignored: list[str]):
        self.api, self.body, self.messages, self.tools, self.ignored = api, body, messages, tools, ignored
        self.id = "resp_" + uuid.uuid4().hex
        self.message_id = "msg_" + uuid.uuid4().hex
        self.created = int(time.time())
        self.text, self.logprobs, self.calls, self.last = "", [], [], None
        self.sequence = 0

    def output(self) -> list[dict]:
        """The completed output items: the message (unless the answer is only tool calls), then the calls."""
        message = [self._message_item("completed")] if self.text or not self.calls else []
        return message + [self._call_item(call, "completed") for call in self.calls]

    def snapshot(self, status: Optional[str] = None) -> dict:
        output = self.output()
        last = self.last
        incomplete = last is not None and last.finish_reason == "length"
        usage = None
        if last is not None:
            dflash = decoding_stats(last)
            if self.ignored:
                dflash["ignored_fields"] = self.ignored
            usage = {
                "input_tokens": last.prompt_tokens,
                "input_tokens_details": {"cached_tokens": last.cached_tokens},
                "output_tokens": last.generation_tokens,
                "output_tokens_details": {"reasoning_tokens": 0},
                "total_tokens": last.prompt_tokens + last.generation_tokens,
                "dflash": dflash,
            }
        return {
            "id": self.id,
            "object": "response",
            "created_at": self.created,
            "status": status or ("incomplete" if incomplete else "completed"),
            "model": self.api.server.model_id,
            "output": output if status is None else [],
            "usage": usage,
            "error": None,
            "incomplete_details": {"reason": "max_output_tokens"} if incomplete and status is None else None,
            "instructions": self.body.get("instructions"),
            "max_output_tokens": self.body.get("max_output_tokens"),
            "temperature": self.body.get("temperature", 0.0),
            "top_p": self.body.get("top_p", 1.0),
            "tools": self.body.get("tools") or [],
            "tool_choice": self.body.get("tool_choice", "auto"),
            "parallel_tool_calls": True,
            "metadata": self.body.get("metadata") or {},
            "text": self.body.get("text") or {"format": {"type": "text"}},
            "truncation": "disabled",
            "store": False,
        }

    def _message_item(self, status: str) -> dict:
        content = []
        if status == "completed":
            logprobs = self.api.token_logprobs(self.logprobs)
            content = [{"type": "output_text", "text": self.text, "annotations": [], "logprobs": logprobs}]
        return {"type": "message", "id": self.message_id, "status": status, "role": "assistant", "content": content}

    @staticmethod
    def _call_item(call: dict, status: str) -> dict:
        return {
            "type": "function_call",
            "id": "fc_" + call["id"].removeprefix("call_"),
            "call_id": call["id"],
            "name": call["function"]["name"],
            "arguments": call["function"]["arguments"] if status == "completed" else "",
            "status": status,
        }

    def prefill_next_turn(self) -> None:
        """Once the response is complete: the conversation with its output items, as the client
        sends them back as input, prefilled while it acts on them (Server.prefill_next_turn)."""
        if self.last is not None and self.last.finish_reason:
            answer = input_messages(self.output())
            self.api.server.prefill_next_turn(self.messages + answer, self.tools)

    async def run(self, job, first):
        """Consume the engine's events; yields the text shown at each."""
        server = self.api.server
        async for self.last, shown, self.calls in with_tool_calls(
            server.events(job, first, (self.messages, self.tools)), server.tokenizer, self.tools
        ):
            self.logprobs += self.last.logprobs or []
            self.text += shown
            yield shown

    def _event(self, kind: str, **fields) -> str:
        self.sequence += 1
        return (
            f"event: {kind}\ndata: "
            + json.dumps({"type": kind, "sequence_number": self.sequence - 1, **fields})
            + "\n\n"
        )

    async def stream(self, job, first):
        try:
            yield self._event("response.created", response=self.snapshot("in_progress"))
            yield self._event("response.in_progress", response=self.snapshot("in_progress"))
            opened = False
            where = {"item_id": self.message_id, "output_index": 0, "content_index": 0}
            async for shown in self.run(job, first):
                if shown and not opened:
                    opened = True
                    yield self._event(
                        "response.output_item.added", output_index=0, item=self._message_item("in_progress")
                    )
                    yield self._event(
                        "response.content_part.added",
                        item_id=self.message_id,
                        output_index=0,
                        content_index=0,
                        part={"type": "output_text", "text": "", "annotations": []},
                    )
                if shown:
                    yield self._event(
                        "response.output_text.delta",
                        **where,
                        delta=shown,
                        logprobs=self.api.token_logprobs(self.last.logprobs or []),
                    )
            if opened or not self.calls:
                if not opened:  # an empty answer is still a message
                    yield self._event(
                        "response.output_item.added", output_index=0, item=self._message_item("in_progress")
                    )
                item = self._message_item("completed")
                yield self._event("response.output_text.done", **where, text=self.text, logprobs=[])
                yield self._event("response.content_part.done", **where, part=item["content"][0])
                yield self._event("response.output_item.done", output_index=0, item=item)
            first_call = 1 if (opened or not self.calls) else 0
            for index, call in enumerate(self.calls, start=first_call):
                item = self._call_item(call, "completed")
                yield self._event(
                    "response.output_item.added", output_index=index, item=self._call_item(call, "in_progress")
                )
                yield self._event(
                    "response.function_call_arguments.delta",
                    item_id=item["id"],
                    output_index=index,
                    delta=item["arguments"],
                )
                yield self._event(
                    "response.function_call_arguments.done",
                    item_id=item["id"],
                    output_index=index,
                    arguments=item["arguments"],
                    name=item["name"],
                )
                yield self._event("response.output_item.done", output_index=index, item=item)
            final = self.snapshot()
            yield self._event(
                "response.incomplete" if final["status"] == "incomplete" else "response.completed", response=final
            )
        except Exception as e:
            yield self._event("error", code="server_error", message=str(self.api.server.stream_failed(e)), param=None)
        finally:
            job.cancelled.set()
