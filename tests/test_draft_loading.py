"""Drafter directories in the z-lab format load; mismatches fail with one clear line."""

import json

import mlx.core as mx
import numpy as np
import pytest
from safetensors.numpy import save_file

from dflash_mlx.drafters import DraftLoadError, load_draft, save_draft
from tiny_models import random_dflash2, random_draft, tiny_target


@pytest.fixture(scope="module")
def target():
    return tiny_target("qwen3", seed=2)


def zlab_dir(tmp_path, target, layers=2, layer_ids=(0, 2), hidden=None, vocab=None, drop=(), extra=None):
    """A drafter directory written the way z-lab releases are: HF config + bf16 safetensors."""
    hidden = hidden or target.hidden_size
    heads, kv_heads, head_dim, inter = 4, 2, 8, 64
    config = {
        "architectures": ["DFlashDraftModel"],
        "model_type": "qwen3",
        "attention_bias": False,
        "attention_dropout": 0.0,
        "block_size": 16,
        "bos_token_id": 1,
        "dflash_config": {"mask_token_id": 5, "target_layer_ids": list(layer_ids)},
        "eos_token_id": 2,
        "head_dim": head_dim,
        "hidden_act": "silu",
        "hidden_size": hidden,
        "initializer_range": 0.02,
        "intermediate_size": inter,
        "layer_types": ["full_attention"] * layers,
        "max_position_embeddings": 40960,
        "max_window_layers": layers,
        "num_attention_heads": heads,
        "num_hidden_layers": layers,
        "num_key_value_heads": kv_heads,
        "num_target_layers": target.num_layers,
        "rms_norm_eps": 1e-6,
        "rope_scaling": None,
        "rope_theta": 1000000,
        "sliding_window": None,
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
        "use_cache": True,
        "use_sliding_window": False,
        "vocab_size": vocab or target.vocab_size,
        **(extra or {}),
    }
    rng = np.random.default_rng(0)

    def w(*shape):
        return (rng.standard_normal(shape) * 0.1).astype(np.float32)

    tensors = {
        "fc.weight": w(hidden, len(layer_ids) * hidden),
        "hidden_norm.weight": np.ones(hidden, np.float32),
        "norm.weight": np.ones(hidden, np.float32),
    }
    for i in range(layers):
        p = f"layers.{i}."
        tensors |= {
            p + "self_attn.q_proj.weight": w(heads * head_dim, hidden),
            p + "self_attn.k_proj.weight": w(kv_heads * head_dim, hidden),
            p + "self_attn.v_proj.weight": w(kv_heads * head_dim, hidden),
            p + "self_attn.o_proj.weight": w(hidden, heads * head_dim),
            p + "self_attn.q_norm.weight": np.ones(head_dim, np.float32),
            p + "self_attn.k_norm.weight": np.ones(head_dim, np.float32),
            p + "mlp.gate_proj.weight": w(inter, hidden),
            p + "mlp.up_proj.weight": w(inter, hidden),
            p + "mlp.down_proj.weight": w(hidden, inter),
            p + "input_layernorm.weight": np.ones(hidden, np.float32),
            p + "post_attention_layernorm.weight": np.ones(hidden, np.float32),
        }
    for name in drop:
        tensors.pop(name)
    tmp_path.mkdir(parents=True, exist_ok=True)
    (tmp_path / "config.json").write_text(json.dumps(config))
    save_file(tensors, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    return tmp_path


def test_zlab_directory_loads_and_drafts(tmp_path, target):
    draft = load_draft(zlab_dir(tmp_path, target)).bind(target)
    assert draft.block_size == 16 and draft.mask_token_id == 5 and draft.target_layer_ids == [0, 2]
    cache = draft.make_cache()
    draft.add_context(mx.random.normal((1, 7, 2 * target.hidden_size)), cache)
    logits = draft(mx.array([[3, 5, 5, 5]]), cache)
    assert logits.shape == (1, 3, target.vocab_size)
    assert mx.isfinite(logits).all().item()


def test_save_then_load_round_trips(tmp_path, target):
    draft = random_draft(target)
    out = save_draft(draft, tmp_path / "d")
    config = json.loads((out / "config.json").read_text())
    assert config["dflash_config"] == {"mask_token_id": draft.mask_token_id, "target_layer_ids": [0, 2]}
    assert config["architectures"] == ["DFlashDraftModel"]
    again = load_draft(out).bind(target)
    features = mx.random.normal((1, 5, 2 * target.hidden_size))
    block = mx.array([[7] + [draft.mask_token_id] * 7])
    results = []
    for d in (draft, again):
        cache = d.make_cache()
        d.add_context(features, cache)
        results.append(d(block, cache))
    assert mx.array_equal(results[0], results[1])


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(hidden=48), "hidden_size 48 != target hidden_size"),
        (dict(vocab=500), "vocab_size 500 != target vocab_size"),
        (dict(layer_ids=(0, 9)), "target_layer_ids [9] out of range"),
        (dict(extra={"num_target_layers": 36}), "expects a 36-layer target"),
    ],
)
def test_mismatched_target_is_refused(tmp_path, target, kwargs, message):
    with pytest.raises(DraftLoadError, match=message.replace("[", r"\[").replace("]", r"\]")):
        load_draft(zlab_dir(tmp_path, target, **kwargs)).bind(target)


