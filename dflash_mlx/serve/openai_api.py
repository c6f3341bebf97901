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

A chat answer is read by answer.AnswerParser: a thinking model's reasoning comes as
`reasoning_content` (and `reasoning`, the name vLLM now prefers and mlx-lm's server uses) before
`content`, tool calls as `tool_calls` deltas, the function's name first, then its arguments in
pieces.  `reasoning_effort` and `chat_template_kwargs` switch thinking where the template does.
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
from .answer import AnswerParser, Blocks, Text, answer_events
from .forced_tools import choose_tools, openai_tool_choice
from .protocol import (
    RequestError,
    answer_message,
    arguments_json,
    check_tools,
    constrained,
    decoding_stats,
    generation_failure,
    number,
    prompt_tokens,
    refuse_nonzero,
    sampling,
    template_options,
    text_of,
    unknown_fields,
)
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
        "reasoning_effort",
        "chat_template_kwargs",
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

    def reasoning_tokens(self, reasoning: str) -> int:
        """The tokens of an answer's reasoning (its text re-tokenized: the markers around it aside)."""
        return len(self.server.tokenizer.encode(reasoning, add_special_tokens=False)) if reasoning else 0

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

    def _usage(self, responses: list, ignored: list[str], reasoning: str = "") -> dict:
        last = responses[-1]
        completion = sum(r.generation_tokens for r in responses)
        dflash = decoding_stats(last)
        if ignored:
            dflash["ignored_fields"] = ignored
        usage = {
            "prompt_tokens": last.prompt_tokens,
            "completion_tokens": completion,
            "total_tokens": last.prompt_tokens + completion,
            "prompt_tokens_details": {"cached_tokens": last.cached_tokens},
            "dflash": dflash,
        }
        if reasoning:
            usage["completion_tokens_details"] = {"reasoning_tokens": self.reasoning_tokens(reasoning)}
        return usage

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
            reasoning = m.get("reasoning_content", m.get("reasoning"))  # an answer's reasoning, sent back
            if m["role"] == "assistant" and isinstance(reasoning, str) and reasoning:
                message["reasoning_content"] = reasoning
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
        template = template_options(effort=body.get("reasoning_effort"), kwargs=body.get("chat_template_kwargs"))
        if grammar is not None:
            template = constrained(template)
        prompt = prompt_tokens(self.server.tokenizer, normalised, tools, template=template)
        return prompt, (normalised, tools, template), logprobs, grammar

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
                prompt, conversation, logprobs, grammar = self._chat_request(body)
            else:
                (prompt, logprobs), conversation, grammar = self._completion_request(body), None, None
            check_openai_ranges(body)
            options = {**sampling(body, {"stop": "stop"}), "logprobs": logprobs, "grammar": grammar}
            max_tokens, stream, include_usage = self._length_and_stream(body, 512 if chat else 16)
            n = number(body, "n", 1, numbers.Integral, 1, MAX_CHOICES)
            ignored = unknown_fields(body, CHAT_FIELDS if chat else COMPLETION_FIELDS)
            job, first = await self.server.start(prompt, max_tokens, options)
        except RequestError as e:
            return self.error(e)
        ident = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
        choices = _Choices(self, prompt, max_tokens, options, n, job, first, conversation)
        if stream:
            return StreamingResponse(
                self._sse(choices, ident, chat, include_usage, ignored),
                media_type="text/event-stream",
                headers=self._headers(ignored),
                background=BackgroundTask(choices.prefill_next_turn),
            )
        response = await self.server.while_connected(request, self._whole(choices, ident, chat, ignored))
        response.background = BackgroundTask(choices.prefill_next_turn)
        return response

    def _choice(
        self, chat: bool, index: int, content, finish: Optional[str], delta: bool, logprobs: Optional[list] = None
    ) -> dict:
        """A choice: `content` is a chat message (or delta) dict, or a text completion's text."""
        if not chat:
            return {
                "index": index,
                "text": content,
                "finish_reason": finish,
                "logprobs": None if logprobs is None else self._completion_logprobs(logprobs),
            }
        return {
            "index": index,
            "delta" if delta else "message": content,
            "finish_reason": finish,
            "logprobs": None if logprobs is None else {"content": self.token_logprobs(logprobs)},
        }

    def _completion_logprobs(self, logprobs: list) -> dict:
        return {
            "tokens": [self._token_text(lp.token) for lp in logprobs],
            "token_logprobs": [lp.logprob for lp in logprobs],
            "top_logprobs": [{self._token_text(t): v for t, v in lp.top} for lp in logprobs],
        }

    async def _whole(self, choices: "_Choices", ident: str, chat: bool, ignored: list[str]) -> JSONResponse:
        out, finals, reasoning = [], [], ""
        try:
            async for index, events in choices:
                blocks, logprobs = Blocks(), [] if choices.options["logprobs"] is not None else None
                async for last, changes in events:
                    for event in changes:
                        blocks.add(event)
                    if logprobs is not None:
                        logprobs += last.logprobs
                blocks.stop()
                choices.answered(blocks, last)
                content = _message(blocks) if chat else blocks.joined("text")
                finish = "tool_calls" if chat and blocks.calls() else last.finish_reason
                out.append(self._choice(chat, index, content, finish, False, logprobs))
                finals.append(last)
                reasoning += blocks.joined("reasoning")
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
                "usage": self._usage(finals, ignored, reasoning),
            },
            headers=self._headers(ignored),
        )

    async def _sse(self, choices: "_Choices", ident: str, chat: bool, include_usage: bool, ignored: list[str]):
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

        finals, reasoning = [], ""
        try:
            async for index, events in choices:
                last, blocks = None, Blocks()
                async for last, changes in events:
                    steps = [step for event in changes for step in blocks.add(event)]
                    if last.finish_reason:
                        steps += blocks.stop()
                        choices.answered(blocks, last)
                    content = _delta(steps) if chat else "".join(text for _, _, text in steps)
                    finish = last.finish_reason and ("tool_calls" if chat and blocks.calls() else last.finish_reason)
                    said = content if not chat else content["content"] is not None or len(content) > 2
                    if finish or last.logprobs or said:
                        yield chunk([self._choice(chat, index, content, finish, True, last.logprobs)])
                finals.append(last)
                reasoning += blocks.joined("reasoning")
            if include_usage and finals:
                yield chunk([], usage=self._usage(finals, ignored, reasoning))
            yield "data: [DONE]\n\n"
        except Exception as e:
            failure = self.server.stream_failed(e)
            yield "data: " + json.dumps({"error": {"message": str(failure), "type": "server_error"}}) + "\n\n"
        finally:
            choices.close()


