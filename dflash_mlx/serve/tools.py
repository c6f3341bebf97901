"""Tool calls in generated text, parsed with the tool parser mlx-lm picks for the
tokenizer (Qwen3 / Qwen3.5 `<tool_call>{json}</tool_call>` is mlx-lm's json_tools).

A tokenizer without tool calling (a chat template that does not render tools, such
as SmolLM2's) gets the same `<tool_call>{json}</tool_call>` convention: the tools are
described in the system turn (`fallback_tool_prompt`) and calls are parsed with
mlx-lm's json_tools parser."""

import json
import uuid
from dataclasses import dataclass
from typing import Callable, Optional

from mlx_lm.tool_parsers import json_tools


@dataclass(frozen=True)
class CallSyntax:
    """How a tokenizer's model writes a tool call: between `start` and `end`, read by `parse`;
    `format` names mlx-lm's parser module ("json_tools" for the fallback convention) and
    `native` says whether the chat template taught it (else fallback_tool_prompt does)."""

    start: str
    end: str
    parse: Callable
    format: str
    native: bool


def call_syntax(tokenizer) -> CallSyntax:
    """The tool-call syntax ToolCalls parses for `tokenizer` (and forced_tools' grammars write)."""
    if getattr(tokenizer, "has_tool_calling", False):
        parse = tokenizer.tool_parser
        name = parse.__module__.rsplit(".", 1)[-1]
        return CallSyntax(tokenizer.tool_call_start, tokenizer.tool_call_end, parse, name, True)
    return CallSyntax(
        json_tools.tool_call_start, json_tools.tool_call_end, json_tools.parse_tool_call, "json_tools", False
    )


def fallback_tool_prompt(tools: list[dict]) -> str:
    """The system text that offers `tools` to a model whose chat template cannot."""
    listing = "\n".join(json.dumps(tool["function"], ensure_ascii=False) for tool in tools)
    return (
        "You can call these functions (JSON schemas):\n"
        + listing
        + "\n\nTo call one, reply with "
        + json_tools.tool_call_start
        + '{"name": <function name>, "arguments": <arguments object>}'
        + json_tools.tool_call_end
        + "; the result comes back as <tool_response>...</tool_response>."
    )


def render_tool_call(call: dict) -> str:
    """An OpenAI tool call as the text the fallback convention has the model write."""
    function = call.get("function") or {}
    arguments = function.get("arguments") or {}
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except json.JSONDecodeError:
            pass
    body = json.dumps({"name": function.get("name"), "arguments": arguments}, ensure_ascii=False)
    return json_tools.tool_call_start + body + json_tools.tool_call_end


class ToolCalls:
    """Splits streamed text into content and tool calls.

    `push(text)` returns the text that is safe to show now: everything before a
    tool-call start marker (and before any partial marker at the end);
    `finish()` returns (remaining content, parsed tool calls)."""

    def __init__(self, tokenizer, tools: Optional[list]):
        self.enabled = bool(tools)
        syntax = call_syntax(tokenizer) if self.enabled else None
        self.start = syntax.start if syntax else None
        self.end = syntax.end if syntax else None
        self.parse = syntax.parse if syntax else None
        self.tools = tools
        self.text = ""
        self.shown = 0

    def push(self, text: str) -> str:
        self.text += text
        if not self.enabled:
            self.shown = len(self.text)
            return text
        cut = self.text.find(self.start, self.shown)
        if cut < 0:  # hold back a tail that could be the start of a marker
            cut = len(self.text)
            for k in range(min(len(self.start) - 1, len(self.text) - self.shown), 0, -1):
                if self.start.startswith(self.text[-k:]):
                    cut = len(self.text) - k
                    break
        out = self.text[self.shown : max(cut, self.shown)]
        self.shown = max(cut, self.shown)
        return out

    def finish(self) -> tuple[str, list[dict]]:
        rest = self.text[self.shown :]
        if not self.enabled:
            return rest, []
        content, calls = [], []
        while True:
            start = rest.find(self.start)
            if start < 0:
                content.append(rest)
                break
            content.append(rest[:start])
            end = rest.find(self.end, start + len(self.start)) if self.end else -1
            body = rest[start + len(self.start) : end if end >= 0 else len(rest)]
            rest = rest[end + len(self.end) :] if end >= 0 else ""
            try:
                parsed = self.parse(body, self.tools)
            except Exception:  # unparseable: keep it as text rather than lose it
                content.append(self.start + body + (self.end or ""))
                continue
            for call in parsed if isinstance(parsed, list) else [parsed]:
                calls.append(
                    {
                        "id": f"call_{uuid.uuid4().hex[:24]}",
                        "type": "function",
                        "function": {
                            "name": call["name"],
                            "arguments": json.dumps(call.get("arguments", {}), ensure_ascii=False),
                        },
                    }
                )
        return "".join(content), calls


async def with_tool_calls(events, tokenizer, tools: Optional[list]):
    """The engine's responses, each with the text safe to show at it and, at the one with a
    finish_reason, the parsed tool calls (an empty list before)."""
    calls = ToolCalls(tokenizer, tools)
    async for response in events:
        shown, parsed = calls.push(response.text), []
        if response.finish_reason:
            rest, parsed = calls.finish()
            shown += rest
        yield response, shown, parsed
