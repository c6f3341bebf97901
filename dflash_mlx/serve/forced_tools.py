"""Which tools a request offers, and forced tool calls: tool_choice "required" or a named tool
(OpenAI chat and Responses), {"type": "any"} or {"type": "tool"} (Anthropic).

A forced call is a grammar (decode/grammar.py, llguidance's lark syntax) that admits one tool
call and nothing else, written as the model's own tool-call format has it (tools.call_syntax,
what answer.ToolCalls parses back), naming one of the tools the choice allows, its arguments
valid against that tool's JSON schema.  The model still chooses all the grammar leaves open
(which tool, the argument values).

Formats: a JSON object {"name", "arguments"} between markers (mlx-lm's json_tools: Qwen3, and
the fallback convention of templates without tools) and Qwen3-Coder's <function=...> with one
<parameter=...> per argument (qwen3_coder: Qwen3-Coder, Qwen3.5, Qwen3.6).  Forcing a call in
another format is refused by name; "auto" and "none" serve every format.
"""

import json
import re
from typing import Optional

from ..decode.grammar import ONE_LINE, Grammar
from .protocol import RequestError
from .tools import CallSyntax, call_syntax

# a tool's schema keywords llguidance cannot enforce are left unenforced rather than the tool refused
TOOL_LAYOUT = {**ONE_LINE, "lenient": True}
RAW_TYPES = {"string", "str", "text", "varchar", "char", "enum"}  # qwen3_coder keeps these values as written
DEFINITIONS = ("$defs", "definitions")  # where a schema's "$ref"s point: kept at the root of each %json
NEWLINE = json.dumps("\n")
CLOSE_PARAMETER = "\n</parameter>"


def openai_tool_choice(choice) -> tuple[str, Optional[str]]:
    """OpenAI's tool_choice, chat's or Responses', as (mode, name): mode "none", "auto",
    "required", or "tool" with the name of the function (or Responses custom tool) to call."""
    if choice is None:
        return "auto", None
    if choice in ("none", "auto", "required"):
        return choice, None
    if isinstance(choice, dict) and choice.get("type") in ("function", "custom"):
        # Responses names the tool at the top; chat under "function" (or "custom")
        name = choice.get("name") or (choice.get(choice["type"]) or {}).get("name")
        if isinstance(name, str):
            return "tool", name
    raise RequestError(
        'tool_choice can be "none", "auto", "required" or a function to call here',
        param="tool_choice",
        code="unsupported_parameter",
    )


def anthropic_tool_choice(choice) -> tuple[str, Optional[str]]:
    """Anthropic's tool_choice as openai_tool_choice's (mode, name)."""
    modes = {"auto": "auto", "none": "none", "any": "required", "tool": "tool"}
    kind = choice.get("type", "auto") if isinstance(choice, dict) else "auto" if choice is None else None
    if kind not in modes:
        raise RequestError(f"tool_choice.type: {kind!r} is not one of auto, any, tool, none")
    if kind == "tool" and not isinstance(choice.get("name"), str):
        raise RequestError("tool_choice.name: Field required")
    return modes[kind], choice.get("name") if kind == "tool" else None


def choose_tools(served, tools: list[dict], mode: str, name: Optional[str]) -> tuple[list[dict], Optional[Grammar]]:
    """The tools the model is offered and, when `mode` forces a call, the grammar that forces it
    (None: the model answers as it likes).  A named tool is forced with all the tools offered,
    so the prompt is the one "auto" renders, whose prefix the cache may hold."""
    if mode == "none":
        return [], None
    if mode == "auto":
        return tools, None
    if not tools:
        raise RequestError("tool_choice: a tool call can be forced only when tools are given", param="tool_choice")
    allowed = tools if mode == "required" else [t for t in tools if t["function"]["name"] == name]
    if not allowed:
        raise RequestError(f"tool_choice: no tool named {name!r} among the tools", param="tool_choice")
    return tools, forced_call_grammar(served.tokenizer, served.bounds.vocab_size, allowed)


def forced_call_grammar(tokenizer, vocab_size: int, tools: list[dict]) -> Grammar:
    """The grammar of one call of one of `tools`, as the tokenizer's model writes calls."""
    syntax = call_syntax(tokenizer)
    write = CALL_GRAMMARS.get(syntax.format)
    if write is None:
        raise RequestError(
            f"tool_choice: forcing a call is not supported for this model's tool-call format "
            f"({syntax.format}); use auto",
            param="tool_choice",
            code="unsupported_parameter",
        )
    try:
        return Grammar(tokenizer, write(tokenizer, syntax, tools), vocab_size)
    except ValueError as e:  # a schema llguidance cannot compile
        raise RequestError(f"tool_choice: the tools' schemas make no grammar ({e})", param="tool_choice") from None


