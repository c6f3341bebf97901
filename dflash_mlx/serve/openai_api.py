"""The OpenAI API: chat completions and text completions, streamed or not (what they share with
the other APIs is in edge.py).

Errors are OpenAI's ({"error": {"message", "type", "param", "code"}}).  Structured
output (response_format / text.format json_object or json_schema) masks the target's
choices with a grammar (grammar.py), and so does a tool_choice that forces a call
(forced_tools.py).  Fields that would change the output and are not implemented
(penalties, logit_bias, echo, suffix) are refused by name; fields
this API does not know are listed in `usage.dflash.ignored_fields` and the
`x-dflash-ignored-fields` header.  `n` choices are queued together
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

from .answer import AnswerParser, Blocks, Text, answer_events
from .edge import (
    OPENAI_NO_EFFECT,
    SAMPLING_FIELDS,
    Call,
    Served,
    engine_request,
    format_grammar,
    ignored_header,
    reasoning_tokens,
    stream_flag,
    token_logprobs,
)
from .forced_tools import choose_tools, openai_tool_choice
from .protocol import (
    RequestError,
    answer_message,
    arguments_json,
    check_tools,
    constrained,
    decoding_stats,
    number,
    prompt_tokens,
    refuse_nonzero,
    template_options,
    text_of,
    unknown_fields,
)
from .validation import OPENAI_RANGES, check_openai_tool_messages, openai_out_of_range

REFUSED = ("frequency_penalty", "presence_penalty", "logit_bias")
CHAT_FIELDS = (
    SAMPLING_FIELDS
    | OPENAI_NO_EFFECT
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
    | OPENAI_NO_EFFECT
    | {"prompt", "max_tokens", "stop", "n", "logprobs", "echo", "suffix", "best_of", *REFUSED}
)
MAX_CHOICES = 8


class OpenAIAPI:
    """Chat completions (POST /v1/chat/completions) and text completions (POST /v1/completions):
    a body read into the Call the server runs (edge.py)."""

    def __init__(self, served: Served):
        self.served = served

    def chat(self, body: dict) -> Call:
        prompt, conversation, logprobs, grammar = self._chat_request(body)
        return self._call(body, prompt, conversation, logprobs, grammar)

    def completions(self, body: dict) -> Call:
        prompt, logprobs = self._completion_request(body)
        return self._call(body, prompt, None, logprobs, None)

    # ------------------------------------------------------------ request parsing

    def _chat_request(self, body: dict):
        refuse_nonzero(body, *REFUSED)
        grammar = format_grammar(
            self.served,
            body.get("response_format"),
            "response_format",
            lambda value: (value.get("json_schema") or {}).get("schema"),
        )
        if body.get("modalities") not in (None, ["text"]):
            raise RequestError("modalities: the served model writes text only", param="modalities")
        normalised = chat_messages(body.get("messages"))
        check_openai_tool_messages(normalised)
        tools, forced = choose_tools(
            self.served, check_tools(body.get("tools")), *openai_tool_choice(body.get("tool_choice"))
        )
        grammar = forced or grammar  # a forced call's grammar admits no text for a format to shape
        logprobs = None
        if body.get("logprobs"):
            logprobs = ("top_logprobs", 0 if body.get("top_logprobs") is None else body["top_logprobs"])
        elif body.get("top_logprobs") is not None:
            raise RequestError("top_logprobs needs logprobs: true", param="top_logprobs")
        template = template_options(effort=body.get("reasoning_effort"), kwargs=body.get("chat_template_kwargs"))
        if grammar is not None:
            template = constrained(template)
        prompt = prompt_tokens(self.served.tokenizer, normalised, tools, template=template)
        return prompt, (normalised, tools, template), logprobs, grammar

    def _completion_request(self, body: dict):
        refuse_nonzero(body, *REFUSED, "echo", "suffix")
        n = number(body, "n", 1, numbers.Integral, 1, MAX_CHOICES)
        if number(body, "best_of", n, numbers.Integral, 1) != n:
            raise RequestError("best_of must equal n here (no server-side ranking)", param="best_of")
        prompt = body.get("prompt")
        if isinstance(prompt, str) and prompt.strip():
            tokens = self.served.tokenizer.encode(prompt)
        elif (
            isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt)
        ):
            tokens = prompt
        else:
            raise RequestError("prompt must be a non-empty string or a list of token ids", param="prompt")
        logprobs = None if body.get("logprobs") is None else ("logprobs", body["logprobs"])
        return tokens, logprobs

    def _call(self, body: dict, prompt: list[int], conversation, logprobs, grammar) -> Call:
        """The Call of a chat (`conversation`: its messages, tools and template options) or a text
        completion (None): its n choices' requests (choice i of a seeded request uses seed + i)."""
        chat = conversation is not None
        n = number(body, "n", 1, numbers.Integral, 1, MAX_CHOICES)
        requests = []
        for index in range(n):
            seed = body.get("seed")
            choice = body if index == 0 or not isinstance(seed, int) else {**body, "seed": seed + index}
            requests.append(
                engine_request(
                    self.served,
                    choice,
                    prompt,
                    length=("max_completion_tokens", "max_tokens"),
                    default_length=512 if chat else 16,
                    ranges=OPENAI_RANGES,
                    out_of_range=openai_out_of_range,
                    logprobs=logprobs,
                    grammar=grammar,
                )
            )
        stream = stream_flag(body)
        stream_options = body.get("stream_options") or {}
        if not isinstance(stream_options, dict):
            raise RequestError("stream_options must be an object", param="stream_options")
        ignored = unknown_fields(body, CHAT_FIELDS if chat else COMPLETION_FIELDS)
        ident = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
        answer = _Choices(self.served, ident, prompt, requests[0], n, conversation, ignored)
        answer.include_usage = bool(stream_options.get("include_usage"))
        following = conversation if chat and n == 1 else None  # only a one-choice chat is followed up
        return Call(requests, answer, stream, ignored_header(ignored), following)


