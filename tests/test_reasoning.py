"""Thinking models and their tool formats, read from the answer as DFlash delivers it (1 to 16
tokens a step, a marker anywhere in a step or split across steps), in all three APIs.

For each family (Qwen3, Qwen3.5, Qwen3-Coder, gpt-oss, Gemma 4) an assistant turn is written as the
family's real chat template renders one (tests/fixtures/), tokenized with a small tokenizer that
has the family's special tokens (mlx-lm's TokenizerWrapper infers its thinking and tool markers
from them and the template, as it does for the real checkpoint), cut into steps of every size
1..16 tokens and detokenized as the engine does.  A scripted engine answers with those pieces, and
every API, streamed and whole, shows the same reasoning, text and calls for every split."""

import json
import shutil
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace

import pytest

httpx = pytest.importorskip("httpx", reason="the dev extra installs httpx (with the openai client)")

from mlx_lm.tokenizer_utils import load as load_tokenizer  # noqa: E402
from tokenizers import ByteLevelBPETokenizer  # noqa: E402

from dflash_mlx.serve import make_app, serve_in_background, worker  # noqa: E402
from dflash_mlx.serve.answer import AnswerParser, Blocks  # noqa: E402
from dflash_mlx.serve.families import NORMAL  # noqa: E402
from dflash_mlx.serve.answer import ToolCalls  # noqa: E402
from gguf_fixtures import CHAT_TEMPLATE, SPECIALS  # noqa: E402
from scripted_engine import scripted_batch  # noqa: E402

FIXTURES = Path(__file__).parent / "fixtures"
SPLITS = range(1, 17)  # DFlash accepts 1 to 16 tokens a step

QWEN = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<think>", "</think>", "<tool_call>", "</tool_call>"]
QWEN += ["<tool_response>", "</tool_response>"]
HARMONY = ["<|startoftext|>", "<|endoftext|>", "<|return|>", "<|constrain|>", "<|channel|>", "<|start|>"]
HARMONY += ["<|end|>", "<|message|>", "<|call|>"]
GEMMA = ["<bos>", "<eos>", "<|turn>", "<turn|>", "<|channel>", "<channel|>", "<|tool_call>", "<tool_call|>"]
GEMMA += ["<|tool_response>", "<tool_response|>", '<|"|>', "<|think|>", "<|tool>", "<tool|>"]


@dataclass(frozen=True)
class Spec:
    """A family's test tokenizer: its template, special tokens, bos/eos, and the tokens its
    engine stops at (the end of a turn: not part of what the engine delivers)."""

    template: str
    specials: list
    eos: str
    bos: str = None
    stops: tuple = ()
    thinks: bool = True


FAMILIES = {
    "qwen3": Spec("qwen3.jinja", QWEN, "<|im_end|>", stops=("<|im_end|>",)),
    "qwen3_5": Spec("qwen3_5.jinja", QWEN, "<|im_end|>", stops=("<|im_end|>",)),
    "qwen3_coder": Spec("qwen3_coder.jinja", QWEN, "<|im_end|>", stops=("<|im_end|>",), thinks=False),
    "gpt_oss": Spec("gpt_oss.jinja", HARMONY, "<|return|>", "<|startoftext|>", ("<|return|>", "<|call|>")),
    "gemma4": Spec("gemma4.jinja", GEMMA, "<turn|>", "<bos>", ("<turn|>",)),
}
MARKERS = [m for spec in FAMILIES.values() for m in spec.specials] + ["<|channel>thought", "<function=", "<parameter="]

WEATHER = {
    "name": "get_weather",
    "description": "The weather of a city",
    "parameters": {
        "type": "object",
        "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
        "required": ["city"],
    },
}
TIME = {
    "name": "get_time",
    "description": "The time in a zone",
    "parameters": {"type": "object", "properties": {"zone": {"type": "string"}}, "required": ["zone"]},
}
CHAT_TOOLS = [{"type": "function", "function": f} for f in (WEATHER, TIME)]
RESPONSES_TOOLS = [{"type": "function", **f} for f in (WEATHER, TIME)]
ANTHROPIC_TOOLS = [
    {"name": f["name"], "description": f["description"], "input_schema": f["parameters"]} for f in (WEATHER, TIME)
]
USER = {"role": "user", "content": "What is the weather in Paris?"}
PARIS = ("get_weather", {"city": "Paris", "days": 3})
ZONE = ("get_time", {"zone": "Europe/Paris"})


