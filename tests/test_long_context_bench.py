"""bench/long_context.py's same-text prompts: every length continues one document from the same
cut points, so a drafter's tau at 16k and at 1k tokens is measured on the same continuations."""

import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

sys.path.insert(0, str(Path(__file__).parent.parent / "bench"))

import long_context  # noqa: E402

BOS = 2


def test_every_length_ends_at_the_same_cut_with_the_text_before_it():
    ids = list(range(100, 1100))
    cuts = long_context.cut_points(len(ids), 600, 3)
    assert cuts == sorted(set(cuts)) and cuts[0] == 600 and cuts[-1] < len(ids)
    prompts = long_context.same_text_prompts(ids, [16, 64, 600], cuts, BOS)
    for i, cut in enumerate(cuts):
        short, middle, long = (prompts[n][i] for n in (16, 64, 600))
        assert [len(short), len(middle), len(long)] == [16, 64, 600]
        assert short[0] == middle[0] == long[0] == BOS
        assert long[-15:] == middle[-15:] == short[1:] == ids[cut - 15 : cut]  # the same text before the cut
        assert long[1:] == ids[cut - 599 : cut]
    assert long_context.same_text_prompts(ids, [8], cuts, None)[8][0] == ids[592:600]  # no BOS: all text


def test_a_document_too_short_for_the_longest_length_is_refused_by_name():
    with pytest.raises(ValueError, match=r"has 1,000 tokens: 3 cut points need at least 16,387"):
        long_context.cut_points(1000, 16384, 3)


def test_the_document_is_read_with_its_tokenizer_and_named(tmp_path):
    text = tmp_path / "held_out.py"
    text.write_text("x" * 50)
    tokenizer = SimpleNamespace(encode=lambda s, add_special_tokens: [ord(c) for c in s], bos_token_id=BOS)
    prompts, about = long_context.document_prompts(tokenizer, text, [10, 20], 2)
    assert about == f"Text: `{text}` (50 tokens), prompts ending at tokens 20, 35"
    assert [len(p) for p in prompts[20]] == [20, 20] and prompts[10][1] == [BOS] + [ord("x")] * 9
