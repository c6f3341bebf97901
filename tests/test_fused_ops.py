"""Compiled norms and RoPEs (fused_ops.py): the same bits as mlx-lm's own ops, fewer primitives;
attention with a compiled softmax: within float32 rounding of MLX's own."""

import mlx.core as mx
import mlx.nn as nn
import pytest
from mlx_lm.models.base import create_causal_mask
from mlx_lm.models.cache import make_prompt_cache

from dflash_mlx.kernels import fused_ops
from dflash_mlx.kernels.fused_ops import (
    FusedAttention,
    FusedNorm,
    FusedRoPE,
    fuse,
    fusing,
    scaled_dot_product_attention,
    unfused,
)
from dflash_mlx.target.wrapper import BatchTargetCache
from tiny_models import by_family, same_up_to_rounding, tiny_model, tiny_target

pytestmark = pytest.mark.skipif(
    not fusing(),
    reason="norms and RoPEs are compiled only where MLX has no kernel "
    "for them (a CPU); on a GPU fuse() leaves a model as it is",
)

FAMILIES = ["llama", "qwen3", "qwen3_moe", "qwen3_5", "qwen3_next", "gpt_oss", "gemma4_text", "deepseek_v3"]


def fused_count(model: nn.Module) -> int:
    return sum(isinstance(m, (FusedNorm, FusedRoPE)) for _, m in model.named_modules())


def logits_fused_and_not(model_type: str):
    """Prefill, two single-token steps and a 4-token verify: each pass's logits from the fused
    target and from the same weights in mlx-lm's own modules."""
    target, twin = tiny_target(model_type, seed=3), tiny_model(model_type, seed=3)
    ours, theirs = make_prompt_cache(target.model), make_prompt_cache(twin)
    for tokens in ([5, 9, 2, 33, 7, 61, 4], [12], [40], [3, 8, 15, 22]):
        batch = mx.array([tokens])
        yield target.model(batch, cache=ours), twin(batch, cache=theirs)


@pytest.mark.parametrize("model_type", by_family(FAMILIES))
def test_compiled_norms_and_ropes_compute_the_same_bits_as_mlx_lm(model_type, monkeypatch):
    """Prefill, single-token steps and a 4-token verify: logits bitwise equal to the
    same weights run by mlx-lm's own (unfused) modules, with the norms and RoPEs compiled
    (attention and the weights' storage, not bitwise on every BLAS, left as mlx-lm has them)."""
    monkeypatch.setattr(fused_ops, "SCORES_IN_CACHE", 0)
    monkeypatch.setattr(fused_ops, "column_major", mx.contiguous)
    for a, b in logits_fused_and_not(model_type):
        assert mx.array_equal(a, b).item(), f"{model_type}: logits differ by {mx.abs(a - b).max().item()}"


@pytest.mark.parametrize("model_type", by_family(FAMILIES))
def test_a_fused_target_stays_within_rounding_of_mlx_lm(model_type):
    """The same passes with everything fused_ops does: logits within float32 rounding of
    mlx-lm's own modules, and the same greedy tokens."""
    for a, b in logits_fused_and_not(model_type):
        assert same_up_to_rounding(a, b), f"{model_type}: logits differ by {mx.abs(a - b).max().item()}"


def attention_inputs(batch=2, heads=6, kv_heads=2, length=5, context=40, dim=16, seed=0):
    mx.random.seed(seed)
    q = mx.random.normal((batch, heads, length, dim))
    k, v = mx.random.normal((2, batch, kv_heads, context + length, dim))
    return q, k, v


def causal(length, total):
    return create_causal_mask(length, total - length)


@pytest.mark.parametrize(
    "mask",
    [
        None,
        "causal",
        causal(5, 45),
        mx.broadcast_to(causal(5, 45), (2, 1, 5, 45)),
        mx.random.bernoulli(0.7, (2, 6, 5, 45)) | causal(5, 45),  # a mask per head
        mx.random.bernoulli(0.7, (2, 6, 1, 45)) | (mx.arange(45) == 44),  # per head, one for every query
        mx.where(causal(5, 45), 0.0, -1e9),  # additive
    ],
    ids=["none", "causal", "bool", "bool per row", "bool per head", "bool per head for all queries", "additive"],
)
@pytest.mark.parametrize("in_cache", [10**6, 1350, 700, 300], ids=["whole", "by row", "by kv head", "by queries"])
@pytest.mark.parametrize("softmax", ["kernel", "mlx form"])
def test_the_compiled_softmax_attention_matches_mlx(mask, in_cache, softmax, monkeypatch):
    """Whole, and in parts: 2 rows x 2 kv heads x 3 query heads x 5 queries x 45 keys = 2,700 scores;
    with the C++ row softmax (kernels/cpu.py), and with the softmax MLX ops compose where it is not built."""
    monkeypatch.setattr(fused_ops, "SCORES_IN_CACHE", in_cache)
    if softmax == "mlx form":
        monkeypatch.setattr(fused_ops, "row_softmax_kernel", lambda: None)
    q, k, v = attention_inputs()
    want = mx.fast.scaled_dot_product_attention(q, k, v, scale=0.25, mask=mask)
    got = scaled_dot_product_attention(q, k, v, None, scale=0.25, mask=mask)
    assert got.shape == want.shape
    assert mx.allclose(got, want, rtol=1e-6, atol=1e-6).item(), mx.abs(got - want).max().item()


