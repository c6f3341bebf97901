"""The server against clients nobody here wrote: `anthropic` (Messages, count_tokens, tools),
`openai` (Responses, the chat tool loop, n, logprobs) and `langchain-openai`, on loopback."""

import json
import time
import urllib.request

import mlx.core as mx
import pytest

openai = pytest.importorskip("openai", reason="the dev extra installs the openai client")
anthropic = pytest.importorskip("anthropic", reason="the dev extra installs the anthropic client")
langchain_openai = pytest.importorskip("langchain_openai", reason="the dev extra installs langchain-openai")

from live_server import live_server  # noqa: E402
from dflash_mlx import generate, load, stream_generate  # noqa: E402
from dflash_mlx.serve import app, worker  # noqa: E402
from dflash_mlx.serve.protocol import next_turn_tokens  # noqa: E402
from scripted_engine import scripted_batch  # noqa: E402

pytestmark = pytest.mark.slow  # live servers and real clients

WEATHER = {
    "name": "weather",
    "description": "Current weather of a city",
    "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
}
CALL = '<tool_call>{"name": "weather", "arguments": {"city": "Paris"}}</tool_call>'


@pytest.fixture(scope="module")
def live(tiny_dirs):
    model_dir, draft_dir = tiny_dirs
    model, tokenizer = load(str(model_dir), str(draft_dir), adaptive=False)
    with live_server(model, tokenizer, max_queue=4) as served:
        yield served


def chat_ids(tokenizer, messages: list[dict]) -> list[int]:
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return tokenizer.encode(text, add_special_tokens=False)


@pytest.fixture
def scripted(live, monkeypatch):
    """The engine replaced by a script: each request gets the next list of text pieces; the
    prompts it was asked to continue are recorded (token ids).  The one-at-a-time worker
    runs in a worker of its own (the server's decodes for real)."""
    replies, prompts = [], []

    def reply(prompt):
        prompts.append(live.tokenizer.decode(prompt))
        return replies.pop(0)

    monkeypatch.setattr(worker, "BatchGenerator", scripted_batch(reply))
    single = worker.Worker(live.model, live.tokenizer, 4)
    monkeypatch.setattr(live.server, "worker", single)
    yield replies, prompts
    single.stop()


# ---------------------------------------------------------------- Anthropic Messages


def test_anthropic_message_equals_offline_generation(live):
    messages = [{"role": "user", "content": "hello world"}]
    reply = live.anthropic.messages.create(
        model="local-model", max_tokens=12, messages=messages, system="You are terse."
    )
    offline = generate(
        live.model,
        live.tokenizer,
        chat_ids(live.tokenizer, [{"role": "system", "content": "You are terse."}, *messages]),
        max_tokens=12,
    )
    assert reply.content[0].type == "text" and reply.content[0].text == offline
    assert reply.model == "tiny" and reply.role == "assistant" and reply.stop_reason == "max_tokens"
    assert reply.usage.output_tokens == 12 and reply.usage.input_tokens > 5
    assert reply.usage.model_extra["dflash"]["tau"] >= 1


def test_anthropic_stream_events_and_text(live):
    messages = [{"role": "user", "content": [{"type": "text", "text": "the cat"}]}]
    with live.anthropic.messages.stream(
        model="tiny", max_tokens=10, messages=messages, system=[{"type": "text", "text": "Be brief."}]
    ) as stream:
        kinds = [event.type for event in stream]
        final = stream.get_final_message()
    offline = generate(
        live.model,
        live.tokenizer,
        chat_ids(live.tokenizer, [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "the cat"}]),
        max_tokens=10,
    )
    assert final.content[0].text == offline and final.stop_reason == "max_tokens" and final.usage.output_tokens == 10
    assert kinds[0] == "message_start" and kinds[-1] == "message_stop"
    assert {"content_block_start", "content_block_stop", "message_delta"} <= set(kinds)


