"""The server's edges: what it logs (an access line per request, 5xx with their tracebacks), a
non-streamed request given up when its client goes, a request failed rather than left waiting
when the engine thread has gone, and requests the reference APIs refuse (sampling ranges, tool
calls without their results) refused here too, in their words, raw and through their SDKs."""

import json
import logging
import re
import threading
import time
import traceback

import httpx
import pytest

openai = pytest.importorskip("openai", reason="the dev extra installs the openai client")
anthropic = pytest.importorskip("anthropic", reason="the dev extra installs the anthropic client")

from live_server import live_server  # noqa: E402
from dflash_mlx import load  # noqa: E402
from dflash_mlx.decode.request import Request  # noqa: E402
from dflash_mlx.serve import make_app, serve_in_background, worker  # noqa: E402
from scripted_engine import scripted_batch, slow_batch  # noqa: E402

pytestmark = pytest.mark.slow  # live servers

LOCAL = "http://127.0.0.1:8080"  # TestClient's default Host (testserver) is refused, as any foreign name is
PIECES = 1000  # a scripted answer's length: 20 s at 0.02 s a step, far longer than any test waits
USER = {"role": "user", "content": "Weather in Paris?"}
WEATHER = {"type": "function", "function": {"name": "weather", "parameters": {"type": "object"}}}


@pytest.fixture(scope="module")
def tiny(tiny_dirs):
    model_dir, draft_dir = tiny_dirs
    return load(str(model_dir), str(draft_dir), adaptive=False)


@pytest.fixture(scope="module")
def live(tiny):
    model, tokenizer = tiny
    with live_server(model, tokenizer, max_queue=4, prompt_cache_bytes=0) as served:
        yield served


@pytest.fixture
def slow(tiny, monkeypatch):
    """A live server whose engine is a script: every answer PIECES pieces long, 0.02 s a step."""
    model, tokenizer = tiny
    monkeypatch.setattr(worker, "BatchGenerator", slow_batch(pieces=PIECES, seconds_per_step=0.02))
    server = make_app(model, tokenizer, "tiny", prompt_cache_bytes=0, max_batch=1)
    http, port = serve_in_background(server)
    yield server, f"http://127.0.0.1:{port}"
    http.should_exit = True
    server.worker.stop()


def access_lines(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "dflash_mlx.serve.access"]


def wait_for(condition, seconds: float = 10.0) -> None:
    deadline = time.monotonic() + seconds
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.02)


# ---------------------------------------------------------------- logging


def test_each_request_gets_one_access_line_with_its_tokens(live, caplog):
    caplog.set_level(logging.INFO, logger="dflash_mlx.serve.access")
    reply = live.openai.chat.completions.create(model="tiny", messages=[USER], max_tokens=5)
    streamed = list(live.openai.completions.create(model="tiny", prompt="the cat", max_tokens=4, n=2, stream=True))
    httpx.get(live.base + "/health")
    httpx.post(live.base + "/v1/chat/completions", json={"messages": []})
    wait_for(lambda: len(access_lines(caplog)) == 4)
    chat, stream, health, refused = access_lines(caplog)
    usage = reply.usage
    assert chat.startswith("127.0.0.1:") and '"POST /v1/chat/completions HTTP/1.1" 200' in chat
    assert f"prompt={usage.prompt_tokens} cached={usage.prompt_tokens_details.cached_tokens} generated=5 " in chat
    assert streamed and '"POST /v1/completions HTTP/1.1" 200' in stream and "generated=8 " in stream  # n=2
    assert '"GET /health HTTP/1.1" 200 ' in health and "prompt=" not in health
    assert '"POST /v1/chat/completions HTTP/1.1" 400 ' in refused and "prompt=" not in refused
    assert all(line.endswith("s") for line in (chat, stream, health, refused))


