"""The Anthropic Messages API: POST /v1/messages (streamed or not) and
/v1/messages/count_tokens, in the shapes the `anthropic` client parses.

Sampling: the `anthropic` SDK sends no sampling fields unless the caller sets
them, so the default is this server's default everywhere: greedy (temperature 0),
the most reproducible and the fastest with DFlash.  temperature / top_p / top_k
are honoured when sent; `seed` and `block_size` can be sent through `extra_body`.
`thinking` switches a thinking model's thinking where its template does ("enabled",
"adaptive": on; "disabled": off; absent: the model's default); its reasoning comes as
thinking blocks (thinking_delta, then a signature_delta, an opaque constant, before the
block's stop), then text and tool_use blocks, a tool_use block's input streamed
(input_json_delta) once its name is known.  A model without a thinking mode answers
without thinking blocks, as the reference allows.  Thinking blocks sent back go to the
template as the turn's reasoning (which renders it where the model reads it, as after a
tool call in Qwen3's); redacted ones are dropped.  A last assistant turn is
continued (prefill).  Claude Code is served as it calls: its billing-header system
block is dropped, its cache_control marks are taken (every prefix is cached anyway),
its system-role messages are rendered in place.  Everything else a request carries is
used, reported as ignored, or refused by name with an Anthropic-style error.
"""

import json
import time
import uuid
from typing import Optional

from ..decode.grammar import Grammar
from .answer import AnswerParser, Block, Blocks, answer_events
from .edge import Call, Served, engine_request, first_events, format_grammar, ignored_header, stream_flag
from .forced_tools import anthropic_tool_choice, choose_tools
from .protocol import (
    RequestError,
    answer_message,
    check_tools,
    constrained,
    decoding_stats,
    prompt_tokens,
    template_options,
    text_of,
    unknown_fields,
)
from .validation import (
    ANTHROPIC_RANGES,
    anthropic_out_of_range,
    check_anthropic_prefill,
    check_anthropic_thinking,
    check_anthropic_tool_results,
)

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
    "cache_control",  # the whole request's cache mark: every prefix is cached here anyway
    "output_config",  # its format is honoured, its other fields reported ignored (_output_config)
    "seed",
    "block_size",
}
REFUSED = {
    "mcp_servers": "this server connects to no MCP servers; connect them in the client (Claude Code: /mcp)",
    "container": "this server runs no code-execution containers",
}
DROPPED_BLOCKS = ("redacted_thinking",)  # encrypted: nothing the served model can read
BILLING_HEADER = "x-anthropic-billing-header:"
SIGNATURE = "dflash-mlx"  # a thinking block's signature: the reference's is opaque, and nothing checks this one


def _blocks(content, where: str) -> list[dict]:
    if isinstance(content, str):
        return [{"type": "text", "text": content}]
    if not isinstance(content, list):
        raise RequestError(f"{where} must be a string or a list of content blocks")
    for i, block in enumerate(content):
        if not isinstance(block, dict) or not isinstance(block.get("type"), str):
            raise RequestError(f"{where}[{i}] must be an object with a type")
    return content


def _without_billing_header(blocks: list[dict]) -> list[dict]:
    """System blocks without Claude Code's billing header (its first block reads
    `x-anthropic-billing-header: cc_version=...; cc_entrypoint=cli; cch=<hash>;`): the hash
    changes with every request, so a prefix cache would match nothing after it.  It tells the
    model nothing (llama.cpp's server drops it too); text after its line stays."""
    kept = []
    for block in blocks:
        text = block.get("text")
        if isinstance(text, str) and text.startswith(BILLING_HEADER):
            block = {**block, "text": text.partition("\n")[2]}
            if not block["text"]:
                continue
        kept.append(block)
    return kept


