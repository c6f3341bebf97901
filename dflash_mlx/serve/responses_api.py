"""The OpenAI Responses API: POST /v1/responses, streamed (the typed events the `openai`
client parses) or not.  Stateless: a request carries its whole conversation as input items
(previous_response_id is refused), as Codex sends it every turn.  What it shares with chat and
text completions (errors, ignored fields, tools, text.format, logprobs) is in openai_api.py.

Custom tools (free-form input, such as Codex's apply_patch) are offered to the model as
functions of one string argument, `input`, and their calls come back as custom_tool_call
items.  `reasoning` and include ["reasoning.encrypted_content"] are accepted: the served model
writes no reasoning items, and reasoning items sent back are left out of the prompt.
"""

import json
import numbers
import time
import uuid
from typing import Optional

from starlette.background import BackgroundTask
from starlette.requests import Request
from starlette.responses import JSONResponse, StreamingResponse

from .forced_tools import choose_tools, openai_tool_choice
from .openai_api import NO_EFFECT, SAMPLING_FIELDS, OpenAIEndpoints, format_grammar
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
        "prompt_cache_key",  # prefixes are reused by their tokens, whatever the key
        "client_metadata",
    }
)
INCLUDABLE = ("message.output_text.logprobs", "reasoning.encrypted_content")  # no reasoning: nothing to encrypt
CUSTOM_INPUT = "input"  # the one argument a custom tool is offered to the model with


class ResponsesAPI(OpenAIEndpoints):
    """POST /v1/responses: a request's input items as a conversation, answered as one response."""

    def _request(self, body: dict):
        _refuse_what_needs_state(body)
        reasoning = body.get("reasoning")  # effort and summary: the served model does not reason apart
        if reasoning is not None and not isinstance(reasoning, dict):
            raise RequestError("reasoning must be an object", param="reasoning")
        logprobs = _included_logprobs(body)
        items = body.get("input")
        if isinstance(items, str) and items.strip():
            items = [{"role": "user", "content": items}]
        if not isinstance(items, list) or not items:
            raise RequestError("input must be a non-empty string or a list of items", param="input")
        messages = _instructions(body) + input_messages(items)
        check_function_call_outputs(items)
        tools, custom = function_tools(body.get("tools"))
        text_format = (body.get("text") or {}).get("format")
        grammar = format_grammar(self.server, text_format, "text.format", lambda value: value.get("schema"))
        tools, forced = choose_tools(self.server, tools, *openai_tool_choice(body.get("tool_choice")))
        grammar = forced or grammar  # a forced call's grammar admits no text for a format to shape
        prompt = prompt_tokens(self.server.tokenizer, messages, tools)
        return prompt, messages, (tools, custom), logprobs, grammar

    async def create(self, request: Request):
        try:
            body = await self.server.body(request)
            prompt, messages, (tools, custom), logprobs, grammar = self._request(body)
            check_openai_ranges(body)
            options = {**sampling(body, {"stop": "stop"}), "logprobs": logprobs, "grammar": grammar}
            max_tokens, stream, _ = self._length_and_stream(body, 512, ("max_output_tokens",))
            ignored = unknown_fields(body, RESPONSES_FIELDS)
            job, first = await self.server.start(prompt, max_tokens, options)
        except RequestError as e:
            return self.error(e)
        response = _Response(self, body, messages, (tools, custom), ignored)
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


def _refuse_what_needs_state(body: dict) -> None:
    if body.get("previous_response_id") is not None:
        raise RequestError(
            "previous_response_id: this server keeps no responses; send the whole conversation in input",
            param="previous_response_id",
            code="unsupported_parameter",
        )
    if body.get("background"):
        raise RequestError("background responses are not supported here", param="background")


def _included_logprobs(body: dict) -> Optional[int]:
    """top_logprobs where include asks for the output's logprobs (None: not asked)."""
    include = body.get("include") or []
    if not isinstance(include, list) or any(item not in INCLUDABLE for item in include):
        raise RequestError(f"include: this server can include {', '.join(INCLUDABLE)}", param="include")
    if "message.output_text.logprobs" not in include:
        return None
    return number(body, "top_logprobs", 0, numbers.Integral, 0, 20)


def _instructions(body: dict) -> list[dict]:
    instructions = body.get("instructions")
    if instructions is None:
        return []
    if not isinstance(instructions, str):
        raise RequestError("instructions must be a string", param="instructions")
    return [{"role": "system", "content": instructions}]


def function_tools(raw_tools) -> tuple[list[dict], set[str]]:
    """Responses tools as chat's function tools, and the names of the custom ones."""
    if raw_tools is None:
        return [], set()
    if not isinstance(raw_tools, list):
        raise RequestError("tools must be a list", param="tools")
    custom = {t.get("name") for t in raw_tools if isinstance(t, dict) and t.get("type") == "custom"}
    return check_tools([_as_function(t) if isinstance(t, dict) else t for t in raw_tools]), custom