@dataclass(frozen=True)
class Turn:
    name: str
    reasoning: str = ""
    text: str = ""
    calls: tuple = ()

    def blocks(self) -> list[tuple]:
        """What every API shows of it: reasoning, then text, then the calls."""
        out = [("reasoning", self.reasoning)] if self.reasoning else []
        out += [("text", self.text)] if self.text else []
        return out + [("call", name, arguments) for name, arguments in self.calls]


def turns(family: str) -> list[Turn]:
    """Thinking, text, one call, two calls, as each family writes them (Qwen3-Coder does not
    think; gpt-oss's and Gemma 4's templates put no text beside calls)."""
    thought = "" if not FAMILIES[family].thinks else "The user asks about Paris. I know this: sunny."
    beside = "" if family in ("gpt_oss", "gemma4") else "Let me check."
    return [
        Turn("thinking", thought, "It is sunny in Paris today."),
        Turn("text", "", 'Paris is the capital of France.\n\nIt is sunny there, {"a": 1} <b>.'),
        Turn("one call", thought, beside, (PARIS,)),
        Turn("two calls", thought, beside, (PARIS, ZONE)),
    ]


def family_tokenizer(root: Path, family: str):
    """A small byte-level BPE tokenizer with the family's special tokens and chat template,
    loaded by mlx-lm as it loads a checkpoint's (its markers and tool parser inferred)."""
    spec = FAMILIES[family]
    where = root / family
    shutil.rmtree(where, ignore_errors=True)
    where.mkdir(parents=True)
    bpe = ByteLevelBPETokenizer()
    corpus = ["The weather in Paris is sunny today.", 'Let me check the capital of France: {"city": 3}']
    bpe.train_from_iterator(corpus, vocab_size=320, min_frequency=1, special_tokens=spec.specials, show_progress=False)
    bpe.save(str(where / "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "chat_template": (FIXTURES / spec.template).read_text(),
        "eos_token": spec.eos,
        "bos_token": spec.bos,
        "clean_up_tokenization_spaces": False,
    }
    (where / "tokenizer_config.json").write_text(json.dumps(config))
    return load_tokenizer(where)


def assistant_messages(family: str, turn: Turn) -> list[dict]:
    """The turn as the messages the template renders it from (arguments as objects, as
    transformers' templates take them)."""
    calls = [
        {"id": f"call_{i}", "type": "function", "function": {"name": n, "arguments": a}}
        for i, (n, a) in enumerate(turn.calls)
    ]
    message = {"role": "assistant", "content": turn.text}
    if turn.reasoning:
        message["reasoning_content" if family != "gpt_oss" else "thinking"] = turn.reasoning
    if family == "gpt_oss" and len(calls) > 1:  # its template writes one call a message: one message each
        return [{**message, "tool_calls": calls[:1]}, {"role": "assistant", "content": "", "tool_calls": calls[1:]}]
    return [{**message, "tool_calls": calls}] if calls else [message]


def answer_text(tokenizer, family: str, turn: Turn) -> str:
    """The assistant turn as its template renders it after the generation prompt, up to the
    token the engine stops at.  Gemma 4's template renders a thought only before calls: a thought
    then text is its thought rendering followed by its text rendering."""
    tools = CHAT_TOOLS if turn.calls else None
    prompt = tokenizer.apply_chat_template([USER], tools=tools, tokenize=False, add_generation_prompt=True)
    if family == "gemma4" and turn.reasoning and not turn.calls:
        thought = answer_text(tokenizer, family, Turn("", turn.reasoning, "", (PARIS,)))
        return thought[: thought.index("<|tool_call>")] + answer_text(tokenizer, family, Turn("", "", turn.text))
    messages = [USER] + assistant_messages(family, turn)
    whole = tokenizer.apply_chat_template(messages, tools=tools, tokenize=False)
    assert whole.startswith(prompt), (prompt, whole)
    text = whole[len(prompt) :].rstrip("\n")
    for stop in FAMILIES[family].stops:
        text = text.removesuffix(stop)
    return text


def engine_pieces(tokenizer, text: str, size: int) -> list[str]:
    """`text` as the engine delivers it: its tokens `size` at a time, each step's text the
    streaming detokenizer's new segment (api.generation.Responses)."""
    ids = tokenizer.encode(text, add_special_tokens=False)
    detokenizer, pieces = tokenizer.detokenizer, []
    for at in range(0, len(ids), size):
        for token in ids[at : at + size]:
            detokenizer.add_token(token)
        if at + size >= len(ids):
            detokenizer.finalize()
        pieces.append(detokenizer.last_segment)
    assert "".join(pieces) == text
    return pieces


@pytest.fixture(scope="module")
def tokenizers(tmp_path_factory):
    root = tmp_path_factory.mktemp("families")
    return {family: family_tokenizer(root, family) for family in FAMILIES}


# ---------------------------------------------------------------- the parser, every split


def parsed_blocks(tokenizer, prompt: list[int], pieces: list[str], tools=CHAT_TOOLS) -> list[tuple]:
    parser, blocks = AnswerParser.for_prompt(tokenizer, tools, prompt), Blocks()
    events = [event for piece in pieces for event in parser.push(piece)] + parser.finish()
    for event in events:
        blocks.add(event)
    blocks.stop()
    return [
        (b.kind, b.text) if b.kind != "call" else ("call", b.call["name"], json.loads(b.call["arguments"]))
        for b in blocks.blocks
    ]


@pytest.mark.parametrize("family", FAMILIES)
def test_every_split_of_every_turn_reads_the_same(tokenizers, family):
    tokenizer = tokenizers[family]
    prompt = tokenizer.apply_chat_template([USER], tools=CHAT_TOOLS, add_generation_prompt=True)
    for turn in turns(family):
        text = answer_text(tokenizer, family, turn)
        for size in SPLITS:
            assert parsed_blocks(tokenizer, prompt, engine_pieces(tokenizer, text, size)) == turn.blocks(), (
                turn.name,
                size,
                text,
            )


def test_a_template_that_opens_the_reasoning_starts_the_answer_in_it(tokenizers):
    """Qwen3.5's generation prompt ends `<think>\\n` (thinking on) or `<think>\\n\\n</think>\\n\\n`."""
    tokenizer = tokenizers["qwen3_5"]
    on = tokenizer.apply_chat_template([USER], add_generation_prompt=True, enable_thinking=True)
    off = tokenizer.apply_chat_template([USER], add_generation_prompt=True, enable_thinking=False)
    assert parsed_blocks(tokenizer, on, ["Hmm.\n</think>\n\nSunny."]) == [("reasoning", "Hmm."), ("text", "Sunny.")]
    assert parsed_blocks(tokenizer, off, ["Sunny."]) == [("text", "Sunny.")]
    grammar = AnswerParser.for_prompt(tokenizer, None, on, constrained=True)  # a grammar writes it from its start
    assert grammar.state == NORMAL


def test_call_bodies_read_as_mlx_lms_parsers_read_them(tokenizers):
    """Values by type (qwen3_coder: strings as written, "null", numbers, JSON), nested Gemma 4
    arguments, JSON calls laid out otherwise, and a body no call can be read from (shown as text)."""
    schema = {
        "name": "f",
        "parameters": {
            "type": "object",
            "properties": {"s": {"type": "string"}, "n": {"type": "number"}, "o": {"type": "object"}},
        },
    }
    tools = [{"type": "function", "function": schema}]
    coder = tokenizers["qwen3_coder"]
    body = "<tool_call>\n<function=f>\n<parameter=s>\nnull\n</parameter>\n<parameter=n>\n2.5\n</parameter>\n"
    body += '<parameter=o>\n{"k": [1, "x</"]}\n</parameter>\n<parameter=free>\n a\n\n</parameter>\n</function>\n</tool_call>'
    want = [("call", "f", {"s": None, "n": 2.5, "o": {"k": [1, "x</"]}, "free": " a\n"})]
    gemma = tokenizers["gemma4"]
    nested = '<|tool_call>call:f{o:{k:[1,<|"|>a{b},c:d<|"|>,true]},s:<|"|>x<|"|>}<tool_call|>'
    qwen = tokenizers["qwen3"]
    reordered = '<tool_call>\n{"arguments": {"s": "x"}, "name": "f"}\n</tool_call>'
    broken = "Sure.<tool_call>\nnot a call\n</tool_call>"
    for size in range(1, 9):
        split = [body[i : i + size] for i in range(0, len(body), size)]
        assert parsed_blocks(coder, [], split, tools) == want
        split = [nested[i : i + size] for i in range(0, len(nested), size)]
        assert parsed_blocks(gemma, [], split, tools) == [("call", "f", {"o": {"k": [1, "a{b},c:d", True]}, "s": "x"})]
        split = [reordered[i : i + size] for i in range(0, len(reordered), size)]
        assert parsed_blocks(qwen, [], split, tools) == [("call", "f", {"s": "x"})]
        split = [broken[i : i + size] for i in range(0, len(broken), size)]
        assert parsed_blocks(qwen, [], split, tools) == [("text", "Sure." + broken[5:])]
    calls = ToolCalls(qwen, tools)  # the text-only reader keeps its contract
    assert calls.push('Hi.<tool_call>{"name": "f", "arguments": {}}</tool_call>') == "Hi."
    assert [c["function"]["name"] for c in calls.finish()[1]] == ["f"]


# ---------------------------------------------------------------- the three APIs, every split


class StubModel:
    """A model the server can keep its learning for (decode/learning.py: weakly keyed, by identity)."""

    def __init__(self, **parts):
        self.__dict__.update(parts)


def stub_model():
    """What the server reads of a model when a script answers for its engine."""
    args = SimpleNamespace(max_position_embeddings=4096)
    return StubModel(target=SimpleNamespace(model=SimpleNamespace(args=args), vocab_size=320), draft=None)


@pytest.fixture(scope="module")
def served(tokenizers):
    """A server per family (and one for a model without thinking), each answering with the
    pieces in `script.pieces`; the prompts it was asked to continue are in `script.prompts`."""
    script = SimpleNamespace(pieces=[], prompts=[])
    servers, tokenizers = {}, {**tokenizers, "plain": plain_tokenizer()}

    def reply(prompt):
        script.prompts.append(prompt)
        return list(script.pieces)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(worker, "BatchGenerator", scripted_batch(reply))
        for family, tokenizer in tokenizers.items():
            server = make_app(stub_model(), tokenizer, family, max_batch=1, prompt_cache_bytes=0, max_queue=4)
            http, port = serve_in_background(server)
            servers[family] = SimpleNamespace(server=server, http=http, tokenizer=tokenizer)
            servers[family].client = httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=60)
    yield SimpleNamespace(servers=servers, script=script)
    for entry in servers.values():
        entry.client.close()
        entry.http.should_exit = True
        entry.server.worker.stop()


