"""A tool call's body read as it streams: its function's name as soon as the text holds it, then
its arguments as JSON text, given out piece by piece, whatever pieces the engine delivers.

Each format's reader writes the JSON the format's mlx-lm parser reads back from the whole body
(answer.AnswerParser checks it against that parser once the body has ended):

- JsonCall (mlx-lm's json_tools: Qwen3 and the fallback convention), `{"name": ..., "arguments":
  {...}}`: the arguments are given out as written, all but what may be the object's closing brace.
- XmlCall (qwen3_coder: Qwen3-Coder, Qwen3.5), `<function=NAME><parameter=KEY>\\nVALUE\\n</parameter>
  </function>`: a string parameter's value is given out as it comes; another's once it is whole,
  converted by mlx-lm's parser as it converts it in a whole call.
- Gemma4Call (gemma4), `call:NAME{key:<|"|>text<|"|>,n:3}`: rewritten as JSON as it comes
  (quoted keys, `<|"|>` strings as JSON strings), as mlx-lm's parser rewrites it.
- HarmonyCall (gpt-oss): the name is in the message header, the body is the arguments' JSON.
- WholeCall (mlx-lm's other parsers): nothing until the body has ended; the parser reads it then.
"""

import json
import re
from typing import Callable, Optional

STRING_TYPES = {"string", "str", "text", "varchar", "char", "enum"}  # qwen3_coder keeps these as written


def json_text(text: str) -> str:
    """`text` inside a JSON string: escaping is per character, so pieces escape as the whole does."""
    return json.dumps(text, ensure_ascii=False)[1:-1]


def closing_at(text: str, start: int, brace: bool) -> int:
    """Where `text` (from `start`) ends but for trailing whitespace and, with `brace`, one closing
    brace and the whitespace around it: what may still close the call, held until the body ends.
    Looked for from the end, so that a long body costs no more to read than a short one."""
    end = len(text)
    while end > start and text[end - 1].isspace():
        end -= 1
    if brace and end > start and text[end - 1] == "}":
        end -= 1
        while end > start and text[end - 1].isspace():
            end -= 1
    return end


def held_prefix(text: str, marker: str) -> int:
    """How many of `text`'s last characters may begin `marker` (and must wait for what follows)."""
    for k in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-k:]):
            return k
    return 0


class CallReader:
    """One call's body: `feed` takes its text as it arrives and returns the arguments' JSON text
    that can be given out now; `name` is set once known.  `body` keeps all of it (for mlx-lm's
    parser), `args` what was given out."""

    def __init__(self, tools: list, parse: Callable, name: Optional[str] = None):
        self.tools, self.parse, self.name = tools, parse, name
        self.body, self.args = "", ""

    def feed(self, text: str) -> str:
        self.body += text
        delta = self._read()
        self.args += delta
        return delta

    def _read(self) -> str:
        return ""


class WholeCall(CallReader):
    """A format read only whole (its parser, once the body has ended)."""


class RawJson(CallReader):
    """A reader whose arguments are JSON text as the model writes it, from `at` on (leading
    whitespace skipped), given out but for what `closing_at` holds."""

    at: Optional[int] = None
    brace = False  # the body's own object closes after the arguments (JsonCall)

    def _raw(self) -> str:
        body = self.body
        while self.at < len(body) and body[self.at].isspace() and not self.args:
            self.at += 1
        return body[self.at + len(self.args) : closing_at(body, self.at, self.brace)]


class HarmonyCall(RawJson):
    """The body is the arguments' JSON, given out as written (trailing whitespace held: the
    message may end there)."""

    at = 0

    def _read(self) -> str:
        return self._raw()


JSON_NAME = re.compile(r'\s*\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"')
JSON_ARGUMENTS = re.compile(r'\s*,\s*"arguments"\s*:')


class JsonCall(RawJson):
    """`{"name": NAME, "arguments": ARGS}`: the name once its string is closed, then ARGS as
    written, but for what may be the call object's closing brace.  A body laid out otherwise
    (arguments first, say) is read whole at its end."""

    brace = True

    def _read(self) -> str:
        if self.name is None:
            match = JSON_NAME.match(self.body)
            if not match:
                return ""
            self.name, self.name_end = json.loads(f'"{match.group(1)}"'), match.end()
        if self.at is None:
            match = JSON_ARGUMENTS.match(self.body, self.name_end)
            if not match:
                return ""
            self.at = match.end()
        return self._raw()


XML_NAME = re.compile(r"\s*([^\s<>]+)")  # qwen3_coder's: a name ends at whitespace or a tag
FUNCTION, PARAMETER, CLOSE_PARAMETER, CLOSE_FUNCTION = "<function=", "<parameter=", "</parameter>", "</function>"