def test_anthropic_stop_sequences_sampling_and_extra_body(live):
    base = dict(model="tiny", max_tokens=16, messages=[{"role": "user", "content": "the cat"}])
    full = live.anthropic.messages.create(**base).content[0].text
    stop = full[5:8]
    cut = live.anthropic.messages.create(**base, stop_sequences=[stop])
    assert cut.content[0].text == full[: full.find(stop)]
    assert cut.stop_reason == "stop_sequence" and cut.stop_sequence == stop
    # this SDK has no sampling arguments at all: they travel in extra_body
    seeded = [
        live.anthropic.messages.create(**base, extra_body={"temperature": 0.9, "top_k": 50, "seed": 3, "block_size": w})
        .content[0]
        .text
        for w in (1, 4)
    ]
    assert seeded[0] == seeded[1] != full


def wait_idle(server, seconds: float = 30.0) -> None:
    """Until the worker has nothing left to prefill (the answer's follow-up runs after it is sent)."""
    deadline = time.monotonic() + seconds
    while not server.worker.idle:
        assert time.monotonic() < deadline, "the idle prefill did not finish"
        time.sleep(0.02)
    time.sleep(0.2)  # a background task not yet queued would show here
    assert server.worker.idle


@pytest.mark.parametrize("api,least", [("anthropic", 1), ("openai", 1), ("responses", 1), ("anthropic", 32)])
def test_the_next_turn_is_prefilled_while_the_client_acts(live, api, least, monkeypatch):
    """After an answer, the conversation as the client sends it back (the answer re-tokenised,
    the turn closed) is prefilled while the server is idle: the next turn restores all of it and
    prefills only its own message, and answers as offline generation does.  Unless that adds
    fewer than `least` tokens to what is kept (this answer reads back as written: its closing
    tokens only), which the next turn's own pass then takes."""
    monkeypatch.setattr(live.server, "next_turn_prefill", True)
    monkeypatch.setattr(live.server.worker.batch.decoder.idle, "min_tokens", least)
    system = f"You are a {api} agent ({least})."
    messages = [{"role": "user", "content": "read the file"}]
    if api == "anthropic":
        with live.anthropic.messages.stream(model="tiny", max_tokens=20, system=system, messages=messages) as stream:
            answer = stream.get_final_message().content[0].text
    elif api == "responses":
        output = live.openai.responses.create(
            model="tiny", max_output_tokens=20, instructions=system, input=messages, stream=True
        )
        first = next(event.response for event in output if event.type in ("response.completed", "response.incomplete"))
        answer = first.output_text
    else:
        reply = live.openai.chat.completions.create(
            model="tiny", max_tokens=20, messages=[{"role": "system", "content": system}, *messages]
        )
        answer = reply.choices[0].message.content
    wait_idle(live.server)
    rendered = [{"role": "system", "content": system}, *messages, {"role": "assistant", "content": answer}]
    follow = next_turn_tokens(live.tokenizer, rendered, [])
    nxt = rendered + [{"role": "user", "content": "now write it back"}]
    assert chat_ids(live.tokenizer, nxt)[: len(follow)] == follow  # the template renders it so
    if api == "anthropic":
        reply = live.anthropic.messages.create(model="tiny", max_tokens=8, system=system, messages=nxt[1:])
        text, cached = reply.content[0].text, reply.usage.cache_read_input_tokens
    elif api == "responses":  # the output items sent back as they came
        sent = messages + [item.model_dump(exclude_none=True) for item in first.output] + nxt[-1:]
        reply = live.openai.responses.create(model="tiny", max_output_tokens=8, instructions=system, input=sent)
        text, cached = reply.output_text, reply.usage.input_tokens_details.cached_tokens
    else:
        reply = live.openai.chat.completions.create(model="tiny", max_tokens=8, messages=nxt)
        text, cached = reply.choices[0].message.content, reply.usage.prompt_tokens_details.cached_tokens
    assert cached == len(follow) if least == 1 else len(follow) - least < cached < len(follow)
    wait_idle(live.server)  # its own next turn's prefill: the model is not shared while it runs
    assert text == generate(live.model, live.tokenizer, chat_ids(live.tokenizer, nxt), max_tokens=8)


