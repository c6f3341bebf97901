"""The OpenAI Responses API: POST /v1/responses, streamed (the typed events the `openai`
client parses) or not.  Stateless: a request carries its whole conversation as input items
(previous_response_id is refused), as Codex sends it every turn.  What it shares with the other
APIs (the body's common fields, errors, ignored fields, text.format, logprobs) is in edge.py.

Custom tools (free-form input, such as Codex's apply_patch) are offered to the model as
functions of one string argument, `input`, and their calls come back as custom_tool_call
items.  The tools of a `namespace` tool are offered under their own names, and a call of one
names its namespace (Codex sends its sub-agent tools so); tools the reference's servers run
(web_search and the like, HOSTED_TOOLS) are left out of the prompt, with a log line.  An answer
cut by the context's end is `incomplete` with reason max_output_tokens, the reference's only
reason for a length (usage.dflash.context_end says which).  A thinking model's reasoning comes as reasoning items whose content is its raw text
(`reasoning_text` parts, streamed as response.reasoning_text.delta, as the reference streams raw
reasoning; the model writes no summaries), before the message item; function calls as
function_call items whose arguments stream as response.function_call_arguments.delta once the
name is known.  `reasoning.effort` switches thinking where the template does ("none": off).
Reasoning items sent back go to the template as the next assistant turn's reasoning (their
reasoning_text; summaries and encrypted content, another model's, are left out);
include ["reasoning.encrypted_content"] is accepted (nothing here is encrypted).
"""

import json
import logging
import time
import uuid
from dataclasses import dataclass
from typing import Optional

from .answer import AnswerParser, Block, Blocks, answer_events
from .edge import (
    OPENAI_NO_EFFECT,
    SAMPLING_FIELDS,
    Call,
    Served,
    engine_request,
    first_events,
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
    prompt_tokens,
    template_options,
    text_of,
    unknown_fields,
)
from .validation import OPENAI_RANGES, check_function_call_outputs, openai_out_of_range

log = logging.getLogger("dflash_mlx.serve")