def test_an_engine_failure_is_a_500_logged_with_its_traceback(tiny, monkeypatch, caplog):
    """The engine's exception crosses to the HTTP side through the job's events: it is logged
    with the traceback it had on the engine thread, and the client gets a 500 in its API's format."""
    from starlette.testclient import TestClient

    def broken_step():
        raise RuntimeError("the target's pass failed")

    class Broken(scripted_batch(lambda prompt: ["never"])):
        def next(self):
            broken_step()

    monkeypatch.setattr(worker, "BatchGenerator", Broken)
    model, tokenizer = tiny
    server = make_app(model, tokenizer, "tiny", prompt_cache_bytes=0, max_batch=1)
    caplog.set_level(logging.INFO, logger="dflash_mlx.serve")
    with TestClient(server.app, base_url=LOCAL) as http:
        reply = http.post("/v1/messages", json={"max_tokens": 4, "messages": [USER]})
    assert reply.status_code == 500 and "the target's pass failed" in reply.json()["error"]["message"]
    (error,) = [r for r in caplog.records if r.name == "dflash_mlx.serve" and r.levelno >= logging.ERROR]
    assert isinstance(error.exc_info[1], RuntimeError)
    assert "broken_step" in [frame.name for frame in traceback.extract_tb(error.exc_info[2])]  # the engine's
    assert '"POST /v1/messages HTTP/1.1" 500' in access_lines(caplog)[0]


def test_an_exception_escaping_a_route_is_logged_once(tiny, monkeypatch, caplog):
    from starlette.testclient import TestClient

    model, tokenizer = tiny
    server = make_app(model, tokenizer, "tiny", prompt_cache_bytes=0, max_batch=1)
    monkeypatch.setattr(server, "model", None)  # /v1/models reads it: an AttributeError, a bug
    caplog.set_level(logging.INFO, logger="dflash_mlx.serve")
    with TestClient(server.app, base_url=LOCAL, raise_server_exceptions=False) as http:
        assert http.get("/v1/models").status_code == 500
    (error,) = [r for r in caplog.records if r.name == "dflash_mlx.serve" and r.levelno >= logging.ERROR]
    assert "GET /v1/models" in error.getMessage() and isinstance(error.exc_info[1], AttributeError)
    assert '"GET /v1/models HTTP/1.1" 500' in access_lines(caplog)[0]


def test_the_log_level_is_checked():
    from typer.testing import CliRunner

    from dflash_mlx.cli import app

    result = CliRunner().invoke(app, ["serve", "--log-level", "loud"])
    assert result.exit_code == 1 and "--log-level must be one of debug, info, warning, error" in result.output


# ---------------------------------------------------------------- a client gone, an engine gone

NON_STREAMED = [
    ("/v1/chat/completions", {"messages": [USER], "max_tokens": PIECES}),
    ("/v1/responses", {"input": "Weather?", "max_output_tokens": PIECES}),
    ("/v1/messages", {"messages": [USER], "max_tokens": PIECES}),
]


@pytest.mark.parametrize("path, body", NON_STREAMED)
def test_a_non_streamed_request_stops_when_its_client_goes(slow, path, body, caplog):
    """A client that times out: its job is cancelled at once (the engine's row freed, far fewer
    than max_tokens generated) and the request is logged 499 with what it generated."""
    server, base = slow
    caplog.set_level(logging.INFO, logger="dflash_mlx.serve.access")
    started = time.monotonic()
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(base + path, json=body, timeout=0.5)
    wait_for(lambda: server.metrics.requests["cancelled"] == 1 and not server.worker.active)
    assert time.monotonic() - started < 5  # a whole answer takes 20 s
    assert 0 < server.metrics.generated_tokens < PIECES // 4
    wait_for(lambda: access_lines(caplog))
    (line,) = access_lines(caplog)
    assert f'"POST {path} HTTP/1.1" 499' in line
    generated = int(re.search(r" generated=(\d+) ", line).group(1))  # what reached the request
    assert 0 < generated <= server.metrics.generated_tokens  # the engine may have made one more


def test_a_stream_whose_client_goes_is_logged_499(slow, caplog):
    server, base = slow
    caplog.set_level(logging.INFO, logger="dflash_mlx.serve.access")
    body = {"messages": [USER], "max_tokens": PIECES, "stream": True}
    with httpx.stream("POST", base + "/v1/chat/completions", json=body) as response:
        next(response.iter_lines())
    wait_for(lambda: server.metrics.requests["cancelled"] == 1 and access_lines(caplog))
    assert '"POST /v1/chat/completions HTTP/1.1" 499' in access_lines(caplog)[0]


