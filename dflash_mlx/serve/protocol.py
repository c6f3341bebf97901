"""What every API of the server shares: request errors, numbers, and turning a
conversation (system text, turns with text, tool calls and tool results, tools)
into the target's prompt tokens.

Conversations are normalised to OpenAI chat messages, the shape chat templates
know: {"role": "system" | "user" | "assistant" | "tool", "content": str,
"tool_calls": [...], "tool_call_id": str, "reasoning_content": str}.  Each API translates its
own format into that (openai_api.py, responses_api.py, anthropic_api.py) and back.  A request's
thinking switches become the template's keyword arguments (`template_options`).
"""

import json
import numbers
from typing import Optional

from .families import HarmonyFamily, family_of
from .tools import fallback_tool_prompt, render_tool_call

ROLES = ("system", "developer", "user", "assistant", "tool")
TEXT_PARTS = ("text", "input_text", "output_text")


class RequestError(Exception):
    """A request the server refuses: HTTP `status`, the offending field in `param`."""

    def __init__(self, message: str, status: int = 400, param: Optional[str] = None, code: Optional[str] = None):
        super().__init__(message)
        self.status, self.param, self.code = status, param, code


def generation_failure(error: Exception) -> RequestError:
    """A generation that failed with `error` (a bug, or the engine's exception, its traceback from
    the engine thread), as the 500 its client gets, caused by it (logged with its traceback when
    answered: Server.refused); a RequestError as it is."""
    if isinstance(error, RequestError):
        return error
    failed = RequestError(f"generation failed: {error}", 500)
    failed.__cause__ = error
    return failed


def number(body: dict, name: str, default, kind=numbers.Real, low=None, high=None):
    """body[name] checked to be a number (an integer for kind=numbers.Integral) in [low, high]."""
    value = body.get(name, default)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, kind):
        raise RequestError(f"{name} must be {'an integer' if kind is numbers.Integral else 'a number'}", param=name)
    if (low is not None and value < low) or (high is not None and value > high):
        bounds = (
            f"at least {low}" if high is None else f"at most {high}" if low is None else f"between {low} and {high}"
        )
        raise RequestError(f"{name} must be {bounds}, got {value}", param=name)
    return value


def refuse_nonzero(body: dict, *names: str) -> None:
    """Fields whose non-default values would change the output and that the server does not
    implement: refused by name rather than ignored."""
    for name in names:
        value = body.get(name)
        if value not in (None, 0, 0.0, {}, [], False):
            raise RequestError(
                f"{name} is not supported by this server (the target's distribution is sampled as is); remove it",
                param=name,
                code="unsupported_parameter",
            )


def unknown_fields(body: dict, known: set) -> list[str]:
    """Request fields this API does not know: reported back in the response (never silently dropped)."""
    return sorted(name for name in body if name not in known)


def text_of(content, where: str) -> str:
    """Message content (a string or a list of parts) as text; non-text parts are refused by name."""
    if content is None or isinstance(content, str):
        return content or ""
    if not isinstance(content, list):
        raise RequestError(f"{where} must be a string or a list of content parts", param=where)
    texts = []
    for i, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind in TEXT_PARTS and isinstance(part.get("text"), str):
            texts.append(part["text"])
        elif kind is None:
            raise RequestError(f"{where}[{i}] must be an object with a type", param=where)
        else:
            raise RequestError(
                f"{where}[{i}] is a {kind!r} part, but the served model reads text only; send text parts",
                param=where,
                code="unsupported_content",
            )
    return "".join(texts)


def check_tools(tools, where: str = "tools") -> list[dict]:
    """OpenAI function tools [{"type": "function", "function": {"name", "description", "parameters"}}]."""
    if tools is None:
        return []
    if not isinstance(tools, list):
        raise RequestError(f"{where} must be a list", param=where)
    for i, tool in enumerate(tools):
        function = tool.get("function") if isinstance(tool, dict) else None
        if not (
            isinstance(tool, dict)
            and tool.get("type") == "function"
            and isinstance(function, dict)
            and isinstance(function.get("name"), str)
        ):
            raise RequestError(
                f"{where}[{i}] must be a function tool with a name (other tool types are not supported here)",
                param=where,
            )
    return tools