def plain_tokenizer():
    """A tokenizer without thinking or tool markers (ChatML, as tests/gguf_fixtures.py's)."""
    from gguf_fixtures import tiny_tokenizer
    from transformers import PreTrainedTokenizerFast
    from mlx_lm.tokenizer_utils import TokenizerWrapper

    fast = PreTrainedTokenizerFast(tokenizer_object=tiny_tokenizer()._tokenizer, eos_token="<|im_end|>")
    fast.chat_template = CHAT_TEMPLATE
    assert SPECIALS[2] == "<|im_end|>"
    return TokenizerWrapper(fast)


def sse(response) -> list[dict]:
    return [json.loads(line[6:]) for line in response.text.split("\n") if line.startswith("data: {")]


def no_marker(*texts: str) -> None:
    for text in texts:
        assert not any(marker in text for marker in MARKERS), text


DELTAS = {  # an Anthropic delta: the block field it adds to, its own field
    "thinking_delta": ("thinking", "thinking"),
    "signature_delta": ("signature", "signature"),
    "text_delta": ("text", "text"),
    "input_json_delta": ("partial", "partial_json"),
}


def anthropic(client, stream: bool, thinking=None) -> list[tuple]:
    body = {"model": "m", "max_tokens": 512, "messages": [USER], "tools": ANTHROPIC_TOOLS, "stream": stream}
    body["thinking"] = thinking or {"type": "enabled", "budget_tokens": 1024}
    reply = client.post("/v1/messages", json=body)
    assert reply.status_code == 200, reply.text
    if not stream:
        return [_anthropic_block(b) for b in reply.json()["content"] if b != {"type": "text", "text": ""}]
    blocks, stop = {}, None
    events = sse(reply)
    for i, event in enumerate(events):
        if event["type"] == "content_block_start":
            block = blocks.setdefault(event["index"], dict(event["content_block"]))
            assert block["type"] != "tool_use" or block["name"]  # a call opens with its name
            block["partial"] = ""
        elif event["type"] == "content_block_delta":
            block, delta = blocks[event["index"]], event["delta"]
            if delta["type"] == "signature_delta":  # a thinking block's last delta
                assert block["type"] == "thinking" and events[i + 1]["type"] == "content_block_stop"
            into, key = DELTAS[delta["type"]]
            block[into] += delta[key]
        elif event["type"] == "content_block_stop":
            block = blocks[event["index"]]
            assert block["type"] != "thinking" or block["signature"]
            if block["type"] == "tool_use":
                block["input"] = json.loads(block["partial"])
        elif event["type"] == "message_delta":
            stop = event["delta"]["stop_reason"]
    out = [_anthropic_block(b) for _, b in sorted(blocks.items()) if not (b["type"] == "text" and not b["text"])]
    assert stop == ("tool_use" if any(b[0] == "call" for b in out) else "end_turn")
    return out