def test_an_answer_is_offered_for_prefill_as_it_grows(live, monkeypatch):
    """While an answer is written, the conversation with its text so far (but the last
    ANSWER_TAIL tokens, which may read back otherwise once more text follows) is offered to the
    engine every ANSWER_FOLLOW_EVERY tokens, each a prefix of what the next request renders,
    then the whole turn once it is out; the next turn answers as offline generation does."""
    monkeypatch.setattr(live.server, "next_turn_prefill", True)
    monkeypatch.setattr(app, "ANSWER_FOLLOW_EVERY", 8)
    offered, offer = [], live.server.worker.prefill_when_idle
    monkeypatch.setattr(live.server.worker, "prefill_when_idle", lambda tokens: offered.append(tokens) or offer(tokens))
    system, messages = "You write long answers.", [{"role": "user", "content": "tell me about the cat"}]
    with live.anthropic.messages.stream(model="tiny", max_tokens=40, system=system, messages=messages) as stream:
        answer = stream.get_final_message().content[0].text
    wait_idle(live.server)
    rendered = [{"role": "system", "content": system}, *messages, {"role": "assistant", "content": answer}]
    follow = next_turn_tokens(live.tokenizer, rendered, [])
    *growing, whole = offered
    assert whole == follow and 2 <= len(growing) <= 40 // 8
    assert all(len(a) < len(b) for a, b in zip(growing, growing[1:] + [whole]))
    text = live.tokenizer.decode(follow)
    assert all(text.startswith(live.tokenizer.decode(tokens).rstrip("\ufffd")) for tokens in growing)
    nxt = rendered + [{"role": "user", "content": "go on"}]
    reply = live.anthropic.messages.create(model="tiny", max_tokens=8, system=system, messages=nxt[1:])
    wait_idle(live.server)
    assert reply.content[0].text == generate(live.model, live.tokenizer, chat_ids(live.tokenizer, nxt), max_tokens=8)


def test_anthropic_count_tokens(live):
    messages = [{"role": "user", "content": "hello world"}]
    counted = live.anthropic.messages.count_tokens(model="tiny", messages=messages, system="sys")
    assert counted.input_tokens == len(chat_ids(live.tokenizer, [{"role": "system", "content": "sys"}, *messages]))


def test_anthropic_tool_round_trip(live, scripted):
    replies, prompts = scripted
    replies += [["Let me look.", CALL], ["It is sunny in Paris."]]
    tools = [WEATHER]
    question = [{"role": "user", "content": "Weather in Paris?"}]
    first = live.anthropic.messages.create(model="tiny", max_tokens=64, tools=tools, messages=question)
    assert first.stop_reason == "tool_use"
    assert [block.type for block in first.content] == ["text", "tool_use"]
    use = first.content[1]
    assert use.name == "weather" and use.input == {"city": "Paris"}
    assert "weather" in prompts[0] and "input_schema" not in prompts[0]  # described to a template without tools
    follow = question + [
        {"role": "assistant", "content": first.content},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id, "content": "sunny, 21C"}]},
    ]
    with live.anthropic.messages.stream(model="tiny", max_tokens=64, tools=tools, messages=follow) as stream:
        final = stream.get_final_message()
    assert final.content[0].text == "It is sunny in Paris." and final.stop_reason == "end_turn"
    assert "sunny, 21C" in prompts[1] and '"city": "Paris"' in prompts[1]


def test_anthropic_streamed_tool_use(live, scripted):
    replies, _ = scripted
    replies.append([CALL])
    with live.anthropic.messages.stream(
        model="tiny", max_tokens=64, tools=[WEATHER], messages=[{"role": "user", "content": "Weather?"}]
    ) as stream:
        final = stream.get_final_message()
    assert final.stop_reason == "tool_use" and final.content[0].type == "tool_use"
    assert final.content[0].input == {"city": "Paris"}