def json_calls(tokenizer, syntax: CallSyntax, tools: list[dict]) -> str:
    """start, {"name": ..., "arguments": {...}}, end: Qwen3's template puts the JSON on a line of
    its own; the fallback convention (fallback_tool_prompt) writes it between the markers."""
    gap = NEWLINE if syntax.native else ""
    rules = [
        f"start: {_marker(tokenizer, syntax.start)} {gap} call {gap} {_marker(tokenizer, syntax.end)}",
        "call: " + " | ".join(f"call_{i}" for i in range(len(tools))),
    ]
    # one %json per tool: each schema's "$ref"s resolve against its own root
    rules += [f"call_{i}: %json {json.dumps(_call_schema(tool), ensure_ascii=False)}" for i, tool in enumerate(tools)]
    return "\n".join(rules)


def _call_schema(tool: dict) -> dict:
    parameters = dict(tool["function"].get("parameters") or {"type": "object"})
    definitions = {key: parameters.pop(key) for key in DEFINITIONS if key in parameters}
    return {
        "x-guidance": TOOL_LAYOUT,
        "type": "object",
        "properties": {"name": {"const": tool["function"]["name"]}, "arguments": parameters},
        "required": ["name", "arguments"],
        "additionalProperties": False,
        **definitions,
    }


def xml_calls(tokenizer, syntax: CallSyntax, tools: list[dict]) -> str:
    """Qwen3-Coder's call, as its template renders one:
    start \\n <function=NAME> \\n (<parameter=KEY> \\n VALUE \\n </parameter> \\n)* </function> \\n end.
    The parser converts each value by its property's type: strings are read as written (any
    text that does not close the parameter or the call), other values as JSON."""
    rules = [
        f"start: {_marker(tokenizer, syntax.start)} {NEWLINE} call {_marker(tokenizer, syntax.end)}",
        "call: " + " | ".join(f"call_{i}" for i in range(len(tools))),
    ]
    for i, tool in enumerate(tools):
        parameters = tool["function"].get("parameters") or {}
        definitions = {key: parameters[key] for key in DEFINITIONS if key in parameters}
        required = parameters.get("required") or []
        parts = []
        for j, (key, schema) in enumerate((parameters.get("properties") or {}).items()):
            rule = f"p{i}_{j}"
            value = _xml_value(rule, schema if isinstance(schema, dict) else {}, definitions, syntax.end, rules)
            rules.append(f"{rule}: {_literal(f'<parameter={key}>')} {NEWLINE} {value} {NEWLINE}")
            parts.append(rule if key in required else rule + "?")
        head = _literal(f"<function={tool['function']['name']}>")
        rules.append(f"call_{i}: {head} {NEWLINE} {' '.join(parts)} {_literal('</function>')} {NEWLINE}")
    return "\n".join(rules)


def _xml_value(rule: str, schema: dict, definitions: dict, end: str, rules: list[str]) -> str:
    """One parameter's value and its closing tag (rules it needs appended to `rules`)."""
    kind = schema.get("type")
    choices = schema.get("enum", [schema["const"]] if "const" in schema else None)
    raw = (isinstance(kind, str) and kind.lower() in RAW_TYPES) or (
        kind is None and choices and all(isinstance(c, str) for c in choices)
    )
    if raw and choices:
        return "(" + " | ".join(_literal(str(c)) for c in choices) + f") {_literal(CLOSE_PARAMETER)}"
    if raw:
        # lazy: the value ends at the first closing tag, which it may therefore not hold; nor
        # may it hold the call's end marker, where ToolCalls would cut the call short
        low, high = schema.get("minLength", 0), schema.get("maxLength", "")
        text = f"/(?s:.{{{low},{high}}}){_regex(CLOSE_PARAMETER)}/ & ~/(?s:.*){_regex(end)}(?s:.*)/"
        rules += [f"{rule.upper()}_TEXT: {text}", f"{rule}_text[lazy]: {rule.upper()}_TEXT"]
        return f"{rule}_text"
    value = json.dumps({"x-guidance": TOOL_LAYOUT, **schema, **definitions}, ensure_ascii=False)
    return f"%json {value} {_literal(CLOSE_PARAMETER)}"


def _marker(tokenizer, text: str) -> str:
    """A call marker as a grammar element: its token, where the tokenizer has one for it (Qwen's
    <tool_call> is one token, the one the model writes), else its text."""
    ids = tokenizer.encode(text, add_special_tokens=False)
    return f"<[{ids[0]}]>" if len(ids) == 1 else _literal(text)


def _literal(text: str) -> str:
    return json.dumps(text, ensure_ascii=False)


def _regex(text: str) -> str:
    """`text` matched literally inside a lark /regex/."""
    return re.escape(text).replace("\\\n", "\\n").replace("/", "\\/")


CALL_GRAMMARS = {"json_tools": json_calls, "qwen3_coder": xml_calls}