def _anthropic_block(block: dict) -> tuple:
    if block["type"] == "thinking":
        assert block["signature"]
        no_marker(block["thinking"])
        return ("reasoning", block["thinking"])
    if block["type"] == "text":
        no_marker(block["text"])
        return ("text", block["text"])
    return ("call", block["name"], block["input"])


def chat(client, stream: bool, **fields) -> list[tuple]:
    body = {"model": "m", "messages": [USER], "tools": CHAT_TOOLS, "stream": stream, **fields}
    reply = client.post("/v1/chat/completions", json=body)
    assert reply.status_code == 200, reply.text
    if not stream:
        choice = reply.json()["choices"][0]
        message, finish = choice["message"], choice["finish_reason"]
        reasoning, text = message.get("reasoning_content") or "", message["content"] or ""
        assert reasoning == (message.get("reasoning") or "")
        calls = [
            (c["function"]["name"], json.loads(c["function"]["arguments"])) for c in message.get("tool_calls") or []
        ]
    else:
        reasoning, text, calls, finish, seen_text = "", "", {}, None, False
        for chunk in sse(reply):
            (choice,) = chunk["choices"]
            delta, finish = choice["delta"], choice["finish_reason"] or finish
            assert delta.get("reasoning_content") == delta.get("reasoning")
            assert not (seen_text and delta.get("reasoning_content"))  # reasoning comes before the answer
            reasoning += delta.get("reasoning_content") or ""
            text += delta.get("content") or ""
            seen_text = seen_text or bool(delta.get("content"))
            for call in delta.get("tool_calls") or []:
                if call["index"] not in calls:  # a call's first delta: its id and name
                    assert call["id"] and call["function"]["name"]
                    calls[call["index"]] = [call["function"]["name"], ""]
                calls[call["index"]][1] += call["function"].get("arguments", "")
        calls = [(name, json.loads(arguments)) for _, (name, arguments) in sorted(calls.items())]
    no_marker(reasoning, text)
    assert finish == ("tool_calls" if calls else "stop")
    out = [("reasoning", reasoning)] if reasoning else []
    return out + ([("text", text)] if text else []) + [("call", name, arguments) for name, arguments in calls]


