"""An answer read as the engine delivers it, block after block of accepted tokens (1 to 16 at a
time with DFlash): reasoning, answer text and tool calls, as events every API turns into its own.

AnswerParser cuts the text at its family's markers (families.py), wherever they fall: a piece that
may be the start of a marker waits for the next (never shown as text, never missed), so the events
are the same however the answer is split; only where they are cut differs.  Markers are never
shown.  Around a marker, the newlines the templates put there (`<think>\\n`, `</think>\\n\\n`, `\\n<tool_call>`)
are not shown either; an answer without markers comes out exactly as written.

Events: Reasoning(text), Text(text), CallStart(index, id, name) once the name is known,
CallArguments(index, delta) pieces of the arguments' JSON, CallEnd(index, arguments) with the
final arguments.  Blocks turns them into the blocks the APIs stream (a thinking block, a text
block, a tool_use block; reasoning, message, function_call items) and keep for whole answers.
"""

import json
import uuid
from dataclasses import dataclass, field
from typing import Optional, Union

from .call_readers import CallReader, held_prefix
from .families import CALL, HEADER, NORMAL, REASONING, family_of

NEWLINES = "\r\n"


@dataclass
class Reasoning:
    text: str


@dataclass
class Text:
    text: str


@dataclass
class CallStart:
    index: int
    id: str
    name: str


@dataclass
class CallArguments:
    index: int
    delta: str


@dataclass
class CallEnd:
    index: int
    arguments: str  # the arguments' final JSON (the deltas' concatenation where that is valid JSON)


Event = Union[Reasoning, Text, CallStart, CallArguments, CallEnd]


class AnswerParser:
    """`push(text)` -> the events the text completes; `finish()` -> the rest, at the answer's end.
    `tools`: the tools offered (none: calls are not looked for); `state`: where the answer starts
    (`for_prompt` finds it from the prompt)."""

    def __init__(self, family, tools: Optional[list], state: str = NORMAL):
        self.family, self.tools = family, tools or []
        self.table = family.transitions(bool(tools))
        self.state = state
        self.pending = ""  # text that may begin a marker
        self.held = ""  # trailing newlines, shown only if more text follows before a marker
        self.fresh = False  # just past a marker: leading newlines are the template's
        self.marked = False  # a marker was seen (the answer has structure: its end's newlines go too)
        self.header = ""  # harmony: the message header being read
        self.reader: Optional[CallReader] = None
        self.started = False  # the call being read was announced (CallStart)
        self.call_marker = ""  # the marker that opened it (an unparseable call is shown as written)
        self.calls: list[CallStart] = []

    @classmethod
    def for_prompt(cls, tokenizer, tools: Optional[list], prompt: list[int], constrained: bool = False):
        """The parser of an answer to `prompt`.  A grammar-constrained answer (`constrained`)
        starts as answer text: the grammar writes it from its first token."""
        family = family_of(tokenizer)
        return cls(family, tools, NORMAL if constrained else family.initial(tokenizer, prompt))

    def push(self, text: str) -> list[Event]:
        out: list[Event] = []
        text, self.pending = self.pending + text, ""
        while text:
            markers = self.table.get(self.state, [])
            found = min(((text.find(m), -len(m), m, to) for m, to in markers if m in text), default=None)
            if found is None:
                keep = max((held_prefix(text, m) for m, _ in markers), default=0)
                self._segment(text[: len(text) - keep], out, ends=False)
                self.pending = text[len(text) - keep :]
                break
            at, _, marker, to = found
            self._segment(text[:at], out, ends=True)
            self._cross(marker, to, out)
            text = text[at + len(marker) :]
        return out

    def finish(self) -> list[Event]:
        """The answer has ended: a partial marker is text after all, an open call ends here."""
        out: list[Event] = []
        pending, self.pending = self.pending, ""
        self._segment(pending, out, ends=self.marked)
        if not self.marked and self.held:
            self._show(self.held, out)
        self.held = ""
        if self.state == CALL:
            self._end_call(out, closed=False)
        return out

    # ------------------------------------------------------------ text between markers

    def _segment(self, text: str, out: list, ends: bool) -> None:
        """Text of the current state; `ends`: a marker (or the end) follows it."""
        if self.state == CALL:
            self._feed_call(text, out)
        elif self.state == HEADER:
            self.header += text
        elif self.state in (NORMAL, REASONING) and text:
            if not self.table.get(self.state):  # no marker can follow: shown exactly as written
                self._show(text, out)
                return
            if self.fresh:
                text = text.lstrip(NEWLINES)
                self.fresh = not text
            text, self.held = self.held + text, ""
            body = text.rstrip(NEWLINES)
            self._show(body, out)
            if not ends:
                self.held = text[len(body) :]
        # IDLE: between harmony messages, or after the answer's end marker: nothing to show

    def _show(self, text: str, out: list) -> None:
        if not text:
            return
        kind = Reasoning if self.state == REASONING else Text
        if out and type(out[-1]) is kind:
            out[-1].text += text
        else:
            out.append(kind(text))

    # ------------------------------------------------------------ markers

    def _cross(self, marker: str, to: str, out: list) -> None:
        self.marked, self.held = True, ""
        if self.state == CALL:
            self._end_call(out, closed=True)
        if self.state == HEADER:  # harmony: the header says where its message goes
            to, name = self.family.after_header(self.header, bool(self.tools))
            self.header = ""
            if to == CALL:
                self._start_call(marker, name, out)
        elif to == CALL:
            self._start_call(marker, None, out)
        self.state, self.fresh = to, True

    def _start_call(self, marker: str, name: Optional[str], out: list) -> None:
        self.reader, self.started, self.call_marker = self.family.reader(self.tools, name), False, marker
        self._announce(out)

    def _announce(self, out: list) -> None:
        if not self.started and self.reader.name is not None:
            start = CallStart(len(self.calls), f"call_{uuid.uuid4().hex[:24]}", self.reader.name)
            self.calls.append(start)
            out.append(start)
            self.started = True

    def _feed_call(self, text: str, out: list) -> None:
        if not text:
            return
        delta = self.reader.feed(text)
        self._announce(out)
        if delta:
            out.append(CallArguments(self.calls[-1].index, delta))

    def _end_call(self, out: list, closed: bool) -> None:
        """A call's body has ended: mlx-lm's parser reads it whole.  An announced call ends with
        the arguments given out (where they are a JSON object; else the parser's); calls it holds
        beyond (a parser reading several) follow whole; a body no call can be read from (no name,
        no parse) is shown as the text it is."""
        reader, self.reader = self.reader, None
        try:
            parsed = reader.parse(reader.body, self.tools)
            parsed = parsed if isinstance(parsed, list) else [parsed]
        except Exception:
            parsed = []
        if self.started:
            arguments = reader.args if _is_object(reader.args) else _arguments(parsed[0] if parsed else {})
            out.append(CallEnd(self.calls[-1].index, arguments))
            parsed = parsed[1:]
        elif not parsed:
            end = self.family.call.end if closed else ""
            self.state = NORMAL
            self._show(self.call_marker + reader.body + end, out)
            return
        for call in parsed:
            start = CallStart(len(self.calls), f"call_{uuid.uuid4().hex[:24]}", call.get("name") or "")
            self.calls.append(start)
            arguments = _arguments(call)
            out += [start, CallArguments(start.index, arguments), CallEnd(start.index, arguments)]


