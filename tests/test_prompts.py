"""The builtin training prompts are disjoint from every benchmark set."""

import re
from pathlib import Path

import pytest

from dflash_mlx.bench.prompt_sets import BOXED, SETS, load_prompts, mixed_prompts
from dflash_mlx.train.prompts import REVISIONS, builtin_prompts, edit_prompts, read_prompts, revision_prompts

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


def test_edit_prompts_ask_one_change_of_a_whole_function_and_share_no_span_with_benchmarks():
    edits = read_prompts("edits")
    assert edits == edit_prompts(0) and len(edits) > 200 and len(set(edits)) == len(edits)
    assert all("```python\ndef " in p for p in edits)
    assert len(set(read_prompts("edits:1")) - set(edits)) > 150
    bench = set().union(*(shingles(p) for name in SETS for p in load_prompts(name)))
    overlapping = [p for p in edits if shingles(p) & bench]
    assert not overlapping, overlapping[:3]
    from dflash_mlx.bench.prompt_sets import COPY_MODULES, DOC_MODULES
    from dflash_mlx.train.prompts import EDITS, STUB_MODULES

    assert not set(STUB_MODULES) & set(COPY_MODULES + DOC_MODULES)  # the copy-heavy set's sources
    assert not any("type hints" in edit or "_value" in edit for edit in EDITS)  # nor its tasks
    with pytest.raises(ValueError, match="edits:1"):
        read_prompts("edits:x")


@pytest.mark.slow  # reads the Python docs' topics (~40 s)
def test_revision_prompts_ask_one_change_of_a_paragraph_and_share_no_span_with_benchmarks():
    revisions = read_prompts("revisions")
    assert revisions == revision_prompts(0) and len(revisions) > 300 and len(set(revisions)) == len(revisions)
    assert len(set(read_prompts("revisions:1")) - set(revisions)) > 250
    bench = set().union(*(shingles(p) for name in SETS for p in load_prompts(name)))
    overlapping = [p for p in revisions if shingles(p) & bench]
    assert not overlapping, overlapping[:3]
    sessions = (Path(__file__).parent.parent / "bench" / "agent_session.py").read_text()  # our own bench's
    assert not any(ask.split("'")[0] in sessions for ask in REVISIONS)
    assert not any(shingles(sessions) & shingles(p) for p in revisions)
    with pytest.raises(ValueError, match="revisions:1"):
        read_prompts("revisions:x")


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


@pytest.mark.slow
def test_the_target_writes_prompts_itself(smollm2, tmp_path):
    """Magpie-style: from its user-turn opening alone, SmolLM2 writes user prompts; kept are
    finished, distinct ones that share no 8-word span with the banned (benchmark) spans."""
    import json

    from dflash_mlx.train.corpus import shingles as spans
    from dflash_mlx.train.self_prompts import keep, make_prompts, user_turn_prefix

    model, tokenizer = smollm2
    prefix = tokenizer.decode(user_turn_prefix(tokenizer))
    assert prefix.endswith("<|im_start|>user\n") and "system" in prefix
    banned = spans("write a short story about a cat who loves to nap in the sun")
    assert not keep("Write a short story about a cat who loves to nap in the sun all day.", set(), banned)
    assert not keep("hi", set(), set()) and not keep(
        "What is the capital of France?", {"what is the capital of france?"}, set()
    )
    out = tmp_path / "prompts.jsonl"
    make_prompts(model, tokenizer, out, 2, banned, batch_size=4, max_tokens=48, show_progress=False)
    make_prompts(model, tokenizer, out, 3, banned, batch_size=4, max_tokens=48, show_progress=False)  # resumes
    prompts = [json.loads(line)["prompt"] for line in out.read_text().splitlines()]
    assert len(prompts) == 3 and len(set(prompts)) == 3
    assert all(keep(p, set(), banned) for p in prompts)
    assert read_prompts(str(out)) == prompts  # what make-data --prompts reads


def test_mixed_prompts_take_the_sets_in_turn():
    sets = [load_prompts(name) for name in ("mtbench", "gsm8k", "humaneval")]
    mixed = mixed_prompts(["mtbench", "gsm8k", "humaneval"], 7)
    assert mixed == [sets[0][0], sets[1][0], sets[2][0], sets[0][1], sets[1][1], sets[2][1], sets[0][2]]
    with pytest.raises(ValueError, match="asked for"):
        mixed_prompts(["aime"], 10**6)