def responses(client, stream: bool, **fields) -> list[tuple]:
    body = {"model": "m", "input": [USER], "tools": RESPONSES_TOOLS, "stream": stream, **fields}
    reply = client.post("/v1/responses", json=body)
    assert reply.status_code == 200, reply.text
    if not stream:
        return _responses_output(reply.json()["output"])
    events, deltas, done = sse(reply), {}, []
    for event in events:
        kind = event["type"]
        if kind == "response.output_item.added" and event["item"]["type"] == "function_call":
            assert event["item"]["name"]  # a call's item opens with its name
        if kind.endswith(".delta"):
            deltas[event["item_id"]] = deltas.get(event["item_id"], "") + event["delta"]
        if kind == "response.output_item.done":
            done.append(event["item"])
    assert events[-1]["type"] == "response.completed" and events[-1]["response"]["output"] == done
    for item in done:  # the deltas add up to each item
        whole = {"reasoning": lambda i: i["content"][0]["text"], "message": lambda i: i["content"][0]["text"]}
        assert deltas.get(item["id"], "") == whole.get(item["type"], lambda i: i["arguments"])(item)
    return _responses_output(done)


def _responses_output(items: list[dict]) -> list[tuple]:
    out = []
    for item in items:
        if item["type"] == "reasoning":
            assert item["summary"] == [] and item["content"][0]["type"] == "reasoning_text"
            out.append(("reasoning", item["content"][0]["text"]))
        elif item["type"] == "message":
            out.append(("text", item["content"][0]["text"]))
        else:
            out.append(("call", item["name"], json.loads(item["arguments"])))
    no_marker(*(b[1] for b in out if b[0] != "call"))
    return [b for b in out if b != ("text", "")]


