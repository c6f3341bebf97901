"""Claude Code and the `anthropic` SDK served as the Anthropic reference describes: requests shaped
as Claude Code sends them (its billing-header system block, cache_control marks, ~20 tools,
thinking, metadata, max_tokens 32000, streamed, beta headers) against a tiny model, max_tokens cut
to the context, usage split as the reference splits it, a session's prefix cache kept across the
requests Claude Code sends between turns, prefill, the models endpoints and browser pages on
localhost.  Greedy answers are checked against offline generation from the same prompt tokens."""

import json
import time

import httpx
import pytest

openai = pytest.importorskip("openai", reason="the dev extra installs the openai client")
anthropic = pytest.importorskip("anthropic", reason="the dev extra installs the anthropic client")

from live_server import live_server  # noqa: E402
from dflash_mlx import generate, load  # noqa: E402
from dflash_mlx.serve.protocol import prompt_tokens  # noqa: E402

pytestmark = pytest.mark.slow  # live servers and real clients

CONTEXT = 4096  # the tiny model's
SENTENCE = "The quick brown fox jumps over the lazy dog. "  # about 10 of the tiny tokenizer's tokens
HEADERS = {  # as Claude Code sends them
    "anthropic-version": "2023-06-01",
    "anthropic-beta": "claude-code-20250219,interleaved-thinking-2025-05-14,context-management-2025-06-27",
    "x-api-key": "sk-ant-none",
    "user-agent": "claude-cli/2.1.100 (external, cli)",
}
TOOL_NAMES = [
    "Task", "Bash", "Glob", "Grep", "LS", "ExitPlanMode", "Read", "Edit", "MultiEdit", "Write", "NotebookEdit",
    "WebFetch", "TodoWrite", "WebSearch", "BashOutput", "KillShell", "SlashCommand", "AskUserQuestion", "Skill",
    "ListMcpResources",
]  # fmt: skip
SYSTEM_TEXTS = [
    "You are Claude Code, Anthropic's official CLI for Claude.",
    "You are an interactive CLI tool that helps users with software engineering tasks.",
]


def billing_header(cch: str) -> dict:
    """Claude Code's first system block: its cch changes with every request."""
    return {
        "type": "text",
        "text": f"x-anthropic-billing-header: cc_version=2.1.100.7b4; cc_entrypoint=cli; cch={cch};",
    }


def claude_code_tools() -> list[dict]:
    """20 tools as Claude Code sends them (small schemas: the tiny model's context is 4096 tokens)."""
    tools = [
        {
            "name": name,
            "description": name,
            "input_schema": {
                "type": "object",
                "properties": {"a": {"type": "string"}},
                "required": ["a"],
                "additionalProperties": False,
            },
        }
        for name in TOOL_NAMES
    ]
    tools[0]["input_schema"]["$schema"] = "http://json-schema.org/draft-07/schema#"
    tools[1]["defer_loading"] = False
    tools[-1]["cache_control"] = {"type": "ephemeral"}
    return tools


def user_turn(text: str) -> dict:
    return {
        "role": "user",
        "content": [
            {"type": "text", "text": "<system-reminder>Be careful.</system-reminder>"},
            {"type": "text", "text": text, "cache_control": {"type": "ephemeral"}},
        ],
    }


def claude_code_body(messages: list[dict], cch: str = "eb6c6", **fields) -> dict:
    """A main-loop request as Claude Code sends it."""
    return {
        "model": "claude-sonnet-4-5-20250929",
        "max_tokens": 32000,
        "stream": True,
        "system": [
            billing_header(cch),
            {"type": "text", "text": SYSTEM_TEXTS[0], "cache_control": {"type": "ephemeral"}},
            {
                "type": "text",
                "text": SYSTEM_TEXTS[1],
                "cache_control": {"type": "ephemeral", "ttl": "1h", "scope": "global"},
            },
        ],
        "messages": messages,
        "tools": claude_code_tools(),
        "metadata": {"user_id": "user_0123_account__session_4567"},
        "thinking": {"type": "enabled", "budget_tokens": 31999},
        "context_management": {"edits": [{"type": "clear_thinking_20251015", "keep": "all"}]},
        "output_config": {"effort": "high"},
        **fields,
    }