@pytest.mark.parametrize(
    "body, status, needle",
    [
        ({"messages": [{"role": "user", "content": "hi"}]}, 400, "max_tokens"),
        ({"max_tokens": 4, "messages": [{"role": "robot", "content": "hi"}]}, 400, "role"),
        (
            {
                "max_tokens": 4,
                "messages": [
                    {
                        "role": "user",
                        "content": [
                            {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "AAAA"}}
                        ],
                    }
                ],
            },
            400,
            "text only",
        ),
        (
            {
                "max_tokens": 4,
                "messages": [{"role": "user", "content": "hi"}],
                "thinking": {"type": "enabled", "budget_tokens": 100},  # the reference's least is 1024
            },
            400,
            "thinking",
        ),
        (
            {
                "max_tokens": 4,
                "messages": [{"role": "user", "content": "hi"}],
                "tools": [WEATHER],
                "tool_choice": {"type": "tool", "name": "nowhere"},
            },
            400,
            "tool_choice",
        ),
        (
            {
                "max_tokens": 4,
                "messages": [{"role": "user", "content": "hi"}],
                "tools": [{"type": "web_search_20250305", "name": "web_search"}],
            },
            400,
            "custom tools",
        ),
    ],
)
def test_anthropic_errors(live, body, status, needle):
    request = urllib.request.Request(
        live.base + "/v1/messages", data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
    )
    with pytest.raises(urllib.error.HTTPError) as caught:
        urllib.request.urlopen(request, timeout=60)
    reply = json.loads(caught.value.read())
    assert caught.value.code == status and reply["type"] == "error" and needle in reply["error"]["message"]
    with pytest.raises(anthropic.BadRequestError, match="max_tokens"):  # the client sees it as Anthropic's own
        live.anthropic.messages.create(model="tiny", max_tokens=0, messages=[{"role": "user", "content": "hi"}])


# ---------------------------------------------------------------- OpenAI Responses


def test_responses_equals_offline_generation(live):
    reply = live.openai.responses.create(
        model="tiny", input="hello world", instructions="You are terse.", max_output_tokens=12
    )
    offline = generate(
        live.model,
        live.tokenizer,
        chat_ids(
            live.tokenizer,
            [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "hello world"}],
        ),
        max_tokens=12,
    )
    assert reply.output_text == offline and reply.status == "incomplete"
    assert reply.incomplete_details.reason == "max_output_tokens" and reply.usage.output_tokens == 12


def test_responses_stream(live):
    events = list(
        live.openai.responses.create(
            model="tiny",
            input=[{"role": "user", "content": [{"type": "input_text", "text": "the cat"}]}],
            max_output_tokens=10,
            stream=True,
        )
    )
    kinds = [e.type for e in events]
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    offline = generate(
        live.model, live.tokenizer, chat_ids(live.tokenizer, [{"role": "user", "content": "the cat"}]), max_tokens=10
    )
    assert text == offline and events[-1].response.output_text == offline
    assert kinds[0] == "response.created" and kinds[-1] == "response.incomplete"
    assert [e.sequence_number for e in events] == list(range(len(events)))


def test_responses_function_tool_round_trip(live, scripted):
    replies, prompts = scripted
    replies += [[CALL], ["Sunny."]]
    tools = [
        {"type": "function", "name": "weather", "description": "Current weather", "parameters": WEATHER["input_schema"]}
    ]
    first = live.openai.responses.create(model="tiny", input="Weather in Paris?", tools=tools)
    (call,) = [item for item in first.output if item.type == "function_call"]
    assert call.name == "weather" and json.loads(call.arguments) == {"city": "Paris"}
    follow = [
        {"role": "user", "content": "Weather in Paris?"},
        call.model_dump(exclude_none=True),
        {"type": "function_call_output", "call_id": call.call_id, "output": "sunny, 21C"},
    ]
    events = list(live.openai.responses.create(model="tiny", input=follow, tools=tools, stream=True))
    assert events[-1].response.output_text == "Sunny."
    assert "sunny, 21C" in prompts[1]


def test_a_responses_answer_with_text_and_a_call_is_followed_up_as_it_comes_back(live, scripted, monkeypatch):
    """The next turn prefilled after a Responses answer is rendered from its output items as the
    client sends them back as input (a message item, then a function call: two assistant turns
    here), so the next request's prompt begins with it."""
    replies, prompts = scripted
    replies += [["Let me look.", CALL], ["Sunny."]]
    followed = []
    monkeypatch.setattr(live.server, "prefill_next_turn", lambda *rendering: followed.append(rendering))
    tools = [
        {"type": "function", "name": "weather", "description": "Current weather", "parameters": WEATHER["input_schema"]}
    ]
    question = [{"role": "user", "content": "Weather in Paris?"}]
    first = live.openai.responses.create(model="tiny", input=question, tools=tools)
    assert [item.type for item in first.output] == ["message", "function_call"]
    deadline = time.monotonic() + 10  # offered once the answer is out (a background task): the client acts first
    while not followed:
        assert time.monotonic() < deadline, "the answer's next turn was never offered for prefill"
        time.sleep(0.01)
    call = first.output[1]
    follow = question + [item.model_dump(exclude_none=True) for item in first.output]
    follow.append({"type": "function_call_output", "call_id": call.call_id, "output": "sunny, 21C"})
    live.openai.responses.create(model="tiny", input=follow, tools=tools)
    rendered = live.tokenizer.decode(next_turn_tokens(live.tokenizer, *followed[0]))
    assert prompts[1].startswith(rendered) and "Let me look." in rendered and '"city": "Paris"' in rendered


