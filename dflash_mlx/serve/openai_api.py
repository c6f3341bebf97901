"""The OpenAI API: chat completions and text completions, streamed or not, and what they
share with its Responses API (responses_api.py): OpenAIEndpoints and the checks below.

Errors are OpenAI's ({"error": {"message", "type", "param", "code"}}).  Structured
output (response_format / text.format json_object or json_schema) masks the target's
choices with a grammar (grammar.py), and so does a tool_choice that forces a call
(forced_tools.py).  Fields that would change the output and are not implemented
(penalties, logit_bias, echo, suffix) are refused by name; fields
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

from ..decode.grammar import Grammar
from .forced_tools import choose_tools, openai_tool_choice
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
from .validation import check_openai_ranges, check_openai_tool_messages

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
MAX_CHOICES = 8


def format_grammar(server, value, name: str, schema_of) -> Optional[Grammar]:
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
        return Grammar.json(server.tokenizer, server.model.target.vocab_size, schema, one_line=True)
    except (ValueError, RuntimeError) as e:
        raise RequestError(f"{name}: {e}", param=name) from None


class OpenAIEndpoints:
    """What every OpenAI endpoint shares: errors in OpenAI's format, the ignored-fields header,
    the length and streaming fields, and tokens' logprobs."""

    def __init__(self, server):
        self.server = server

    def error(self, e: RequestError) -> JSONResponse:
        self.server.refused(e)
        kind = {404: "not_found_error", 429: "rate_limit_error"}.get(
            e.status, "invalid_request_error" if e.status < 500 else "server_error"
        )
        return JSONResponse({"error": {"message": str(e), "type": kind, "param": e.param, "code": e.code}}, e.status)

    @staticmethod
    def _headers(ignored: list[str]) -> dict:
        return {"x-dflash-ignored-fields": ", ".join(ignored)} if ignored else {}

    def _length_and_stream(self, body: dict, default_max: int, max_names=("max_completion_tokens", "max_tokens")):
        max_tokens = self.server.max_tokens(body, max_names, default_max)
        stream = body.get("stream", False)
        if not isinstance(stream, bool):
            raise RequestError("stream must be true or false", param="stream")
        stream_options = body.get("stream_options") or {}
        if not isinstance(stream_options, dict):
            raise RequestError("stream_options must be an object", param="stream_options")
        return max_tokens, stream, bool(stream_options.get("include_usage"))

    def _token_text(self, token: int) -> str:
        return self.server.tokenizer.decode([token])

    def token_logprobs(self, logprobs: list) -> list[dict]:
        """The target's logprobs as chat's logprobs.content and Responses' output_text.logprobs list them."""

        def entry(token, logprob):
            text = self._token_text(token)
            return {"token": text, "logprob": logprob, "bytes": list(text.encode())}

        return [{**entry(lp.token, lp.logprob), "top_logprobs": [entry(t, v) for t, v in lp.top]} for lp in logprobs]


class OpenAIAPI(OpenAIEndpoints):
    """Chat completions (POST /v1/chat/completions) and text completions (POST /v1/completions)."""

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

    # ------------------------------------------------------------ request parsing

    def _chat_request(self, body: dict):
        refuse_nonzero(body, *REFUSED)
        grammar = format_grammar(
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
        tools, forced = choose_tools(
            self.server, check_tools(body.get("tools")), *openai_tool_choice(body.get("tool_choice"))
        )
        grammar = forced or grammar  # a forced call's grammar admits no text for a format to shape
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
            max_tokens, stream, include_usage = self._length_and_stream(body, 512 if chat else 16)
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
            "logprobs": None if logprobs is None else {"content": self.token_logprobs(logprobs)},
        }

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