class XmlCall(CallReader):
    """Qwen3-Coder's call: each parameter becomes `"KEY": VALUE` in a JSON object, the object
    closed at `</function>`.  Values as mlx-lm's qwen3_coder converts them: one newline either
    side dropped, "null" is null, a string-typed (or undeclared) parameter's text as written."""

    at = 0  # where the body is read up to (past a tag)
    key: Optional[str] = None  # the parameter whose value is being read
    value_at = seen = 0  # where its value starts; where its closing tag may start
    opened = quoted = done = string = False
    sent = 0  # characters of a string value given out

    def _read(self) -> str:
        out = []
        while not self.done:
            if self.name is None and not self._function():
                break
            if self.key is None and not self._next_parameter(out):
                break
            if self.key is not None and not self._value(out):
                break
        return "".join(out)

    def _tag(self, tag: str) -> Optional[tuple[str, int]]:
        """The name in `tag=NAME>` at the read position's next `tag`, and where it ends."""
        start = self.body.find(tag, self.at)
        close = self.body.find(">", start) if start >= 0 else -1
        if close < 0:
            return None
        match = XML_NAME.match(self.body, start + len(tag), close)
        return (match.group(1) if match else ""), close + 1

    def _function(self) -> bool:
        found = self._tag(FUNCTION)
        if found is None:
            return False
        self.name, self.at = found
        return True

    def _next_parameter(self, out: list) -> bool:
        parameter = self.body.find(PARAMETER, self.at)
        end = self.body.find(CLOSE_FUNCTION, self.at)
        if end >= 0 and (parameter < 0 or end < parameter):
            out.append("}" if self.opened else "{}")
            self.done = True
            return False
        found = self._tag(PARAMETER) if parameter >= 0 else None
        if found is None:
            return False
        self.key, self.value_at = found
        self.at, self.seen, self.quoted, self.sent, self.string = (
            self.value_at,
            self.value_at,
            False,
            0,
            self._is_string(),
        )
        out.append(("{" if not self.opened else ", ") + json.dumps(self.key, ensure_ascii=False) + ": ")
        self.opened = True
        return True

    def _value(self, out: list) -> bool:
        body = self.body
        end = body.find(CLOSE_PARAMETER, self.seen)
        if end < 0:  # still coming: a string value goes out but for what may close it
            self.seen = max(self.value_at, len(body) - len(CLOSE_PARAMETER))
            if self.string and len(body) > self.value_at:
                first = self.value_at + body.startswith("\n", self.value_at)
                tail = body[-len(CLOSE_PARAMETER) - 1 :]
                stop = max(first, len(body) - held_prefix(tail, "\n" + CLOSE_PARAMETER))
                if self.quoted or not "null".startswith(body[first:stop].lower()):
                    out.append(("" if self.quoted else '"') + json_text(body[first + self.sent : stop]))
                    self.quoted, self.sent = True, stop - first
            return False
        raw = body[self.value_at : end]
        text = raw[1:] if raw.startswith("\n") else raw
        text = text[:-1] if text.endswith("\n") else text
        if self.quoted:
            out.append(json_text(text[self.sent :]) + '"')
        else:
            out.append(json.dumps(self._converted(raw, text), ensure_ascii=False))
        self.key, self.at = None, end + len(CLOSE_PARAMETER)
        return True

    def _schema(self) -> dict:
        for tool in self.tools or []:
            function = tool.get("function") or {}
            if function.get("name") == self.name:
                return (function.get("parameters") or {}).get("properties") or {}
        return {}

    def _is_string(self) -> bool:
        """Whether mlx-lm keeps the value as written: a string-typed parameter, or one the tool does
        not declare (one declared without a type may be JSON: it waits for its end)."""
        schema = self._schema()
        if self.key not in schema:
            return True
        kind = schema[self.key].get("type") if isinstance(schema[self.key], dict) else None
        return kind is not None and str(kind).strip().lower() in STRING_TYPES

    def _converted(self, raw: str, text: str):
        """A whole value as mlx-lm's parser converts it (through the parser itself)."""
        try:
            call = self.parse(
                f"{FUNCTION}{self.name}>{PARAMETER}{self.key}>{raw}{CLOSE_PARAMETER}{CLOSE_FUNCTION}", self.tools
            )
            return call["arguments"][self.key]
        except Exception:  # a value the parser refuses: its text, rather than nothing
            return None if text.lower() == "null" else text


GEMMA_NAME = re.compile(r"\s*call:([\w-]+)\{")  # mlx-lm's gemma4 call, up to its arguments' brace
GEMMA_QUOTE = '<|"|>'
WORD = re.compile(r"\w+")


class Gemma4Call(CallReader):
    """`call:NAME{...}`: the arguments rewritten as JSON character by character: `<|"|>` strings
    become JSON strings, a bare word right after `{` or `,` and followed by `:` a quoted key (the
    rule mlx-lm's gemma4 parser applies), everything else as written, up to the closing brace."""

    at = depth = 0
    in_string = done = False
    previous = ""  # the character before the read position

    def _read(self) -> str:
        if self.name is None:
            match = GEMMA_NAME.match(self.body)
            if not match:
                return ""
            self.name, self.at = match.group(1), match.end() - 1
        out, body = [], self.body
        while self.at < len(body) and not self.done:
            if self.in_string:
                close = body.find(GEMMA_QUOTE, self.at)
                stop = close if close >= 0 else len(body) - held_prefix(body[self.at :], GEMMA_QUOTE)
                out.append(json_text(body[self.at : stop]))
                if close < 0:
                    self.at = stop
                    break
                out.append('"')
                self.at, self.in_string, self.previous = close + len(GEMMA_QUOTE), False, '"'
            elif body.startswith(GEMMA_QUOTE, self.at):
                out.append('"')
                self.at, self.in_string = self.at + len(GEMMA_QUOTE), True
            elif GEMMA_QUOTE.startswith(body[self.at :]):
                break  # the start of a quote, or of nothing yet
            elif self.previous in ("{", ",") and WORD.match(body, self.at):
                word = WORD.match(body, self.at)
                if word.end() == len(body):
                    break  # the word may go on
                key = body[word.end()] == ":"
                out.append(json.dumps(word.group(), ensure_ascii=False) + ":" if key else word.group())
                self.at, self.previous = word.end() + key, ":" if key else word.group()[-1]
            else:
                char = body[self.at]
                self.depth += (char in "{[") - (char in "}]")
                self.done = self.depth == 0
                out.append(char)
                self.at, self.previous = self.at + 1, char
        return "".join(out)


READERS = {"json_tools": JsonCall, "qwen3_coder": XmlCall, "gemma4": Gemma4Call}