def test_a_request_running_when_the_engine_stops_is_answered(slow):
    """The engine thread stops under a running request: the request gets an error in seconds."""
    server, base = slow
    answers = []

    def ask():
        body = {"messages": [USER], "max_tokens": PIECES}
        answers.append(httpx.post(base + "/v1/chat/completions", json=body, timeout=60))

    asking = threading.Thread(target=ask, daemon=True)
    asking.start()
    wait_for(lambda: server.worker.active)
    server.worker.stop()
    asking.join(timeout=15)
    assert not asking.is_alive(), "the request waits for an engine that has gone"
    (reply,) = answers
    assert reply.status_code >= 500 and "the engine stopped" in reply.json()["error"]["message"]


@pytest.mark.parametrize("stream", [False, True])
def test_a_request_fails_rather_than_waits_when_the_engine_has_gone(slow, stream, monkeypatch):
    """An engine thread that ended without answering a job it had taken (whatever killed it skipped
    the worker's own clean-up): the request waiting for the job's next response gets 503 "the
    engine stopped" (a stream, an error event) in seconds instead of waiting for ever."""
    server, base = slow
    script = scripted_batch(lambda prompt: ["w0 ", "never sent"])()
    script.add(Request([1], 2))
    ((_, first),) = script.next()

    def taken_then_lost(job):
        job.events.put(first)
        return job

    server.worker.stop()
    monkeypatch.setattr(server.worker, "submit", taken_then_lost)
    body = {"messages": [USER], "max_tokens": 2, "stream": stream}
    reply = httpx.post(base + "/v1/chat/completions", json=body, timeout=30)  # a hang would time out
    if stream:
        *_, last = reply.text.strip().split("\n\n")  # an error event ends the stream
        assert reply.status_code == 200 and "w0 " in reply.text
        assert json.loads(last[6:])["error"]["message"] == "the engine stopped; restart the server"
    else:
        assert reply.status_code == 503 and reply.json()["error"]["message"] == "the engine stopped; restart the server"


# ---------------------------------------------------------------- validation: Anthropic Messages

CALLED = {
    "role": "assistant",
    "content": [
        {"type": "text", "text": "Let me look."},
        {"type": "tool_use", "id": "toolu_1", "name": "weather", "input": {"city": "Paris"}},
    ],
}


def result(tool_use_id, text: str = "sunny") -> dict:
    return {"role": "user", "content": [{"type": "tool_result", "tool_use_id": tool_use_id, "content": text}]}


def anthropic_body(*messages, **fields) -> dict:
    tools = [{"name": "weather", "input_schema": {"type": "object"}}]
    return {"model": "tiny", "max_tokens": 2, "tools": tools, "messages": list(messages), **fields}


@pytest.mark.parametrize(
    "body, message",
    [
        (anthropic_body(USER, temperature=1.5), "temperature: range: 0..1"),
        (anthropic_body(USER, top_p=1.5), "top_p: range: 0..1"),
        (anthropic_body(USER, temperature=-0.1), "temperature: range: 0..1"),
        (
            anthropic_body(USER, CALLED, {"role": "user", "content": "never mind"}),
            "messages.2: `tool_use` ids were found without `tool_result` blocks immediately after: toolu_1. "
            "Each `tool_use` block must have a corresponding `tool_result` block in the next message.",
        ),
        (
            anthropic_body(USER, CALLED, result("toolu_9")),
            "messages.2.content.0: unexpected `tool_use_id` found in `tool_result` blocks: toolu_9. "
            "Each `tool_result` block must have a corresponding `tool_use` block in the previous message.",
        ),
        (
            anthropic_body(result("toolu_1")),
            "messages.0.content.0: unexpected `tool_use_id` found in `tool_result` blocks: toolu_1. "
            "Each `tool_result` block must have a corresponding `tool_use` block in the previous message.",
        ),
        (
            anthropic_body(USER, CALLED, {"role": "assistant", "content": "It is sunny."}),
            "messages.2: `tool_use` ids were found without `tool_result` blocks immediately after: toolu_1.",
        ),
        (  # ids are any JSON a client sends: compared, never hashed
            anthropic_body(USER, CALLED, result(["toolu_1"])),
            "messages.2.content.0: unexpected `tool_use_id` found in `tool_result` blocks: ['toolu_1'].",
        ),
    ],
)
def test_anthropic_refusals_read_as_the_references(live, body, message):
    reply = httpx.post(live.base + "/v1/messages", json=body)
    assert reply.status_code == 400, reply.text
    assert reply.json()["type"] == "error" and reply.json()["error"]["type"] == "invalid_request_error"
    assert reply.json()["error"]["message"].startswith(message)


