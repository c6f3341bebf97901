"""The public API: load a target (+ drafter), then stream or return generated text."""

from .generation import (
    BatchGenerator,
    BatchResponse,
    GenerationResponse,
    batch_generate,
    format_prompt,
    format_stats,
    generate,
    make_request,
    prompt_ids,
    stream_generate,
)
from .loading import context_limit, load

__all__ = [
    "load",
    "context_limit",
    "generate",
    "stream_generate",
    "batch_generate",
    "BatchGenerator",
    "BatchResponse",
    "GenerationResponse",
    "format_prompt",
    "format_stats",
    "make_request",
    "prompt_ids",
]
