"""The builtin training prompts are disjoint from every benchmark set."""

import re

import pytest

from dflash_mlx.bench.prompt_sets import BOXED, SETS, load_prompts
from dflash_mlx.train.prompts import builtin_prompts, read_prompts

SHINGLE = 8  # words


def shingles(text: str) -> set:
    words = re.findall(r"\w+", text.replace(BOXED, "").lower())
    return {tuple(words[i : i + SHINGLE]) for i in range(len(words) - SHINGLE + 1)}


def test_builtin_prompts_share_no_8_word_span_with_benchmarks():
    train = builtin_prompts()
    assert len(train) > 1000 and len(set(train)) == len(train)
    train += [p for p in builtin_prompts(1) if p not in set(train)]
    bench = set().union(*(shingles(p) for name in SETS for p in load_prompts(name)))
    assert len(bench) > 10000  # the sets really were read
    overlapping = [p for p in train if shingles(p) & bench]
    assert not overlapping, overlapping[:3]


def test_builtin_seeds_draw_new_prompts():
    assert read_prompts("builtin") == builtin_prompts(0)
    again = read_prompts("builtin:1")
    assert again == builtin_prompts(1) and len(set(again) - set(builtin_prompts(0))) > 500
    with pytest.raises(ValueError, match="builtin:1"):
        read_prompts("builtin:x")


def test_prompt_files(tmp_path):
    (tmp_path / "p.txt").write_text("first\n\nsecond\n")
    assert read_prompts(str(tmp_path / "p.txt")) == ["first", "second"]
    (tmp_path / "p.jsonl").write_text('{"prompt": "a"}\n{"text": "b"}\n')
    with pytest.raises(ValueError, match="prompt"):
        read_prompts(str(tmp_path / "p.jsonl"))
    with pytest.raises(FileNotFoundError, match="builtin"):
        read_prompts(str(tmp_path / "missing.txt"))
    (tmp_path / "empty.txt").write_text("\n")
    with pytest.raises(ValueError, match="no prompts"):
        read_prompts(str(tmp_path / "empty.txt"))
