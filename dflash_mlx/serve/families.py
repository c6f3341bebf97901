"""How a model family lays out an answer: where its reasoning and its tool calls start and end.

Two layouts, one interface (answer.AnswerParser reads either):

- Markers: reasoning between think markers and calls between call markers, the rest answer
  text.  The markers are the ones mlx-lm's TokenizerWrapper infers for the tokenizer
  (`think_start` / `think_end`: Qwen3's `<think>`, Gemma 4's `<|channel>thought` ...
  `<channel|>`; `tool_call_start` / `tool_call_end` and the tool parser, through
  tools.call_syntax), never a table kept here.
- Harmony (gpt-oss): every message has a header, `<|channel|>analysis<|message|>`, and ends
  with `<|end|>`, `<|call|>` or `<|return|>`.  mlx-lm knows nothing of it, so it is recognised
  by its tokens.  openai-harmony's StreamableParser is not used: its encoding downloads the
  o200k vocabulary on first use (the server runs offline), and it reads o200k token ids while
  this parser reads the text the engine delivers, whatever the tokenizer.

A family also says in which state an answer starts (a template may open the reasoning itself in
the generation prompt: Qwen3.5's ends with `<think>\\n`) and how a call's body is read as it
streams (call_readers.py).
"""

import re
from dataclasses import dataclass
from functools import lru_cache
from typing import Optional

from .call_readers import READERS, CallReader, HarmonyCall, WholeCall
from .tools import HARMONY_CHANNEL, HARMONY_MESSAGE, CallSyntax, call_syntax, is_harmony

NORMAL, REASONING, CALL, HEADER, IDLE = "normal", "reasoning", "call", "header", "idle"
PROMPT_TAIL = 64  # prompt tokens looked at for an open reasoning block (the generation prompt's own)

# harmony's markers (openai/harmony's format description; gpt-oss's chat template writes them)
H_START, H_END, H_CALL, H_RETURN = "<|start|>", "<|end|>", "<|call|>", "<|return|>"
H_CHANNEL, H_MESSAGE = HARMONY_CHANNEL, HARMONY_MESSAGE
H_RECIPIENT = re.compile(r"to=([^\s<]+)")
H_CHANNEL_NAME = re.compile(re.escape(H_CHANNEL) + r"\s*(\w+)")


@dataclass(frozen=True)
class MarkerFamily:
    """Reasoning and calls between markers.  `ends`: markers after which nothing is the answer's
    (Gemma 4 writes `<|tool_response>` after its calls, where a tool's result is to follow)."""

    name: str
    think: Optional[tuple[str, str]]
    call: CallSyntax
    ends: tuple[str, ...] = ()

    def transitions(self, tools: bool) -> dict[str, list[tuple[str, str]]]:
        """state -> [(marker, next state)]; a call opens only where tools were offered."""
        calls = [(self.call.start, CALL)] if tools else []
        ends = [(marker, IDLE) for marker in self.ends]
        table = {NORMAL: calls + ends, CALL: [(self.call.end, NORMAL)], IDLE: []}
        if self.think:
            table[NORMAL] = [(self.think[0], REASONING)] + table[NORMAL]
            table[REASONING] = [(self.think[1], NORMAL)] + calls + ends
        return table

    def initial(self, tokenizer, prompt: list[int]) -> str:
        """Reasoning where the prompt opened a think block it did not close (mlx-lm's server
        decides so too), else answer text."""
        if self.think and prompt:
            start = max(len(prompt) - PROMPT_TAIL, 0)
            if tokenizer.rfind_think_start(prompt, start) > tokenizer.rfind_think_end(prompt, start):
                return REASONING
        return NORMAL

    def after_header(self, header: str, tools: bool) -> tuple[str, Optional[str]]:
        raise AssertionError("no headers in a marker family")

    def reader(self, tools: list, name: Optional[str] = None) -> CallReader:
        return READERS.get(self.call.format, WholeCall)(tools, self.call.parse, name)

    def arguments_as_text(self) -> bool:
        """Whether the template takes a call's arguments as the JSON text the model wrote (Qwen3's
        puts it in as it is) rather than an object (Qwen3-Coder's iterates its items, Gemma 4's
        writes it in its own syntax)."""
        return self.call.format == "json_tools"


@dataclass(frozen=True)
class HarmonyFamily:
    """gpt-oss's messages: analysis is reasoning, final is answer text, commentary addressed
    `to=functions.NAME` is a call of NAME (other commentary is text the user may see: the
    preambles gpt-oss writes before its calls)."""

    name: str = "harmony"
    call: CallSyntax = None

    def transitions(self, tools: bool) -> dict[str, list[tuple[str, str]]]:
        ends = [(H_END, IDLE), (H_CALL, IDLE), (H_RETURN, IDLE), (H_START, HEADER)]
        # a header's <|message|> leads where after_header says (HEADER here stands for that)
        return {HEADER: [(H_MESSAGE, HEADER)], NORMAL: ends, REASONING: ends, CALL: ends, IDLE: [(H_START, HEADER)]}

    def initial(self, tokenizer, prompt: list[int]) -> str:
        """The generation prompt ends `<|start|>assistant`, so the answer starts with a header;
        a message the prompt left open (a continued answer) goes on in its channel."""
        tail = tokenizer.decode(prompt[-PROMPT_TAIL:]) if prompt else ""
        opened = tail[tail.rfind(H_START) + len(H_START) :] if H_START in tail else ""
        if H_MESSAGE in opened:
            return self.after_header(opened.split(H_MESSAGE)[0], False)[0]
        return HEADER

    def after_header(self, header: str, tools: bool) -> tuple[str, Optional[str]]:
        """The state a message's header leads to, and the function a call names."""
        channel = H_CHANNEL_NAME.search(header)
        recipient = H_RECIPIENT.search(header)
        if channel and channel.group(1) == "analysis":
            return REASONING, None
        if tools and recipient and recipient.group(1).startswith("functions."):
            return CALL, recipient.group(1).removeprefix("functions.")
        return NORMAL, None

    def reader(self, tools: list, name: Optional[str] = None) -> CallReader:
        return HarmonyCall(tools, self.call.parse, name)

    def arguments_as_text(self) -> bool:
        return False  # its template writes `arguments|tojson`: an object, else the text is quoted again


Family = MarkerFamily | HarmonyFamily


@lru_cache(maxsize=16)
def family_of(tokenizer) -> Family:
    """The tokenizer's family (kept: looking through the vocabulary costs)."""
    if is_harmony(tokenizer):
        return HarmonyFamily(call=call_syntax(tokenizer))
    think = None
    if getattr(tokenizer, "has_thinking", False):
        think = (tokenizer.think_start, tokenizer.think_end)
    syntax = call_syntax(tokenizer)
    added = tokenizer.get_added_vocab() if hasattr(tokenizer, "get_added_vocab") else {}
    ends = tuple(m for m in ("<|tool_response>", "<turn|>") if syntax.format == "gemma4" and m in added)
    return MarkerFamily(syntax.format, think, syntax, ends)