def title_body(cch: str) -> dict:
    """Claude Code's side request between turns: a title for the session."""
    return {
        "model": "claude-haiku-4-5-20251001",
        "max_tokens": 32,
        "system": [billing_header(cch), {"type": "text", "text": "Write a 3-word title for the conversation."}],
        "messages": [{"role": "user", "content": "fix the bug in add"}],
        "metadata": {"user_id": "user_0123_account__session_4567"},
        "stream": False,
    }


@pytest.fixture(scope="module")
def live(tiny_dirs):
    model_dir, draft_dir = tiny_dirs
    model, tokenizer = load(str(model_dir), str(draft_dir), adaptive=False)
    with live_server(model, tokenizer, max_queue=4) as served:  # the prompt cache on, sized for the machine
        yield served


@pytest.fixture
def submitted(live, monkeypatch):
    """The prompt tokens of every job the server submits to its engine, in order."""
    prompts, submit = [], live.server.worker.submit
    monkeypatch.setattr(live.server.worker, "submit", lambda job: prompts.append(job.request.prompt) or submit(job))
    return prompts


def sse_events(response: httpx.Response) -> list[dict]:
    return [json.loads(line[6:]) for line in response.iter_lines() if line.startswith("data: ")]


def stream_messages(live, body: dict) -> tuple[httpx.Response, list[dict]]:
    with httpx.stream("POST", live.base + "/v1/messages?beta=true", json=body, headers=HEADERS, timeout=600) as reply:
        return reply, sse_events(reply)


def streamed_text(events: list[dict]) -> str:
    return "".join(e["delta"]["text"] for e in events if e["type"] == "content_block_delta")


def offline(live, prompt: list[int], max_tokens: int) -> str:
    return generate(live.model, live.tokenizer, prompt, max_tokens=max_tokens)


def chat_ids(tokenizer, messages: list[dict], tools: list[dict] = ()) -> list[int]:
    """The prompt a chat renders to, through the server's own rendering of OpenAI messages."""
    return prompt_tokens(tokenizer, messages, list(tools))


def function_tools(tools: list[dict]) -> list[dict]:
    return [
        {
            "type": "function",
            "function": {"name": t["name"], "description": t["description"], "parameters": t["input_schema"]},
        }
        for t in tools
    ]


def total_input(usage) -> int:
    """The reference's total input: the three input fields summed."""
    return usage["input_tokens"] + usage["cache_creation_input_tokens"] + usage["cache_read_input_tokens"]


# ---------------------------------------------------------------- a Claude Code turn


def test_a_claude_code_turn_is_served_to_the_end_of_the_context(live, submitted):
    """max_tokens 32000 on a 4096-token model: cut to what the context leaves after the prompt,
    the answer ends there with stop_reason model_context_window_exceeded, equal to offline generation; the billing
    header is not in the prompt, Claude Code's extra fields are taken or reported ignored."""
    body = claude_code_body([user_turn("fix the bug in add")])
    counted = httpx.post(
        live.base + "/v1/messages/count_tokens?beta=true",
        json={name: body[name] for name in ("model", "system", "messages", "tools")},
        headers=HEADERS,
    )
    reply, events = stream_messages(live, body)
    assert reply.status_code == 200
    assert reply.headers["x-dflash-ignored-fields"] == "context_management, output_config.effort"
    expected = chat_ids(
        live.tokenizer,
        [
            {"role": "system", "content": "".join(SYSTEM_TEXTS)},
            {"role": "user", "content": "<system-reminder>Be careful.</system-reminder>fix the bug in add"},
        ],
        function_tools(claude_code_tools()),
    )
    assert submitted == [expected] and counted.json() == {"input_tokens": len(expected)}
    kinds = [event["type"] for event in events]
    assert kinds[:2] == ["message_start", "ping"] and kinds[-2:] == ["message_delta", "message_stop"]
    start, delta = events[0]["message"]["usage"], events[-2]["usage"]
    assert total_input(start) == len(expected) and start["output_tokens"] == 0
    assert events[-2]["delta"]["stop_reason"] == "model_context_window_exceeded"  # not Claude Code's 32000
    assert delta["output_tokens"] == CONTEXT - len(expected) and total_input(delta) == len(expected)
    assert streamed_text(events) == offline(live, expected, CONTEXT - len(expected))


