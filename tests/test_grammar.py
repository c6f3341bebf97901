"""Structured output: a grammar masks the target's choices; DFlash under a grammar gives exactly
what constrained plain decoding gives, whatever the drafter proposes."""

import json

import pytest

pytest.importorskip("llguidance", reason="the serve / dev extras install llguidance")

from dflash_mlx import DFlashModel, Grammar, load, stream_generate  # noqa: E402
from dflash_mlx.api import format_prompt  # noqa: E402
from tiny_models import oracle_draft  # noqa: E402

SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
    "required": ["name", "age"],
    "additionalProperties": False,
}


def tokens_of(model, tokenizer, prompt, **options) -> list[int]:
    return [t for r in stream_generate(model, tokenizer, prompt, 40, **options) for t in r.tokens]


@pytest.fixture(scope="module")
def plain(tiny_dirs):
    model_dir, _ = tiny_dirs
    return load(str(model_dir), use_draft=False, adaptive=False)


def test_dflash_under_a_grammar_equals_constrained_plain_decoding(plain):
    model, tokenizer = plain
    grammar = Grammar.json(tokenizer, model.target.vocab_size, SCHEMA)
    prompt = tokenizer.encode("the cat")
    constrained = tokens_of(model, tokenizer, prompt, grammar=grammar)
    free = tokens_of(model, tokenizer, prompt)
    text = tokenizer.decode(constrained)
    assert constrained != free and text.startswith("{") and '"name"' in text
    grammar.start().commit(constrained)  # raises if any token is one the grammar forbids
    # drafters proposing the constrained text (some wrong) and the unconstrained text (forbidden tokens)
    for reference, wrong in ((prompt + constrained, {5, 9, 10, 17}), (prompt + free, set())):
        draft = oracle_draft(model.target, reference, wrong=wrong, block_size=4, layer_ids=(0, 1))
        pair = DFlashModel(model.target, draft)
        for width in (2, 4):
            assert tokens_of(pair, tokenizer, prompt, grammar=grammar, block_size=width) == constrained
    sampled = tokens_of(model, tokenizer, prompt, grammar=grammar, temp=1.0, seed=3)
    pair = DFlashModel(
        model.target, oracle_draft(model.target, prompt + sampled, wrong={7}, block_size=4, layer_ids=(0, 1))
    )
    assert tokens_of(pair, tokenizer, prompt, grammar=grammar, temp=1.0, seed=3, block_size=4) == sampled
    grammar.start().commit(sampled)


def test_a_bad_schema_is_a_clear_error(plain):
    model, tokenizer = plain
    with pytest.raises(ValueError, match="JSON schema must be an object"):
        Grammar.json(tokenizer, model.target.vocab_size, ["not", "a", "schema"])
    with pytest.raises(ValueError, match="grammar is not valid"):
        Grammar.json(tokenizer, model.target.vocab_size, {"type": "no-such-type"})


@pytest.mark.slow  # the real default pair
def test_the_default_pair_answers_in_the_schema(smollm2_dir):
    model, tokenizer = load(adaptive=False)
    schema = {
        "type": "object",
        "properties": {"capital": {"type": "string"}},
        "required": ["capital"],
        "additionalProperties": False,
    }
    prompt = format_prompt(tokenizer, "What is the capital of France? Answer in JSON with the key capital.")
    text = "".join(
        r.text
        for r in stream_generate(
            model, tokenizer, prompt, 48, grammar=Grammar.json(tokenizer, model.target.vocab_size, schema)
        )
    )
    assert "Paris" in json.loads(text)["capital"]


def test_a_complete_grammar_allows_only_the_end_and_survives_proposals_past_it(plain):
    """Proposals that run past the grammar's end (the object closed, then the end token, then
    more) leave the state at the committed tokens; once complete only the end token is allowed."""
    model, tokenizer = plain
    grammar = Grammar.json(tokenizer, model.target.vocab_size, SCHEMA)
    body = tokenizer.encode('{"name": "A", "age": 1', add_special_tokens=False)
    close = tokenizer.encode("}", add_special_tokens=False)
    (eos,) = sorted(tokenizer.eos_token_ids)[:1]
    state = grammar.start()
    state.commit(body)
    masks = state.masks(close + [eos, eos, close[0]])
    assert masks[0, close[0]] and not masks[0, eos]
    ended = masks[len(close)]
    assert ended[eos] and int(ended.sum()) == 1  # complete: the end token and nothing else
    state.commit(close)
    state.masks([eos, eos])  # the matcher has stopped: nothing may be rolled back past the close
    state.commit([eos, eos])  # raised "chosen against the mask" when the close was undone
    assert state.matcher.is_stopped()


def test_grammar_rows_are_never_a_stale_state(plain):
    """A row past a proposal token the parser refuses is never the state before that token:
    the refused token is masked at its own row, so the target cannot accept it."""
    model, tokenizer = plain
    grammar = Grammar.json(tokenizer, model.target.vocab_size, SCHEMA)
    state = grammar.start()
    state.commit(tokenizer.encode('{"name": "A", "age": 1}', add_special_tokens=False))
    after = tokenizer.encode("x", add_special_tokens=False)
    masks = state.masks(after * 3)
    assert not any(bool(masks[i, after[0]]) for i in range(4))


PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "age": {"type": "integer"},
        "role": {"enum": ["farmer", "wizard", "nurse", "baker"]},
        "skills": {"type": "array", "items": {"type": "string"}, "minItems": 1, "maxItems": 3},
        "home": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "year": {"type": "integer"}},
            "required": ["city", "year"],
            "additionalProperties": False,
        },
    },
    "required": ["name", "age", "role", "skills", "home"],
    "additionalProperties": False,
}
CHARACTERS = ["a farmer", "a wizard", "a cat", "a baker"]


@pytest.mark.slow
def test_strict_schemas_hold_on_every_path_whatever_ran_before(smollm2_dir):
    """The default pair, greedy: answers in a strict schema (nested object, enum, array,
    integers) validate, end at the object, and are the same alone with the drafter, plain,
    in a batch of 4, after other requests (the session-wide answer store proposes copies of
    earlier answers) and served."""
    import jsonschema

    from dflash_mlx import batch_generate, generate

    model, tokenizer = load()
    grammar = Grammar.json(tokenizer, model.target.vocab_size, PERSON)
    prompts = [[{"role": "user", "content": f"Invent {who}. Reply in JSON."}] for who in CHARACTERS]

    def answer(prompt, **options):
        return generate(model, tokenizer, prompt, 160, **{"grammar": grammar, **options})

    first = [answer(p) for p in prompts]
    for text in first:
        jsonschema.validate(json.loads(text), PERSON)  # json.loads: nothing after the object
    assert answer(prompts[0]) == first[0]  # after the others: their answers are on offer as copies
    assert answer(prompts[1], block_size=1) == first[1]
    batched = batch_generate(model, tokenizer, prompts, 160, max_batch=4, grammar=grammar)
    assert batched.texts == first
    assert all(r.finish_reason == "stop" for r in batched.responses)
    one_line = Grammar.json(tokenizer, model.target.vocab_size, PERSON, one_line=True)  # as the server lays it out
    assert_served_alike(model, tokenizer, prompts[:1], [answer(prompts[0], grammar=one_line)])


def assert_served_alike(model, tokenizer, prompts, expected):
    """The server's strict json_schema answers are the in-process ones, and the openai SDK's
    `parse()` (which refuses trailing text) takes them."""
    from typing import Literal

    import openai
    from pydantic import BaseModel, Field

    from dflash_mlx.serve import make_app, serve_in_background

    class Home(BaseModel):
        city: str
        year: int

    class Person(BaseModel):
        name: str
        age: int
        role: Literal["farmer", "wizard", "nurse", "baker"]
        skills: list[str] = Field(min_length=1, max_length=3)
        home: Home

    server = make_app(model, tokenizer, "default")
    http, port = serve_in_background(server)
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", max_retries=0)
    schema = {"type": "json_schema", "json_schema": {"name": "person", "strict": True, "schema": PERSON}}
    try:
        for messages, text in zip(prompts, expected):
            reply = client.chat.completions.create(
                model="default", messages=messages, max_tokens=160, response_format=schema
            )
            assert reply.choices[0].message.content == text and reply.choices[0].finish_reason == "stop"
        parsed = client.chat.completions.parse(
            model="default", messages=prompts[0], max_tokens=160, response_format=Person
        )
        assert isinstance(parsed.choices[0].message.parsed, Person)
    finally:
        http.should_exit = True
        server.worker.stop()


def test_tokens_a_grammar_forces_are_verified_as_a_draft(plain, monkeypatch):
    """A grammar that fixes a stretch of text (a tool call's frame and name) proposes it whole:
    one target pass verifies the stretch and the next choice, and the output is what constrained
    decoding without such drafts gives, greedy and seeded."""
    from dflash_mlx.decode.grammar import GrammarState

    model, tokenizer = plain
    lark = (
        'start: "<tool_call>\\n{\\"name\\": \\"get_weather\\", \\"arguments\\": " args "}\\n</tool_call>"\n'
        'args: %json{"type": "object", "properties": {"city": {"enum": ["Paris", "Rome"]}}, "required": ["city"]}'
    )
    grammar = Grammar(tokenizer, lark, model.target.vocab_size)
    prompt = tokenizer.encode("the cat")

    def run(**options):
        responses = list(stream_generate(model, tokenizer, prompt, 60, grammar=grammar, **options))
        return [t for r in responses for t in r.tokens], responses[-1]

    for options in ({}, {"temp": 1.0, "seed": 3}):
        forced, last = run(**options)
        with monkeypatch.context() as patch:
            patch.setattr(GrammarState, "forced", lambda self, limit: [])
            unforced, plain_last = run(**options)
        assert forced == unforced and tokenizer.decode(forced).startswith('<tool_call>\n{"name": "get_weather"')
        assert "grammar" in last.sources and "grammar" not in plain_last.sources
        assert len(last.widths) < len(plain_last.widths) / 2  # target passes
