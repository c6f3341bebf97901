"""A target without a drafter, served by copies from the prompt and earlier answers where its
measured cost curve says they pay: through load() and generate(), the CLI and the server, each
answer equal to plain greedy decoding's."""

from collections import Counter

import pytest
from starlette.testclient import TestClient
from typer.testing import CliRunner

from dflash_mlx import generate, load, stream_generate
from dflash_mlx.api import format_prompt
from dflash_mlx.cli import app
from dflash_mlx.decode.decoder import warm_up
from dflash_mlx.decode.learning import kept
from dflash_mlx.io.storage import CACHE_ENV
from dflash_mlx.serve import make_app
from tiny_models import Recording

PROMPT = "the cat sat on the mat and the dog sat on the log"
LOCAL = "http://127.0.0.1:8080"


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    """A cache folder of the module's own: the tiny target's cost curve is measured there once."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv(CACHE_ENV, str(tmp_path_factory.mktemp("cache")))
        yield


@pytest.fixture(scope="module")
def alone(tiny_dirs, cache):
    return load(str(tiny_dirs[0]), use_draft=False)


@pytest.fixture(scope="module")
def plain(tiny_dirs):
    return load(str(tiny_dirs[0]), use_draft=False, adaptive=False)


def test_load_measures_the_copies_widths_for_a_target_alone(alone, plain):
    model, _ = alone
    planner = kept(model).planner
    assert model.draft is None and planner.max_width == 16 and kept(model).suffixes is not None
    assert planner.cost.widths[-1] == 16 and planner.cost.draft_seconds == 0  # no drafter pass to time
    assert kept(plain[0]).planner is None  # adaptive=False: plain decoding


def test_a_repeated_request_copies_its_earlier_answer(alone, plain):
    model, tokenizer = alone
    reference = generate(*plain, PROMPT, max_tokens=24)
    answers = [list(stream_generate(model, tokenizer, PROMPT, max_tokens=24)) for _ in range(2)]
    assert ["".join(r.text for r in responses) for responses in answers] == [reference, reference]
    last = answers[1][-1]
    assert last.adaptive and "suffix" in last.sources and last.tau > 1  # the first answer, accepted


def test_a_warm_up_verifies_a_copy_and_keeps_nothing(tiny_dirs, cache):
    """Without a drafter the copies are what verifies wide: a server's warm-up runs one (its
    first copy cycle then pays no first calls), and keeps no answer, acceptance or step time."""
    model, _ = load(str(tiny_dirs[0]), use_draft=False)
    recording = Recording(model.target)
    model.target = recording
    warm_up(model)
    verifies = Counter(recording.passes) - Counter(recording.prefills)
    assert max(width for _, width in verifies) > 1, verifies
    learnt = kept(model)
    assert len(learnt.suffixes.tokens) == 0 and learnt.planner.steps == 0 and not learnt.planner.long_run


def test_the_cli_decodes_with_copies_without_a_drafter(tiny_dirs, alone, plain):
    result = CliRunner().invoke(
        app, ["generate", "--model", str(tiny_dirs[0]), "--no-draft", "-p", PROMPT, "--max-tokens", "16"]
    )
    assert result.exit_code == 0, result.output
    model, tokenizer = plain
    assert generate(model, tokenizer, format_prompt(tokenizer, PROMPT), max_tokens=16) in result.output
    assert "DFlash: off (drafting disabled (--no-draft)), copies verified" in result.output
    assert "prompt lookup" in result.output  # the cycles each source proposed


def test_the_server_copies_without_a_drafter(alone, plain):
    model, tokenizer = alone
    reference = generate(*plain, PROMPT, max_tokens=24)
    server = make_app(model, tokenizer, "tiny", prompt_cache_bytes=0)
    try:
        with TestClient(server.app, base_url=LOCAL) as http:
            replies = [
                http.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 24, "temperature": 0}).json()
                for _ in range(2)
            ]
    finally:
        server.worker.stop()
    assert [reply["choices"][0]["text"] for reply in replies] == [reference, reference]
    usage = replies[1]["usage"]["dflash"]
    assert usage["suffix_cycles"] > 0 and usage["tau"] > 1 and usage["draft_cycles"] == 0
