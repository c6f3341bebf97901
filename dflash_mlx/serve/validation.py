"""Checks at the API edge that the reference APIs make, in their own words: sampling ranges
(checked by decode/request.build_request, worded here), and tool calls paired with their results.  A conversation whose tool call has no result (or
whose result answers no call) is refused with a 400 rather than rendered as something the
client did not mean; the wording is the reference API's, so clients and their users recognise it.

Ids are compared with == over lists, never hashed: a client may send any JSON value as an id.
"""

import numbers

from ..decode.request import OutOfRange
from .protocol import RequestError

OPENAI_RANGES = {"temperature": (0, 2), "top_p": (0, 1)}
ANTHROPIC_RANGES = {"temperature": (0, 1), "top_p": (0, 1)}


def openai_out_of_range(e: OutOfRange) -> RequestError:
    """A sampling value outside OpenAI's range (decode/request.build_request found it), in OpenAI's words."""
    below = e.value < e.low
    return RequestError(
        f"Invalid '{e.field}': decimal {'below minimum' if below else 'above maximum'} value. "
        f"Expected a value {'>=' if below else '<='} {e.low if below else e.high}, but got {e.value} instead.",
        param=e.field,
        code="decimal_below_min_value" if below else "decimal_above_max_value",
    )


def anthropic_out_of_range(e: OutOfRange) -> RequestError:
    return RequestError(f"{e.field}: range: {e.low}..{e.high}")  # Anthropic's errors name no param


def _listing(ids: list) -> str:
    return ", ".join(str(i) for i in ids)


# ---------------------------------------------------------------- Anthropic Messages


def _blocks_of(turn: dict, kind: str) -> list[tuple[int, dict]]:
    """(index, block) of the `kind` blocks of a turn (a string content has none)."""
    content = turn.get("content")
    if not isinstance(content, list):
        return []
    return [(j, block) for j, block in enumerate(content) if block.get("type") == kind]


def check_anthropic_tool_results(turns: list[dict]) -> None:
    """Each assistant turn's tool_use blocks are answered, every one, by tool_result blocks in the
    user turn right after it, and each tool_result answers a tool_use of the turn right before.
    An assistant turn with tool_use last (nothing after it yet) is let through: the reference
    reports the pairing at the turn after, and there is none.  `turns`: checked by
    anthropic_api.conversation already (roles, block types)."""
    for i, turn in enumerate(turns):
        previous = turns[i - 1] if i > 0 else None
        asked = []
        if previous is not None and previous["role"] == "assistant":
            asked = [block.get("id") for _, block in _blocks_of(previous, "tool_use")]
        answered = []
        for j, block in _blocks_of(turn, "tool_result"):
            if block.get("tool_use_id") not in asked:
                raise RequestError(
                    f"messages.{i}.content.{j}: unexpected `tool_use_id` found in `tool_result` blocks: "
                    f"{block.get('tool_use_id')}. Each `tool_result` block must have a corresponding "
                    "`tool_use` block in the previous message."
                )
            answered.append(block.get("tool_use_id"))
        missing = [tool_id for tool_id in asked if tool_id not in answered]
        if missing:
            raise RequestError(
                f"messages.{i}: `tool_use` ids were found without `tool_result` blocks immediately after: "
                f"{_listing(missing)}. Each `tool_use` block must have a corresponding `tool_result` block "
                "in the next message."
            )


THINKING_TYPES = ("enabled", "disabled", "adaptive", "between_tools")


def check_anthropic_thinking(thinking) -> None:
    """`thinking` as the reference takes it: a type it knows, and with "enabled" a budget of at
    least 1024 tokens.  (Its rule that the budget stay below max_tokens is left out: with the
    interleaved-thinking beta Claude Code sends, the reference lifts it.)"""
    if thinking is None:
        return
    kind = thinking.get("type") if isinstance(thinking, dict) else None
    if kind not in THINKING_TYPES:
        raise RequestError(f"thinking.type: Input should be {', '.join(map(repr, THINKING_TYPES))}")
    budget = thinking.get("budget_tokens")
    if kind == "enabled" and (isinstance(budget, bool) or not isinstance(budget, numbers.Integral) or budget < 1024):
        raise RequestError("thinking.enabled.budget_tokens: Input should be greater than or equal to 1024")


def check_anthropic_prefill(prefill: str) -> None:
    """A partial assistant answer to continue (the request's last turn) ends in no whitespace."""
    if prefill != prefill.rstrip():
        raise RequestError("messages: final assistant content cannot end with trailing whitespace")


# ---------------------------------------------------------------- OpenAI chat and Responses


def check_openai_tool_messages(messages: list[dict]) -> None:
    """An assistant message with tool_calls is followed by tool messages answering each of its
    calls before any other message (or the end), and a tool message answers a call of the
    assistant message its run of tool messages follows.  `messages`: openai_api's normalised ones."""
    asked, waiting, asked_at = [], [], None  # the last assistant message's calls; those unanswered
    for i, message in enumerate(messages):
        if message["role"] == "tool":
            if message.get("tool_call_id") not in asked:
                raise RequestError(
                    "Invalid parameter: messages with role 'tool' must be a response to a preceeding "
                    "message with 'tool_calls'.",
                    param=f"messages.[{i}].role",
                )
            waiting = [call for call in waiting if call != message.get("tool_call_id")]
            continue
        _check_answered(waiting, asked_at)
        asked = [call.get("id") for call in message.get("tool_calls") or []]
        waiting, asked_at = list(asked), i
    _check_answered(waiting, asked_at)


def _check_answered(waiting: list, asked_at) -> None:
    if waiting:
        raise RequestError(
            "An assistant message with 'tool_calls' must be followed by tool messages responding to each "
            f"'tool_call_id'. The following tool_call_ids did not have response messages: {_listing(waiting)}",
            param=f"messages.[{asked_at}].role",
        )


def check_function_call_outputs(items: list[dict]) -> None:
    """Responses API input: each function_call_output answers a function_call before it, and each
    function_call is answered.  `items`: checked by responses_api.input_messages already (objects)."""
    calls, outputs = [], []
    for item in items:
        if item.get("type") == "function_call":
            calls.append(item.get("call_id"))
        elif item.get("type") == "function_call_output":
            if item.get("call_id") not in calls:
                raise RequestError(
                    f"No tool call found for function call output with call_id {item.get('call_id')}.",
                    param="input",
                )
            outputs.append(item.get("call_id"))
    for call in calls:
        if call not in outputs:
            raise RequestError(f"No tool output found for function call {call}.", param="input")
