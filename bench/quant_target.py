"""Acceptance of the shipped pair with its target's weights at bf16, 8 and 4 bits: what a short
name's default variant costs in drafts accepted.

    nice -n 10 python bench/quant_target.py [--prompts 8] [--max-tokens 64]

The offline default target, SmolLM2-135M-Instruct, with the weights a Mac would load: bf16 (the
GGUF's Q4_1 weights dequantized, as `load` converts it on a Mac), 8-bit (mlx-lm's affine
quantization, group 64, of that bf16 model) and 4-bit (the GGUF's native Q4_1, as `--quant 4`
loads it); each expanded to float32 and computed in float32 here, as MLX's CPU runs
half-precision and quantized matmuls about ten times slower (so a Mac's bf16 activations are not
what is measured: the weights are); with the shipped drafter as `load` loads it on a CPU.
Held-out prompts: the last examples of data/smollm2-135m (never trained on); greedy, block 16
fixed; the variants interleaved prompt by prompt, the table printed after each prompt.  tau is the
mean accepted length (bonus token included), ± the standard error of that mean over the cycles.
"""

from pathlib import Path

import typer

import dflash_mlx  # noqa: F401  (loads OpenBLAS before mlx)
import mlx.core as mx

import mlx_lm
from mlx_lm.utils import dequantize_model

from dflash_mlx.api.registry import DEFAULT_DRAFT
from dflash_mlx.convert.models import convert_target
from dflash_mlx.convert.smollm2 import DEFAULT_MODEL, smollm2_path
from dflash_mlx.decode.decoder import decode
from dflash_mlx.decode.request import Request
from dflash_mlx.decode.model import DecodeStats, DFlashModel
from dflash_mlx.drafters import load_draft
from dflash_mlx.drafters.precision import apply_precision, draft_precision, runs_packed
from dflash_mlx.io.storage import cache_dir
from dflash_mlx.kernels.fused_ops import fuse
from dflash_mlx.sampling import SamplingParams
from dflash_mlx.target.wrapper import Target
from dflash_mlx.train.data import read_data

BLOCK = 16


def variants() -> dict[str, Path]:
    """The target's dir for each variant, converted into the cache on first use."""
    bf16 = smollm2_path("bfloat16")
    eight = cache_dir() / "models" / f"{DEFAULT_MODEL}-8bit"
    if not (eight / "config.json").is_file():
        convert_target(str(bf16), eight, q_bits=8, force=True, show_progress=False)
    return {"bf16": bf16, "8-bit": eight, "4-bit (Q4_1)": smollm2_path("native")}


def pair(folder: Path) -> DFlashModel:
    """The target in `folder` expanded to float32, with the shipped drafter as `load` runs it here."""
    model, _ = mlx_lm.load(str(folder))
    model = dequantize_model(model)
    model.set_dtype(mx.float32)
    target = Target(model)
    drafter = load_draft(DEFAULT_DRAFT, dtype=mx.float32)
    stored = drafter.quantization["bits"] if drafter.quantization else None
    precision = draft_precision(None, stored, runs_packed())
    return DFlashModel(target, fuse(apply_precision(drafter, precision).bind(target)))


def mean_and_error(lengths: list[int]) -> str:
    tau = sum(lengths) / len(lengths)
    spread = (sum((n - tau) ** 2 for n in lengths) / (len(lengths) - 1) / len(lengths)) ** 0.5
    return f"{tau:.3f} ± {spread:.3f}"


def main(prompts: int = 8, max_tokens: int = 64):
    held_out = [e.prompt_ids for e in read_data(Path(__file__).parents[1] / "data" / "smollm2-135m")[-prompts:]]
    models = {name: pair(path) for name, path in variants().items()}
    lengths = {name: [] for name in models}
    agree = {name: 0 for name in models}
    for i, prompt in enumerate(held_out):
        outputs = {}
        for name, model in models.items():  # interleaved: every variant on this prompt, then the next
            stats = DecodeStats()
            steps = decode(model, Request(list(prompt), max_tokens, SamplingParams(), block_size=BLOCK), stats=stats)
            outputs[name] = [t for step in steps for t in step.tokens]
            lengths[name] += stats.accepted_lengths
        for name, tokens in outputs.items():
            agree[name] += tokens == outputs["bf16"]
        # the table so far, after every prompt: each is a complete interleaved measurement
        print(f"\nafter {i + 1} of {len(held_out)} prompts\n| target | tau (block {BLOCK}) | answers equal to bf16's |")
        print("|---|---|---|")
        for name in models:
            print(f"| {name} | {mean_and_error(lengths[name])} | {agree[name]}/{i + 1} |", flush=True)


if __name__ == "__main__":
    typer.run(main)