def _as_function(tool: dict) -> dict:
    """A Responses tool in chat's shape; a custom tool as a function of its free-form `input`,
    whose format (a grammar, say) is told to the model in the argument's description."""
    if tool.get("type") != "custom":
        return {"type": tool.get("type"), "function": {k: v for k, v in tool.items() if k != "type"}}
    about = "The tool's input, as free-form text"
    form = tool.get("format") or {}
    if isinstance(form, dict) and form.get("type") == "grammar":
        about += f" following this {form.get('syntax')} grammar:\n{form.get('definition')}"
    parameters = {
        "type": "object",
        "properties": {CUSTOM_INPUT: {"type": "string", "description": about}},
        "required": [CUSTOM_INPUT],
        "additionalProperties": False,
    }
    description = tool.get("description", "")
    return {
        "type": "function",
        "function": {"name": tool.get("name"), "description": description, "parameters": parameters},
    }


def custom_input(arguments: str) -> str:
    """A custom tool's input, from its call's arguments: their `input` (else, where the model
    wrote something else, the arguments as written)."""
    try:
        value = json.loads(arguments)
    except json.JSONDecodeError:
        return arguments
    return value[CUSTOM_INPUT] if isinstance(value, dict) and isinstance(value.get(CUSTOM_INPUT), str) else arguments


def input_messages(items: list) -> list[dict]:
    """Responses API input items as chat messages (a call joins the assistant message before it
    when that has no text).  Reasoning items are left out: the served model has no reasoning of
    its own to read back, and another model's is encrypted."""
    messages = []
    for i, item in enumerate(items):
        kind = item.get("type", "message") if isinstance(item, dict) else None
        if kind == "message":
            messages.append({"role": item.get("role"), "content": text_of(item.get("content"), f"input[{i}].content")})
        elif kind in ("function_call", "custom_tool_call"):
            _add_call(messages, _call_of(item))
        elif kind in ("function_call_output", "custom_tool_call_output"):
            output = item.get("output")
            content = output if isinstance(output, str) else text_of(output, f"input[{i}]")
            messages.append({"role": "tool", "tool_call_id": item.get("call_id"), "content": content})
        elif kind != "reasoning":
            raise RequestError(
                f"input[{i}] is a {kind!r} item; this server reads message, reasoning, function_call, "
                "function_call_output, custom_tool_call and custom_tool_call_output items",
                param="input",
            )
    return messages


def _call_of(item: dict) -> dict:
    """A function or custom tool call item as a chat tool call (a custom tool's input as the
    `input` argument it was offered with)."""
    if item["type"] == "custom_tool_call":
        arguments = json.dumps({CUSTOM_INPUT: item.get("input", "")}, ensure_ascii=False)
    else:
        arguments = arguments_json(item.get("arguments"))
    return {
        "id": item.get("call_id"),
        "type": "function",
        "function": {"name": item.get("name"), "arguments": arguments},
    }


def _add_call(messages: list[dict], call: dict) -> None:
    if messages and messages[-1]["role"] == "assistant" and not messages[-1]["content"]:
        messages[-1].setdefault("tool_calls", []).append(call)
    else:
        messages.append({"role": "assistant", "content": "", "tool_calls": [call]})


class _Response:
    """One Responses API response, built from the engine's events: the final object, or the
    stream of typed events the openai client parses."""

    def __init__(self, api: ResponsesAPI, body: dict, messages: list[dict], tools: tuple, ignored: list[str]):
        """`tools`: the function tools offered, and the names of those that are custom tools."""
        self.api, self.body, self.messages, self.ignored = api, body, messages, ignored
        self.tools, self.custom = tools
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
            "parallel_tool_calls": self.body.get("parallel_tool_calls", True),
            "reasoning": self.body.get("reasoning"),
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

    def _call_item(self, call: dict, status: str) -> dict:
        """A call as its output item: a custom_tool_call for a custom tool, else a function_call
        (in progress: its input or arguments still empty)."""
        name, arguments, suffix = (
            call["function"]["name"],
            call["function"]["arguments"],
            call["id"].removeprefix("call_"),
        )
        if name in self.custom:
            kind, prefix, field, value = "custom_tool_call", "ctc_", "input", custom_input(arguments)
        else:
            kind, prefix, field, value = "function_call", "fc_", "arguments", arguments
        item = {"type": kind, "id": prefix + suffix, "call_id": call["id"], "name": name}
        return {**item, field: value if status == "completed" else "", "status": status}

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

    def _call_events(self, index: int, call: dict):
        """A call's output item, added, its input (custom tool) or arguments (function) in one
        delta, then done."""
        item = self._call_item(call, "completed")
        where = {"item_id": item["id"], "output_index": index}
        yield self._event("response.output_item.added", output_index=index, item=self._call_item(call, "in_progress"))
        if item["type"] == "custom_tool_call":
            yield self._event("response.custom_tool_call_input.delta", **where, delta=item["input"])
            yield self._event("response.custom_tool_call_input.done", **where, input=item["input"])
        else:
            yield self._event("response.function_call_arguments.delta", **where, delta=item["arguments"])
            yield self._event(
                "response.function_call_arguments.done", **where, arguments=item["arguments"], name=item["name"]
            )
        yield self._event("response.output_item.done", output_index=index, item=item)

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
                for event in self._call_events(index, call):
                    yield event
            final = self.snapshot()
            yield self._event(
                "response.incomplete" if final["status"] == "incomplete" else "response.completed", response=final
            )
        except Exception as e:
            yield self._event("error", code="server_error", message=str(self.api.server.stream_failed(e)), param=None)
        finally:
            job.cancelled.set()