def prompt_tokens(
    tokenizer,
    messages: list[dict],
    tools: list[dict],
    add_generation_prompt: bool = True,
    continued: bool = False,
    template: Optional[dict] = None,
) -> list[int]:
    """The conversation through the target's chat template.  A template that does not render
    tools (SmolLM2's, for one) gets them described in the system turn, with the
    <tool_call>{json}</tool_call> convention answer.ToolCalls then parses; its tool turns are
    rendered as text the same way.  `continued`: the last message is an assistant's partial
    answer, rendered as the template writes an assistant turn but left open (no end of turn
    after its text), so the model continues it.

    System messages after the first (Claude Code sends hooks' context so, OpenAI clients a late
    developer message) are rendered in place, as system turns where the template takes them
    there, else as user turns (Qwen3.5's refuses them: "System message must be at the
    beginning"); merged into the first, they would change the prompt's start, and every turn
    would miss the prefix cache.  `template`: keyword arguments for the template (template_options)."""
    for i, message in enumerate(messages):
        if message.get("role") not in ROLES:
            raise RequestError(
                f"messages[{i}].role must be one of {', '.join(ROLES)}, got {message.get('role')!r}", param="messages"
            )
    messages = [{**m, "role": "system"} if m["role"] == "developer" else m for m in messages]
    if not tokenizer.has_chat_template:
        text = "\n".join(m.get("content") or "" for m in messages)
        return tokenizer.encode(text)

    def render(conversation: list[dict]) -> str:
        return _chat_text(
            tokenizer, conversation, tools, add_generation_prompt and not continued, continued, template or {}
        )

    try:
        text = render(messages)
    except RequestError:
        in_user_turns = [{**m, "role": "user"} if i and m["role"] == "system" else m for i, m in enumerate(messages)]
        if in_user_turns == messages:
            raise
        text = render(in_user_turns)
    return tokenizer.encode(text, add_special_tokens=False)


def _chat_text(
    tokenizer, messages: list[dict], tools: list[dict], add_generation_prompt: bool, continued: bool, template: dict
) -> str:
    native_tools = bool(tools) and "tools" in (tokenizer.chat_template or "")
    if tools and not native_tools:
        messages = _with_tool_text(messages, tools)
    else:
        messages = _for_template(tokenizer, messages)
    try:
        return tokenizer.apply_chat_template(
            messages,
            tools=tools if native_tools else None,
            tokenize=False,
            add_generation_prompt=add_generation_prompt,
            continue_final_message=continued,
            **template,
        )
    except Exception as e:  # the template's own checks (roles, order)
        raise RequestError(f"the chat template refused these messages ({e})", param="messages") from None


def answer_message(text: str, calls: list, reasoning: str = "") -> dict:
    """An answer as a client sends it back: its text, tool calls and reasoning (a thinking block,
    a reasoning item, reasoning_content), one assistant message."""
    message = {"role": "assistant", "content": text}
    if calls:
        message["tool_calls"] = calls
    if reasoning:
        message["reasoning_content"] = reasoning
    return message


def next_turn_tokens(
    tokenizer, conversation: list[dict], tools: list[dict], template: Optional[dict] = None
) -> Optional[list[int]]:
    """The conversation, its answer last (as the client's next request will send it), rendered up
    to the next turn; None where the template will not render it."""
    try:
        return prompt_tokens(tokenizer, conversation, tools, add_generation_prompt=False, template=template)
    except RequestError:
        return None


def _for_template(tokenizer, messages: list[dict]) -> list[dict]:
    """Messages as the family's template reads them: a call's arguments as an object, unless the
    template takes the text the model wrote (families: arguments_as_text); reasoning under
    `reasoning_content` (Qwen3's, Qwen3.5's, Gemma 4's templates) and, for gpt-oss's, `thinking`
    too (which it refuses beside text in a message with calls: there the text stands for it)."""
    family = family_of(tokenizer)
    as_text, harmony = family.arguments_as_text(), isinstance(family, HarmonyFamily)
    out = []
    for message in messages:
        if message.get("tool_calls") and not as_text:
            message = {**message, "tool_calls": [_object_arguments(call) for call in message["tool_calls"]]}
        if harmony and message.get("reasoning_content") and not (message.get("content") and message.get("tool_calls")):
            message = {**message, "thinking": message["reasoning_content"]}
        out.append(message)
    return out


