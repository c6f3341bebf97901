"""convert: drafters quantize and reload exactly, never compute in float16, and
targets (HF dirs and GGUF files) convert, load and decode losslessly."""

import json

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from mlx.utils import tree_flatten, tree_map
from mlx_lm.generate import generate_step
from typer.testing import CliRunner

from dflash_mlx import load
from dflash_mlx.cli import app
from dflash_mlx.convert.models import convert_draft, convert_target
from dflash_mlx.drafters.precision import quantize_draft
from dflash_mlx.drafters import DFlashDraftModel, DraftLoadError, load_draft, save_draft
from dflash_mlx.decode.decoder import decode
from dflash_mlx.decode.request import Request
from dflash_mlx.decode.model import DecodeStats, DFlashModel
from dflash_mlx.sampling import SamplingParams
from gguf_fixtures import write_gguf
from tiny_models import draft_args, random_dflash2, tiny_target

runner = CliRunner()


@pytest.fixture(scope="module")
def target():
    return tiny_target("qwen3", seed=7, hidden_size=64, head_dim=16)


@pytest.fixture
def zlab_drafter(tmp_path, target):
    """A random drafter saved like z-lab ships them: bf16 safetensors, z-lab config."""
    mx.random.seed(3)
    draft = DFlashDraftModel(draft_args(target, layer_ids=(1, 3), block_size=4, head_dim=16, intermediate_size=128))
    draft.update(tree_map(lambda p: p.astype(mx.bfloat16), draft.parameters()))
    return save_draft(draft, tmp_path / "zlab")


def block_logits(draft, target, seed=0):
    mx.random.seed(seed)
    cache = draft.make_cache()
    draft.add_context(mx.random.normal((1, 9, 2 * target.hidden_size)), cache)
    return np.array(draft(mx.array([[5, 96, 96, 96]]), cache).astype(mx.float32))


@pytest.mark.parametrize("bits", [4, 8])
def test_quantized_drafter_reloads_with_identical_logits(tmp_path, target, zlab_drafter, bits):
    out = convert_draft(str(zlab_drafter), tmp_path / f"q{bits}", q_bits=bits, q_group_size=32, show_progress=False)
    config = json.loads((out / "config.json").read_text())
    assert config["quantization"] == {"group_size": 32, "bits": bits, "mode": "affine"}
    assert config["dflash_config"]["target_layer_ids"] == [1, 3]  # still the z-lab schema
    in_memory = load_draft(zlab_drafter)
    quantize_draft(in_memory, bits, 32)
    reloaded = load_draft(out)
    assert isinstance(reloaded.layers[0].mlp.up_proj, nn.QuantizedLinear)
    assert isinstance(reloaded.norm, nn.RMSNorm) and reloaded.norm.weight.dtype == mx.bfloat16
    np.testing.assert_array_equal(
        block_logits(reloaded.bind(target), target), block_logits(in_memory.bind(target), target)
    )
    # and close to the float drafter
    float_logits = block_logits(load_draft(zlab_drafter).bind(target), target)
    error = np.abs(block_logits(reloaded, target) - float_logits).mean() / np.abs(float_logits).mean()
    assert error < (0.05 if bits == 8 else 0.3)


def test_fc_can_stay_float(tmp_path, zlab_drafter):
    out = convert_draft(
        str(zlab_drafter), tmp_path / "q", q_bits=4, q_group_size=64, quantize_fc=False, show_progress=False
    )
    assert json.loads((out / "config.json").read_text())["quantization"]["fc"] is False
    reloaded = load_draft(out)
    assert type(reloaded.fc) is nn.Linear and isinstance(reloaded.layers[0].self_attn.q_proj, nn.QuantizedLinear)


