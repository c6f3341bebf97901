"""Compiled norms and RoPEs (fused_ops.py): the same bits as mlx-lm's own ops, fewer primitives."""

import mlx.core as mx
import mlx.nn as nn
import pytest
from mlx_lm.models.cache import make_prompt_cache

from dflash_mlx.fused_ops import FusedNorm, FusedRoPE, fuse, fusing, unfused
from dflash_mlx.target import BatchTargetCache
from tiny_models import tiny_model, tiny_target

pytestmark = pytest.mark.skipif(
    not fusing(),
    reason="norms and RoPEs are compiled only where MLX has no kernel "
    "for them (a CPU); on a GPU fuse() leaves a model as it is",
)

FAMILIES = ["llama", "qwen3", "qwen3_moe", "qwen3_5", "qwen3_next", "gpt_oss", "gemma4_text", "deepseek_v3"]


def fused_count(model: nn.Module) -> int:
    return sum(isinstance(m, (FusedNorm, FusedRoPE)) for _, m in model.named_modules())


@pytest.mark.parametrize("model_type", FAMILIES)
def test_a_fused_target_computes_the_same_bits_as_mlx_lm(model_type):
    """Prefill, single-token steps and a 4-token verify: logits bitwise equal to the
    same weights run by mlx-lm's own (unfused) modules."""
    target, twin = tiny_target(model_type, seed=3), tiny_model(model_type, seed=3)
    ours, theirs = make_prompt_cache(target.model), make_prompt_cache(twin)
    for tokens in ([5, 9, 2, 33, 7, 61, 4], [12], [40], [3, 8, 15, 22]):
        batch = mx.array([tokens])
        a, b = target.model(batch, cache=ours), twin(batch, cache=theirs)
        assert mx.array_equal(a, b).item(), f"{model_type}: logits differ by {mx.abs(a - b).max().item()}"


def test_llama_norms_and_ropes_are_all_fused_once():
    model = tiny_model("llama")
    norms = sum(type(m) is nn.RMSNorm for _, m in model.named_modules())
    ropes = sum(type(m) is nn.RoPE for _, m in model.named_modules())
    fuse(fuse(model))  # a second pass wraps nothing again
    assert fused_count(model) == norms + ropes > 0
    with unfused(model):
        assert fused_count(model) == 0
        assert sum(type(m) is nn.RMSNorm for _, m in model.named_modules()) == norms
    assert fused_count(model) == norms + ropes


def test_batch_rows_at_different_offsets_match_each_row_alone():
    """Batch caches carry one offset per row (an array): each row's logits equal those of
    the row run alone by mlx-lm's modules."""
    target, twin = tiny_target("llama", seed=4), tiny_model("llama", seed=4)
    prompts = [[5, 9, 2, 33, 7], [61, 4, 8]]
    rows = []
    for prompt in prompts:
        cache = target.make_cache()
        target.model(mx.array([prompt]), cache=cache.layers)
        rows.append(cache)
    batch = BatchTargetCache(rows)
    got = target.model(mx.array([[11, 12], [13, 14]]), cache=batch.layers)
    for i, prompt in enumerate(prompts):
        cache = make_prompt_cache(twin)
        twin(mx.array([prompt]), cache=cache)
        alone = twin(mx.array([[[11, 12], [13, 14]][i]]), cache=cache)
        assert mx.allclose(got[i], alone[0], atol=1e-5).item()  # the batch's left padding changes sums' order


def test_the_compiled_norm_reads_the_live_weights():
    norm = nn.RMSNorm(8)
    fused = FusedNorm(norm)
    x = mx.random.normal((2, 8))
    before = fused(x)
    norm.weight = norm.weight * 2  # e.g. weights loaded or quantized after fusing
    assert mx.allclose(fused(x), 2 * before).item()
    assert "inner" in fused.parameters() and fused.weight is norm.weight  # reachable as the module's own


def test_a_loaded_model_runs_fused_and_the_plain_baseline_does_not(tiny_dirs):
    from dflash_mlx import load

    model_dir, draft_dir = tiny_dirs
    model, _ = load(str(model_dir), draft=str(draft_dir))
    net = model.target.model
    assert fused_count(net) > 0 and fused_count(model.draft) > 0
    with unfused(net):
        assert fused_count(net) == 0
        assert sum(type(m) in (nn.RMSNorm, nn.RoPE) for _, m in net.named_modules()) > 0


def matmul_weights(model: nn.Module) -> list[mx.array]:
    return [m.weight for m in model.modules() if type(m) in (nn.Linear, nn.Embedding)]


def stored_column_major(weight: mx.array) -> bool:
    rows, columns = weight.shape
    return memoryview(weight).strides == (weight.itemsize, rows * weight.itemsize)


def test_float_matmul_weights_are_stored_column_major_and_unfused_gives_them_back_row_major():
    model = tiny_model("llama")
    values = [mx.array(w) for w in matmul_weights(model)]
    fuse(model)
    assert values and all(map(stored_column_major, matmul_weights(model)))
    with unfused(model):
        assert not any(map(stored_column_major, matmul_weights(model)))
    assert all(map(stored_column_major, matmul_weights(model)))
    assert all(mx.array_equal(a, b).item() for a, b in zip(values, matmul_weights(model)))


def test_quantized_and_half_precision_weights_keep_their_storage():
    """Only float32 weights go through BLAS on a CPU; the others are left as loaded."""
    model = tiny_model("llama")
    nn.quantize(model, group_size=32, bits=8, class_predicate=lambda path, m: "mlp" in path)
    model.model.embed_tokens.weight = model.model.embed_tokens.weight.astype(mx.bfloat16)
    fuse(model)
    weights = matmul_weights(model)
    assert not stored_column_major(model.model.embed_tokens.weight)
    assert all(type(m) is nn.QuantizedLinear for path, m in model.named_modules() if path.endswith("mlp.up_proj"))
    assert any(map(stored_column_major, weights))  # the attention projections are float32