def _is_object(text: str) -> bool:
    try:
        return isinstance(json.loads(text), dict)
    except json.JSONDecodeError:
        return False


def _arguments(call: dict) -> str:
    arguments = call.get("arguments", {})
    return arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False)


# ---------------------------------------------------------------- blocks


@dataclass
class Block:
    """A run of one kind in the answer: "reasoning", "text", or "call" (`call`: its id, name and,
    once done, final arguments; `text`: its arguments so far).  `logprobs`: of the steps whose
    text went into it first."""

    kind: str
    text: str = ""
    call: Optional[dict] = None
    logprobs: list = field(default_factory=list)


class Blocks:
    """The answer as blocks, in order; `add(event)` says what the event does to them, as
    ("start", block, ""), ("delta", block, text) and ("stop", block, "") steps, which streams
    follow; `blocks` is the whole answer."""

    def __init__(self):
        self.blocks: list[Block] = []
        self.open: Optional[Block] = None

    def add(self, event: Event) -> list[tuple[str, Block, str]]:
        if isinstance(event, (Reasoning, Text)):
            kind = "reasoning" if isinstance(event, Reasoning) else "text"
            steps = [] if self.open is not None and self.open.kind == kind else self._start(Block(kind))
            self.open.text += event.text
            return steps + [("delta", self.open, event.text)]
        if isinstance(event, CallStart):
            call = {"index": event.index, "id": event.id, "name": event.name, "arguments": None}
            return self._start(Block("call", call=call))
        if isinstance(event, CallArguments):
            self.open.text += event.delta
            return [("delta", self.open, event.delta)]
        self.open.call["arguments"] = event.arguments
        return self.stop()

    def stop(self) -> list[tuple[str, Block, str]]:
        block, self.open = self.open, None
        return [("stop", block, "")] if block is not None else []

    def _start(self, block: Block) -> list[tuple[str, Block, str]]:
        steps = self.stop()
        self.blocks.append(block)
        self.open = block
        return steps + [("start", block, "")]

    def of(self, kind: str) -> list[Block]:
        return [block for block in self.blocks if block.kind == kind]

    def joined(self, kind: str) -> str:
        return "".join(block.text for block in self.of(kind))

    def calls(self) -> list[dict]:
        """The calls as OpenAI chat's tool_calls."""
        return [
            {
                "id": b.call["id"],
                "type": "function",
                "function": {"name": b.call["name"], "arguments": b.call["arguments"]},
            }
            for b in self.of("call")
            if b.call["arguments"] is not None
        ]


async def answer_events(responses, parser: AnswerParser):
    """The engine's responses, each with the events its text completes (at the last, the
    answer's end too)."""
    async for response in responses:
        events = parser.push(response.text)
        if response.finish_reason:
            events += parser.finish()
        yield response, events


class ToolCalls:
    """Tool calls in text, read whole or in pieces (AnswerParser with tools only):
    `push(text)` returns the text that is safe to show now (everything before a call, and before
    what may be the start of a call marker); `finish()` returns (remaining text, parsed calls)."""

    def __init__(self, tokenizer, tools: Optional[list]):
        self.parser = AnswerParser.for_prompt(tokenizer, tools, [])
        self.calls: list[dict] = []

    def _take(self, events) -> str:
        shown = []
        for event in events:
            if isinstance(event, Text):
                shown.append(event.text)
            elif isinstance(event, CallStart):
                self.calls.append({"id": event.id, "type": "function", "function": {"name": event.name}})
            elif isinstance(event, CallEnd):
                self.calls[event.index]["function"]["arguments"] = event.arguments
        return "".join(shown)

    def push(self, text: str) -> str:
        return self._take(self.parser.push(text))

    def finish(self) -> tuple[str, list[dict]]:
        return self._take(self.parser.finish()), self.calls
