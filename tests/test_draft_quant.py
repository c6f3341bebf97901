"""`load(draft_quant=...)` / `--draft-quant`: the drafter quantized (or expanded) on loading, the
default by device, one-line errors, its own cache keys, and output that never depends on it."""

import json

import mlx.core as mx
import mlx.nn as nn
import pytest
from typer.testing import CliRunner

from dflash_mlx import format_prompt, generate, load, stream_generate
from dflash_mlx.api import loading, registry
from dflash_mlx.api.loading import _fingerprint
from dflash_mlx.cli import app
from dflash_mlx.convert.models import convert_draft
from dflash_mlx.drafters import save_draft
from dflash_mlx.drafters.precision import AUTO_DRAFT_BITS, FLOAT, draft_precision
from dflash_mlx.serve.launch import ModelOptions
from tiny_models import random_draft

runner = CliRunner()
PROMPT = "tell me a story about a cat"


@pytest.fixture(scope="module")
def target_dir(tiny_dirs):
    return str(tiny_dirs[0])


@pytest.fixture(scope="module")
def float_draft(tiny_dirs, tmp_path_factory):
    """A float drafter all of whose linear layers take a multiple of 64 inputs (all quantizable)."""
    plain, _ = load(str(tiny_dirs[0]), use_draft=False, adaptive=False)
    folder = tmp_path_factory.mktemp("drafters") / "float"
    save_draft(random_draft(plain.target, layer_ids=(0, 1), block_size=4, head_dim=16, intermediate_size=128), folder)
    return folder


@pytest.fixture(scope="module")
def q4_draft(float_draft):
    return convert_draft(str(float_draft), float_draft.parent / "q4", q_bits=4, show_progress=False)


@pytest.fixture
def on_a_gpu(monkeypatch):
    """Quantized drafter weights run packed, as on a GPU (MLX's quantized matmul runs on a CPU too)."""
    monkeypatch.setattr(loading, "runs_packed", lambda: True)


def linear_bits(draft) -> list:
    """Each linear layer's bits (None: float)."""
    return [
        m.bits if isinstance(m, nn.QuantizedLinear) else None
        for _, m in draft.named_modules()
        if isinstance(m, (nn.Linear, nn.QuantizedLinear))
    ]


@pytest.mark.parametrize(
    "asked, stored, packed, bits, changed",
    [
        (None, None, True, AUTO_DRAFT_BITS, True),  # a GPU quantizes a float drafter
        (None, None, False, None, False),  # a CPU keeps it float
        (None, 4, True, 4, False),  # a quantized checkpoint stays as stored
        (None, 8, False, 8, False),  # (on a CPU expanded, with its values)
        (FLOAT, 8, True, None, True),
        (8, 8, True, 8, False),
        (4, 8, False, 4, True),
    ],
)
def test_the_rule(asked, stored, packed, bits, changed):
    precision = draft_precision(asked, stored, packed)
    assert (precision.bits, precision.changed) == (bits, changed)


def test_float_weights_held_as_stored_count_as_stored_and_expanded_ones_as_float():
    assert draft_precision(None, 8, packed=True).held is None
    assert draft_precision(None, 8, packed=False).held == FLOAT  # the CPU expands it
    assert draft_precision(4, None, packed=True).held == 4
    assert draft_precision(4, None, packed=False).held is None  # quantized, then expanded back to float


@pytest.mark.parametrize("bits", [8, 4])
def test_the_asked_bits_reach_the_drafter_on_a_gpu(target_dir, float_draft, on_a_gpu, bits):
    model, _ = load(target_dir, str(float_draft), draft_quant=bits, adaptive=False)
    assert set(linear_bits(model.draft)) == {bits}
    assert model.draft.quantization == {"group_size": 64, "bits": bits, "mode": "affine"}


def test_a_gpu_quantizes_a_float_drafter_by_default_and_keeps_a_quantized_one(
    target_dir, float_draft, q4_draft, on_a_gpu
):
    model, _ = load(target_dir, str(float_draft), adaptive=False)
    assert set(linear_bits(model.draft)) == {AUTO_DRAFT_BITS}
    model, _ = load(target_dir, str(q4_draft), adaptive=False)
    assert set(linear_bits(model.draft)) == {4}
    assert model.fingerprint.endswith(_fingerprint(q4_draft))  # the checkpoint as it is
    model, _ = load(target_dir, str(q4_draft), draft_quant=FLOAT, adaptive=False)
    assert set(linear_bits(model.draft)) == {None}


def test_a_cpu_by_default_changes_nothing(target_dir, float_draft, q4_draft):
    for folder in (float_draft, q4_draft):
        model, _ = load(target_dir, str(folder), adaptive=False)
        assert set(linear_bits(model.draft)) == {None}  # float, or the 4-bit one expanded
        assert model.fingerprint.endswith(f"-{_fingerprint(folder)}")


def test_an_asked_quant_on_a_cpu_quantizes_then_expands(target_dir, float_draft):
    """The drafts of 4-bit weights (their values), run as float."""
    auto, _ = load(target_dir, str(float_draft), adaptive=False)
    q4, _ = load(target_dir, str(float_draft), draft_quant=4, adaptive=False)
    assert set(linear_bits(q4.draft)) == {None}
    assert q4.draft.quantization is None
    assert not mx.array_equal(q4.draft.fc.weight, auto.draft.fc.weight).item()
    assert mx.allclose(q4.draft.fc.weight, auto.draft.fc.weight, atol=0.2 * mx.abs(auto.draft.fc.weight).max()).item()