def test_missing_weight_is_named(tmp_path, target):
    with pytest.raises(DraftLoadError, match="missing layers.1.mlp.up_proj.weight"):
        load_draft(zlab_dir(tmp_path, target, drop=["layers.1.mlp.up_proj.weight"]))


def test_not_a_drafter_dir(tmp_path):
    with pytest.raises(DraftLoadError, match="no config.json"):
        load_draft(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama", "hidden_size": 8}))
    with pytest.raises(DraftLoadError, match="not a DFlash drafter"):
        load_draft(tmp_path)


def test_corrupt_weights(tmp_path, target):
    d = zlab_dir(tmp_path, target)
    (d / "model.safetensors").write_bytes(b"\x00garbage" * 10)
    with pytest.raises(DraftLoadError, match="corrupt"):
        load_draft(d)


def dflash2_dir(tmp_path, target, drop=(), dflash_config=None):
    """A DFlash 2 drafter saved in z-lab's names, then optionally damaged."""
    out = save_draft(random_dflash2(target), tmp_path / "d2")
    config = json.loads((out / "config.json").read_text())
    config["dflash_config"].update(dflash_config or {})
    (out / "config.json").write_text(json.dumps(config))
    if drop:
        weights = dict(mx.load(str(out / "model.safetensors")))
        for name in drop:
            weights.pop(name)
        mx.save_safetensors(str(out / "model.safetensors"), weights)
    return out


def test_dflash2_schema_round_trips(tmp_path, target):
    out = dflash2_dir(tmp_path, target)
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == ["DFlash2DraftModel"]
    assert {"conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k"} <= set(config["dflash_config"])
    names = set(mx.load(str(out / "model.safetensors")))
    assert {
        "layers.0.attention_conv.base_kernel",
        "layers.0.attention_conv.kernel_projection.weight",
        "layers.0.mlp_conv.base_kernel",
        "candidate_selector.hidden_projection.weight",
        "candidate_selector.predecessor_codebook",
        "candidate_selector.successor_codebook",
    } <= names
    assert load_draft(out).bind(target).candidate_selector is not None


@pytest.mark.parametrize(
    "damage, message",
    [
        (dict(drop=["candidate_selector.successor_codebook"]), "missing candidate_selector.successor_codebook"),
        (dict(drop=["candidate_selector.hidden_projection.weight"]), "missing candidate_selector.hidden_projection"),
        (dict(dflash_config={"conv_kernel_size": 5}), r"_conv\..* has shape .* config implies"),
        (dict(dflash_config={"conv_group_size": 7}), "conv_group_size 7 does not divide hidden_size"),
        (dict(dflash_config={"selector_rank": 16}), "selector.* has shape"),
        (dict(dflash_config={"selector_top_k": 0}), "needs dflash_config.selector_top_k > 0"),
    ],
)
def test_broken_dflash2_checkpoints_are_named(tmp_path, target, damage, message):
    with pytest.raises(DraftLoadError, match=message):
        load_draft(dflash2_dir(tmp_path, target, **damage))
