"""Tool-call syntaxes: the tool parser mlx-lm picks for the tokenizer (Qwen3's
`<tool_call>{json}</tool_call>` is mlx-lm's json_tools, Qwen3-Coder's and Qwen3.5's XML calls
qwen3_coder, Gemma 4's gemma4), and gpt-oss's harmony messages.  Calls are read out of the
streamed answer by answer.AnswerParser; answer.ToolCalls reads them out of text alone.

A tokenizer without tool calling (a chat template that does not render tools, such
as SmolLM2's) gets the same `<tool_call>{json}</tool_call>` convention: the tools are
described in the system turn (`fallback_tool_prompt`) and calls are parsed with
mlx-lm's json_tools parser."""

import json
from dataclasses import dataclass
from typing import Callable

from mlx_lm.tool_parsers import json_tools

HARMONY_CHANNEL, HARMONY_MESSAGE = "<|channel|>", "<|message|>"


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


def is_harmony(tokenizer) -> bool:
    """Whether the tokenizer writes OpenAI's harmony format (gpt-oss), which mlx-lm does not parse:
    its message tokens are in the vocabulary."""
    added = tokenizer.get_added_vocab() if hasattr(tokenizer, "get_added_vocab") else {}
    return HARMONY_CHANNEL in added and HARMONY_MESSAGE in added


def _harmony_call(body: str, tools=None) -> dict:
    """A harmony call's body: its arguments' JSON (the function is named in the message header)."""
    return {"arguments": json.loads(body)}


def call_syntax(tokenizer) -> CallSyntax:
    """The tool-call syntax ToolCalls parses for `tokenizer` (and forced_tools' grammars write).
    Harmony's calls are messages (families.HarmonyFamily reads them): its syntax names the
    commentary channel and the call's end."""
    if is_harmony(tokenizer):
        return CallSyntax(HARMONY_CHANNEL, "<|call|>", _harmony_call, "harmony", True)
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