def test_a_prompt_longer_than_the_context_is_refused_by_name(live):
    too_long = SENTENCE * 420
    with pytest.raises(anthropic.BadRequestError, match=r"prompt is too long: \d+ tokens > 4095 maximum"):
        live.anthropic.messages.create(model="tiny", max_tokens=16000, messages=[{"role": "user", "content": too_long}])
    with pytest.raises(openai.BadRequestError) as caught:
        live.openai.chat.completions.create(
            model="tiny", max_tokens=8, messages=[{"role": "user", "content": too_long}]
        )
    assert caught.value.body["code"] == "context_length_exceeded" and "prompt is too long" in caught.value.message


def test_max_tokens_beyond_the_context_is_cut_in_every_api(live):
    """The OpenAI endpoints share the cut: a prompt 20 tokens short of the context, any max_tokens.
    The answer's end says it was the window's: Anthropic's model_context_window_exceeded; the
    OpenAI references' only length reasons ("length", "max_output_tokens") with
    usage.dflash.context_end; a client's own max_tokens is told apart."""
    prompt = [5] * (CONTEXT - 20)
    text = live.openai.completions.create(model="tiny", prompt=prompt, max_tokens=100000)
    assert text.choices[0].finish_reason == "length" and text.usage.completion_tokens == 20
    assert text.choices[0].text == offline(live, prompt, 20) and text.usage.dflash["context_end"] is True
    user = SENTENCE * 400
    chat = live.openai.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": user}], max_tokens=99999
    )
    room = CONTEXT - chat.usage.prompt_tokens
    assert chat.choices[0].finish_reason == "length" and chat.usage.completion_tokens == room < 200
    assert chat.usage.dflash["context_end"] is True
    message = live.anthropic.messages.create(
        model="tiny", max_tokens=16000, messages=[{"role": "user", "content": user}]
    )
    assert message.stop_reason == "model_context_window_exceeded" and message.usage.output_tokens == room
    assert message.content[0].text == chat.choices[0].message.content
    response = live.openai.responses.create(model="tiny", input=[{"role": "user", "content": user}])  # none sent
    assert response.status == "incomplete" and response.incomplete_details.reason == "max_output_tokens"
    assert response.usage.output_tokens == room and response.usage.dflash["context_end"] is True
    own = live.anthropic.messages.create(model="tiny", max_tokens=3, messages=[{"role": "user", "content": user}])
    assert own.stop_reason == "max_tokens" and own.usage.dflash["context_end"] is False
    own = live.openai.chat.completions.create(model="tiny", messages=[{"role": "user", "content": user}], max_tokens=3)
    assert own.choices[0].finish_reason == "length" and own.usage.dflash["context_end"] is False


# ---------------------------------------------------------------- fields Claude Code and the SDK send


