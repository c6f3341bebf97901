"""Which target goes with which drafter, and the offline default model.

`--model` takes a short name (published target/drafter pairs), a Hugging Face
repo id, or a local directory.  With no model, the offline default is
SmolLM2-135M-Instruct (convert/smollm2.py) with the drafter shipped in weights/.
"""

from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from ..convert.smollm2 import DEFAULT_MODEL, smollm2_path
from ..io.storage import looks_like_path

# trained by `dflash-mlx train` (see README); absent until one has been shipped
DEFAULT_DRAFT = Path(__file__).parent.parent / "weights" / DEFAULT_MODEL


@dataclass(frozen=True)
class Published:
    target: str
    draft: str
    quantized: str  # mlx-community repo stem; "-4bit" / "-8bit" is appended


def _pair(target: str, draft: str, quantized_stem: Optional[str] = None) -> Published:
    return Published(target, draft, quantized_stem or f"mlx-community/{target.split('/')[1]}")


# z-lab's published drafters (huggingface.co/z-lab) and the targets they were trained on
PUBLISHED = {
    "Qwen3-4B": _pair("Qwen/Qwen3-4B", "z-lab/Qwen3-4B-DFlash-b16"),
    "Qwen3-8B": _pair("Qwen/Qwen3-8B", "z-lab/Qwen3-8B-DFlash-b16"),
    "Qwen3-Coder-30B-A3B": _pair("Qwen/Qwen3-Coder-30B-A3B-Instruct", "z-lab/Qwen3-Coder-30B-A3B-DFlash"),
    "Qwen3-Coder-Next": _pair("Qwen/Qwen3-Coder-Next", "z-lab/Qwen3-Coder-Next-DFlash"),
    "Qwen3.5-4B": _pair("Qwen/Qwen3.5-4B", "z-lab/Qwen3.5-4B-DFlash"),
    "Qwen3.5-9B": _pair("Qwen/Qwen3.5-9B", "z-lab/Qwen3.5-9B-DFlash"),
    "Qwen3.5-27B": _pair("Qwen/Qwen3.5-27B", "z-lab/Qwen3.5-27B-DFlash"),
    "Qwen3.5-35B-A3B": _pair("Qwen/Qwen3.5-35B-A3B", "z-lab/Qwen3.5-35B-A3B-DFlash"),
    "Qwen3.6-27B": _pair("Qwen/Qwen3.6-27B", "z-lab/Qwen3.6-27B-DFlash"),
    "Qwen3.6-35B-A3B": _pair("Qwen/Qwen3.6-35B-A3B", "z-lab/Qwen3.6-35B-A3B-DFlash"),
    "Llama-3.1-8B-Instruct": _pair(
        "meta-llama/Llama-3.1-8B-Instruct",
        "z-lab/LLaMA3.1-8B-Instruct-DFlash-UltraChat",
        "mlx-community/Meta-Llama-3.1-8B-Instruct",
    ),
    "gpt-oss-20b": _pair("openai/gpt-oss-20b", "z-lab/gpt-oss-20b-DFlash"),
    "gpt-oss-120b": _pair("openai/gpt-oss-120b", "z-lab/gpt-oss-120b-DFlash"),
    "gemma-4-26B-A4B": _pair("google/gemma-4-26B-A4B-it", "z-lab/gemma-4-26B-A4B-it-DFlash"),
    "gemma-4-31B": _pair("google/gemma-4-31B-it", "z-lab/gemma-4-31B-it-DFlash"),
    "Kimi-K2.5": _pair("moonshotai/Kimi-K2.5", "z-lab/Kimi-K2.5-DFlash"),
}


@dataclass(frozen=True)
class Resolved:
    target: str  # local dir or HF repo id
    draft: Optional[str]  # local dir, HF repo id, or None
    draft_note: Optional[str] = None  # why there is no drafter


def known_names() -> list[str]:
    return [DEFAULT_MODEL, *PUBLISHED]


def resolve(model: Optional[str], draft: Optional[str] = None, quant: Optional[int] = None) -> Resolved:
    if quant not in (None, 4, 8):
        raise ValueError(f"quant must be 4 or 8, got {quant}")
    if model in (None, DEFAULT_MODEL):
        if quant == 8:
            raise ValueError(f"{DEFAULT_MODEL} ships as Q4_1 only: use --quant 4 or no --quant")
        target = str(smollm2_path("native" if quant == 4 else None))
        if draft or DEFAULT_DRAFT.is_dir():
            return Resolved(target, draft or str(DEFAULT_DRAFT))
        return Resolved(target, None, f"no trained drafter for {DEFAULT_MODEL} yet")
    if model in PUBLISHED:
        pair = PUBLISHED[model]
        target = f"{pair.quantized}-{quant}bit" if quant else pair.target
        return Resolved(target, draft or pair.draft)
    if quant:
        raise ValueError("--quant applies to short names only; pass a quantized repo or dir as --model")
    if Path(model).expanduser().exists():
        return _unpublished(str(Path(model).expanduser()), draft)
    if looks_like_path(model):
        raise FileNotFoundError(f"no model directory at {model}")
    if "/" in model:
        return _unpublished(model, draft)
    raise ValueError(
        f"unknown model {model!r}; known short names: {', '.join(known_names())} "
        "(or pass a Hugging Face repo id or a local directory)"
    )


def _unpublished(target: str, draft: Optional[str]) -> Resolved:
    if draft:
        return Resolved(target, draft)
    return Resolved(target, None, "no drafter given for this model (pass --draft)")
