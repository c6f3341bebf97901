"""The OpenAI API: chat completions, text completions and Responses, streamed or not.

Errors are OpenAI's ({"error": {"message", "type", "param", "code"}}).  Structured
output (response_format / text.format json_object or json_schema) masks the target's
choices with a grammar (grammar.py).  Fields that would change the output and are
not implemented (penalties, logit_bias, forced tool choice, echo, suffix) are refused by name; fields
this API does not know are listed in `usage.dflash.ignored_fields` and the
`x-dflash-ignored-fields` header.  `n` choices are decoded one after another
(choice i of a seeded request uses seed + i); `logprobs` are the target's own.
"""

import json
import numbers
import time
import uuid
from typing import Optional

from starlette.background import BackgroundTask
from starlette.requests import Request
from starlette.responses import JSONResponse, StreamingResponse

from ..grammar import Grammar
from .protocol import (
    RequestError,
    answer_message,
    arguments_json,
    check_tools,
    decoding_stats,
    generation_failure,
    number,
    prompt_tokens,
    refuse_nonzero,
    sampling,
    text_of,
    unknown_fields,
)
from .tools import with_tool_calls
from .validation import check_function_call_outputs, check_openai_ranges, check_openai_tool_messages

SAMPLING_FIELDS = {"temperature", "top_p", "top_k", "seed", "block_size"}
NO_EFFECT = {"model", "user", "metadata", "store", "service_tier", "parallel_tool_calls", "stream", "stream_options"}
REFUSED = ("frequency_penalty", "presence_penalty", "logit_bias")
CHAT_FIELDS = (
    SAMPLING_FIELDS
    | NO_EFFECT
    | {
        "messages",
        "max_tokens",
        "max_completion_tokens",
        "stop",
        "tools",
        "tool_choice",
        "n",
        "logprobs",
        "top_logprobs",
        "response_format",
        "modalities",
        *REFUSED,
    }
)
COMPLETION_FIELDS = (
    SAMPLING_FIELDS
    | NO_EFFECT
    | {"prompt", "max_tokens", "stop", "n", "logprobs", "echo", "suffix", "best_of", *REFUSED}
)
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
MAX_CHOICES = 8


def _tools_for(tools: list, tool_choice) -> list:
    """The tools the model is offered, given tool_choice ("auto" or "none"; forcing a call would
    need constrained decoding, which this server does not do)."""
    if tool_choice in (None, "auto"):
        return tools
    if tool_choice == "none":
        return []
    raise RequestError(
        'tool_choice can be "auto" or "none" here (forcing a call is not supported)',
        param="tool_choice",
        code="unsupported_parameter",
    )


def _grammar(server, value, name: str, schema_of) -> Optional[Grammar]:
    """The grammar a response format asks for: None for text, JSON (any object, or a schema)."""
    kind = value.get("type") if isinstance(value, dict) else value
    if value is None or kind == "text":
        return None
    if kind not in ("json_object", "json_schema"):
        raise RequestError(f"{name} type {kind!r} is not one of text, json_object, json_schema", param=name)
    schema = None
    if kind == "json_schema":
        schema = schema_of(value)
        if not isinstance(schema, dict):
            raise RequestError(f"{name}: json_schema needs a schema object", param=name)
    try:
        return Grammar.json(server.tokenizer, server.model.target.vocab_size, schema)
    except (ValueError, RuntimeError) as e:
        raise RequestError(f"{name}: {e}", param=name) from None


