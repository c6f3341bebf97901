"""The real SmolLM2-135M-Instruct target (offline default): DFlash greedy output
equals plain mlx-lm greedy output, and the CLI runs on it."""

from pathlib import Path

import mlx.core as mx
import pytest
from mlx_lm.generate import generate_step
from typer.testing import CliRunner

from dflash_mlx import format_prompt
from dflash_mlx.cli import app
from dflash_mlx.decode.decoder import decode
from dflash_mlx.decode.request import Request
from dflash_mlx.decode.model import DecodeStats, DFlashModel
from dflash_mlx.sampling import SamplingParams
from dflash_mlx.target.wrapper import Target
from tiny_models import oracle_draft, random_draft

pytestmark = pytest.mark.slow  # the real default model

QUESTIONS = [
    "What is the capital of France?",
    "Write a Python function that reverses a string.",
    "If I have 3 apples and buy 5 more, how many do I have?",
]
MAX_TOKENS = 24


@pytest.fixture(scope="module")
def target(smollm2):
    model, _ = smollm2
    return Target(model)


@pytest.fixture(scope="module")
def prompts(smollm2):
    _, tokenizer = smollm2
    return [format_prompt(tokenizer, q) for q in QUESTIONS]


def plain(target, prompt, max_tokens=MAX_TOKENS):
    return [int(t) for t, _ in generate_step(mx.array(prompt), target.model, max_tokens=max_tokens)]


def dflash(target, draft, prompt, max_tokens=MAX_TOKENS):
    stats = DecodeStats()
    out = [
        t
        for s in decode(DFlashModel(target, draft), Request(list(prompt), max_tokens, SamplingParams()), stats=stats)
        for t in s.tokens
    ]
    return out, stats


def test_real_model_is_lossless(target, prompts):
    """Random drafter (nearly every draft rejected) and an oracle drafter that is
    right except at chosen positions (full and partial acceptance)."""
    rejecting = random_draft(target, layer_ids=(1, 10, 20, 28), block_size=4)
    for prompt in prompts:
        reference = plain(target, prompt, MAX_TOKENS + 16)
        assert dflash(target, rejecting, prompt)[0] == reference[:MAX_TOKENS]
        wrong = {len(prompt) + 5, len(prompt) + 6, len(prompt) + 15}
        oracle = oracle_draft(target, prompt + reference, wrong=wrong, layer_ids=(1, 10, 20, 28), block_size=8)
        out, stats = dflash(target, oracle, prompt)
        assert out == reference[:MAX_TOKENS]
        assert stats.tau > 2


def test_answers_sensibly(smollm2, prompts, target):
    _, tokenizer = smollm2
    assert "Paris" in tokenizer.decode(plain(target, prompts[0]))


runner = CliRunner()


def test_cli_generates_on_the_default_model():
    result = runner.invoke(app, ["generate", "--prompt", "What is the capital of France?", "--max-tokens", "12"])
    assert result.exit_code == 0, result.output
    assert "Paris" in result.output
    assert "Generation: 12 tokens" in result.output or "Generation:" in result.output
    assert "tokens-per-sec" in result.output and "DFlash:" in result.output


@pytest.mark.parametrize(
    "args, message",
    [
        (["--prompt", ""], "prompt is empty"),
        (["--prompt", "hi", "--max-tokens", "0"], "--max-tokens must be > 0"),
        (["--prompt", "hi", "--model", "./no/such/dir"], "no/such/dir"),
        (["--prompt", "hi", "--model", "Qwen9-Imaginary"], "Qwen3.5-9B"),
        (["--prompt", "hi", "--draft", "./missing-drafter"], "missing-drafter"),
    ],
)
def test_cli_bad_input_is_one_clear_line(args, message):
    result = runner.invoke(app, ["generate", *args])
    assert result.exit_code != 0
    assert message in result.output
    assert "Traceback" not in result.output
    assert len([line for line in result.output.splitlines() if line.startswith("error:")]) == 1


