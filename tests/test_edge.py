"""A request is checked once, where it is built (decode/request.build_request), and the server
builds it before queueing: a malformed value is a 4xx that never reaches the engine thread."""

import math

import pytest

pytest.importorskip("starlette")
pytest.importorskip("httpx")

from dflash_mlx.decode.request import (  # noqa: E402
    BadType,
    BadValue,
    Bounds,
    OutOfRange,
    build_request,
    check_values,
)
from dflash_mlx.sampling import SamplingParams  # noqa: E402
from dflash_mlx.serve.validation import ANTHROPIC_RANGES, OPENAI_RANGES  # noqa: E402

BOUNDS = Bounds(vocab_size=100, widest=4, context=64)
LOCAL = "http://127.0.0.1:8080"


def test_the_builder_turns_values_into_the_request_asked():
    request = build_request(
        [1, 2, 3], 8, BOUNDS, temperature=0.7, top_p=0.9, top_k=5, seed=-1, block_size=2, stop="END", logprobs=3
    )
    assert request.prompt == [1, 2, 3] and request.max_tokens == 8
    assert request.params == SamplingParams(0.7, 0.9, 5) and request.seed == (1 << 64) - 1
    assert request.block_size == 2 and request.stop == ("END",) and request.logprobs == 3
    assert build_request([1], 8, BOUNDS).block_size is None  # the planner's choice


def test_the_budget_is_cut_to_the_context_or_refused():
    assert build_request([1] * 60, 100, BOUNDS, cut_to_context=True).max_tokens == 4
    assert build_request([1] * 60, 3, BOUNDS, cut_to_context=True).max_tokens == 3
    with pytest.raises(BadValue, match="exceeds the model's context of 64"):
        build_request([1] * 60, 100, BOUNDS)
    with pytest.raises(BadValue, match="prompt is too long: 64 tokens > 63 maximum") as refused:
        build_request([1] * 64, 1, BOUNDS, cut_to_context=True)
    assert refused.value.code == "context_length_exceeded"


@pytest.mark.parametrize(
    "values, error, field",
    [
        (dict(temperature="hot"), BadType, "temperature"),
        (dict(temperature=math.nan), BadValue, "temperature"),
        (dict(temperature=-0.5), OutOfRange, "temperature"),
        (dict(top_p=0), BadValue, "top_p"),
        (dict(top_k=-1), BadValue, "top_k"),
        (dict(top_k=1.5), BadType, "top_k"),
        (dict(seed=1.5), BadType, "seed"),
        (dict(block_size=0), BadValue, "block_size"),
        (dict(block_size=5), BadValue, "block_size"),
        (dict(block_size=True), BadType, "block_size"),
        (dict(stop=[1]), BadType, "stop"),
        (dict(stop=5), BadType, "stop"),
        (dict(logprobs=21), BadValue, "logprobs"),
    ],
)
def test_each_bad_value_is_named(values, error, field):
    with pytest.raises(error) as refused:
        build_request([1, 2], 4, BOUNDS, **values)
    assert refused.value.field == field and field in str(refused.value)


def test_wrong_types_are_type_errors_and_bad_ids_value_errors():
    with pytest.raises(TypeError):
        build_request([1], 2.5, BOUNDS)
    with pytest.raises(ValueError, match="prompt token id 100 is outside the vocabulary"):
        build_request([1, 100], 4, BOUNDS)
    with pytest.raises(BadValue, match="block_size must be 1 without a drafter"):
        build_request([1], 4, Bounds(vocab_size=100), block_size=2)


def test_the_reference_ranges_are_the_apis():
    assert build_request([1], 4, BOUNDS, temperature=1.5, ranges=OPENAI_RANGES).params.temp == 1.5
    with pytest.raises(OutOfRange) as refused:
        build_request([1], 4, BOUNDS, temperature=1.5, ranges=ANTHROPIC_RANGES)
    assert (refused.value.value, refused.value.low, refused.value.high) == (1.5, 0, 1)
    assert build_request([1], 4, BOUNDS, temperature=50.0).params.temp == 50.0  # the Python API: any >= 0


def test_errors_name_the_field_as_the_caller_calls_it():
    with pytest.raises(BadValue, match="--max-tokens must be > 0") as refused:
        check_values(0, names={"max_tokens": "--max-tokens"})
    assert refused.value.field == "--max-tokens"
    with pytest.raises(BadValue, match="max_output_tokens"):
        build_request([1] * 60, 100, BOUNDS, names={"max_tokens": "max_output_tokens"})


# ---------------------------------------------------------------- the server, with a spy on its queue