def conversation(body: dict) -> tuple[list[dict], list[dict]]:
    """The request as OpenAI chat messages and function tools (protocol.py's shape)."""
    messages = []
    system = _without_billing_header(_blocks(body["system"], "system")) if body.get("system") is not None else []
    if system:
        messages.append({"role": "system", "content": text_of(system, "system")})
    turns = body.get("messages")
    if not isinstance(turns, list) or not turns:
        raise RequestError("messages must be a non-empty list")
    for i, turn in enumerate(turns):
        role = turn.get("role") if isinstance(turn, dict) else None
        if role not in ("user", "assistant", "system"):
            raise RequestError(f"messages[{i}].role must be user, assistant or system, got {role!r}")
        if role == "system":  # an instruction mid-conversation (Claude Code sends hooks' context so)
            where = f"messages[{i}].content"
            messages.append({"role": "system", "content": text_of(_blocks(turn.get("content"), where), where)})
            continue
        text, calls, results, reasoning = [], [], [], []
        for j, block in enumerate(_blocks(turn.get("content"), f"messages[{i}].content")):
            kind, where = block["type"], f"messages[{i}].content[{j}]"
            if kind == "text":
                text.append(block)
            elif kind == "thinking" and role == "assistant":
                reasoning.append(block.get("thinking") if isinstance(block.get("thinking"), str) else "")
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
            elif kind in ("tool_use", "tool_result", "thinking", *DROPPED_BLOCKS):
                raise RequestError(f"{where}: a {kind} block does not belong in a {role} turn")
            else:
                text_of([block], where)  # refuses images, documents and other non-text blocks by name
        messages += results
        if text or calls or not results:
            message = {"role": role, "content": text_of(text, f"messages[{i}].content")}
            if calls:
                message["tool_calls"] = calls
            if "".join(reasoning):
                message["reasoning_content"] = "\n\n".join(r for r in reasoning if r)
            messages.append(message)
    if messages[-1] == {"role": "assistant", "content": ""}:
        messages.pop()  # an empty last assistant turn (the reference allows one) prefills nothing
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
    mode, _ = anthropic_tool_choice(body.get("tool_choice"))  # a forced call: AnthropicAPI.messages
    return messages, [] if mode == "none" else check_tools(tools)


def _prefill(messages: list[dict]) -> Optional[str]:
    """The partial answer a request ends with, which the reply continues (the reference's
    prefill): the text of a last assistant turn without tool calls; None for a new turn."""
    last = messages[-1]
    if last["role"] != "assistant" or last.get("tool_calls"):
        return None
    check_anthropic_prefill(last["content"])
    return last["content"]


class AnthropicAPI:
    """POST /v1/messages and /v1/messages/count_tokens: a body read into the Call the server
    runs (edge.py), or its prompt's length."""

    def __init__(self, served: Served):
        self.served = served

    def _prompt(self, body: dict, grammar: bool):
        """The request's prompt tokens, its messages, tools and template options, and the partial
        answer it ends with (None: a new turn).  `grammar`: a grammar writes the answer (no room
        for thinking before it: protocol.constrained)."""
        for name, reason in REFUSED.items():
            if body.get(name) is not None:
                raise RequestError(f"{name}: {reason}; remove it")
        thinking = body.get("thinking")
        check_anthropic_thinking(thinking)
        messages, tools = conversation(body)
        check_anthropic_tool_results(body["messages"])
        prefill = _prefill(messages)
        template = template_options(None if thinking is None else thinking["type"] != "disabled")
        if grammar:
            template = constrained(template)
        tokens = prompt_tokens(self.served.tokenizer, messages, tools, continued=prefill is not None, template=template)
        return tokens, (messages, tools, template), prefill

    def count_tokens(self, body: dict) -> int:
        prompt, *_ = self._prompt(body, _asks_grammar(body))
        return len(prompt)

    def messages(self, body: dict) -> Call:
        prompt, chat, prefill = self._prompt(body, _asks_grammar(body))
        grammar, ignored_output = self._output_config(body.get("output_config"))
        _, forced = choose_tools(self.served, chat[1], *anthropic_tool_choice(body.get("tool_choice")))
        grammar = forced or grammar
        request = engine_request(
            self.served,
            body,
            prompt,
            length=("max_tokens",),
            default_length=None,
            ranges=ANTHROPIC_RANGES,
            out_of_range=anthropic_out_of_range,
            stop="stop_sequences",
            grammar=grammar,
        )
        stream = stream_flag(body)
        ignored = unknown_fields(body, FIELDS) + ignored_output
        message = _Message(self.served, chat, ignored, prefill, prompt, grammar is not None)
        # a continued answer's text so far is not what the client sends back: only whole ones are followed
        return Call([request], message, stream, ignored_header(ignored), chat if prefill is None else None)

    def _output_config(self, config) -> tuple[Optional[Grammar], list[str]]:
        """output_config: its `format` (a JSON schema) as the grammar the answer follows, and
        its other fields (`effort`), reported ignored: the served model has one effort."""
        if config is None:
            return None, []
        if not isinstance(config, dict):
            raise RequestError("output_config: Input should be an object")
        ignored = [f"output_config.{name}" for name in config if name != "format"]
        grammar = format_grammar(self.served, config.get("format"), "output_config.format", lambda f: f.get("schema"))
        return grammar, ignored