@pytest.mark.parametrize(
    "rows,kv_heads,group,queries,keys", [(4, 3, 3, 16, 2100), (1, 3, 3, 128, 2048), (8, 8, 4, 1, 900)]
)
def test_attention_parts_hold_at_most_one_query_row_past_the_cache(rows, kv_heads, group, queries, keys):
    r, h, q = fused_ops._part_sizes(rows, kv_heads, group, queries, keys)
    assert 1 <= r <= rows and 1 <= h <= kv_heads and 1 <= q <= queries
    assert r * h * group * q * keys <= fused_ops.SCORES_IN_CACHE + group * keys
    assert (r == 1 or h == kv_heads) and (h == 1 or q == queries)  # parts are whole rows, kv heads or spans


class RowsOfTheirOwnLength:
    """A batch cache whose rows use keys of their own (RaggedBatchKVCache.key_spans)."""

    def __init__(self, spans):
        self.spans = spans

    def key_spans(self):
        return self.spans


@pytest.mark.parametrize("in_cache", [10**6, 300], ids=["rows whole", "rows in parts"])
def test_rows_attend_over_their_own_keys_alone(in_cache, monkeypatch):
    """Left padding and tokens past a row's end are masked: leaving them out changes nothing."""
    monkeypatch.setattr(fused_ops, "SCORES_IN_CACHE", in_cache)
    q, k, v = attention_inputs()  # 2 rows, 5 queries, 45 keys
    spans = [(30, 45), (3, 41)]  # row 0: 30 tokens of left padding; row 1: 3, and 4 it dropped past its end
    keys = mx.arange(45)
    mask = mx.stack([(keys >= first) & (keys <= end - 5 + mx.arange(5)[:, None]) for first, end in spans])[
        :, None
    ]  # (2, 1, 5, 45): row r's query i sits at end - 5 + i
    want = mx.fast.scaled_dot_product_attention(q, k, v, scale=0.25, mask=mask)
    got = scaled_dot_product_attention(q, k, v, RowsOfTheirOwnLength(spans), scale=0.25, mask=mask)
    assert mx.allclose(got, want, rtol=1e-6, atol=1e-6).item(), mx.abs(got - want).max().item()


def test_masked_and_negligible_scores_weigh_exactly_nothing():
    shifted = mx.array([[-1.0, -mx.inf, -200.0, -88.5, -87.0, 0.0, -1.5]])
    weights = fused_ops.exp_nonpositive(shifted)
    assert weights[0, 1].item() == weights[0, 2].item() == weights[0, 3].item() == 0.0 < weights[0, 4].item()
    assert mx.allclose(weights, mx.exp(shifted), rtol=1e-6, atol=0).item()
    wide = mx.random.normal((3, 300)) * 20
    wide = wide - wide.max(-1, keepdims=True)
    assert mx.allclose(fused_ops.exp_nonpositive(wide), mx.exp(wide), rtol=1e-6, atol=1e-30).item()


@pytest.mark.parametrize("case", ["sinks", "half precision", "a query's scores past the cache"])
def test_what_the_compiled_softmax_does_not_cover_is_mlx_lms_attention(case, monkeypatch):
    q, k, v = attention_inputs()
    sinks = mx.zeros((6,)) if case == "sinks" else None
    if case == "half precision":
        q, k, v = (x.astype(mx.bfloat16) for x in (q, k, v))
    if case == "a query's scores past the cache":  # 3 query heads of a kv head x 45 keys
        monkeypatch.setattr(fused_ops, "SCORES_IN_CACHE", 3 * 45 - 1)
    want = mx.fast.scaled_dot_product_attention(q, k, v, scale=0.25, mask="causal", sinks=sinks)
    got = scaled_dot_product_attention(q, k, v, None, scale=0.25, mask="causal", sinks=sinks)
    assert mx.array_equal(got, want).item()


@pytest.mark.parametrize("model_type", by_family(FAMILIES))
def test_every_attention_calling_mlx_lms_is_stood_in_for_and_unfused_puts_it_back(model_type):
    model = tiny_model(model_type)
    calling = sum(fused_ops._calls_mlx_attention(m) for _, m in model.named_modules())
    assert calling > 0  # every family here has attention layers written with mlx-lm's function
    fuse(fuse(model))
    assert sum(isinstance(m, FusedAttention) for _, m in model.named_modules()) == calling
    with unfused(model):
        assert not any(isinstance(m, (FusedAttention, FusedNorm, FusedRoPE)) for _, m in model.named_modules())
        assert sum(fused_ops._calls_mlx_attention(m) for _, m in model.named_modules()) == calling
    assert sum(isinstance(m, FusedAttention) for _, m in model.named_modules()) == calling


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
