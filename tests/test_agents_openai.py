"""Agents' clients against the server: Codex CLI's Responses requests (raw, as it sends them, and
through the `openai` SDK as it consumes the stream), forced tool calls in all three APIs
(tool_choice "required" / a named tool, Anthropic's any / tool) and `langchain-openai`'s
structured output and bind_tools.  The tiny model's weights are random: a forced call is valid
only because the grammar leaves the model no other way."""

import json
from pathlib import Path
from types import SimpleNamespace
from typing import Literal

import httpx
import pytest

openai = pytest.importorskip("openai", reason="the dev extra installs the openai client")
anthropic = pytest.importorskip("anthropic", reason="the dev extra installs the anthropic client")
langchain_openai = pytest.importorskip("langchain_openai", reason="the dev extra installs langchain-openai")
jsonschema = pytest.importorskip("jsonschema", reason="the dev extra installs jsonschema")

from mlx_lm.tokenizer_utils import TokenizerWrapper  # noqa: E402
from mlx_lm.tool_parsers import json_tools, mistral, qwen3_coder  # noqa: E402
from pydantic import BaseModel, Field  # noqa: E402

from live_server import live_server  # noqa: E402
from dflash_mlx import generate, load  # noqa: E402
from dflash_mlx.serve import worker  # noqa: E402
from dflash_mlx.serve.forced_tools import forced_call_grammar  # noqa: E402
from dflash_mlx.serve.protocol import RequestError, prompt_tokens  # noqa: E402
from dflash_mlx.serve.responses_api import function_tools, input_messages  # noqa: E402
from dflash_mlx.serve.answer import ToolCalls  # noqa: E402
from scripted_engine import scripted_batch  # noqa: E402

pytestmark = pytest.mark.slow  # live servers and real clients

# bounded schemas: a random model writes a value until the grammar lets it stop
WEATHER = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 8},
        "unit": {"enum": ["celsius", "fahrenheit"]},
        "days": {"type": "integer", "minimum": 1, "maximum": 7},
    },
    "required": ["city", "unit", "days"],
    "additionalProperties": False,
}
SEARCH = {
    "type": "object",
    "properties": {"query": {"type": "string", "maxLength": 6}, "exact": {"type": "boolean"}},
    "required": ["query", "exact"],
    "additionalProperties": False,
}
SCHEMAS = {"weather": WEATHER, "search": SEARCH}
CHAT_TOOLS = [
    {"type": "function", "function": {"name": name, "parameters": schema}} for name, schema in SCHEMAS.items()
]
RESPONSES_TOOLS = [{"type": "function", "name": name, "parameters": schema} for name, schema in SCHEMAS.items()]
ANTHROPIC_TOOLS = [{"name": name, "input_schema": schema} for name, schema in SCHEMAS.items()]
USER = {"role": "user", "content": "What is the weather in Paris?"}
PATCH = "*** Begin Patch\n*** Add File: hello.txt\n+hello\n*** End Patch\n"
APPLY_PATCH_GRAMMAR = """start: begin_patch hunk+ end_patch
begin_patch: "*** Begin Patch" LF
end_patch: "*** End Patch" LF?
hunk: add_hunk | delete_hunk
add_hunk: "*** Add File: " filename LF add_line+
delete_hunk: "*** Delete File: " filename LF
filename: /(.+)/
add_line: "+" /(.*)/ LF
%import common.LF"""
APPLY_PATCH = {
    "type": "custom",
    "name": "apply_patch",
    "description": "Use the `apply_patch` tool to edit files. This is a FREEFORM tool, so do not wrap the patch in JSON.",
    "format": {"type": "grammar", "syntax": "lark", "definition": APPLY_PATCH_GRAMMAR},
}
SHELL = {
    "type": "function",
    "name": "shell",
    "description": "Runs a shell command and returns its output.",
    "strict": False,
    "parameters": {
        "type": "object",
        "properties": {
            "command": {"type": "array", "items": {"type": "string"}},
            "workdir": {"type": "string"},
            "timeout_ms": {"type": "number"},
        },
        "required": ["command"],
        "additionalProperties": False,
    },
}
UPDATE_PLAN = {
    "type": "function",
    "name": "update_plan",
    "description": "Updates the task plan.",
    "strict": False,
    "parameters": {
        "type": "object",
        "properties": {
            "explanation": {"type": "string"},
            "plan": {
                "type": "array",
                "items": {
                    "type": "object",
                    "properties": {"step": {"type": "string"}, "status": {"type": "string"}},
                    "required": ["step", "status"],
                    "additionalProperties": False,
                },
            },
        },
        "required": ["plan"],
        "additionalProperties": False,
    },
}
REASONING_SUMMARY = "Thinking about which files to read"