@pytest.mark.slow
@pytest.mark.parametrize("family", FAMILIES)
def test_every_api_shows_every_split_alike(served, family):
    entry, script = served.servers[family], served.script
    for turn in turns(family):
        text = answer_text(entry.tokenizer, family, turn)
        for size in SPLITS:
            script.pieces = engine_pieces(entry.tokenizer, text, size)
            for api in (anthropic, chat, responses):
                for stream in (False, True):
                    assert api(entry.client, stream) == turn.blocks(), (turn.name, size, api.__name__, stream)


@pytest.mark.slow
def test_thinking_is_switched_where_the_template_can(served):
    """Anthropic `thinking`, chat `reasoning_effort` / `chat_template_kwargs`, Responses
    `reasoning.effort` reach the template as enable_thinking (Qwen3.5's generation prompt opens
    the reasoning, or closes it empty) and reasoning_effort (gpt-oss's system message)."""
    entry, script = served.servers["qwen3_5"], served.script
    script.pieces = ["Sunny."]
    off, on = "<think>\n\n</think>\n\n", "<think>\n"

    def prompt() -> str:
        return entry.tokenizer.decode(script.prompts[-1])

    anthropic(entry.client, False, thinking={"type": "disabled"})
    assert prompt().endswith(off)
    anthropic(entry.client, False, thinking={"type": "adaptive"})
    assert prompt().endswith(on) and not prompt().endswith(off)
    for fields in ({"reasoning_effort": "none"}, {"chat_template_kwargs": {"enable_thinking": False}}):
        assert chat(entry.client, False, **fields) == [("text", "Sunny.")]
        assert prompt().endswith(off)
    responses(entry.client, True, reasoning={"effort": "none"})
    assert prompt().endswith(off)
    responses(entry.client, True, reasoning={"effort": "high"})
    assert prompt().endswith(on)
    harmony = served.servers["gpt_oss"]
    script.pieces = ["<|channel|>final<|message|>Sunny."]
    assert chat(harmony.client, True, reasoning_effort="high") == [("text", "Sunny.")]
    assert "Reasoning: high" in harmony.tokenizer.decode(script.prompts[-1])
    reply = entry.client.post("/v1/chat/completions", json={"messages": [USER], "reasoning_effort": "huge"})
    assert reply.status_code == 400 and "reasoning_effort" in reply.text


@pytest.mark.slow
def test_a_model_without_thinking_takes_the_switches_and_answers_without_reasoning(served):
    entry, script = served.servers["plain"], served.script
    script.pieces = ["Hello", " there", ".\n"]
    assert anthropic(entry.client, True) == [("text", "Hello there.\n")]
    assert anthropic(entry.client, False, thinking={"type": "adaptive"}) == [("text", "Hello there.\n")]
    assert chat(entry.client, True, reasoning_effort="high") == [("text", "Hello there.\n")]
    assert responses(entry.client, False, reasoning={"effort": "high", "summary": "auto"}) == [
        ("text", "Hello there.\n")
    ]