@pytest.fixture(scope="module")
def served(tiny_dirs):
    """The server and a client of it (leaving the client stops the server)."""
    from starlette.testclient import TestClient

    from dflash_mlx import load
    from dflash_mlx.serve import make_app

    model_dir, draft_dir = tiny_dirs
    model, tokenizer = load(str(model_dir), str(draft_dir), adaptive=False)
    server = make_app(model, tokenizer, "tiny", prompt_cache_bytes=0)
    with TestClient(server.app, base_url=LOCAL) as http:
        yield server, http


@pytest.fixture
def server(served):
    return served[0]


@pytest.fixture
def queued(server, monkeypatch):
    """The jobs put in the engine's queue, and the requests the engine thread was handed."""
    jobs, engine = [], []
    put, add = server.worker.jobs.put, server.worker.batch.add
    monkeypatch.setattr(server.worker.jobs, "put", lambda job: (job is not None and jobs.append(job), put(job)))
    monkeypatch.setattr(server.worker.batch, "add", lambda request: engine.append(request) or add(request))
    return jobs, engine


USER = {"role": "user", "content": "hi"}
CHAT, COMPLETIONS, RESPONSES, MESSAGES = "/v1/chat/completions", "/v1/completions", "/v1/responses", "/v1/messages"
BASE = {
    CHAT: {"messages": [USER], "max_tokens": 2},
    COMPLETIONS: {"prompt": "hi", "max_tokens": 2},
    RESPONSES: {"input": "hi", "max_output_tokens": 2},
    MESSAGES: {"messages": [USER], "max_tokens": 2},
}
MALFORMED = [
    (CHAT, {"block_size": 99}, "block_size"),
    (CHAT, {"block_size": 0}, "block_size"),
    (CHAT, {"block_size": "4"}, "block_size"),
    (CHAT, {"temperature": 2.5}, "temperature"),
    (CHAT, {"temperature": "hot"}, "temperature"),
    (CHAT, {"top_p": 0}, "top_p"),
    (CHAT, {"top_k": -1}, "top_k"),
    (CHAT, {"seed": 1.5}, "seed"),
    (CHAT, {"max_tokens": 0}, "max_tokens"),
    (CHAT, {"max_completion_tokens": 2.5}, "max_completion_tokens"),
    (CHAT, {"stop": [1]}, "stop"),
    (CHAT, {"logprobs": True, "top_logprobs": 25}, "top_logprobs"),
    (CHAT, {"n": 2, "block_size": 99}, "block_size"),
    (COMPLETIONS, {"prompt": [1, 10**9]}, "vocabulary"),
    (COMPLETIONS, {"logprobs": 21}, "logprobs"),
    (COMPLETIONS, {"max_tokens": -3}, "max_tokens"),
    (COMPLETIONS, {"stop": 5}, "stop"),
    (RESPONSES, {"max_output_tokens": 0}, "max_output_tokens"),
    (RESPONSES, {"temperature": 3}, "temperature"),
    (RESPONSES, {"block_size": 99}, "block_size"),
    (RESPONSES, {"include": ["message.output_text.logprobs"], "top_logprobs": 30}, "top_logprobs"),
    (MESSAGES, {"temperature": 1.5}, "temperature"),
    (MESSAGES, {"max_tokens": None}, "max_tokens"),
    (MESSAGES, {"max_tokens": 0}, "max_tokens"),
    (MESSAGES, {"stop_sequences": [1]}, "stop_sequences"),
    (MESSAGES, {"top_k": -1}, "top_k"),
    (MESSAGES, {"block_size": 99}, "block_size"),
]


def test_a_malformed_value_is_a_4xx_that_never_reaches_the_engine(served, queued):
    server, http = served
    jobs, engine = queued
    for path, fields, needle in MALFORMED:
        reply = http.post(path, json={"model": "tiny", **BASE[path], **fields})
        assert reply.status_code == 400, (path, fields, reply.text)
        error = reply.json()["error"]
        assert needle in error["message"], (path, fields, error)
        assert not jobs and not engine, (path, fields)
    long = list(range(1, 10)) * (server.context // 9 + 1)
    reply = http.post(COMPLETIONS, json={"prompt": long, "max_tokens": 2})
    assert reply.status_code == 400 and reply.json()["error"]["code"] == "context_length_exceeded"
    assert not jobs and not engine
    for path, body in BASE.items():  # the spies see what does reach the engine
        assert http.post(path, json={"model": "tiny", **body}).status_code == 200
    assert len(jobs) == len(BASE) and [job.request for job in jobs] == engine


def test_the_budget_is_cut_to_the_window_before_queueing(served, queued):
    server, http = served
    jobs, _ = queued
    prompt = list(range(1, 10)) * ((server.context - 3) // 9)
    reply = http.post(COMPLETIONS, json={"prompt": prompt, "max_tokens": 10**6})
    assert reply.status_code == 200
    assert jobs[0].request.max_tokens == server.context - len(prompt)