def chat_messages(messages) -> list[dict]:
    """Chat messages as protocol.py's shape: text content, reasoning sent back, tool calls with
    their arguments as JSON text."""
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
    return normalised


def reference_finish(finish: str) -> str:
    """The engine's finish as the reference's finish_reason: its "length" covers the context's
    end as well as max_tokens (usage.dflash.context_end tells them apart)."""
    return "length" if finish == "context" else finish


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
    """The answer to a chat or text completion: its n choices (the Call's requests, decoded
    together), written whole or as a stream of chunks, each engine response with the answer
    events its text completes."""

    def __init__(self, served: Served, ident: str, prompt, request, n: int, conversation, ignored: list[str]):
        self.served, self.ident, self.prompt, self.n, self.ignored = served, ident, prompt, n, ignored
        self.logprobs, self.grammar = request.logprobs is not None, request.grammar is not None
        self.conversation = conversation  # a chat's messages, tools and template options (None: a text completion)
        self.chat = conversation is not None
        self.include_usage = False
        self.blocks, self.finished = None, False  # a one-choice chat's answer

    def _answered(self, blocks: Blocks, last) -> None:
        """A choice's answer (one choice: the only one followed up)."""
        self.blocks, self.finished = blocks, bool(last.finish_reason)

    def next_turn(self) -> Optional[tuple[list[dict], list, dict]]:
        if not (self.chat and self.n == 1 and self.finished):
            return None
        messages, tools, template = self.conversation
        blocks = self.blocks
        answer = answer_message(blocks.joined("text"), blocks.calls(), blocks.joined("reasoning"))
        return messages + [answer], tools, template

    def _parsed(self, events):
        """A choice's engine responses with their answer events (a text completion's: its text)."""
        if not self.chat:
            return _as_text(events)
        _, tools, _ = self.conversation
        parser = AnswerParser.for_prompt(self.served.tokenizer, tools, self.prompt, constrained=self.grammar)
        return answer_events(events, parser)

    def _usage(self, responses: list, reasoning: str = "") -> dict:
        last = responses[-1]
        completion = sum(r.generation_tokens for r in responses)
        dflash = decoding_stats(last)
        if self.ignored:
            dflash["ignored_fields"] = self.ignored
        usage = {
            "prompt_tokens": last.prompt_tokens,
            "completion_tokens": completion,
            "total_tokens": last.prompt_tokens + completion,
            "prompt_tokens_details": {"cached_tokens": last.cached_tokens},
            "dflash": dflash,
        }
        if reasoning:
            usage["completion_tokens_details"] = {
                "reasoning_tokens": reasoning_tokens(self.served.tokenizer, reasoning)
            }
        return usage

    def _choice(self, index: int, content, finish: Optional[str], delta: bool, logprobs: Optional[list] = None) -> dict:
        """A choice: `content` is a chat message (or delta) dict, or a text completion's text."""
        if not self.chat:
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
            "logprobs": None if logprobs is None else {"content": token_logprobs(self.served.tokenizer, logprobs)},
        }

    def _completion_logprobs(self, logprobs: list) -> dict:
        text = self.served.tokenizer.decode
        return {
            "tokens": [text([lp.token]) for lp in logprobs],
            "token_logprobs": [lp.logprob for lp in logprobs],
            "top_logprobs": [{text([t]): v for t, v in lp.top} for lp in logprobs],
        }

    async def whole(self, generations) -> dict:
        out, finals, reasoning = [], [], ""
        async for index, events in generations:
            blocks, logprobs = Blocks(), [] if self.logprobs else None
            async for last, changes in self._parsed(events):
                for event in changes:
                    blocks.add(event)
                if logprobs is not None:
                    logprobs += last.logprobs
            blocks.stop()
            self._answered(blocks, last)
            content = _message(blocks) if self.chat else blocks.joined("text")
            finish = "tool_calls" if self.chat and blocks.calls() else reference_finish(last.finish_reason)
            out.append(self._choice(index, content, finish, False, logprobs))
            finals.append(last)
            reasoning += blocks.joined("reasoning")
        return {
            "id": self.ident,
            "object": "chat.completion" if self.chat else "text_completion",
            "created": int(time.time()),
            "model": self.served.model_id,
            "choices": out,
            "usage": self._usage(finals, reasoning),
        }

    def _chunk(self, created: int, choices: list, **extra) -> str:
        kind = "chat.completion.chunk" if self.chat else "text_completion"
        chunk = {"id": self.ident, "object": kind, "created": created, "model": self.served.model_id}
        return "data: " + json.dumps({**chunk, "choices": choices, **extra}) + "\n\n"

    async def stream(self, generations):
        created, chat = int(time.time()), self.chat
        finals, reasoning = [], ""
        async for index, events in generations:
            last, blocks = None, Blocks()
            async for last, changes in self._parsed(events):
                steps = [step for event in changes for step in blocks.add(event)]
                if last.finish_reason:
                    steps += blocks.stop()
                    self._answered(blocks, last)
                content = _delta(steps) if chat else "".join(text for _, _, text in steps)
                finish = last.finish_reason and (
                    "tool_calls" if chat and blocks.calls() else reference_finish(last.finish_reason)
                )
                said = content if not chat else content["content"] is not None or len(content) > 2
                if finish or last.logprobs or said:
                    yield self._chunk(created, [self._choice(index, content, finish, True, last.logprobs)])
            finals.append(last)
            reasoning += blocks.joined("reasoning")
        if self.include_usage and finals:
            yield self._chunk(created, [], usage=self._usage(finals, reasoning))
        yield "data: [DONE]\n\n"

    def stream_error(self, failure: RequestError) -> str:
        return "data: " + json.dumps({"error": {"message": str(failure), "type": "server_error"}}) + "\n\n"


async def _as_text(events):
    async for response in events:
        yield response, [Text(response.text)] if response.text else []