def _object_arguments(call: dict) -> dict:
    function = call.get("function") or {}
    arguments = function.get("arguments")
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except json.JSONDecodeError:
            return call  # not JSON: the template gets the text
    return {**call, "function": {**function, "arguments": arguments}}


# ---------------------------------------------------------------- thinking, as requests switch it

EFFORTS = {"minimal": "low", "low": "low", "medium": "medium", "high": "high", "xhigh": "high"}
RESERVED_KWARGS = {  # set by the server itself
    "messages",
    "tools",
    "documents",
    "tokenize",
    "add_generation_prompt",
    "continue_final_message",
    "return_dict",
    "chat_template",
}


def template_options(enabled: Optional[bool] = None, effort=None, kwargs=None, where: str = "reasoning_effort") -> dict:
    """The chat template's keyword arguments for a request's thinking fields: `enable_thinking`
    (mlx-lm's TokenizerWrapper renames it for templates that call it otherwise, and sets it to the
    model's default when it is not given), and `reasoning_effort` low / medium / high for an effort
    (gpt-oss's template reads it); effort "none" turns thinking off.  `kwargs`: the request's own
    chat_template_kwargs, as vLLM and mlx-lm's server take them; they win."""
    options = {}
    if effort is not None:
        if effort != "none" and effort not in EFFORTS:
            raise RequestError(f"{where} must be one of none, {', '.join(EFFORTS)}; got {effort!r}", param=where)
        options["enable_thinking"] = effort != "none"
        options["reasoning_effort"] = EFFORTS.get(effort, "low")
    if enabled is not None:
        options["enable_thinking"] = enabled
    if kwargs is not None:
        if not isinstance(kwargs, dict):
            raise RequestError("chat_template_kwargs must be an object", param="chat_template_kwargs")
        reserved = sorted(RESERVED_KWARGS & set(kwargs))
        if reserved:
            raise RequestError(
                f"chat_template_kwargs: {', '.join(reserved)} is the server's to set", param="chat_template_kwargs"
            )
        options.update(kwargs)
    return options


def constrained(options: dict) -> dict:
    """A grammar writes the answer from its first token (a JSON format, a forced call): there is no
    room for reasoning before it, so the prompt is rendered with thinking off."""
    return {**options, "enable_thinking": False}


def _with_tool_text(messages: list[dict], tools: list[dict]) -> list[dict]:
    """Messages for a template without tool support: the tools described in the system turn,
    assistant tool calls and tool results written out as text."""
    description = fallback_tool_prompt(tools)
    out = []
    if messages and messages[0]["role"] == "system":
        out.append({"role": "system", "content": messages[0]["content"] + "\n\n" + description})
        messages = messages[1:]
    else:
        out.append({"role": "system", "content": description})
    for message in messages:
        if message["role"] == "tool":
            out.append({"role": "user", "content": f"<tool_response>\n{message['content']}\n</tool_response>"})
        elif message.get("tool_calls"):
            calls = "".join(render_tool_call(call) for call in message["tool_calls"])
            out.append({"role": "assistant", "content": (message.get("content") or "") + calls})
        else:
            out.append({"role": message["role"], "content": message.get("content") or ""})
    return out


def arguments_json(arguments) -> str:
    """Tool-call arguments as the JSON text OpenAI messages carry."""
    return arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False)


def decoding_stats(last) -> dict:
    """How a response was decoded (the `dflash` object every API's usage carries)."""
    return {
        "tau": round(last.tau, 3),
        "acceptance_histogram": last.acceptance_histogram,
        "draft_cycles": last.sources.count("dflash"),
        "lookup_cycles": last.sources.count("lookup"),
        "suffix_cycles": last.sources.count("suffix"),
        "grammar_cycles": last.sources.count("grammar"),
        "plain_cycles": last.sources.count("plain"),
        "block_size": last.block_size,
        "generation_tps": round(last.generation_tps, 2),
        # the answer ran to the context's end (the OpenAI APIs' reasons, "length" and
        # "max_output_tokens", say the same for a client's max_tokens)
        "context_end": last.finish_reason == "context",
    }
