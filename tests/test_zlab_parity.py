"""Our drafter against z-lab's own MLX implementation (PyPI `dflash`, installed without
its dependencies by scripts/setup.sh) on the same random weights: every config field
that changes the computation is read and applied the way theirs does."""

import json

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.models.cache import make_prompt_cache

from dflash_mlx.drafters import DraftLoadError, load_draft, save_draft
from dflash_mlx.sampling import SamplingParams
from tiny_models import random_dflash2, random_draft, same_up_to_rounding, tiny_model, tiny_target

zlab = pytest.importorskip("dflash.model_mlx", reason="z-lab's dflash package is installed by scripts/setup.sh")

VARIANTS = {
    "plain": {},
    "sliding": {"layer_types": ["sliding_attention", "full_attention"], "sliding_window": 8},
    "rope_parameters-yarn": {
        "rope_parameters": {
            "rope_type": "yarn",
            "factor": 4.0,
            "rope_theta": 5000.0,
            "original_max_position_embeddings": 64,
        }
    },
    "rope_parameters-llama3": {
        "rope_parameters": {
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "rope_theta": 5000.0,
            "original_max_position_embeddings": 64,
        }
    },
    "logit-fields": {
        "dflash_config": {"output_multiplier": 0.5, "final_logit_softcapping": 3.0, "input_embedding_scale": 1.7}
    },
    "causal": {"is_causal": True},
}


def write_drafter(target, folder, variant: dict, seed: int = 3):
    save_draft(
        random_draft(
            target, seed=seed, layer_ids=(0, 2), block_size=6, num_hidden_layers=2, layer_types=["full_attention"] * 2
        ),
        folder,
    )
    config = json.loads((folder / "config.json").read_text())
    for key, value in variant.items():
        if key == "dflash_config":
            config["dflash_config"].update(value)
        elif key == "rope_parameters":
            config.pop("rope_theta"), config.pop("rope_scaling")
            config[key] = value
        else:
            config[key] = value
    (folder / "config.json").write_text(json.dumps(config))
    return folder


def zlab_drafter(folder, target, monkeypatch):
    monkeypatch.setattr(zlab, "snapshot_download", lambda repo, **kwargs: repo)  # local dirs
    return zlab.load_draft(str(folder)).bind(target.model)


def block_logits_ours(draft, features, block):
    cache = draft.make_cache()
    draft.add_context(features, cache)
    return np.array(draft(block, cache))


def block_logits_theirs(draft, features, block):
    return np.array(draft(block, features, draft.make_cache())[:, 1:])


@pytest.mark.parametrize("model_type", ["llama", "qwen3"])
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_drafter_logits_match_zlab(model_type, variant, tmp_path, monkeypatch):
    target = tiny_target(model_type, seed=7)
    folder = write_drafter(target, tmp_path / "d", VARIANTS[variant])
    ours = load_draft(folder, dtype=mx.float32).bind(target)
    theirs = zlab_drafter(folder, target, monkeypatch)
    prompt = mx.array([[3, 14, 15, 92, 65, 35, 89, 79, 32, 38, 46, 26]])
    features = target(prompt, target.make_cache(), ours.target_layer_ids)[1]
    block = mx.array([[11] + [ours.mask_token_id] * 5])
    a, b = block_logits_ours(ours, features, block), block_logits_theirs(theirs, features, block)
    assert np.abs(a - b).max() <= 1e-5 * max(1.0, np.abs(b).max())


def test_the_fields_really_change_the_logits(tmp_path):
    """So the parity above could fail: each variant computes something else than plain."""
    target = tiny_target("qwen3", seed=7)
    prompt = mx.array([[3, 14, 15, 92, 65, 35, 89, 79, 32, 38, 46, 26]])
    logits = {}
    for name, variant in VARIANTS.items():
        draft = load_draft(write_drafter(target, tmp_path / name, variant), dtype=mx.float32).bind(target)
        features = target(prompt, target.make_cache(), draft.target_layer_ids)[1]
        logits[name] = block_logits_ours(draft, features, mx.array([[11] + [draft.mask_token_id] * 5]))
    for name in VARIANTS:
        if name != "plain":
            assert np.abs(logits[name] - logits["plain"]).max() > 1e-3, name