# ---------------------------------------------------------------- OpenAI chat: the tool loop and more


def test_openai_tool_loop(live, scripted):
    """The assistant turn comes back with content None and tool_calls, then a role tool message."""
    replies, prompts = scripted
    replies += [[CALL], ["Sunny."]]
    tools = [{"type": "function", "function": {"name": "weather", "parameters": WEATHER["input_schema"]}}]
    messages = [{"role": "user", "content": "Weather in Paris?"}]
    first = live.openai.chat.completions.create(model="tiny", messages=messages, tools=tools)
    message = first.choices[0].message
    assert first.choices[0].finish_reason == "tool_calls" and message.content is None
    messages += [
        message.model_dump(exclude_none=False),
        {"role": "tool", "tool_call_id": message.tool_calls[0].id, "content": "sunny, 21C"},
    ]
    assert messages[1]["content"] is None
    second = live.openai.chat.completions.create(model="tiny", messages=messages, tools=tools)
    assert second.choices[0].message.content == "Sunny." and "sunny, 21C" in prompts[1]


def test_n_choices_and_seeds(live):
    base = dict(model="tiny", messages=[{"role": "user", "content": "the cat"}], max_tokens=8, temperature=1.0)
    both = live.openai.chat.completions.create(**base, n=2, seed=7)
    assert [c.index for c in both.choices] == [0, 1]
    alone = [live.openai.chat.completions.create(**base, seed=s).choices[0].message.content for s in (7, 8)]
    assert [c.message.content for c in both.choices] == alone
    assert both.usage.completion_tokens == 16
    streamed = live.openai.completions.create(
        model="tiny", prompt="the cat", max_tokens=6, n=2, seed=7, temperature=1.0, stream=True
    )
    texts = ["", ""]
    for chunk in streamed:
        for choice in chunk.choices:
            texts[choice.index] += choice.text
    assert texts == [
        live.openai.completions.create(model="tiny", prompt="the cat", max_tokens=6, seed=s, temperature=1.0)
        .choices[0]
        .text
        for s in (7, 8)
    ]


def test_logprobs_are_the_targets(live):
    """logprobs of the committed tokens equal log-softmax of the target's own logits over the
    prompt and output (one plain forward), and greedy picks the top alternative."""
    reply = live.openai.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "the cat"}], max_tokens=8, logprobs=True, top_logprobs=3
    )
    content = reply.choices[0].logprobs.content
    assert len(content) == 8 and all(len(entry.top_logprobs) == 3 for entry in content)
    assert all(entry.logprob == pytest.approx(entry.top_logprobs[0].logprob, abs=1e-6) for entry in content)
    prompt = chat_ids(live.tokenizer, [{"role": "user", "content": "the cat"}])
    tokens = [t for r in stream_generate(live.model, live.tokenizer, prompt, max_tokens=8) for t in r.tokens]
    logits = live.model.target.model(mx.array(prompt + tokens)[None])[0, len(prompt) - 1 : -1].astype(mx.float32)
    want = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
    want = mx.take_along_axis(want, mx.array(tokens)[:, None], axis=-1)[:, 0].tolist()
    assert [entry.logprob for entry in content] == pytest.approx(want, abs=1e-4)
    text = live.openai.completions.create(model="tiny", prompt="the cat", max_tokens=4, logprobs=2)
    assert len(text.choices[0].logprobs.token_logprobs) == 4 and len(text.choices[0].logprobs.top_logprobs[0]) == 2