def _asks_grammar(body: dict) -> bool:
    """Whether the request's answer is written by a grammar (a JSON format, a forced call), as
    its fields say (the prompt is rendered, and checked, before the grammar is compiled)."""
    config, choice = body.get("output_config"), body.get("tool_choice")
    return (isinstance(config, dict) and config.get("format") is not None) or (
        isinstance(choice, dict) and choice.get("type") in ("any", "tool")
    )


def input_usage(response) -> dict:
    """A request's input tokens as the reference's usage splits them, their total the sum of the
    three: those restored from the prefix cache (cache_read_input_tokens), and those prefilled
    (input_tokens).  None are reported written (cache_creation_input_tokens): the server keeps
    what it prefills when the cache has room, with no breakpoints, lifetimes or price to report."""
    return {
        "input_tokens": response.prompt_tokens - response.cached_tokens,
        "cache_creation_input_tokens": 0,
        "cache_read_input_tokens": response.cached_tokens,
    }


class _Message:
    """One assistant message built from the engine's events: the final object, or the event
    stream (message_start, content_block_start / delta / stop, ping, message_delta, message_stop).
    Its content blocks are the answer's blocks (answer.Blocks): thinking, text, tool_use."""

    def __init__(self, served: Served, chat: tuple, ignored: list[str], prefill: Optional[str], prompt, grammar: bool):
        self.served, self.ignored = served, ignored
        self.messages, self.tools, self.template = chat
        self.prefill = prefill  # the partial answer continued (the last of `messages`), if any
        self.parser = AnswerParser.for_prompt(served.tokenizer, self.tools, prompt, constrained=grammar)
        self.id = "msg_" + uuid.uuid4().hex
        self.blocks, self.last = Blocks(), None

    def _usage(self) -> dict:
        """The usage of the answer so far (its engine response `last`), with how it was decoded."""
        usage = {**input_usage(self.last), "output_tokens": self.last.generation_tokens}
        usage["dflash"] = decoding_stats(self.last)
        if self.ignored:
            usage["dflash"]["ignored_fields"] = self.ignored
        return usage

    def _stop(self) -> tuple[str, object]:
        last = self.last
        if self.blocks.calls():
            return "tool_use", None
        if last.finish_reason == "length":
            return "max_tokens", None
        if last.finish_reason == "context":  # the reference's words, which Claude Code reads as the window's end
            return "model_context_window_exceeded", None
        if last.stop_sequence is not None:
            return "stop_sequence", last.stop_sequence
        return "end_turn", None

    @staticmethod
    def _content(block: Block, started: bool = False) -> dict:
        """A block as the reference's content block: whole, or as content_block_start opens it."""
        if block.kind == "reasoning":
            return {"type": "thinking", "thinking": "", "signature": ""} if started else _thinking(block.text)
        if block.kind == "text":
            return {"type": "text", "text": "" if started else block.text}
        call = block.call
        tool = {"type": "tool_use", "id": "toolu_" + call["id"].removeprefix("call_"), "name": call["name"]}
        return {**tool, "input": {} if started else _input(call["arguments"])}

    def snapshot(self) -> dict:
        stop_reason, stop_sequence = self._stop()
        content = [self._content(block) for block in self.blocks.blocks] or [{"type": "text", "text": ""}]
        return {
            "id": self.id,
            "type": "message",
            "role": "assistant",
            "model": self.served.model_id,
            "content": content,
            "stop_reason": stop_reason,
            "stop_sequence": stop_sequence,
            "usage": self._usage(),
        }

    async def _run(self, generations):
        """Consume the engine's events; yields the block steps (answer.Blocks.add) at each."""
        async for self.last, events in answer_events(first_events(generations), self.parser):
            steps = [step for event in events for step in self.blocks.add(event)]
            yield steps + (self.blocks.stop() if self.last.finish_reason else [])

    async def whole(self, generations) -> dict:
        async for _ in self._run(generations):
            pass
        return self.snapshot()

    def next_turn(self) -> Optional[tuple[list[dict], list, dict]]:
        """Once the answer is out: the conversation with it.  A continued answer goes back as one
        assistant turn, the partial answer and its continuation."""
        if self.last is None or not self.last.finish_reason:
            return None
        text, calls, reasoning = self.blocks.joined("text"), self.blocks.calls(), self.blocks.joined("reasoning")
        if self.prefill is None:
            answered = self.messages + [answer_message(text, calls, reasoning)]
        else:
            answered = self.messages[:-1] + [answer_message(self.prefill + text, calls, reasoning)]
        return answered, self.tools, self.template

    @staticmethod
    def _event(kind: str, **fields) -> str:
        return f"event: {kind}\ndata: " + json.dumps({"type": kind, **fields}) + "\n\n"

    def _block_events(self, step: str, block: Block, text: str, index: int):
        if step == "start":
            yield self._event("content_block_start", index=index, content_block=self._content(block, started=True))
        elif step == "delta":
            kind, field = {"reasoning": ("thinking_delta", "thinking"), "text": ("text_delta", "text")}.get(
                block.kind, ("input_json_delta", "partial_json")
            )
            yield self._event("content_block_delta", index=index, delta={"type": kind, field: text})
        else:
            if block.kind == "reasoning":  # the reference signs a thinking block before it stops
                yield self._event(
                    "content_block_delta", index=index, delta={"type": "signature_delta", "signature": SIGNATURE}
                )
            yield self._event("content_block_stop", index=index)

    async def stream(self, generations):
        start = {
            "id": self.id,
            "type": "message",
            "role": "assistant",
            "model": self.served.model_id,
            "content": [],
            "stop_reason": None,
            "stop_sequence": None,
            "usage": {**input_usage(generations.first), "output_tokens": 0},
        }
        yield self._event("message_start", message=start)
        yield self._event("ping")
        indexes, last_ping = {}, time.monotonic()  # a block's index: its place among the blocks
        async for steps in self._run(generations):
            for step, block, text in steps:
                index = indexes.setdefault(id(block), len(indexes))
                for event in self._block_events(step, block, text, index):
                    yield event
            if not steps and time.monotonic() - last_ping > 10:  # long silences keep proxies from closing the stream
                last_ping = time.monotonic()
                yield self._event("ping")
        if not indexes:  # an empty answer is still a text block
            yield self._event("content_block_start", index=0, content_block={"type": "text", "text": ""})
            yield self._event("content_block_stop", index=0)
        stop_reason, stop_sequence = self._stop()
        yield self._event(
            "message_delta", delta={"stop_reason": stop_reason, "stop_sequence": stop_sequence}, usage=self._usage()
        )
        yield self._event("message_stop")

    def stream_error(self, failure: RequestError) -> str:
        return self._event("error", error={"type": "api_error", "message": str(failure)})


def _thinking(text: str) -> dict:
    return {"type": "thinking", "thinking": text, "signature": SIGNATURE}


def _input(arguments: str) -> dict:
    """A call's arguments as a tool_use block's input (an object, whatever the model wrote)."""
    try:
        value = json.loads(arguments)
    except (TypeError, json.JSONDecodeError):
        return {}
    return value if isinstance(value, dict) else {}