@pytest.mark.slow
def test_reasoning_sent_back_reaches_the_template(served):
    """A thinking block (Anthropic), a reasoning item's reasoning_text (Responses) and
    reasoning_content (chat) go back to the template, which renders the reasoning after the
    last user turn, as Qwen3's does within a tool loop."""
    entry, script = served.servers["qwen3"], served.script
    script.pieces = ["<think>\nok\n</think>\n\nDone."]
    call = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
    result = {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}
    history = [USER, {"role": "assistant", "content": "", "reasoning_content": "Need weather.", "tool_calls": [call]}]
    assert chat(entry.client, False, messages=history + [result])[-1] == ("text", "Done.")
    assert "<think>\nNeed weather.\n</think>" in entry.tokenizer.decode(script.prompts[-1])
    use = {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {"city": "Paris"}}
    thinking = {"type": "thinking", "thinking": "Need weather.", "signature": "dflash-mlx"}
    turns_ = [USER, {"role": "assistant", "content": [thinking, use]}]
    turns_.append({"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "content": "sunny"}]})
    body = {"model": "m", "max_tokens": 64, "messages": turns_, "tools": ANTHROPIC_TOOLS}
    assert entry.client.post("/v1/messages", json=body).status_code == 200
    assert "<think>\nNeed weather.\n</think>" in entry.tokenizer.decode(script.prompts[-1])
    items = [
        USER,
        {
            "type": "reasoning",
            "id": "rs_1",
            "summary": [],
            "content": [{"type": "reasoning_text", "text": "Need weather."}],
        },
        {"type": "function_call", "call_id": "call_1", "name": "get_weather", "arguments": '{"city": "Paris"}'},
        {"type": "function_call_output", "call_id": "call_1", "output": "sunny"},
    ]
    responses(entry.client, False, input=items)
    assert "<think>\nNeed weather.\n</think>" in entry.tokenizer.decode(script.prompts[-1])


def test_turns_render_as_their_templates_write_them(tokenizers):
    """The test turns are the templates' own renderings (what the model was trained to write)."""
    qwen3 = answer_text(tokenizers["qwen3"], "qwen3", turns("qwen3")[3])
    assert qwen3.startswith("<think>\nThe user") and qwen3.count('<tool_call>\n{"name": ') == 2
    harmony = answer_text(tokenizers["gpt_oss"], "gpt_oss", turns("gpt_oss")[3])
    assert (
        harmony.startswith("<|channel|>analysis<|message|>")
        and "<|call|><|start|>assistant to=functions.get_time" in harmony
    )
    gemma = answer_text(tokenizers["gemma4"], "gemma4", turns("gemma4")[2])
    assert (
        gemma.startswith("<|channel>thought\n") and '<|tool_call>call:get_weather{city:<|"|>Paris<|"|>,days:3}' in gemma
    )


@pytest.mark.slow
def test_the_reference_clients_read_the_streams(served):
    """The `anthropic` SDK assembles the thinking block (with its signature), the text and the
    tool_use block; the `openai` SDK parses the Responses reasoning item and the chat deltas."""
    anthropic_sdk = pytest.importorskip("anthropic")
    openai_sdk = pytest.importorskip("openai")
    entry, script = served.servers["qwen3_5"], served.script
    turn = turns("qwen3_5")[2]
    script.pieces = engine_pieces(entry.tokenizer, answer_text(entry.tokenizer, "qwen3_5", turn), 3)
    base = str(entry.client.base_url)
    client = anthropic_sdk.Anthropic(base_url=base, api_key="none", max_retries=0)
    thinking = {"type": "enabled", "budget_tokens": 1024}
    with client.messages.stream(
        model="m", max_tokens=256, messages=[USER], tools=ANTHROPIC_TOOLS, thinking=thinking
    ) as stream:
        final = stream.get_final_message()
    assert [block.type for block in final.content] == ["thinking", "text", "tool_use"]
    assert final.content[0].thinking == turn.reasoning and final.content[0].signature
    assert final.content[2].input == PARIS[1] and final.stop_reason == "tool_use"
    openai = openai_sdk.OpenAI(base_url=base + "/v1", api_key="none", max_retries=0)
    events = list(openai.responses.create(model="m", input=[USER], tools=RESPONSES_TOOLS, stream=True))
    kinds = {type(event).__name__ for event in events}
    assert {"ResponseReasoningTextDeltaEvent", "ResponseFunctionCallArgumentsDeltaEvent"} <= kinds
    output = events[-1].response.output
    assert [item.type for item in output] == ["reasoning", "message", "function_call"]
    assert output[0].content[0].text == turn.reasoning and output[1].content[0].text == turn.text
    chunks = list(openai.chat.completions.create(model="m", messages=[USER], tools=CHAT_TOOLS, stream=True))
    reasoning = "".join(c.choices[0].delta.model_extra.get("reasoning_content") or "" for c in chunks)
    assert reasoning == turn.reasoning and chunks[-1].choices[0].finish_reason == "tool_calls"