def test_structured_output(live):
    """response_format (chat) and text.format (Responses) constrain the output with the same grammar
    the Python API takes, JSON laid out on one line (a model that would rather write whitespace,
    as this one would, cannot write it for ever)."""
    from dflash_mlx import Grammar

    schema = {"type": "object", "properties": {"name": {"type": "string"}}, "required": ["name"]}
    messages = [{"role": "user", "content": "the cat"}]
    offline = generate(
        live.model,
        live.tokenizer,
        chat_ids(live.tokenizer, messages),
        max_tokens=12,
        grammar=Grammar.json(live.tokenizer, live.model.target.vocab_size, schema, one_line=True),
    )
    assert offline.startswith('{"name"')
    reply = live.openai.chat.completions.create(
        model="tiny",
        messages=messages,
        max_tokens=12,
        response_format={"type": "json_schema", "json_schema": {"name": "person", "schema": schema}},
    )
    assert reply.choices[0].message.content == offline
    response = live.openai.responses.create(
        model="tiny",
        input="the cat",
        max_output_tokens=12,
        text={"format": {"type": "json_schema", "name": "person", "schema": schema}},
    )
    assert response.output_text == offline
    anything = live.openai.chat.completions.create(
        model="tiny", messages=messages, max_tokens=12, response_format={"type": "json_object"}
    )
    assert anything.choices[0].message.content.startswith("{")


@pytest.mark.parametrize(
    "extra, needle",
    [
        ({"response_format": {"type": "xml"}}, "response_format"),
        ({"frequency_penalty": 0.5}, "frequency_penalty"),
        ({"logit_bias": {"5": 10}}, "logit_bias"),
        (
            {
                "tool_choice": {"type": "function", "function": {"name": "g"}},
                "tools": [{"type": "function", "function": {"name": "f"}}],
            },
            "tool_choice",
        ),
        ({"n": 50}, "n must be"),
        ({"messages": [{"role": "robot", "content": "hi"}]}, "role"),
        (
            {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "data:,"}}]}]},
            "text only",
        ),
        ({"messages": [{"role": "user", "content": [{"type": "input_audio", "input_audio": {}}]}]}, "text only"),
    ],
)
def test_nothing_silently_ignored(live, extra, needle):
    body = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, **extra}
    with pytest.raises(openai.BadRequestError) as caught:
        live.openai.chat.completions.create(**body)
    assert needle in caught.value.body["message"]


def test_unknown_fields_are_reported_and_any_model_name_is_served(live):
    reply = live.openai.chat.completions.with_raw_response.create(
        model="gpt-3.5-turbo", messages=[{"role": "user", "content": "hi"}], max_tokens=2, extra_body={"mirostat": 2}
    )
    assert reply.headers["x-dflash-ignored-fields"] == "mirostat"
    parsed = reply.parse()
    assert parsed.model == "tiny" and parsed.usage.model_extra["dflash"]["ignored_fields"] == ["mirostat"]


def test_unknown_routes_and_methods_answer_json(live):
    for path, method, status in (
        ("/v1/nothing", "POST", 404),
        ("/v1/chat/completions", "GET", 405),
        ("/v1/messages", "GET", 405),
    ):
        request = urllib.request.Request(
            live.base + path,
            method=method,
            data=b"{}" if method == "POST" else None,
            headers={"Content-Type": "application/json"},
        )
        with pytest.raises(urllib.error.HTTPError) as caught:
            urllib.request.urlopen(request, timeout=30)
        body = json.loads(caught.value.read())
        assert caught.value.code == status and path in body["error"]["message"]
        assert body.get("type") == ("error" if path.startswith("/v1/messages") else None)  # each API's own format


# ---------------------------------------------------------------- LangChain


def test_langchain_chat_openai(live):
    chat = langchain_openai.ChatOpenAI(
        base_url=live.base + "/v1", api_key="none", max_tokens=10, max_retries=0, temperature=0
    )
    offline = generate(
        live.model, live.tokenizer, chat_ids(live.tokenizer, [{"role": "user", "content": "the cat"}]), max_tokens=10
    )
    assert chat.invoke("the cat").content == offline
    assert "".join(chunk.content for chunk in chat.stream("the cat")) == offline
