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
    return load(str(model_dir), use_draft=False)


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
