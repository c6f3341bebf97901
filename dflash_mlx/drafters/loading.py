"""Reading and writing drafter directories (z-lab format: config.json + safetensors,
plus our optional draft_vocab.json)."""

import json
from pathlib import Path
from typing import Any, Optional

import mlx.core as mx
import mlx.nn as nn

from .config import ARCHITECTURES, CODEBOOKS, DraftArgs, DraftLoadError
from .model import DFlashDraftModel
from .precision import expand
from .vocab import VOCAB_FILE


def safe_activation_dtype(dtype: mx.Dtype) -> mx.Dtype:
    """Drafters never compute in float16: the target features they fuse reach ~3e4
    (massive activations) and fc sums thousands of them, which overflows float16
    (zero acceptance, as reported for 4-bit drafters on M1/M2).  bfloat16 has
    float32's range."""
    return mx.bfloat16 if dtype == mx.float16 else dtype


def load_draft(path: str | Path, dtype: Optional[mx.Dtype] = None, dequantize: bool = False) -> DFlashDraftModel:
    """Load a drafter directory (z-lab format: config.json + *.safetensors).

    Weights and activations use `dtype` (default: as stored), except that
    float16 becomes bfloat16 (see safe_activation_dtype); quantized layers keep
    their packed weights and take their scales in that dtype, unless
    `dequantize`, which expands them to plain `dtype` weights."""
    path = Path(path)
    config_file = path / "config.json"
    if not config_file.is_file():
        raise DraftLoadError(f"{path} is not a DFlash drafter directory: no config.json")
    try:
        config = json.loads(config_file.read_text())
    except json.JSONDecodeError as e:
        raise DraftLoadError(f"{config_file} is not valid JSON ({e}); re-download the drafter") from None
    architecture = (config.get("architectures") or ["DFlashDraftModel"])[0]
    if architecture not in ARCHITECTURES:
        raise DraftLoadError(
            f"{path}: drafter architecture {architecture!r} is not supported ({' or '.join(ARCHITECTURES)})"
        )
    args = DraftArgs.from_config(config)
    model = DFlashDraftModel(args)

    weights = {}
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise DraftLoadError(f"{path} has no *.safetensors weights")
    for f in files:
        try:
            weights.update(mx.load(str(f)))
        except Exception as e:  # mlx raises bare RuntimeError/ValueError on corrupt files
            raise DraftLoadError(f"{f} is corrupt or unreadable ({e}); re-download or re-convert it") from None
    weights = model.sanitize(weights)

    if quantization := config.get("quantization"):
        nn.quantize(
            model,
            group_size=quantization["group_size"],
            bits=quantization["bits"],
            class_predicate=lambda p, m: f"{p}.scales" in weights,
        )
        model.quantization = quantization
    _load_weights_checked(model, weights, path)
    model.set_dtype(safe_activation_dtype(dtype or model.dtype))
    if dequantize:  # after the cast: expanded in the activation dtype
        expand(model)
    if (path / VOCAB_FILE).is_file():
        try:
            model.restrict_vocab(json.loads((path / VOCAB_FILE).read_text())["token_ids"])
        except (json.JSONDecodeError, KeyError, TypeError, ValueError) as e:
            raise DraftLoadError(
                f"{path / VOCAB_FILE} is not a drafting vocabulary ({e}); delete it or re-export the drafter"
            ) from None
    mx.eval(model.parameters())
    model.eval()
    return model


def _load_weights_checked(model: nn.Module, weights: dict[str, Any], path: Path) -> None:
    from mlx.utils import tree_flatten

    expected = dict(tree_flatten(model.parameters()))
    missing = sorted(set(expected) - set(weights))
    unexpected = sorted(set(weights) - set(expected))
    if missing:
        more = f" (+{len(missing) - 3} more)" if len(missing) > 3 else ""
        raise DraftLoadError(f"{path}: drafter weights missing {', '.join(missing[:3])}{more}")
    if unexpected:
        more = f" (+{len(unexpected) - 3} more)" if len(unexpected) > 3 else ""
        raise DraftLoadError(f"{path}: unexpected drafter weights {', '.join(unexpected[:3])}{more}")
    for name, value in weights.items():
        if value.shape != expected[name].shape:
            raise DraftLoadError(
                f"{path}: weight {name} has shape {tuple(value.shape)}, config implies {tuple(expected[name].shape)}"
            )
    model.load_weights(list(weights.items()))


def save_draft(model: DFlashDraftModel, path: str | Path, quantization: Optional[dict] = None) -> Path:
    """Write `model` as a z-lab drafter directory (config.json + model.safetensors);
    a quantized drafter also records mlx-lm's `quantization` entry."""
    from mlx.utils import tree_flatten

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    config = model.args.to_config()
    quantization = quantization or model.quantization
    if quantization:
        model.quantization = quantization
        config["quantization"] = config["quantization_config"] = quantization
    (path / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    weights = {
        name.removesuffix(".weight") if name.removesuffix(".weight") in CODEBOOKS else name: value
        for name, value in tree_flatten(model.parameters())
    }
    # "pt" is what transformers / SGLang / vLLM expect in the safetensors header
    mx.save_safetensors(str(path / "model.safetensors"), weights, metadata={"format": "pt"})
    if model.vocab_ids is not None:
        (path / VOCAB_FILE).write_text(json.dumps({"token_ids": model.vocab_ids.tolist()}))
    return path