def test_anthropic_tool_conversations_that_pair_up_are_served(live):
    two_calls = {
        "role": "assistant",
        "content": [
            {"type": "tool_use", "id": "toolu_1", "name": "weather", "input": {"city": "Paris"}},
            {"type": "tool_use", "id": "toolu_2", "name": "weather", "input": {"city": "Rome"}},
        ],
    }
    both = {
        "role": "user",
        "content": [
            {"type": "tool_result", "tool_use_id": "toolu_2", "content": "rain"},
            {"type": "tool_result", "tool_use_id": "toolu_1", "content": "sunny", "is_error": False},
            {"type": "text", "text": "and tomorrow?"},
        ],
    }
    accepted = [
        anthropic_body(USER, CALLED, result("toolu_1")),
        anthropic_body(USER, two_calls, both, {"role": "assistant", "content": "Sunny, then rain."}, USER),
        anthropic_body(USER, CALLED),  # a call last, nothing after it yet: as the reference, let through
    ]
    for body in accepted:
        assert httpx.post(live.base + "/v1/messages/count_tokens", json=body).status_code == 200
    reply = httpx.post(live.base + "/v1/messages", json=accepted[1], timeout=60)
    assert reply.status_code == 200 and reply.json()["usage"]["output_tokens"] == 2


def test_the_anthropic_sdk_sees_anthropics_own_errors(live):
    with pytest.raises(anthropic.BadRequestError, match="temperature: range: 0..1"):
        live.anthropic.messages.create(model="tiny", max_tokens=2, messages=[USER], extra_body={"temperature": 1.5})
    with pytest.raises(anthropic.BadRequestError) as caught:
        live.anthropic.messages.create(
            model="tiny", max_tokens=2, messages=[USER, CALLED, {"role": "user", "content": "go on"}]
        )
    assert caught.value.status_code == 400 and "without `tool_result` blocks" in caught.value.message
    assert live.anthropic.messages.count_tokens(model="tiny", messages=[USER, CALLED, result("toolu_1")]).input_tokens


# ---------------------------------------------------------------- validation: OpenAI chat and Responses


def chat_call(*ids) -> dict:
    calls = [{"id": i, "type": "function", "function": {"name": "weather", "arguments": "{}"}} for i in ids]
    return {"role": "assistant", "content": None, "tool_calls": calls}


def tool(tool_call_id, text: str = "sunny") -> dict:
    return {"role": "tool", "tool_call_id": tool_call_id, "content": text}


UNANSWERED = (
    "An assistant message with 'tool_calls' must be followed by tool messages responding to each 'tool_call_id'. "
    "The following tool_call_ids did not have response messages: "
)
NOT_A_RESPONSE = (
    "Invalid parameter: messages with role 'tool' must be a response to a preceeding message with 'tool_calls'."
)