def test_shipped_drafter_loads_by_default_and_is_lossless(smollm2, target, prompts):
    from dflash_mlx import load
    from dflash_mlx.api.registry import DEFAULT_DRAFT

    assert (DEFAULT_DRAFT / "model.safetensors").stat().st_size < 25e6
    model, _ = load(adaptive=False)
    assert model.draft is not None and model.draft.block_size == 16
    drafter = model.draft.bind(target)
    for prompt in prompts[:2]:
        out, stats = dflash(target, drafter, prompt, 32)
        assert out == plain(target, prompt, 32)
        assert stats.tau > 1.0  # it accepts something: a trained drafter, not a random one


def test_cli_evaluates_a_drafter_on_held_out_data():
    from pathlib import Path

    from dflash_mlx.api.registry import DEFAULT_DRAFT

    data = Path(__file__).parent.parent / "data" / "smollm2-135m"
    result = runner.invoke(
        app,
        ["train", "eval", "--data", str(data), "--draft", str(DEFAULT_DRAFT), "--prompts", "1", "--max-tokens", "16"],
    )
    assert result.exit_code == 0, result.output
    assert float(result.output.split("held-out: tau ")[1].split()[0]) >= 1.0
    rates = [float(r) for r in result.output.split("acceptance by position: ")[1].split()]
    assert len(rates) == 15 and all(0 <= r <= 1 for r in rates)
    missing = runner.invoke(app, ["train", "eval", "--data", str(data), "--draft", "./missing-drafter"])
    assert missing.exit_code != 0 and "missing-drafter" in missing.output and "Traceback" not in missing.output
    empty = runner.invoke(app, ["train", "eval", "--data", str(data), "--draft", str(DEFAULT_DRAFT), "--prompts", "0"])
    assert empty.exit_code != 0 and "--prompts" in empty.output and "Traceback" not in empty.output
    neither = runner.invoke(app, ["train", "eval", "--draft", str(DEFAULT_DRAFT)])
    assert neither.exit_code != 0 and "--sets" in neither.output


def test_readme_snippet_answers_chat_messages():
    """The README's Python snippet as a new user runs it: chat messages get the chat
    template (a raw string would not), token ids from apply_chat_template work alike."""
    from dflash_mlx import generate, load

    model, tokenizer = load(adaptive=False)
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    text = generate(model, tokenizer, messages, max_tokens=16)
    assert "Paris" in text
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True)
    assert generate(model, tokenizer, ids, max_tokens=16) == text
    with pytest.raises(ValueError, match="'role' and 'content'"):
        generate(model, tokenizer, [{"role": "user"}], max_tokens=4)


@pytest.fixture
def lossless_real(monkeypatch):
    monkeypatch.syspath_prepend(str(Path(__file__).parents[1] / "bench"))
    import lossless_real

    return lossless_real


NEAR_TIE = {"fp32": 1e-3, "bf16": 0.25}  # a few ulps of a logit of ~20: where rounding may choose


@pytest.mark.parametrize("variant", ["fp32", "bf16"])
def test_the_default_pair_equals_plain_mlx_lm_up_to_near_ties(lossless_real, variant):
    """The default pair as loaded (the shipped drafter, verifying blocks of 4: 4-token passes
    against stock mlx-lm's one-token steps) against stock mlx-lm's greedy tokens: identical, or
    different first where the reference's top-2 gap is a near-tie (docs/how-it-works.md, "What
    lossless means")."""
    pair, tokenizer = lossless_real.load_variant(None, None, variant)
    taus = []
    # bf16 runs on MLX's CPU matmuls without BLAS (several times slower): two questions
    for i, question in enumerate(QUESTIONS if variant == "fp32" else QUESTIONS[1:]):
        row = lossless_real.compare(pair, variant, i, format_prompt(tokenizer, question), 48, block_size=4)
        assert row.tokens == 48
        assert row.first_difference is None or row.gap < NEAR_TIE[variant], row
        taus.append(row.tau)
    assert max(taus) > 1.5, taus  # drafts were accepted