def codex_body(**changes) -> dict:
    """A turn as Codex CLI sends it: the whole history each time, streamed, stateless."""
    body = {
        "model": "gpt-5-codex",
        "instructions": "You are Codex, a coding agent. Be concise.",
        "input": [
            {
                "type": "message",
                "role": "developer",
                "content": [{"type": "input_text", "text": "<permissions>workspace-write</permissions>"}],
            },
            {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Add hello.txt"}]},
            {
                "type": "reasoning",
                "summary": [{"type": "summary_text", "text": REASONING_SUMMARY}],
                "content": None,
                "encrypted_content": "gAAAAABo-opaque-blob",
            },
            {"type": "function_call", "name": "shell", "arguments": '{"command": ["ls"]}', "call_id": "call_ls"},
            {"type": "function_call_output", "call_id": "call_ls", "output": "README.md\nsrc"},
            {
                "type": "custom_tool_call",
                "status": "completed",
                "call_id": "call_patch",
                "name": "apply_patch",
                "input": PATCH,
            },
            {"type": "custom_tool_call_output", "call_id": "call_patch", "output": "Success. Updated: A hello.txt"},
            {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Added hello.txt."}]},
            {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Thanks. Anything else?"}]},
        ],
        "tools": [SHELL, APPLY_PATCH, UPDATE_PLAN],
        "tool_choice": "auto",
        "parallel_tool_calls": False,
        "reasoning": {"effort": "medium", "summary": "auto"},
        "store": False,
        "stream": True,
        "include": ["reasoning.encrypted_content"],
        "prompt_cache_key": "0199a7c2-5b1e-7c41-9d0e-3f1c2b4a5d6e",
        "client_metadata": {"originator": "codex_cli_rs"},
        "max_output_tokens": 12,  # Codex sends none; a short answer keeps the test quick
    }
    return {**body, **changes}


@pytest.fixture(scope="module")
def live(tiny_dirs):
    model_dir, draft_dir = tiny_dirs
    model, tokenizer = load(str(model_dir), str(draft_dir), adaptive=False)
    with live_server(model, tokenizer, max_queue=4, prompt_cache_bytes=0) as served:
        yield served


@pytest.fixture
def scripted(live, monkeypatch):
    """The engine replaced by a script: each request gets the next list of text pieces; the
    prompts it was asked to continue are recorded (as text)."""
    replies, prompts = [], []

    def reply(prompt):
        prompts.append(live.tokenizer.decode(prompt))
        return replies.pop(0)

    monkeypatch.setattr(worker, "BatchGenerator", scripted_batch(reply))
    single = worker.Worker(live.model, live.tokenizer, 4)
    monkeypatch.setattr(live.server, "worker", single)
    yield replies, prompts
    single.stop()


def assert_valid_call(name: str, arguments, among=tuple(SCHEMAS)) -> None:
    """A call of one of `among`, its arguments (a JSON text or an object) valid against its schema."""
    assert name in among
    jsonschema.validate(json.loads(arguments) if isinstance(arguments, str) else arguments, SCHEMAS[name])


def sse_events(reply: httpx.Response) -> list[dict]:
    return [json.loads(line[len("data: ") :]) for line in reply.iter_lines() if line.startswith("data: ")]


def offline_answer(live, messages: list[dict], tools: list[dict], max_tokens: int) -> str:
    return generate(live.model, live.tokenizer, prompt_tokens(live.tokenizer, messages, tools), max_tokens=max_tokens)


# ---------------------------------------------------------------- forced calls, three APIs


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize(
    "tool_choice, among",
    [("required", tuple(SCHEMAS)), ({"type": "function", "function": {"name": "search"}}, ("search",))],
)
def test_chat_tool_choice_forces_a_valid_call(live, tool_choice, among, stream):
    request = dict(model="tiny", messages=[USER], tools=CHAT_TOOLS, tool_choice=tool_choice, max_tokens=120)
    if stream:
        chunks = list(live.openai.chat.completions.create(**request, stream=True))
        deltas = [c for chunk in chunks if chunk.choices for c in chunk.choices[0].delta.tool_calls or []]
        # a call streams as a client assembles it: its name first, then pieces of its arguments
        assert {c.index for c in deltas} == {0} and deltas[0].function.name
        arguments = "".join(c.function.arguments or "" for c in deltas)
        call = SimpleNamespace(function=SimpleNamespace(name=deltas[0].function.name, arguments=arguments))
        finish = chunks[-1].choices[0].finish_reason
    else:
        reply = live.openai.chat.completions.create(**request)
        (call,) = reply.choices[0].message.tool_calls
        finish = reply.choices[0].finish_reason
        assert reply.choices[0].message.content is None
    assert finish == "tool_calls"
    assert_valid_call(call.function.name, call.function.arguments, among)


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize(
    "tool_choice, among", [("required", tuple(SCHEMAS)), ({"type": "function", "name": "search"}, ("search",))]
)
def test_responses_tool_choice_forces_a_valid_call(live, tool_choice, among, stream):
    request = dict(model="tiny", input=[USER], tools=RESPONSES_TOOLS, tool_choice=tool_choice, max_output_tokens=120)
    if stream:  # as Codex reads a stream: the items done, then the response completed
        events = list(live.openai.responses.create(**request, stream=True))
        output = [e.item for e in events if e.type == "response.output_item.done"]
        assert events[-1].type == "response.completed"
    else:
        output = live.openai.responses.create(**request).output
    (call,) = output
    assert call.type == "function_call" and call.status == "completed"
    assert_valid_call(call.name, call.arguments, among)


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize(
    "tool_choice, among", [({"type": "any"}, tuple(SCHEMAS)), ({"type": "tool", "name": "search"}, ("search",))]
)
def test_anthropic_tool_choice_forces_a_valid_call(live, tool_choice, among, stream):
    request = dict(model="tiny", max_tokens=120, messages=[USER], tools=ANTHROPIC_TOOLS, tool_choice=tool_choice)
    if stream:
        with live.anthropic.messages.stream(**request) as events:
            message = events.get_final_message()
    else:
        message = live.anthropic.messages.create(**request)
    (block,) = message.content
    assert message.stop_reason == "tool_use" and block.type == "tool_use"
    assert_valid_call(block.name, block.input, among)


def test_tool_choice_none_offers_no_tools(live):
    """The answer is the one the conversation gets without tools: greedy, token for token."""
    offline = offline_answer(live, [USER], [], 10)
    chat = live.openai.chat.completions.create(
        model="tiny", messages=[USER], tools=CHAT_TOOLS, tool_choice="none", max_tokens=10
    )
    response = live.openai.responses.create(
        model="tiny", input=[USER], tools=RESPONSES_TOOLS, tool_choice="none", max_output_tokens=10
    )
    message = live.anthropic.messages.create(
        model="tiny", max_tokens=10, messages=[USER], tools=ANTHROPIC_TOOLS, tool_choice={"type": "none"}
    )
    assert chat.choices[0].message.content == response.output_text == message.content[0].text == offline


@pytest.mark.parametrize(
    "path, fields, needle",
    [
        (
            "/v1/chat/completions",
            {"tools": CHAT_TOOLS, "tool_choice": {"type": "function", "function": {"name": "x"}}},
            "x",
        ),
        ("/v1/chat/completions", {"tool_choice": "required"}, "only when tools are given"),
        ("/v1/chat/completions", {"tools": CHAT_TOOLS, "tool_choice": {"type": "allowed_tools"}}, "tool_choice"),
        ("/v1/responses", {"tools": RESPONSES_TOOLS, "tool_choice": {"type": "function", "name": "x"}}, "x"),
        ("/v1/messages", {"tools": ANTHROPIC_TOOLS, "tool_choice": {"type": "tool", "name": "x"}}, "x"),
        ("/v1/messages", {"tools": ANTHROPIC_TOOLS, "tool_choice": {"type": "tool"}}, "tool_choice.name"),
    ],
)
def test_a_call_that_cannot_be_forced_is_refused(live, path, fields, needle):
    body = {"model": "tiny", "max_tokens": 4, **fields}
    body.update({"input": [USER]} if path == "/v1/responses" else {"messages": [USER]})
    reply = httpx.post(live.base + path, json=body)
    assert reply.status_code == 400, reply.text
    assert needle in reply.json()["error"]["message"]


def coder_tokenizer(tokenizer, parser) -> TokenizerWrapper:
    """The tiny tokenizer as a model whose template teaches `parser`'s tool-call format."""
    return TokenizerWrapper(
        tokenizer._tokenizer,
        tool_parser=parser.parse_tool_call,
        tool_call_start=parser.tool_call_start,
        tool_call_end=parser.tool_call_end,
    )


@pytest.mark.parametrize("parser", [json_tools, qwen3_coder])
@pytest.mark.parametrize("tools", [CHAT_TOOLS, CHAT_TOOLS[:1]], ids=["any", "named"])
def test_a_forced_call_is_written_in_the_models_own_format(live, parser, tools):
    """Qwen3's JSON calls and Qwen3-Coder's <function=...><parameter=...> calls: what the grammar
    admits is what mlx-lm's parser for the format reads back, valid against the schema."""
    tokenizer = coder_tokenizer(live.tokenizer, parser)
    grammar = forced_call_grammar(tokenizer, live.model.target.vocab_size, tools)
    prompt = prompt_tokens(tokenizer, [USER], CHAT_TOOLS)
    text = generate(live.model, tokenizer, prompt, max_tokens=160, grammar=grammar)
    assert text.startswith(parser.tool_call_start + "\n") and text.endswith(parser.tool_call_end)
    calls = ToolCalls(tokenizer, CHAT_TOOLS)
    assert calls.push(text) == ""
    rest, (call,) = calls.finish()
    assert rest == ""
    assert_valid_call(call["function"]["name"], call["function"]["arguments"], [t["function"]["name"] for t in tools])


def test_forcing_a_format_without_a_grammar_is_refused_by_name(live):
    tokenizer = coder_tokenizer(live.tokenizer, mistral)
    with pytest.raises(RequestError, match=r"tool-call format \(mistral\)"):
        forced_call_grammar(tokenizer, live.model.target.vocab_size, CHAT_TOOLS)


# ---------------------------------------------------------------- Codex CLI: Responses as it sends them


def test_a_codex_turn_streams_what_offline_generation_writes(live):
    """A realistic Codex body (reasoning replayed, function and custom tool calls, a custom
    apply_patch tool, include, store, prompt_cache_key...) is served, streamed as the reference
    does, its answer the offline greedy one for the same conversation; no reasoning items."""
    body = codex_body()
    with httpx.stream("POST", live.base + "/v1/responses", json=body, timeout=120) as reply:
        assert reply.status_code == 200 and "x-dflash-ignored-fields" not in reply.headers
        events = sse_events(reply)
    kinds = [e["type"] for e in events]
    assert kinds[:2] == ["response.created", "response.in_progress"]
    assert kinds[-1] in ("response.completed", "response.incomplete")
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    done = [e["item"] for e in events if e["type"] == "response.output_item.done"]
    assert [item["type"] for item in done] == ["message"]
    final = events[-1]["response"]
    assert final["reasoning"] == body["reasoning"] and final["parallel_tool_calls"] is False
    tools = function_tools(body["tools"]).functions
    messages = [{"role": "system", "content": body["instructions"]}] + input_messages(body["input"])
    text = "".join(e["delta"] for e in events if e["type"] == "response.output_text.delta")
    assert text == done[0]["content"][0]["text"] == offline_answer(live, messages, tools, 12)


def test_a_codex_history_reaches_the_prompt_and_a_patch_comes_back_as_a_custom_call(live, scripted):
    """Everything Codex replays is in the prompt (the custom tool with its grammar, the patch it
    sent and its result, the shell call and its output) but the reasoning; an apply_patch call
    comes back as a custom_tool_call item, its input the patch, with its input events."""
    replies, prompts = scripted
    call = json.dumps({"name": "apply_patch", "arguments": {"input": PATCH}})
    replies.append(["<tool_call>", call[:20], call[20:], "</tool_call>"])
    with httpx.stream("POST", live.base + "/v1/responses", json=codex_body(), timeout=60) as reply:
        events = sse_events(reply)
    (prompt,) = prompts
    for seen in ("apply_patch", "FREEFORM tool", "add_hunk", json.dumps(PATCH)[1:-1], "Success. Updated", "src"):
        assert seen in prompt
    assert REASONING_SUMMARY not in prompt and "opaque-blob" not in prompt
    kinds = [e["type"] for e in events]
    assert kinds[2:-1] == [
        "response.output_item.added",
        "response.custom_tool_call_input.delta",
        "response.custom_tool_call_input.done",
        "response.output_item.done",
    ]
    item = events[-2]["item"]
    assert item["type"] == "custom_tool_call" and item["name"] == "apply_patch" and item["input"] == PATCH
    assert item["call_id"].startswith("call_") and events[-3]["input"] == PATCH
    assert events[-1]["type"] == "response.completed" and events[-1]["response"]["output"] == [item]


def test_a_custom_tool_round_trip_through_the_sdk(live, scripted):
    """The openai SDK parses the custom_tool_call item, and sends it back with its output."""
    replies, prompts = scripted
    call = json.dumps({"name": "apply_patch", "arguments": {"input": PATCH}})
    replies += [["<tool_call>" + call + "</tool_call>"], ["Done."]]
    question = [{"role": "user", "content": "Add hello.txt"}]
    first = live.openai.responses.create(model="tiny", input=question, tools=[APPLY_PATCH])
    (item,) = first.output
    assert item.type == "custom_tool_call" and item.name == "apply_patch" and item.input == PATCH
    follow = question + [
        item.model_dump(exclude_none=True),
        {"type": "custom_tool_call_output", "call_id": item.call_id, "output": "Success. Updated: A hello.txt"},
    ]
    events = list(live.openai.responses.create(model="tiny", input=follow, tools=[APPLY_PATCH], stream=True))
    assert events[-1].response.output_text == "Done." and "Success. Updated" in prompts[1]


def test_the_sdk_sends_codex_fields_and_gets_the_offline_answer(live):
    """reasoning, include, store, parallel_tool_calls, prompt_cache_key through the SDK: accepted,
    no effect on a greedy answer, none reported as ignored."""
    reply = live.openai.responses.with_raw_response.create(
        model="tiny",
        instructions="Be brief.",
        input=[USER],
        reasoning={"effort": "medium", "summary": "auto"},
        include=["reasoning.encrypted_content"],
        store=False,
        parallel_tool_calls=False,
        prompt_cache_key="session-1",
        tools=[APPLY_PATCH, *RESPONSES_TOOLS],
        max_output_tokens=10,
        extra_body={"client_metadata": {"originator": "codex_cli_rs"}},
    )
    response = reply.parse()
    tools = function_tools([APPLY_PATCH, *RESPONSES_TOOLS]).functions
    offline = offline_answer(live, [{"role": "system", "content": "Be brief."}, USER], tools, 10)
    assert (
        "x-dflash-ignored-fields" not in reply.headers and "ignored_fields" not in response.usage.model_extra["dflash"]
    )
    assert [item.type for item in response.output] == ["message"] and response.output_text == offline


# ---------------------------------------------------------------- LangChain


class Forecast(BaseModel):
    """A weather forecast."""

    city: str = Field(max_length=8)
    unit: Literal["celsius", "fahrenheit"]
    days: int = Field(ge=1, le=7)


@pytest.mark.parametrize("method", [None, "function_calling"], ids=["default", "function_calling"])
def test_langchain_structured_output(live, method):
    """with_structured_output's default (json_schema, a response_format) and function_calling
    (a forced tool call): a parsed object either way."""
    chat = langchain_openai.ChatOpenAI(
        base_url=live.base + "/v1", api_key="none", model="some-local-model", max_tokens=120, max_retries=0
    )
    structured = chat.with_structured_output(Forecast, **({"method": method} if method else {}))
    forecast = structured.invoke("Weather in Paris for three days?")
    assert isinstance(forecast, Forecast)
    jsonschema.validate(forecast.model_dump(), Forecast.model_json_schema())


class Search(BaseModel):
    """Search the web."""

    query: str = Field(max_length=6)
    exact: bool


def test_langchain_bind_tools_required(live):
    chat = langchain_openai.ChatOpenAI(
        base_url=live.base + "/v1", api_key="none", model="some-local-model", max_tokens=120, max_retries=0
    )
    reply = chat.bind_tools([Search, Forecast], tool_choice="required").invoke("Weather in Paris?")
    (call,) = reply.tool_calls
    chosen = {"Search": Search, "Forecast": Forecast}[call["name"]]
    jsonschema.validate(call["args"], chosen.model_json_schema())


# ---------------------------------------------------------------- a real client's request, replayed

CODEX_REQUEST = Path(__file__).parent / "fixtures" / "codex-0.171.0-request.json"


def test_codex_with_only_a_base_url_is_answered(wide_dirs, monkeypatch, caplog):
    """Codex 0.171's own first request (recorded): its namespace's functions are offered under
    their names and a call of one comes back naming its namespace; the hosted web_search is left
    out of the prompt with one log line."""
    body = {**json.loads(CODEX_REQUEST.read_text()), "model": "tiny"}
    prompts = []
    call = json.dumps({"name": "spawn_agent", "arguments": {"message": "look around"}})

    def reply(prompt):
        prompts.append(tokenizer.decode(prompt))
        return ["<tool_call>", call, "</tool_call>"]

    model, tokenizer = load(str(wide_dirs[0]), use_draft=False, adaptive=False)
    monkeypatch.setattr(worker, "BatchGenerator", scripted_batch(reply))
    with (
        caplog.at_level("INFO", logger="dflash_mlx.serve"),
        live_server(model, tokenizer, prompt_cache_bytes=0) as live,
    ):
        with httpx.stream("POST", live.base + "/v1/responses", json=body, timeout=120) as answer:
            assert answer.status_code == 200, answer.read()
            events = sse_events(answer)
    (prompt,) = prompts
    assert '"name": "spawn_agent"' in prompt and '"name": "exec_command"' in prompt
    assert "web_search" not in prompt and "multi_agent_v1" not in prompt
    assert [r.getMessage() for r in caplog.records if "left out of the prompt" in r.getMessage()] == [
        "left out of the prompt, run by the reference's servers and not here: tools[8] (web_search)"
    ]
    (item,) = events[-1]["response"]["output"]
    assert item["type"] == "function_call" and item["name"] == "spawn_agent" and item["namespace"] == "multi_agent_v1"