def _message(blocks: Blocks) -> dict:
    """A whole chat answer: its text, its reasoning (as vLLM and mlx-lm's server name it) and calls."""
    text, reasoning, calls = blocks.joined("text"), blocks.joined("reasoning"), blocks.calls()
    message = {"role": "assistant", "content": text or (None if calls else "")}
    if reasoning:
        message.update(reasoning_content=reasoning, reasoning=reasoning)
    if calls:
        message["tool_calls"] = calls
    return message


def _delta(steps: list) -> dict:
    """What one engine step added to a chat answer, as one delta: reasoning, text, and each call
    touched (its id and name where it started, then pieces of its arguments)."""
    delta, calls = {"role": "assistant", "content": None}, {}
    for step, block, text in steps:
        if block.kind == "call":
            index = block.call["index"]
            if step == "start":
                function = {"name": block.call["name"], "arguments": ""}
                calls[index] = {"index": index, "id": block.call["id"], "type": "function", "function": function}
            elif step == "delta":
                calls.setdefault(index, {"index": index, "function": {"arguments": ""}})["function"]["arguments"] += (
                    text
                )
        elif step == "delta":
            key = "content" if block.kind == "text" else "reasoning_content"
            delta[key] = (delta.get(key) or "") + text
    if "reasoning_content" in delta:
        delta["reasoning"] = delta["reasoning_content"]
    if calls:
        delta["tool_calls"] = list(calls.values())
    return delta


class _Choices:
    """The n choices of a request: all queued at once (a batching engine decodes them together),
    async-iterated as (index, events) in order, each event an engine response with the answer
    events its text completes."""

    def __init__(self, api: OpenAIAPI, prompt, max_tokens, options, n, job, first, conversation=None):
        self.api, self.prompt, self.max_tokens, self.options, self.n = api, prompt, max_tokens, options, n
        self.started = [(job, first)]
        self.conversation = conversation  # a chat's messages, tools and template options (None: a text completion)
        self.blocks, self.finished = None, False  # a one-choice chat's answer

    def answered(self, blocks: Blocks, last) -> None:
        """A choice's answer (one choice: the only one followed up)."""
        self.blocks, self.finished = blocks, bool(last.finish_reason)

    @property
    def chat(self) -> Optional[tuple[list[dict], list, dict]]:
        """The messages, tools and template options of a one-choice chat (the only one whose next
        turn is prefilled)."""
        return self.conversation if self.conversation is not None and self.n == 1 else None

    def prefill_next_turn(self) -> None:
        """Once a one-choice chat's answer is out: its next turn prefilled (Server.prefill_next_turn)."""
        if self.chat is not None and self.finished:
            messages, tools, template = self.chat
            blocks = self.blocks
            answer = answer_message(blocks.joined("text"), blocks.calls(), blocks.joined("reasoning"))
            self.api.server.follow_up(messages + [answer], tools, template)

    def _parsed(self, events):
        """A choice's engine responses with their answer events (a text completion's: its text)."""
        if self.conversation is None:
            return _as_text(events)
        _, tools, _ = self.conversation
        grammar = self.options["grammar"] is not None
        parser = AnswerParser.for_prompt(self.api.server.tokenizer, tools, self.prompt, constrained=grammar)
        return answer_events(events, parser)

    async def __aiter__(self):
        seed = self.options["seed"]
        for index in range(1, self.n):
            options = {**self.options, "seed": None if seed is None else seed + index}
            self.started.append(await self.api.server.start(self.prompt, self.max_tokens, options))
        for index, (job, first) in enumerate(self.started):
            yield index, self._parsed(self.api.server.events(job, first, self.chat))

    def close(self):
        for job, _ in self.started:
            job.cancelled.set()


async def _as_text(events):
    async for response in events:
        yield response, [Text(response.text)] if response.text else []