@pytest.mark.parametrize(
    "fields",
    [
        {"thinking": {"type": "enabled", "budget_tokens": 1024}},
        {"thinking": {"type": "disabled"}},
        {"thinking": {"type": "adaptive"}},
        {"top_k": 40, "stop_sequences": ["\n\nHuman:"], "service_tier": "auto", "metadata": {"user_id": "u"}},
        {"cache_control": {"type": "ephemeral", "ttl": "1h"}},
    ],
)
def test_fields_claude_code_sends_are_taken(live, fields):
    """A model without a thinking mode answers without thinking blocks, as the reference allows."""
    body = claude_code_body([user_turn("hi")], max_tokens=4, stream=False, **fields)
    del body["context_management"], body["output_config"]
    reply = httpx.post(live.base + "/v1/messages", json=body, headers={**HEADERS, "anthropic-beta": "anything-at-all"})
    assert reply.status_code == 200, reply.text
    assert [block["type"] for block in reply.json()["content"]] == ["text"]
    assert "x-dflash-ignored-fields" not in reply.headers


@pytest.mark.parametrize(
    "fields, message",
    [
        (
            {"thinking": {"type": "enabled", "budget_tokens": 100}},
            "thinking.enabled.budget_tokens: Input should be greater than or equal to 1024",
        ),
        ({"thinking": {"type": "sometimes"}}, "thinking.type: Input should be 'enabled', 'disabled', 'adaptive'"),
        (
            {"mcp_servers": [{"type": "url", "url": "https://mcp.example", "name": "x"}]},
            "mcp_servers: this server connects to no MCP",
        ),
        ({"container": "container_1"}, "container: this server runs no code-execution containers"),
        ({"output_config": {"format": {"type": "xml"}}}, "output_config.format"),
    ],
)
def test_fields_the_server_cannot_honour_are_refused_by_name(live, fields, message):
    reply = httpx.post(
        live.base + "/v1/messages", json={**claude_code_body([user_turn("hi")]), **fields}, headers=HEADERS
    )
    assert reply.status_code == 400 and reply.json()["error"]["message"].startswith(message), reply.text


def test_output_config_format_is_followed(live):
    schema = {"type": "object", "properties": {"title": {"type": "string"}}, "required": ["title"]}
    reply = live.anthropic.messages.create(
        model="tiny",
        max_tokens=48,
        messages=[{"role": "user", "content": "a title"}],
        extra_body={"output_config": {"format": {"type": "json_schema", "schema": schema}}},
    )
    assert reply.content[0].text.startswith('{"title"')


def test_system_messages_inside_messages_are_rendered_in_place(live, submitted):
    """Claude Code (2.1.156 on) sends hooks' context as role "system" messages after a user turn."""
    late = {"role": "system", "content": [{"type": "text", "text": "The user is on Linux."}]}
    messages = [
        {"role": "user", "content": "hi"},
        late,
        {"role": "assistant", "content": "Hello."},
        {"role": "user", "content": "go"},
    ]
    reply = live.anthropic.messages.create(model="tiny", max_tokens=6, system="Be brief.", messages=messages)
    expected = chat_ids(
        live.tokenizer,
        [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": "hi"},
            {"role": "system", "content": "The user is on Linux."},
            {"role": "assistant", "content": "Hello."},
            {"role": "user", "content": "go"},
        ],
    )
    assert submitted == [expected] and reply.content[0].text == offline(live, expected, 6)


def test_a_template_taking_system_text_only_first_gets_later_ones_as_user_turns():
    """Qwen3.5's template refuses a system message after the first; it is then a user turn, in place."""

    class FirstSystemOnly:
        has_chat_template, chat_template = True, "..."

        def apply_chat_template(self, messages, **options):
            if any(m["role"] == "system" for m in messages[1:]):
                raise ValueError("System message must be at the beginning.")
            return "|".join(f"{m['role']}:{m['content']}" for m in messages)

        def encode(self, text, add_special_tokens=False):
            return text

    messages = [
        {"role": "system", "content": "S"},
        {"role": "user", "content": "u"},
        {"role": "system", "content": "late"},
    ]
    assert prompt_tokens(FirstSystemOnly(), messages, []) == "system:S|user:u|user:late"


# ---------------------------------------------------------------- the billing header and the prefix cache