@pytest.mark.parametrize(
    "field, value, message",
    [
        ("hidden_act", "gelu", "hidden_act"),
        ("attn_logit_softcapping", 30.0, "attn_logit_softcapping"),
        ("dflash_config", {"conv_kernel_size": 4}, "DFlash 2 field"),
        ("dflash_config", {"mystery_knob": 1}, "unknown dflash_config field 'mystery_knob'"),
        (
            "rope_parameters",
            {"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.5},
            "partial_rotary_factor",
        ),
        ("rope_parameters", {"rope_type": "warp-drive", "rope_theta": 1e4}, "RoPE"),
    ],
)
def test_fields_we_do_not_implement_are_refused(field, value, message, tmp_path):
    target = tiny_target("qwen3", seed=7)
    folder = write_drafter(target, tmp_path / "d", {field: value})
    with pytest.raises(DraftLoadError, match=message):
        load_draft(folder)


@pytest.mark.parametrize(
    "model_type",
    [
        "llama",
        "qwen3",
        "qwen3_moe",
        "qwen3_5",
        "qwen3_next",
        "gpt_oss",
        "gemma4_text",
        "gemma4",
        "deepseek_v3",
        "kimi_k25",
    ],
)
def test_target_features_match_zlab(model_type):
    """The outputs of target_layer_ids, ours (through the model's own forward) against
    z-lab's layer hooks on an untouched twin of the same model."""
    layer_ids = [0, 1, 3]
    target = tiny_target(model_type, seed=5)
    twin = tiny_model(model_type, seed=5)
    zlab._patch_model(twin, layer_ids)
    prompt = mx.array([[3, 14, 15, 92, 65, 35, 89, 79, 32, 38, 46, 26]])
    logits, features = target(prompt, target.make_cache(), layer_ids)
    expected_logits = twin(prompt, cache=make_prompt_cache(twin))
    expected = mx.concatenate(twin._hidden_states, axis=-1)
    assert same_up_to_rounding(features, expected) and same_up_to_rounding(logits, expected_logits)


@pytest.mark.parametrize("model_type", ["llama", "qwen3_5"])
@pytest.mark.parametrize("layer_types", [["full_attention"] * 2, ["sliding_attention", "full_attention"]])
def test_dflash2_drafts_match_zlab(model_type, layer_types, tmp_path, monkeypatch):
    """A DFlash 2 drafter (convolutions + candidate selector) written by us and read by
    z-lab's loader: same block logits, same greedy path through the candidates."""
    target = tiny_target(model_type, seed=7)
    extra = {"sliding_window": 8} if "sliding_attention" in layer_types else {}
    save_draft(
        random_dflash2(target, seed=3, layer_ids=(0, 2), block_size=6, layer_types=layer_types, **extra), tmp_path / "d"
    )
    config = json.loads((tmp_path / "d" / "config.json").read_text())
    assert config["architectures"] == ["DFlash2DraftModel"] and config["dflash_config"]["selector_top_k"] == 4
    ours = load_draft(tmp_path / "d", dtype=mx.float32).bind(target)
    theirs = zlab_drafter(tmp_path / "d", target, monkeypatch)
    prompt = mx.array([[3, 14, 15, 92, 65, 35, 89, 79, 32, 38, 46, 26]])
    features = target(prompt, target.make_cache(), ours.target_layer_ids)[1]
    overruled = 0
    for anchor in (11, 40, 77, 63, 5):
        block = mx.array([[anchor] + [ours.mask_token_id] * 5])
        a, b = block_logits_ours(ours, features, block), block_logits_theirs(theirs, features, block)
        assert np.abs(a - b).max() <= 1e-5 * max(1.0, np.abs(b).max())
        cache = ours.make_cache()
        ours.add_context(features, cache)
        path = ours.propose(block, cache, SamplingParams(), None)
        expected, _, _ = theirs.propose(block, features, theirs.make_cache(), 0.0, logits_start=1)
        assert path.tolist() == expected[0].tolist()
        overruled += path.tolist() != np.argmax(a[0], axis=-1).tolist()
    assert overruled  # the selector's edge term really chose, so this comparison could fail


@pytest.mark.slow  # the real default pair
def test_the_shipped_drafter_in_float_loads_in_zlab_code(smollm2_dir, tmp_path, monkeypatch):
    """The drafter we ship (8-bit), expanded to float32 by `convert draft`, is read by z-lab's
    loader and drafts the block logits ours drafts, on SmolLM2's own features."""
    import mlx_lm

    from dflash_mlx.convert.models import convert_draft
    from dflash_mlx.api.registry import DEFAULT_DRAFT
    from dflash_mlx.target.wrapper import Target

    folder = convert_draft(str(DEFAULT_DRAFT), tmp_path / "float", dtype="float32", show_progress=False)
    (folder / "draft_vocab.json").unlink(missing_ok=True)  # ours would draft over its restricted vocabulary
    target = Target(mlx_lm.load(str(smollm2_dir))[0])
    ours = load_draft(folder, dtype=mx.float32).bind(target)
    theirs = zlab_drafter(folder, target, monkeypatch)
    prompt = mx.array([[1, 9690, 198, 2683, 359, 253, 5356, 5646, 11173, 30, 2, 198, 1, 4093, 198]])
    features = target(prompt, target.make_cache(), ours.target_layer_ids)[1]
    for anchor in (28, 1694, 314):
        block = mx.array([[anchor] + [ours.mask_token_id] * 7])
        a, b = block_logits_ours(ours, features, block), block_logits_theirs(theirs, features, block)
        assert np.abs(a - b).max() <= 1e-4 * max(1.0, np.abs(b).max())
