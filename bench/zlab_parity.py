"""Parity figures against z-lab's own MLX code (PyPI `dflash`), on the tests' random weights:
the largest relative error of our drafter's block logits, per drafter variant and target
family, and whether target features are bit-equal.  The tests assert the same bounds;
this prints the numbers for the README.

    python bench/zlab_parity.py
"""

import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

import dflash_mlx  # noqa: F401  (BLAS before mlx)
import mlx.core as mx
import numpy as np
from mlx_lm.models.cache import make_prompt_cache

import test_zlab_parity as parity
from dflash_mlx.drafters import load_draft, save_draft
from tiny_models import random_dflash2, tiny_model, tiny_target

PROMPT = mx.array([[3, 14, 15, 92, 65, 35, 89, 79, 32, 38, 46, 26]])
parity.zlab.snapshot_download = lambda repo, **kwargs: repo  # local dirs


def relative_error(ours, theirs, target, anchor=11):
    features = target(PROMPT, target.make_cache(), ours.target_layer_ids)[1]
    block = mx.array([[anchor] + [ours.mask_token_id] * 5])
    a = parity.block_logits_ours(ours, features, block)
    b = parity.block_logits_theirs(theirs, features, block)
    return np.abs(a - b).max() / max(1.0, np.abs(b).max())


def main():
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for model_type in ("llama", "qwen3"):
            target = tiny_target(model_type, seed=7)
            for name, variant in parity.VARIANTS.items():
                folder = parity.write_drafter(target, Path(tmp) / f"{model_type}-{name}", variant)
                ours = load_draft(folder, dtype=mx.float32).bind(target)
                theirs = parity.zlab.load_draft(str(folder)).bind(target.model)
                rows.append((f"DFlash 1, {name}", model_type, relative_error(ours, theirs, target)))
        for model_type in ("llama", "qwen3_5"):
            target = tiny_target(model_type, seed=7)
            for layer_types in (["full_attention"] * 2, ["sliding_attention", "full_attention"]):
                extra = {"sliding_window": 8} if "sliding_attention" in layer_types else {}
                folder = Path(tmp) / f"d2-{model_type}-{layer_types[0]}"
                save_draft(
                    random_dflash2(target, seed=3, layer_ids=(0, 2), block_size=6, layer_types=layer_types, **extra),
                    folder,
                )
                ours = load_draft(folder, dtype=mx.float32).bind(target)
                theirs = parity.zlab.load_draft(str(folder)).bind(target.model)
                rows.append(
                    (
                        f"DFlash 2, {layer_types[0].split('_')[0]} first layer",
                        model_type,
                        relative_error(ours, theirs, target),
                    )
                )
    print("| drafter | target | max relative error of block logits |\n|---|---|---|")
    for drafter, model_type, error in rows:
        print(f"| {drafter} | {model_type} | {error:.1e} |")
    print("\n| target family | features and logits vs z-lab's layer hooks |\n|---|---|")
    for model_type in (
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
    ):
        target, twin = tiny_target(model_type, seed=5), tiny_model(model_type, seed=5)
        parity.zlab._patch_model(twin, [0, 1, 3])
        logits, features = target(PROMPT, target.make_cache(), [0, 1, 3])
        expected_logits = twin(PROMPT, cache=make_prompt_cache(twin))
        expected = mx.concatenate(twin._hidden_states, axis=-1)
        equal = mx.array_equal(features, expected) and mx.array_equal(logits, expected_logits)
        print(f"| {model_type} | {'bit-equal' if equal else 'DIFFERENT'} |")


if __name__ == "__main__":
    main()