def test_the_billing_header_is_not_in_the_prompt(live, submitted):
    """Two requests differing only in the billing header's hash: the same prompt tokens, and the
    second reads all but its last token from the prefix cache."""
    usages = []
    for cch in ("00aa1", "f93c2"):
        reply = httpx.post(
            live.base + "/v1/messages",
            json=claude_code_body([user_turn("same question")], cch=cch, max_tokens=2, stream=False),
            headers=HEADERS,
        )
        usages.append(reply.json()["usage"])
    first, second = submitted
    assert first == second and "x-anthropic-billing-header" not in live.tokenizer.decode(first)
    assert usages[1]["cache_read_input_tokens"] == len(first) - 1 and usages[1]["input_tokens"] == 1


def test_a_session_keeps_its_prefix_cache_across_claude_codes_side_requests(live, submitted):
    """Turn 1; then count_tokens calls and a title request (another small system prompt, max_tokens
    32), as Claude Code sends between turns; then turn 2 reads at least 85% of its prompt from
    the prefix cache, and answers as offline generation does."""
    first_turn = [user_turn("read the file add.py")]
    # max_tokens 48, not 32000: the next turn must fit the tiny model's 4096-token context
    _, events = stream_messages(live, claude_code_body(first_turn, cch="1a2b3", max_tokens=48))
    answer = streamed_text(events)
    for messages in (first_turn, first_turn + [{"role": "assistant", "content": answer}, user_turn("now fix it")]):
        counted = httpx.post(
            live.base + "/v1/messages/count_tokens?beta=true",
            json={"model": "claude-sonnet-4-5-20250929", "messages": messages, "tools": claude_code_tools()},
            headers=HEADERS,
        )
        assert counted.status_code == 200
    title = httpx.post(live.base + "/v1/messages?beta=true", json=title_body("9f8e7"), headers=HEADERS, timeout=60)
    assert title.status_code == 200 and title.json()["usage"]["output_tokens"] <= 32
    second_turn = first_turn + [
        {"role": "assistant", "content": [{"type": "text", "text": answer}]},
        user_turn("now fix it"),
    ]
    _, events = stream_messages(live, claude_code_body(second_turn, cch="4c5d6", max_tokens=16))
    usage = events[-2]["usage"]
    assert total_input(usage) == len(submitted[-1])
    assert usage["cache_read_input_tokens"] >= len(submitted[0]) - 1  # the session's first turn, not just its system
    assert usage["cache_read_input_tokens"] / total_input(usage) >= 0.85, usage
    assert streamed_text(events) == offline(live, submitted[-1], 16)


# ---------------------------------------------------------------- usage


def test_usage_splits_input_as_the_reference_does(live):
    """input_tokens excludes the tokens read from the prefix cache; the three input fields sum to
    the prompt, non-streamed and streamed; a stream's message_start carries the input usage, its
    message_delta the output tokens."""
    request = dict(model="tiny", max_tokens=5, system="You count.", messages=[{"role": "user", "content": "one two"}])
    prompt = live.anthropic.messages.count_tokens(
        **{k: request[k] for k in ("model", "system", "messages")}
    ).input_tokens
    cold = live.anthropic.messages.create(**request).usage
    assert cold.input_tokens + cold.cache_read_input_tokens == prompt and cold.cache_creation_input_tokens == 0
    warm = live.anthropic.messages.create(**request).usage
    assert warm.cache_read_input_tokens == prompt - 1 and warm.input_tokens == 1 and warm.output_tokens == 5
    with live.anthropic.messages.stream(**request) as stream:
        events = list(stream)
        final = stream.get_final_message()
    start = next(e for e in events if e.type == "message_start").message.usage
    delta = next(e for e in events if e.type == "message_delta").usage
    assert (start.input_tokens, start.cache_read_input_tokens, start.output_tokens) == (1, prompt - 1, 0)
    assert delta.output_tokens == 5 and (delta.input_tokens, delta.cache_read_input_tokens) == (1, prompt - 1)
    assert final.usage.input_tokens + final.usage.cache_read_input_tokens == prompt and final.usage.output_tokens == 5


