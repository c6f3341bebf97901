"""`train make-data --text`: plain continuations of text files for a base model, cut exactly,
in the order that keeps the last file's for held-out, and bad input refused in one line."""

import json

import pytest
from mlx_lm.tokenizer_utils import load as load_tokenizer
from typer.testing import CliRunner

from dflash_mlx.cli import app
from dflash_mlx.convert.gguf import convert_gguf
from dflash_mlx.train.continuations import continuations, text_files
from dflash_mlx.train.data import read_data
from dflash_mlx.train.evaluate import split_held_out
from gguf_fixtures import write_gemma3_gguf

runner = CliRunner()
PROSE = "The quick brown fox jumps over the lazy dog, and then it naps by the river bank. "


@pytest.fixture(scope="module")
def base_model(tmp_path_factory):
    """A tiny Gemma 3 dir, its tokenizer putting a BOS before raw text as the real one does."""
    root = tmp_path_factory.mktemp("gemma3")
    write_gemma3_gguf(root / "g.gguf")
    return convert_gguf(root / "g.gguf", root / "model", show_progress=False)


@pytest.fixture
def docs(tmp_path):
    (tmp_path / "docs" / "agents").mkdir(parents=True)
    (tmp_path / "docs" / "b.md").write_text(PROSE * 12)
    (tmp_path / "docs" / "a.md").write_text(PROSE * 6)
    (tmp_path / "docs" / "agents" / "c.md").write_text(PROSE * 3)
    return tmp_path / "docs"


def test_files_are_cut_into_continuations_in_glob_order(base_model, docs):
    tokenizer = load_tokenizer(base_model)
    lead = tokenizer.encode("")
    assert lead == [tokenizer.bos_token_id]
    files = text_files(f"{docs}/*.md,{docs}/agents/*.md")
    assert [name for name, _ in files] == ["a.md", "b.md", "c.md"]
    prompt, response, stride = 12, 5, 20
    examples = continuations(tokenizer, files, prompt, response, stride)
    expected = []
    for name, path in files:
        tokens = tokenizer.encode(path.read_text(), add_special_tokens=False)
        starts = list(range(0, len(tokens) - prompt - response + 1, stride))
        assert starts[-1] + stride + prompt + response > len(tokens)  # no room for another
        expected += [
            (f"{name}:{s}", tokens[s : s + prompt - 1], tokens[s + prompt - 1 : s + prompt - 1 + response])
            for s in starts
        ]
    assert [e.prompt for e in examples] == [name for name, _, _ in expected]
    for example, (_, text, following) in zip(examples, expected):
        assert len(example.prompt_ids) == prompt and len(example.response_ids) == response
        assert example.prompt_ids == lead + text  # the response is the text's very next tokens
        assert example.response_ids == following
    held_out, _ = split_held_out(examples, 2)
    assert all(e.prompt.startswith("c.md:") for e in held_out)


def test_make_data_text_writes_a_data_dir_fit_reads(base_model, docs, tmp_path):
    out = tmp_path / "data"
    args = ["train", "make-data", "--model", str(base_model), "--text", f"{docs}/*.md", "--out", str(out)]
    result = runner.invoke(app, [*args, "--prompt-tokens", "10", "--max-tokens", "6"])
    assert result.exit_code == 0, result.output
    meta = json.loads((out / "meta.json").read_text())
    assert meta["decoding"] == "text" and meta["max_tokens"] == 6
    examples = read_data(out, meta["target"])
    assert examples[0].prompt == "a.md:0" and examples[1].prompt == "a.md:16"  # back to back by default
    assert {len(e.prompt_ids) for e in examples} == {10} and {len(e.response_ids) for e in examples} == {6}
    again = runner.invoke(app, args)
    assert again.exit_code == 1 and "already holds data" in again.output


@pytest.mark.parametrize(
    "extra, message",
    [
        (["--text", "{docs}/*.txt"], "no file matches"),
        (["--text", "{docs}/*.md", "--prompts", "builtin"], "--prompts, --temp and --budget apply to generated"),
        (["--stride", "8"], "apply to --text only"),
        (["--text", "{docs}/*.md", "--stride", "8"], "overlaps continuations"),
        (["--text", "{docs}/agents/*.md", "--max-tokens", "300"], "fewer than one continuation's"),
    ],
)
def test_bad_text_input_is_one_line(base_model, docs, tmp_path, extra, message):
    args = ["train", "make-data", "--model", str(base_model), "--out", str(tmp_path / "data")]
    result = runner.invoke(app, args + [a.format(docs=docs) for a in extra])
    assert result.exit_code == 1 and message in result.output, result.output
    assert len(result.output.strip().splitlines()) == 1 and not (tmp_path / "data" / "meta.json").exists()