RESPONSES_FIELDS = (
    SAMPLING_FIELDS
    | OPENAI_NO_EFFECT
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
UNBOUNDED = 1 << 30  # no max_output_tokens: cut to what the context leaves (decode/request.build_request)


class ResponsesAPI:
    """POST /v1/responses: a request's input items as a conversation, read into the Call the
    server runs (edge.py), answered as one response."""

    def __init__(self, served: Served):
        self.served = served

    def _request(self, body: dict):
        _refuse_what_needs_state(body)
        reasoning = body.get("reasoning")  # its effort switches thinking; summaries: none are written
        if reasoning is not None and not isinstance(reasoning, dict):
            raise RequestError("reasoning must be an object", param="reasoning")
        template = template_options(effort=(reasoning or {}).get("effort"), where="reasoning.effort")
        logprobs = _included_logprobs(body)
        items = body.get("input")
        if isinstance(items, str) and items.strip():
            items = [{"role": "user", "content": items}]
        if not isinstance(items, list) or not items:
            raise RequestError("input must be a non-empty string or a list of items", param="input")
        messages = _instructions(body) + input_messages(items)
        check_function_call_outputs(items)
        offered = function_tools(body.get("tools"))
        tools = offered.functions
        text_format = (body.get("text") or {}).get("format")
        grammar = format_grammar(self.served, text_format, "text.format", lambda value: value.get("schema"))
        tools, forced = choose_tools(self.served, tools, *openai_tool_choice(body.get("tool_choice")))
        grammar = forced or grammar  # a forced call's grammar admits no text for a format to shape
        if grammar is not None:
            template = constrained(template)
        prompt = prompt_tokens(self.served.tokenizer, messages, tools, template=template)
        return prompt, (messages, tools, template), offered, logprobs, grammar

    def create(self, body: dict) -> Call:
        prompt, chat, offered, logprobs, grammar = self._request(body)
        # without max_output_tokens, an answer may run to the end of the context, as the reference's
        # do (Codex sends none, and reads a response.incomplete as a failed turn)
        request = engine_request(
            self.served,
            body,
            prompt,
            length=("max_output_tokens",),
            default_length=UNBOUNDED,
            ranges=OPENAI_RANGES,
            out_of_range=openai_out_of_range,
            logprobs=logprobs,
            grammar=grammar,
        )
        stream = stream_flag(body)
        ignored = unknown_fields(body, RESPONSES_FIELDS)
        parser = AnswerParser.for_prompt(self.served.tokenizer, chat[1], prompt, constrained=grammar is not None)
        response = _Response(self.served, body, chat, offered, ignored, parser)
        return Call([request], response, stream, ignored_header(ignored), chat)


def _refuse_what_needs_state(body: dict) -> None:
    if body.get("previous_response_id") is not None:
        raise RequestError(
            "previous_response_id: this server keeps no responses; send the whole conversation in input",
            param="previous_response_id",
            code="unsupported_parameter",
        )
    if body.get("background"):
        raise RequestError("background responses are not supported here", param="background")


def _included_logprobs(body: dict) -> Optional[tuple[str, object]]:
    """("top_logprobs", its value) where include asks for the output's logprobs (None: not asked)."""
    include = body.get("include") or []
    if not isinstance(include, list) or any(item not in INCLUDABLE for item in include):
        raise RequestError(f"include: this server can include {', '.join(INCLUDABLE)}", param="include")
    if "message.output_text.logprobs" not in include:
        return None
    return "top_logprobs", 0 if body.get("top_logprobs") is None else body["top_logprobs"]


def _instructions(body: dict) -> list[dict]:
    instructions = body.get("instructions")
    if instructions is None:
        return []
    if not isinstance(instructions, str):
        raise RequestError("instructions must be a string", param="instructions")
    return [{"role": "system", "content": instructions}]


# tool types the reference's own servers run (its web search, file search, code interpreter ...):
# a request may offer them, and they are left out of the prompt here, where nothing runs them
HOSTED_TOOLS = {
    "web_search",
    "web_search_preview",
    "file_search",
    "code_interpreter",
    "computer_use_preview",
    "image_generation",
    "mcp",
    "local_shell",
}


@dataclass(frozen=True)
class OfferedTools:
    """A request's tools as chat's function tools; the names of the custom ones (their calls are
    custom_tool_call items) and the namespace each namespaced function came in (its calls say it)."""

    functions: list[dict]
    custom: set[str]
    namespaces: dict[str, str]


def function_tools(raw_tools) -> OfferedTools:
    """Responses tools as chat's function tools: function and custom tools, those inside a
    `namespace` tool under their own names (Codex sends its sub-agent tools so); hosted tools
    are left out, with a log line."""
    if raw_tools is None:
        return OfferedTools([], set(), {})
    if not isinstance(raw_tools, list):
        raise RequestError("tools must be a list", param="tools")
    offered, namespaces, hosted = [], {}, []
    for i, tool in enumerate(raw_tools):
        kind = tool.get("type") if isinstance(tool, dict) else None
        if kind in HOSTED_TOOLS:
            hosted.append(f"tools[{i}] ({kind})")
        elif kind == "namespace" and isinstance(tool.get("tools"), list):
            inner = tool["tools"]
            namespaces.update({t.get("name"): tool.get("name") for t in inner if isinstance(t, dict)})
            offered += inner
        else:
            offered.append(tool)
    if hosted:
        log.info("left out of the prompt, run by the reference's servers and not here: %s", ", ".join(hosted))
    custom = {t.get("name") for t in offered if isinstance(t, dict) and t.get("type") == "custom"}
    functions = check_tools([_as_function(t) if isinstance(t, dict) else t for t in offered])
    return OfferedTools(functions, custom, namespaces)


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
    when that has no text).  A reasoning item's raw text (its reasoning_text parts, as this server
    writes them) becomes the reasoning of the assistant turn after it; its summary and encrypted
    content (another model's) are left out."""
    messages, reasoning = [], []
    for i, item in enumerate(items):
        kind = item.get("type", "message") if isinstance(item, dict) else None
        if kind == "message":
            message = {"role": item.get("role"), "content": text_of(item.get("content"), f"input[{i}].content")}
            if message["role"] == "assistant" and reasoning:
                message["reasoning_content"], reasoning = "\n\n".join(reasoning), []
            messages.append(message)
        elif kind == "reasoning":
            parts = item.get("content") if isinstance(item.get("content"), list) else []
            reasoning += [
                p["text"] for p in parts if isinstance(p, dict) and isinstance(p.get("text"), str) and p["text"]
            ]
        elif kind in ("function_call", "custom_tool_call"):
            _add_call(messages, _call_of(item), "\n\n".join(reasoning))
            reasoning = []
        elif kind in ("function_call_output", "custom_tool_call_output"):
            output = item.get("output")
            content = output if isinstance(output, str) else text_of(output, f"input[{i}]")
            messages.append({"role": "tool", "tool_call_id": item.get("call_id"), "content": content})
        else:
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


def _add_call(messages: list[dict], call: dict, reasoning: str) -> None:
    """A call joins the assistant message before it when that has no text (nor reasoning of its
    own to go first), else it is a turn of its own, with the reasoning that came before it."""
    last = messages[-1] if messages else None
    if last is not None and last["role"] == "assistant" and not last["content"] and not reasoning:
        last.setdefault("tool_calls", []).append(call)
    else:
        messages.append(answer_message("", [call], reasoning))


class _Response:
    """One Responses API response, built from the engine's events: the final object, or the
    stream of typed events the openai client parses.  Its output items are the answer's blocks
    (answer.Blocks): reasoning, message, function_call (or custom_tool_call) items, in order."""

    def __init__(self, served: Served, body: dict, chat: tuple, offered: OfferedTools, ignored: list[str], parser):
        """`chat`: the conversation's messages, the function tools offered and the template options;
        `offered`: which of those tools are custom tools, and which came in a namespace."""
        self.served, self.body, self.ignored, self.parser = served, body, ignored, parser
        self.messages, self.tools, self.template = chat
        self.custom, self.namespaces = offered.custom, offered.namespaces
        self.id = "resp_" + uuid.uuid4().hex
        self.created = int(time.time())
        self.blocks, self.last, self.ids = Blocks(), None, {}
        self.empty = Block("text")  # the message of an answer without text or calls
        self.sequence, self.step_logprobs = 0, []

    def _id(self, block: Block) -> str:
        prefix = {"reasoning": "rs_", "text": "msg_"}.get(block.kind)
        if prefix is None:
            return ("ctc_" if block.call["name"] in self.custom else "fc_") + block.call["id"].removeprefix("call_")
        return self.ids.setdefault(id(block), prefix + uuid.uuid4().hex)

    def _closing(self) -> list[Block]:
        """The blocks the output ends with: an answer without text or calls still has a message."""
        return [] if self.blocks.of("text") or self.blocks.of("call") else [self.empty]

    def output(self) -> list[dict]:
        """The completed output items."""
        return [self._item(block, "completed") for block in self.blocks.blocks + self._closing()]

    def snapshot(self, status: Optional[str] = None) -> dict:
        output = self.output()
        last = self.last
        incomplete = last is not None and last.finish_reason in ("length", "context")
        usage = None
        if last is not None:
            dflash = decoding_stats(last)
            if self.ignored:
                dflash["ignored_fields"] = self.ignored
            usage = {
                "input_tokens": last.prompt_tokens,
                "input_tokens_details": {"cached_tokens": last.cached_tokens},
                "output_tokens": last.generation_tokens,
                "output_tokens_details": {
                    "reasoning_tokens": reasoning_tokens(self.served.tokenizer, self.blocks.joined("reasoning"))
                },
                "total_tokens": last.prompt_tokens + last.generation_tokens,
                "dflash": dflash,
            }
        return {
            "id": self.id,
            "object": "response",
            "created_at": self.created,
            "status": status or ("incomplete" if incomplete else "completed"),
            "model": self.served.model_id,
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

    def _part(self, block: Block, done: bool) -> dict:
        if block.kind == "reasoning":
            return {"type": "reasoning_text", "text": block.text if done else ""}
        logprobs = token_logprobs(self.served.tokenizer, block.logprobs) if done else []
        return {"type": "output_text", "text": block.text if done else "", "annotations": [], "logprobs": logprobs}

    def _item(self, block: Block, status: str) -> dict:
        """A block as its output item (in progress: no content yet, a call's input still empty)."""
        done = status == "completed"
        if block.kind == "reasoning":
            content = [self._part(block, True)] if done else []
            return {"type": "reasoning", "id": self._id(block), "summary": [], "content": content, "status": status}
        if block.kind == "text":
            content = [self._part(block, True)] if done else []
            return {"type": "message", "id": self._id(block), "status": status, "role": "assistant", "content": content}
        call = block.call
        arguments = call["arguments"] if done else ""
        item = {"id": self._id(block), "call_id": call["id"], "name": call["name"], "status": status}
        if call["name"] in self.namespaces:
            item["namespace"] = self.namespaces[call["name"]]
        if call["name"] in self.custom:
            return {"type": "custom_tool_call", **item, "input": custom_input(arguments) if done else ""}
        return {"type": "function_call", **item, "arguments": arguments}

    def next_turn(self) -> Optional[tuple[list[dict], list, dict]]:
        """Once the response is complete: the conversation with its output items, as the client
        sends them back as input."""
        if self.last is None or not self.last.finish_reason:
            return None
        return self.messages + input_messages(self.output()), self.tools, self.template

    async def _run(self, generations):
        """Consume the engine's events; yields the block steps (answer.Blocks.add) at each, the
        step's logprobs on its first piece of text (a step with none passes them on; a step of
        reasoning drops them: they are not the text's)."""
        pending = []
        async for self.last, events in answer_events(first_events(generations), self.parser):
            steps = [step for event in events for step in self.blocks.add(event)]
            steps += self.blocks.stop() if self.last.finish_reason else []
            pending += self.last.logprobs or []
            texts = [block for step, block, _ in steps if step == "delta" and block.kind == "text"]
            self.step_logprobs = []
            if texts:
                texts[0].logprobs += pending
                self.step_logprobs, pending = pending, []
            elif any(step == "delta" for step, _, _ in steps):
                pending = []
            yield steps

    async def whole(self, generations) -> dict:
        async for _ in self._run(generations):
            pass
        return self.snapshot()

    def _event(self, kind: str, **fields) -> str:
        self.sequence += 1
        return (
            f"event: {kind}\ndata: "
            + json.dumps({"type": kind, "sequence_number": self.sequence - 1, **fields})
            + "\n\n"
        )

    def _block_events(self, step: str, block: Block, text: str, index: int):
        """A block's events: its item added (and its content part), its deltas, then done."""
        where = {"item_id": self._id(block), "output_index": index}
        if step == "start":
            yield self._event("response.output_item.added", output_index=index, item=self._item(block, "in_progress"))
            if block.kind != "call":
                part = self._part(block, False)
                part.pop("logprobs", None)
                yield self._event("response.content_part.added", **where, content_index=0, part=part)
        elif step == "delta" and block.kind == "reasoning":
            yield self._event("response.reasoning_text.delta", **where, content_index=0, delta=text)
        elif step == "delta" and block.kind == "text":
            logprobs = token_logprobs(self.served.tokenizer, self.step_logprobs)
            self.step_logprobs = []
            yield self._event("response.output_text.delta", **where, content_index=0, delta=text, logprobs=logprobs)
        elif step == "delta" and block.call["name"] not in self.custom:
            yield self._event("response.function_call_arguments.delta", **where, delta=text)
        elif step == "stop":
            yield from self._done_events(block, where)

    def _done_events(self, block: Block, where: dict):
        item = self._item(block, "completed")
        if block.kind == "reasoning":
            yield self._event("response.reasoning_text.done", **where, content_index=0, text=block.text)
        elif block.kind == "text":
            yield self._event("response.output_text.done", **where, content_index=0, text=block.text, logprobs=[])
        elif item["type"] == "custom_tool_call":  # a custom tool's input: whole, once its call is
            yield self._event("response.custom_tool_call_input.delta", **where, delta=item["input"])
            yield self._event("response.custom_tool_call_input.done", **where, input=item["input"])
        else:
            done = {"arguments": item["arguments"], "name": item["name"]}
            yield self._event("response.function_call_arguments.done", **where, **done)
        if block.kind != "call":
            yield self._event("response.content_part.done", **where, content_index=0, part=item["content"][0])
        yield self._event("response.output_item.done", output_index=where["output_index"], item=item)

    async def stream(self, generations):
        yield self._event("response.created", response=self.snapshot("in_progress"))
        yield self._event("response.in_progress", response=self.snapshot("in_progress"))
        indexes = {}  # a block's output index: its place among the items
        async for steps in self._run(generations):
            for step, block, text in steps:
                index = indexes.setdefault(id(block), len(indexes))
                for event in self._block_events(step, block, text, index):
                    yield event
        for block in self._closing():  # an empty answer is still a message
            for step in ("start", "stop"):
                for event in self._block_events(step, block, "", len(indexes)):
                    yield event
        final = self.snapshot()
        yield self._event(
            "response.incomplete" if final["status"] == "incomplete" else "response.completed", response=final
        )

    def stream_error(self, failure: RequestError) -> str:
        return self._event("error", code="server_error", message=str(failure), param=None)
