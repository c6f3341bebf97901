"""dflash-mlx: DFlash block-diffusion speculative decoding on MLX."""

from .io import blas

blas.load_openblas()  # must run before anything imports mlx.core

from .api import (  # noqa: E402
    BatchGenerator,
    GenerationResponse,
    batch_generate,
    format_prompt,
    generate,
    load,
    stream_generate,
)
from .drafters import DFlashDraftModel, DraftArgs, load_draft  # noqa: E402
from .decode.model import DecodeStats, DFlashModel  # noqa: E402
from .decode.grammar import Grammar  # noqa: E402
from .target.wrapper import Target  # noqa: E402

__all__ = [
    "load",
    "generate",
    "stream_generate",
    "batch_generate",
    "BatchGenerator",
    "format_prompt",
    "GenerationResponse",
    "Grammar",
    "DFlashModel",
    "DecodeStats",
    "DFlashDraftModel",
    "DraftArgs",
    "load_draft",
    "Target",
]