# ---------------------------------------------------------------- prefill


def test_a_last_assistant_turn_is_continued(live, submitted):
    """The reply is the continuation only, of the prompt the template renders with the partial
    answer left open, and equals offline generation from that prompt."""
    messages = [{"role": "user", "content": "the cat"}, {"role": "assistant", "content": "The quick"}]
    reply = live.anthropic.messages.create(model="tiny", max_tokens=8, system="Be brief.", messages=messages)
    rendered = [{"role": "system", "content": "Be brief."}, *messages]
    text = live.tokenizer.apply_chat_template(rendered, tokenize=False, continue_final_message=True)
    opened = live.tokenizer.apply_chat_template(rendered[:-1], tokenize=False, add_generation_prompt=True)
    assert text == opened + "The quick"  # the template's assistant turn, left open after the partial answer
    expected = live.tokenizer.encode(text, add_special_tokens=False)
    assert submitted == [expected] and reply.content[0].text == offline(live, expected, 8)
    with live.anthropic.messages.stream(model="tiny", max_tokens=8, system="Be brief.", messages=messages) as stream:
        assert stream.get_final_message().content[0].text == reply.content[0].text
    with pytest.raises(anthropic.BadRequestError, match="final assistant content cannot end with trailing whitespace"):
        live.anthropic.messages.create(
            model="tiny", max_tokens=8, messages=[messages[0], {"role": "assistant", "content": "The quick "}]
        )


# ---------------------------------------------------------------- models


def test_a_model_is_retrieved_by_either_sdk(live):
    """Any id is the served model, as any model name in a request is; each SDK gets its API's shape."""
    retrieved = live.openai.models.retrieve("gpt-4o")
    assert (retrieved.id, retrieved.object, retrieved.owned_by) == ("tiny", "model", "dflash-mlx")
    info = live.anthropic.models.retrieve("claude-sonnet-4-5-20250929")
    assert (info.id, info.type, info.display_name) == ("tiny", "model", "tiny")
    assert abs(info.created_at.timestamp() - time.time()) < 3600 and info.max_input_tokens == CONTEXT
    assert [model.id for model in live.anthropic.models.list()] == ["tiny"]
    assert live.openai.models.retrieve("mlx-community/Qwen3-4B").id == "tiny"


# ---------------------------------------------------------------- browser pages


@pytest.mark.parametrize("origin", ["http://localhost:3000", "http://127.0.0.1:5173"])
def test_a_page_on_localhost_calls_the_server_without_flags(live, origin):
    preflight = {
        "Origin": origin,
        "Access-Control-Request-Method": "POST",
        "Access-Control-Request-Headers": "content-type,x-api-key,anthropic-version",
    }
    answered = httpx.options(live.base + "/v1/messages", headers=preflight)
    assert answered.status_code == 200 and answered.headers["access-control-allow-origin"] == origin
    assert answered.headers["access-control-allow-headers"] == preflight["Access-Control-Request-Headers"]
    body = {"model": "tiny", "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]}
    reply = httpx.post(live.base + "/v1/messages", json=body, headers={"Origin": origin, **HEADERS})
    assert reply.status_code == 200 and reply.headers["access-control-allow-origin"] == origin


def test_other_pages_are_refused_naming_the_flag(live):
    origin = "https://evil.example"
    preflight = {"Origin": origin, "Access-Control-Request-Method": "POST"}
    for method in ("OPTIONS", "POST"):
        reply = httpx.request(method, live.base + "/v1/messages", headers=preflight, json={})
        assert reply.status_code == 403 and f"--cors-origin {origin}" in reply.json()["error"]["message"]
        assert "access-control-allow-origin" not in reply.headers
    stray = httpx.options(live.base + "/v1/chat/completions")  # no Origin: no browser's preflight
    assert stray.status_code == 405 and "--cors-origin <origin>" in stray.json()["error"]["message"]
