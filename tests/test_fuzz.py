"""No client input makes the server answer 5xx (Hypothesis): JSON bodies built from each
endpoint's fields with wrong types, huge and negative numbers, deep nesting, odd Unicode, unknown
fields, empty and long strings and mixed content parts, sent to a live server on a tiny model.
Every answer is 2xx or 4xx with a message, nothing is logged as an error, and the next good
request is answered exactly.  A bounded number of examples runs by default; set
DFLASH_MLX_FUZZ_EXAMPLES for a longer run."""

import http.client
import json
import logging
import os

import pytest

hypothesis = pytest.importorskip("hypothesis", reason="the dev extra installs hypothesis")
pytest.importorskip("uvicorn", reason="the dev extra installs uvicorn")

from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from dflash_mlx import generate, load  # noqa: E402
from dflash_mlx.serve import make_app, serve_in_background  # noqa: E402

pytestmark = pytest.mark.slow  # a live server and many requests

EXAMPLES = int(os.environ.get("DFLASH_MLX_FUZZ_EXAMPLES", "60"))
CONTEXT = 48  # the fuzzed server's context: generations stay short whatever max_tokens says

scalars = (
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**70), max_value=2**70)
    | st.floats(allow_nan=True, allow_infinity=True)
    | st.text(max_size=20)
    | st.text(alphabet=st.characters(min_codepoint=0xD800, max_codepoint=0xDFFF), min_size=1, max_size=2)
    | st.just("x" * 5000)
)
anything = st.recursive(
    scalars,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=8), inner, max_size=3),
    max_leaves=8,
)
roles = st.sampled_from(["user", "system", "assistant", "tool", "developer", "robot", ""]) | anything
parts = st.fixed_dictionaries(
    {"type": st.sampled_from(["text", "image_url", "input_text", "tool_result", "tool_use", "image"]) | anything},
    optional={"text": st.text(max_size=30) | anything, "content": anything, "id": anything, "input": anything},
)
content = st.text(max_size=40) | st.lists(parts, max_size=3) | anything
message = st.fixed_dictionaries(
    {"role": roles}, optional={"content": content, "name": anything, "tool_calls": anything, "tool_call_id": anything}
)
messages = st.lists(message, max_size=3) | anything
small = st.integers(min_value=-3, max_value=6) | anything

COMMON = {
    "model": anything,
    "max_tokens": small,
    "temperature": st.floats(min_value=-1, max_value=3) | anything,
    "top_p": st.floats(min_value=-0.5, max_value=1.5) | anything,
    "top_k": small,
    "seed": st.integers(min_value=-(2**70), max_value=2**70) | anything,
    "stream": st.booleans() | anything,
    "stop": st.text(max_size=5) | st.lists(st.text(max_size=5), max_size=3) | anything,
    "tools": anything,
    "tool_choice": anything,
    "unknown_field": anything,
}
ENDPOINTS = {
    "/v1/chat/completions": {
        **COMMON,
        "messages": messages,
        "n": small,
        "logprobs": anything,
        "top_logprobs": small,
        "response_format": anything,
        "max_completion_tokens": small,
    },
    "/v1/completions": {**COMMON, "prompt": st.text(max_size=40) | st.lists(st.integers(-5, 200)) | anything},
    "/v1/responses": {
        **COMMON,
        "input": st.text(max_size=40) | messages,
        "instructions": anything,
        "max_output_tokens": small,
    },
    "/v1/messages": {
        **COMMON,
        "messages": messages,
        "system": content,
        "stop_sequences": anything,
        "thinking": anything,
        "metadata": anything,
    },
    "/v1/messages/count_tokens": {"messages": messages, "system": content, "model": anything, "tools": anything},
}


@pytest.fixture(scope="module")
def live(tiny_dirs):
    model_dir, draft_dir = tiny_dirs
    model, tokenizer = load(str(model_dir), str(draft_dir), adaptive=False)
    server = make_app(model, tokenizer, "tiny", max_queue=4)
    server.context = CONTEXT
    http_server, port = serve_in_background(server)
    yield port, model, tokenizer
    http_server.should_exit = True


def post(port: int, path: str, raw: bytes) -> tuple[int, bytes]:
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
    connection.request("POST", path, body=raw, headers={"Content-Type": "application/json"})
    response = connection.getresponse()
    return response.status, response.read()


class Errors(logging.Handler):
    def __init__(self):
        super().__init__(logging.ERROR)
        self.records = []

    def emit(self, record):
        self.records.append(record)


@settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)
@given(data=st.data())
def test_no_input_gets_a_5xx(live, data):
    port, _, _ = live
    path = data.draw(st.sampled_from(sorted(ENDPOINTS)))
    body = data.draw(st.fixed_dictionaries({}, optional=ENDPOINTS[path]))
    raw = json.dumps(body).encode("utf-8", "surrogatepass")
    errors, loggers = Errors(), [logging.getLogger(), logging.getLogger("uvicorn.error")]
    for logger in loggers:
        logger.addHandler(errors)
    try:
        status, answer = post(port, path, raw)
    finally:
        for logger in loggers:
            logger.removeHandler(errors)
    assert status < 500, (path, body, answer[:300])
    assert not errors.records, [r.getMessage() for r in errors.records]
    if status >= 400:
        assert b"message" in answer  # says what is wrong


@pytest.mark.parametrize(
    "raw, expect",
    [
        (b"[" * 100_000 + b"]" * 100_000, b"nested too deeply"),
        (b'{"messages": [{"role": "user", "content": "\\ud800"}], "max_tokens": 2}', b"not valid Unicode"),
    ],
)
def test_what_once_gave_a_500_is_a_400(live, raw, expect):
    port, _, _ = live
    status, answer = post(port, "/v1/chat/completions", raw)
    assert status == 400 and expect in answer


def test_the_server_answers_exactly_after_the_fuzz(live):
    port, model, tokenizer = live
    messages = [{"role": "user", "content": "hello"}]
    status, answer = post(port, "/v1/chat/completions", json.dumps({"messages": messages, "max_tokens": 6}).encode())
    assert status == 200
    assert json.loads(answer)["choices"][0]["message"]["content"] == generate(model, tokenizer, messages, max_tokens=6)
