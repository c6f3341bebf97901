"""Convert and quantize DFlash drafters and target models for MLX.

    python convert.py draft z-lab/Qwen3-8B-DFlash-b16 ./qwen3-8b-dflash-4bit --q-bits 4
    python convert.py target Qwen/Qwen3-8B ./qwen3-8b-4bit --q-bits 4
    python convert.py target model.Q4_0.gguf ./model-mlx          # GGUF: llama, qwen2, qwen3

Same as `dflash-mlx convert ...`; add --dry-run to see what would be written.
"""

import sys

import dflash_mlx  # noqa: F401  (loads OpenBLAS before mlx)
from dflash_mlx.cli import app

if __name__ == "__main__":
    sys.exit(app(["convert", *sys.argv[1:]]))