@pytest.mark.parametrize(
    "path, fields, message, param, code",
    [
        (
            "/v1/chat/completions",
            {"temperature": 2.5},
            "Invalid 'temperature': decimal above maximum value. Expected a value <= 2, but got 2.5 instead.",
            "temperature",
            "decimal_above_max_value",
        ),
        (
            "/v1/chat/completions",
            {"temperature": -1},
            "Invalid 'temperature': decimal below minimum value. Expected a value >= 0, but got -1 instead.",
            "temperature",
            "decimal_below_min_value",
        ),
        (
            "/v1/chat/completions",
            {"top_p": 1.5},
            "Invalid 'top_p': decimal above maximum value. Expected a value <= 1, but got 1.5 instead.",
            "top_p",
            "decimal_above_max_value",
        ),
        ("/v1/completions", {"prompt": "hi", "temperature": 2.5}, "Invalid 'temperature'", "temperature", None),
        ("/v1/responses", {"input": "hi", "temperature": 2.5}, "Invalid 'temperature'", "temperature", None),
        (
            "/v1/chat/completions",
            {"messages": [USER, chat_call("call_1", "call_2"), tool("call_1"), USER]},
            UNANSWERED + "call_2",
            "messages.[1].role",
            None,
        ),
        (
            "/v1/chat/completions",
            {"messages": [USER, chat_call("call_1")]},
            UNANSWERED + "call_1",
            "messages.[1].role",
            None,
        ),
        ("/v1/chat/completions", {"messages": [USER, tool("call_1")]}, NOT_A_RESPONSE, "messages.[1].role", None),
        (
            "/v1/chat/completions",
            {"messages": [USER, chat_call("call_1"), tool("call_1"), tool("call_9")]},
            NOT_A_RESPONSE,
            "messages.[3].role",
            None,
        ),
        (
            "/v1/chat/completions",
            {"messages": [USER, chat_call("call_1"), tool({"id": "call_1"})]},
            NOT_A_RESPONSE,
            "messages.[2].role",
            None,
        ),
        (
            "/v1/responses",
            {"input": [USER, {"type": "function_call_output", "call_id": "call_9", "output": "sunny"}]},
            "No tool call found for function call output with call_id call_9.",
            "input",
            None,
        ),
        (
            "/v1/responses",
            {"input": [USER, {"type": "function_call", "call_id": "call_1", "name": "weather", "arguments": "{}"}]},
            "No tool output found for function call call_1.",
            "input",
            None,
        ),
    ],
)
def test_openai_refusals_read_as_the_references(live, path, fields, message, param, code):
    chat = {"max_tokens": 2, "messages": [USER], "tools": [WEATHER]} if path == "/v1/chat/completions" else {}
    reply = httpx.post(live.base + path, json={"model": "tiny", **chat, **fields})
    assert reply.status_code == 400, reply.text
    error = reply.json()["error"]
    assert error["message"].startswith(message) and error["param"] == param and error["type"] == "invalid_request_error"
    assert code is None or error["code"] == code


def test_openai_tool_conversations_that_pair_up_are_served(live):
    messages = [USER, chat_call("call_1", "call_2"), tool("call_2"), tool("call_1", "rain")]
    messages += [{"role": "assistant", "content": "Sunny, then rain."}, USER]
    reply = live.openai.chat.completions.create(model="tiny", max_tokens=2, messages=messages, tools=[WEATHER])
    assert reply.usage.completion_tokens == 2
    items = [
        USER,
        {"type": "function_call", "call_id": "call_1", "name": "weather", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "call_1", "output": "sunny"},
    ]
    tools = [{"type": "function", "name": "weather", "parameters": {"type": "object"}}]
    assert live.openai.responses.create(model="tiny", max_output_tokens=2, input=items, tools=tools).usage


def test_the_openai_sdk_sees_openais_own_errors(live):
    with pytest.raises(openai.BadRequestError) as caught:
        live.openai.chat.completions.create(model="tiny", max_tokens=2, messages=[USER], temperature=2.5)
    assert caught.value.status_code == 400 and caught.value.body["param"] == "temperature"
    with pytest.raises(openai.BadRequestError, match="must be a response to a preceeding message"):
        live.openai.chat.completions.create(model="tiny", max_tokens=2, messages=[USER, tool("call_1")])
    with pytest.raises(openai.BadRequestError, match="No tool call found for function call output"):
        live.openai.responses.create(
            model="tiny", input=[USER, {"type": "function_call_output", "call_id": "call_9", "output": "x"}]
        )
    assert live.openai.models.list().data[0].id == "tiny"  # still serving