def test_drafters_never_compute_in_float16(tmp_path, target, zlab_drafter):
    out = convert_draft(str(zlab_drafter), tmp_path / "q4", q_bits=4, q_group_size=32, show_progress=False)
    draft = load_draft(out, dtype=mx.float16).bind(target)
    assert draft.dtype == mx.bfloat16
    assert all(v.dtype != mx.float16 for _, v in tree_flatten(draft.parameters()))
    # target features with massive activations, as real targets have (|x| ~ 3e4)
    features = mx.random.normal((1, 6, 2 * target.hidden_size)) * 3e4
    assert mx.isfinite(draft.context(features)).all().item()
    # the negative control: the same drafter forced to float16 overflows
    forced = load_draft(out).bind(target)
    forced.set_dtype(mx.float16)
    assert not mx.isfinite(forced.fc(features.astype(mx.float16))).all().item()
    with pytest.raises(ValueError, match="float16"):
        convert_draft(str(zlab_drafter), tmp_path / "f16", dtype="float16", show_progress=False)


def test_bad_drafter_input_leaves_nothing_behind(tmp_path, zlab_drafter):
    (tmp_path / "notadrafter").mkdir()
    with pytest.raises(DraftLoadError, match="no config.json"):
        convert_draft(str(tmp_path / "notadrafter"), tmp_path / "o1", show_progress=False)
    (tmp_path / "llama").mkdir()
    (tmp_path / "llama" / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"]}))
    with pytest.raises(DraftLoadError, match="not supported"):
        convert_draft(str(tmp_path / "llama"), tmp_path / "o2", show_progress=False)
    with pytest.raises(ValueError, match="--q-bits"):
        convert_draft(str(zlab_drafter), tmp_path / "o3", q_bits=3, show_progress=False)
    (tmp_path / "exists").mkdir()
    with pytest.raises(FileExistsError, match="--force"):
        convert_draft(str(zlab_drafter), tmp_path / "exists", q_bits=8, show_progress=False)
    quantized = convert_draft(str(zlab_drafter), tmp_path / "q8", q_bits=8, show_progress=False)
    # a quantized drafter is re-quantized from its expanded weights, as the dry run says
    assert "expanded first" in str(convert_draft(str(quantized), tmp_path / "q4", q_bits=4, dry_run=True).steps)
    requantized = load_draft(convert_draft(str(quantized), tmp_path / "q4", q_bits=4, show_progress=False))
    assert requantized.quantization["bits"] == 4
    assert sorted(p.name for p in tmp_path.iterdir()) == ["exists", "llama", "notadrafter", "q4", "q8", "zlab"]
    assert not any((tmp_path / "exists").iterdir())


def test_dry_run_writes_nothing(tmp_path, zlab_drafter):
    result = runner.invoke(
        app, ["convert", "draft", str(zlab_drafter), str(tmp_path / "out"), "--q-bits", "4", "--dry-run"]
    )
    assert result.exit_code == 0, result.output
    assert "4 bits" in result.output and "norms stay float" in result.output
    assert not (tmp_path / "out").exists()


def test_targets_convert_load_and_decode_losslessly(tmp_path):
    write_gguf(tmp_path / "m.gguf", "llama", "Q8_0")
    native = convert_target(str(tmp_path / "m.gguf"), tmp_path / "native", show_progress=False)
    assert json.loads((native / "config.json").read_text())["quantization"]["bits"] == 8
    dense = convert_target(str(tmp_path / "m.gguf"), tmp_path / "dense", dtype="float32", show_progress=False)
    # an HF-layout dir through mlx-lm's converter, quantized
    q4 = convert_target(str(dense), tmp_path / "q4", q_bits=4, q_group_size=32, show_progress=False)
    assert json.loads((q4 / "config.json").read_text())["quantization"]["bits"] == 4
    for converted in (dense, q4):
        model, tokenizer = load(str(converted), use_draft=False, adaptive=False)
        mx.random.seed(0)
        drafter = DFlashDraftModel(draft_args(model.target, layer_ids=(0, 1), block_size=4)).bind(model.target)
        prompt = mx.array(tokenizer.encode("Hello world, I have 12 apples."))
        reference = [int(t) for t, _ in generate_step(prompt, model.target.model, max_tokens=20)]
        out = [
            t
            for s in decode(
                DFlashModel(model.target, drafter), Request(prompt.tolist(), 20, SamplingParams()), stats=DecodeStats()
            )
            for t in s.tokens
        ]
        assert out == reference
    with pytest.raises(ValueError, match="--q-bits is for float files"):
        convert_target(str(tmp_path / "m.gguf"), tmp_path / "x", q_bits=4, show_progress=False)
    with pytest.raises(FileExistsError):
        convert_target(str(dense), tmp_path / "q4", q_bits=4, show_progress=False)


def test_dflash2_drafter_quantizes_and_reloads(tmp_path, target):
    """Convolution and selector projections and the codebooks quantize; base kernels and norms stay
    float; the codebooks keep z-lab's names (no .weight) on disk."""
    source = save_draft(
        random_dflash2(
            target, seed=3, layer_ids=(1, 3), block_size=4, head_dim=16, intermediate_size=128, selector_rank=32
        ),
        tmp_path / "d2",
    )
    out = convert_draft(str(source), tmp_path / "q8", q_bits=8, q_group_size=32, show_progress=False)
    names = set(mx.load(str(out / "model.safetensors")))
    assert "candidate_selector.successor_codebook" in names and "layers.0.mlp_conv.base_kernel" in names
    assert "candidate_selector.successor_codebook.scales" in names
    reloaded = load_draft(out).bind(target)
    assert isinstance(reloaded.layers[0].attention_conv.kernel_projection, nn.QuantizedLinear)
    assert isinstance(reloaded.candidate_selector.hidden_projection, nn.QuantizedLinear)
    assert isinstance(reloaded.candidate_selector.predecessor_codebook, nn.QuantizedEmbedding)
    in_memory = load_draft(source, dtype=mx.bfloat16)  # convert's default dtype
    quantize_draft(in_memory, 8, 32)
    np.testing.assert_array_equal(block_logits(reloaded, target), block_logits(in_memory.bind(target), target))


def test_quantized_drafters_expand_for_the_cpu(tmp_path, target):
    """On MLX's CPU backend quantized matmuls are several times slower than float ones, so a
    quantized drafter can be loaded expanded: plain float32 layers computing what it computed."""
    source = save_draft(
        random_dflash2(
            target, seed=3, layer_ids=(1, 3), block_size=4, head_dim=16, intermediate_size=128, selector_rank=32
        ),
        tmp_path / "d2",
    )
    out = convert_draft(str(source), tmp_path / "q8", q_bits=8, q_group_size=32, show_progress=False)
    packed = load_draft(out, dtype=mx.float32).bind(target)
    expanded = load_draft(out, dtype=mx.float32, dequantize=True).bind(target)
    kinds = {type(m) for _, m in expanded.named_modules()}
    assert not kinds & {nn.QuantizedLinear, nn.QuantizedEmbedding} and expanded.quantization is None
    assert all(p.dtype == mx.float32 for _, p in tree_flatten(expanded.parameters()))
    np.testing.assert_allclose(block_logits(expanded, target), block_logits(packed, target), rtol=1e-4, atol=1e-4)
    # and the candidate selector picks the same paths
    features = mx.random.normal((1, 6, 2 * target.hidden_size))
    drafts = []
    for draft in (packed, expanded):
        cache = draft.make_cache()
        draft.add_context(features, cache)
        drafts.append(draft.propose(mx.array([[5] + [draft.mask_token_id] * 3]), cache, SamplingParams(), None))
    assert mx.array_equal(*drafts)


def test_a_quantized_drafter_converts_back_to_float(tmp_path, target, zlab_drafter):
    """For runtimes that read float weights only (SGLang, vLLM, z-lab's own code)."""
    q8 = convert_draft(str(zlab_drafter), tmp_path / "q8", q_bits=8, show_progress=False)
    out = convert_draft(str(q8), tmp_path / "bf16", show_progress=False)
    assert "quantization" not in json.loads((out / "config.json").read_text())
    assert all(w.dtype == mx.bfloat16 for w in mx.load(str(out / "model.safetensors")).values())
    expanded, packed = (block_logits(load_draft(d, dtype=mx.float32).bind(target), target) for d in (out, q8))
    assert np.abs(expanded - packed).mean() / np.abs(packed).mean() < 0.01  # bf16 rounding of the weights only