class OpenAIAPI:
    def __init__(self, server):
        self.server = server

    def error(self, e: RequestError) -> JSONResponse:
        self.server.refused(e)
        kind = {404: "not_found_error", 429: "rate_limit_error"}.get(
            e.status, "invalid_request_error" if e.status < 500 else "server_error"
        )
        return JSONResponse({"error": {"message": str(e), "type": kind, "param": e.param, "code": e.code}}, e.status)

    def _usage(self, responses: list, ignored: list[str]) -> dict:
        last = responses[-1]
        completion = sum(r.generation_tokens for r in responses)
        dflash = decoding_stats(last)
        if ignored:
            dflash["ignored_fields"] = ignored
        return {
            "prompt_tokens": last.prompt_tokens,
            "completion_tokens": completion,
            "total_tokens": last.prompt_tokens + completion,
            "prompt_tokens_details": {"cached_tokens": last.cached_tokens},
            "dflash": dflash,
        }

    @staticmethod
    def _headers(ignored: list[str]) -> dict:
        return {"x-dflash-ignored-fields": ", ".join(ignored)} if ignored else {}

    # ------------------------------------------------------------ request parsing

    def _chat_request(self, body: dict):
        refuse_nonzero(body, *REFUSED)
        grammar = _grammar(
            self.server,
            body.get("response_format"),
            "response_format",
            lambda value: (value.get("json_schema") or {}).get("schema"),
        )
        if body.get("modalities") not in (None, ["text"]):
            raise RequestError("modalities: the served model writes text only", param="modalities")
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            raise RequestError("messages must be a non-empty list", param="messages")
        normalised = []
        for i, m in enumerate(messages):
            if not isinstance(m, dict) or not isinstance(m.get("role"), str):
                raise RequestError("every message needs a role and content", param="messages")
            message = {"role": m["role"], "content": text_of(m.get("content"), f"messages[{i}].content")}
            if m.get("tool_calls"):
                calls = m["tool_calls"]
                if not (
                    isinstance(calls, list)
                    and all(isinstance(c, dict) and isinstance(c.get("function"), dict) for c in calls)
                ):
                    raise RequestError(f"messages[{i}].tool_calls must be a list of function calls", param="messages")
                message["tool_calls"] = [
                    {
                        **call,
                        "function": {
                            **call["function"],
                            "arguments": arguments_json(call["function"].get("arguments", {})),
                        },
                    }
                    for call in calls
                ]
            if m.get("tool_call_id") is not None:
                message["tool_call_id"] = m["tool_call_id"]
            normalised.append(message)
        check_openai_tool_messages(normalised)
        tools = _tools_for(check_tools(body.get("tools")), body.get("tool_choice"))
        logprobs = None
        if body.get("logprobs"):
            logprobs = number(body, "top_logprobs", 0, numbers.Integral, 0, 20)
        elif body.get("top_logprobs") is not None:
            raise RequestError("top_logprobs needs logprobs: true", param="top_logprobs")
        return prompt_tokens(self.server.tokenizer, normalised, tools), normalised, tools, logprobs, grammar

    def _completion_request(self, body: dict):
        refuse_nonzero(body, *REFUSED, "echo", "suffix")
        n = number(body, "n", 1, numbers.Integral, 1, MAX_CHOICES)
        if number(body, "best_of", n, numbers.Integral, 1) != n:
            raise RequestError("best_of must equal n here (no server-side ranking)", param="best_of")
        prompt = body.get("prompt")
        if isinstance(prompt, str) and prompt.strip():
            tokens = self.server.tokenizer.encode(prompt)
        elif (
            isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt)
        ):
            tokens = prompt
        else:
            raise RequestError("prompt must be a non-empty string or a list of token ids", param="prompt")
        logprobs = number(body, "logprobs", None, numbers.Integral, 0, 20)
        return tokens, logprobs

    def _common(self, body: dict, default_max: int, max_names=("max_completion_tokens", "max_tokens")):
        max_tokens = self.server.max_tokens(body, max_names, default_max)
        stream = body.get("stream", False)
        if not isinstance(stream, bool):
            raise RequestError("stream must be true or false", param="stream")
        stream_options = body.get("stream_options") or {}
        if not isinstance(stream_options, dict):
            raise RequestError("stream_options must be an object", param="stream_options")
        return max_tokens, stream, bool(stream_options.get("include_usage"))

    # ------------------------------------------------------------ chat and text completions

    async def chat(self, request: Request):
        return await self._complete(request, chat=True)

    async def completions(self, request: Request):
        return await self._complete(request, chat=False)

    async def _complete(self, request: Request, chat: bool):
        try:
            body = await self.server.body(request)
            if chat:
                prompt, messages, tools, logprobs, grammar = self._chat_request(body)
            else:
                (prompt, logprobs), messages, tools, grammar = self._completion_request(body), None, None, None
            check_openai_ranges(body)
            options = {**sampling(body, {"stop": "stop"}), "logprobs": logprobs, "grammar": grammar}
            max_tokens, stream, include_usage = self._common(body, 512 if chat else 16)
            n = number(body, "n", 1, numbers.Integral, 1, MAX_CHOICES)
            ignored = unknown_fields(body, CHAT_FIELDS if chat else COMPLETION_FIELDS)
            job, first = await self.server.start(prompt, max_tokens, options)
        except RequestError as e:
            return self.error(e)
        ident = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
        choices = _Choices(self, prompt, max_tokens, options, n, job, first, messages, tools)
        if stream:
            return StreamingResponse(
                self._sse(choices, ident, chat, include_usage, tools, ignored),
                media_type="text/event-stream",
                headers=self._headers(ignored),
                background=BackgroundTask(choices.prefill_next_turn),
            )
        response = await self.server.while_connected(request, self._whole(choices, ident, chat, tools, ignored))
        response.background = BackgroundTask(choices.prefill_next_turn)
        return response

    def _choice(
        self,
        chat: bool,
        index: int,
        text: Optional[str],
        finish: Optional[str],
        delta: bool,
        tool_calls: Optional[list] = None,
        logprobs: Optional[list] = None,
    ) -> dict:
        if not chat:
            return {
                "index": index,
                "text": text,
                "finish_reason": finish,
                "logprobs": None if logprobs is None else self._completion_logprobs(logprobs),
            }
        message = {"role": "assistant", "content": text}
        if tool_calls:
            message["tool_calls"] = [{"index": i, **c} for i, c in enumerate(tool_calls)] if delta else tool_calls
            finish = finish and "tool_calls"
        return {
            "index": index,
            "delta" if delta else "message": message,
            "finish_reason": finish,
            "logprobs": None if logprobs is None else {"content": self._chat_logprobs(logprobs)},
        }

    def _token_text(self, token: int) -> str:
        return self.server.tokenizer.decode([token])

    def _chat_logprobs(self, logprobs: list) -> list[dict]:
        def entry(token, logprob):
            text = self._token_text(token)
            return {"token": text, "logprob": logprob, "bytes": list(text.encode())}

        return [{**entry(lp.token, lp.logprob), "top_logprobs": [entry(t, v) for t, v in lp.top]} for lp in logprobs]

    def _completion_logprobs(self, logprobs: list) -> dict:
        return {
            "tokens": [self._token_text(lp.token) for lp in logprobs],
            "token_logprobs": [lp.logprob for lp in logprobs],
            "top_logprobs": [{self._token_text(t): v for t, v in lp.top} for lp in logprobs],
        }

    async def _whole(self, choices: "_Choices", ident: str, chat: bool, tools, ignored: list[str]) -> JSONResponse:
        out, finals = [], []
        try:
            async for index, events in choices:
                text, logprobs = "", [] if choices.options["logprobs"] is not None else None
                async for last, shown, tool_calls in with_tool_calls(
                    events, self.server.tokenizer, tools if chat else None
                ):
                    text += shown
                    choices.answered(shown, tool_calls, last)
                    if logprobs is not None:
                        logprobs += last.logprobs
                out.append(
                    self._choice(
                        chat,
                        index,
                        text or (None if tool_calls else ""),
                        last.finish_reason,
                        False,
                        tool_calls,
                        logprobs,
                    )
                )
                finals.append(last)
        except Exception as e:
            return self.error(generation_failure(e))
        finally:
            choices.close()  # choices not reached (one failed) or cut short (their client gone)
        return JSONResponse(
            {
                "id": ident,
                "object": "chat.completion" if chat else "text_completion",
                "created": int(time.time()),
                "model": self.server.model_id,
                "choices": out,
                "usage": self._usage(finals, ignored),
            },
            headers=self._headers(ignored),
        )

    async def _sse(self, choices: "_Choices", ident: str, chat: bool, include_usage: bool, tools, ignored: list[str]):
        kind = "chat.completion.chunk" if chat else "text_completion"
        created = int(time.time())

        def chunk(choice_list: list, **extra) -> str:
            return (
                "data: "
                + json.dumps(
                    {
                        "id": ident,
                        "object": kind,
                        "created": created,
                        "model": self.server.model_id,
                        "choices": choice_list,
                        **extra,
                    }
                )
                + "\n\n"
            )

        finals = []
        try:
            async for index, events in choices:
                last = None
                async for last, text, tool_calls in with_tool_calls(
                    events, self.server.tokenizer, tools if chat else None
                ):
                    choices.answered(text, tool_calls, last)
                    if last.finish_reason:
                        yield chunk(
                            [self._choice(chat, index, text, last.finish_reason, True, tool_calls, last.logprobs)]
                        )
                    elif text or last.logprobs:
                        yield chunk([self._choice(chat, index, text, None, True, None, last.logprobs)])
                finals.append(last)
            if include_usage and finals:
                yield chunk([], usage=self._usage(finals, ignored))
            yield "data: [DONE]\n\n"
        except Exception as e:
            failure = self.server.stream_failed(e)
            yield "data: " + json.dumps({"error": {"message": str(failure), "type": "server_error"}}) + "\n\n"
        finally:
            choices.close()

    # ------------------------------------------------------------ Responses

    def _responses_request(self, body: dict):
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
        grammar = _grammar(
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
        tools = _tools_for(tools, body.get("tool_choice"))
        logprobs = number(body, "top_logprobs", 0, numbers.Integral, 0, 20) if include else None
        return prompt_tokens(self.server.tokenizer, messages, tools), messages, tools, logprobs, grammar

    async def responses(self, request: Request):
        try:
            body = await self.server.body(request)
            prompt, messages, tools, logprobs, grammar = self._responses_request(body)
            check_openai_ranges(body)
            options = {**sampling(body, {"stop": "stop"}), "logprobs": logprobs, "grammar": grammar}
            max_tokens, stream, _ = self._common(body, 512, ("max_output_tokens",))
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
        return await self.server.while_connected(request, self._whole_response(response, job, first, follow))

    async def _whole_response(self, response: "_Response", job, first, follow: BackgroundTask) -> JSONResponse:
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


class _Choices:
    """The n choices of a request: all queued at once (a batching engine decodes them together),
    async-iterated as (index, events) in order."""

    def __init__(self, api: OpenAIAPI, prompt, max_tokens, options, n, job, first, messages=None, tools=None):
        self.api, self.prompt, self.max_tokens, self.options, self.n = api, prompt, max_tokens, options, n
        self.started = [(job, first)]
        self.messages, self.tools = messages, tools  # a chat's (None: a text completion)
        self.text, self.calls, self.finished = "", [], False  # a one-choice chat's answer

    def answered(self, text: str, tool_calls, last) -> None:
        """A piece of the answer (one choice: the only one followed up)."""
        self.text += text
        self.calls, self.finished = tool_calls or [], bool(last.finish_reason)

    @property
    def chat(self) -> Optional[tuple[list[dict], list]]:
        """The messages and tools of a one-choice chat (the only one whose next turn is prefilled)."""
        return (self.messages, self.tools) if self.messages is not None and self.n == 1 else None

    def prefill_next_turn(self) -> None:
        """Once a one-choice chat's answer is out: its next turn prefilled (Server.prefill_next_turn)."""
        if self.chat is not None and self.finished:
            self.api.server.prefill_next_turn(self.messages + [answer_message(self.text, self.calls)], self.tools)

    async def __aiter__(self):
        seed = self.options["seed"]
        for index in range(1, self.n):
            options = {**self.options, "seed": None if seed is None else seed + index}
            self.started.append(await self.api.server.start(self.prompt, self.max_tokens, options))
        for index, (job, first) in enumerate(self.started):
            yield index, self.api.server.events(job, first, self.chat)

    def close(self):
        for job, _ in self.started:
            job.cancelled.set()


class _Response:
    """One Responses API response, built from the engine's events: the final object, or the
    stream of typed events the openai client parses."""

    def __init__(self, api: OpenAIAPI, body: dict, messages: list[dict], tools: list, ignored: list[str]):
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

    def _message_item(self, status: str, text: Optional[str] = None) -> dict:
        part = {
            "type": "output_text",
            "text": self.text if text is None else text,
            "annotations": [],
            "logprobs": self._logprobs(self.logprobs) if text is None else [],
        }
        return {
            "type": "message",
            "id": self.message_id,
            "status": status,
            "role": "assistant",
            "content": [part] if status == "completed" else [],
        }

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

    def _logprobs(self, logprobs: list) -> list[dict]:
        text = self.api._token_text
        return [
            {
                "token": text(lp.token),
                "logprob": lp.logprob,
                "bytes": list(text(lp.token).encode()),
                "top_logprobs": [{"token": text(t), "logprob": v, "bytes": list(text(t).encode())} for t, v in lp.top],
            }
            for lp in logprobs
        ]

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
                        logprobs=self._logprobs(self.last.logprobs or []),
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