def test_each_precision_has_its_own_prompt_cache_and_cost_curve_keys(target_dir, float_draft, monkeypatch):
    curves = []

    def no_measuring(key, measure, folder):  # the key is all this test needs
        curves.append(key)
        raise RuntimeError("stop before measuring")

    monkeypatch.setattr(loading, "cached_costs", no_measuring)
    fingerprints = {}
    for asked in (None, FLOAT, 8, 4):
        fingerprints[asked] = load(target_dir, str(float_draft), draft_quant=asked, adaptive=False)[0].fingerprint
        with pytest.raises(RuntimeError, match="stop before measuring"):
            load(target_dir, str(float_draft), draft_quant=asked)
    assert fingerprints[None] == fingerprints[FLOAT]  # a CPU keeps the float drafter float
    assert len({fingerprints[FLOAT], fingerprints[8], fingerprints[4]}) == 3
    assert curves[0] == curves[1] and len(set(curves[1:])) == 3


@pytest.mark.parametrize("packed", [False, True])
@pytest.mark.parametrize("bits", [8, 4])
def test_greedy_output_is_the_targets_at_any_drafter_precision(target_dir, float_draft, monkeypatch, packed, bits):
    monkeypatch.setattr(loading, "runs_packed", lambda: packed)
    plain, tokenizer = load(target_dir, use_draft=False, adaptive=False)
    model, _ = load(target_dir, str(float_draft), draft_quant=bits, adaptive=False)
    assert linear_bits(model.draft)[0] == (bits if packed else None)
    last = None
    for last in stream_generate(model, tokenizer, PROMPT, 24):
        pass
    assert last.generation_tokens == 24  # (a random drafter: the slow test below has drafts accepted)
    assert generate(model, tokenizer, PROMPT, max_tokens=24) == generate(plain, tokenizer, PROMPT, max_tokens=24)


@pytest.mark.parametrize("bad", [5, 0, 32, "8"])
def test_a_bad_value_is_one_line_naming_the_choices(target_dir, float_draft, bad):
    with pytest.raises(ValueError) as error:
        load(target_dir, str(float_draft), draft_quant=bad)
    assert "draft_quant must be 16 (float), 8 or 4" in str(error.value) and "\n" not in str(error.value)


@pytest.mark.parametrize(
    "command",
    [
        ["generate", "--prompt", "hi"],
        ["serve"],
        ["launch", "claude"],
        ["doctor", "--model", "Qwen3-8B"],
    ],
)
def test_the_flag_refuses_a_bad_value_in_one_line(command):
    result = runner.invoke(app, [*command, "--draft-quant", "3"])
    assert result.exit_code == 1
    errors = [line for line in result.output.splitlines() if line.startswith("error:")]
    assert errors == ["error: --draft-quant must be 16 (float), 8 or 4, got 3"]


@pytest.mark.parametrize("command", [["generate", "--prompt", "hi"], ["serve"]])
def test_the_flag_reaches_load(command, monkeypatch):
    asked = {}

    def stand_in(*args, **kwargs):
        asked.update(kwargs)
        raise ValueError("stand-in load")

    monkeypatch.setattr("dflash_mlx.api.load", stand_in)
    result = runner.invoke(app, [*command, "--draft-quant", "4"])
    assert "stand-in load" in result.output
    assert asked["draft_quant"] == 4


def test_launch_passes_the_flag_to_the_server_it_starts():
    assert ModelOptions(draft_quant=8).serve_arguments() == ["--draft-quant", "8"]


def test_a_checkpoints_bits_are_read_before_loading(float_draft, q4_draft, tmp_path):
    assert registry.stored_draft_bits(str(registry.DEFAULT_DRAFT)) == 8  # the shipped drafter
    assert registry.stored_draft_bits(str(q4_draft)) == 4
    assert registry.stored_draft_bits(str(float_draft)) is None
    assert registry.stored_draft_bits(str(tmp_path / "missing")) is None
    assert registry.stored_draft_bits("z-lab/not-downloaded-DFlash") is None  # taken as float


def test_doctor_counts_the_drafter_at_its_precision(monkeypatch):
    monkeypatch.setattr(registry, "runs_packed", lambda: True)

    def plan(*flags):
        result = runner.invoke(app, ["doctor", "--model", "Qwen3-8B", "--json", *flags])
        assert result.exit_code == 0, result.output
        return json.loads(result.output)["model"]

    auto, float_, q4 = plan(), plan("--draft-quant", "16"), plan("--draft-quant", "4")
    assert auto["draft_quant"].startswith(f"{AUTO_DRAFT_BITS}-bit (quantized on loading")
    assert float_["draft_quant"] == "float" and q4["draft_quant"].startswith("4-bit")
    assert q4["draft_gib"] < auto["draft_gib"] < float_["draft_gib"]
    assert q4["footprint_gib"] < float_["footprint_gib"]


@pytest.mark.slow  # the real default pair
def test_the_shipped_pair_at_4_bits_packed_is_lossless_and_still_accepts(on_a_gpu):
    plain, tokenizer = load(use_draft=False, adaptive=False)
    model, _ = load(draft_quant=4, adaptive=False)
    assert set(linear_bits(model.draft)) == {4}
    prompt = format_prompt(tokenizer, "Write a Python function that reverses a string.")
    text, last = "", None
    for last in stream_generate(model, tokenizer, prompt, 48):
        text += last.text
    assert last.generation_tokens == 48
    assert text == generate(plain, tokenizer, prompt, max_tokens=48)
    assert last.tau > 1.2  # a trained drafter's drafts, not a random one's
