"""Acceptance and speed of the shipped drafter at each `--draft-quant`: float, 8-bit, 4-bit.

    nice -n 10 python bench/quant_drafter.py [--prompts 8] [--max-tokens 96]

Held-out prompts: the last 8 examples of data/smollm2-135m (never trained on); greedy, block 16
fixed; the drafter loaded as `load` loads it (drafters/precision.py, then fused).  tau is the
mean accepted length (bonus token included), ± the standard error of that mean over the cycles;
MB: the drafter's weights as a GPU holds them (bf16, quantized ones packed).  A quantized
drafter is decoded twice: expanded to float32 (how `load` runs it on a CPU) and packed (MLX's
quantized matmul, how a GPU runs it), so the table shows whether acceptance measured through the
expanded weights on a CPU is what a GPU would accept.  The shipped drafter is stored 8-bit: its
float form is those values expanded (no float checkpoint of it was kept), and its 4-bit form is
quantized from them.
"""

import dataclasses
import time
from pathlib import Path

import typer

import dflash_mlx  # noqa: F401  (loads OpenBLAS before mlx)
import mlx.core as mx
import mlx_lm
from mlx.utils import tree_flatten

from dflash_mlx.api.registry import DEFAULT_DRAFT
from dflash_mlx.convert.smollm2 import smollm2_path
from dflash_mlx.decode.decoder import decode
from dflash_mlx.decode.request import Request
from dflash_mlx.decode.model import DecodeStats, DFlashModel
from dflash_mlx.drafters import load_draft
from dflash_mlx.drafters.precision import DRAFT_QUANTS, FLOAT, DraftPrecision, apply_precision, draft_precision
from dflash_mlx.kernels.fused_ops import fuse
from dflash_mlx.sampling import SamplingParams
from dflash_mlx.target.wrapper import Target
from dflash_mlx.train.data import read_data

BLOCK = 16


def drafter(precision: DraftPrecision, dtype: mx.Dtype):
    return apply_precision(load_draft(DEFAULT_DRAFT, dtype=dtype), precision)


def gpu_megabytes(precision: DraftPrecision) -> float:
    """The drafter's weights as a GPU holds them: bf16, quantized ones packed."""
    weights = drafter(dataclasses.replace(precision, packed=True), mx.bfloat16).parameters()
    return sum(w.nbytes for _, w in tree_flatten(weights)) / 1e6


def run(target: Target, draft, prompts: list[list[int]], max_tokens: int) -> tuple[str, float]:
    """(tau with the standard error of its mean over the cycles, tokens per second) over `prompts`."""
    model = DFlashModel(target, draft)
    for _ in decode(model, Request(list(prompts[0]), BLOCK, SamplingParams(), block_size=BLOCK)):
        pass  # compiles the fused ops outside the timing
    lengths, tokens, seconds = [], 0, 0.0
    for prompt in prompts:
        stats = DecodeStats()
        tic = time.perf_counter()
        for step in decode(model, Request(list(prompt), max_tokens, SamplingParams(), block_size=BLOCK), stats=stats):
            tokens += len(step.tokens)
        seconds += time.perf_counter() - tic
        lengths += stats.accepted_lengths
    tau = sum(lengths) / len(lengths)
    spread = (sum((n - tau) ** 2 for n in lengths) / (len(lengths) - 1) / len(lengths)) ** 0.5
    return f"{tau:.3f} ± {spread:.3f}", tokens / seconds


def main(prompts: int = 8, max_tokens: int = 96):
    model, _ = mlx_lm.load(str(smollm2_path()))
    target = Target(model)
    held_out = [e.prompt_ids for e in read_data(Path(__file__).parents[1] / "data" / "smollm2-135m")[-prompts:]]
    stored = load_draft(DEFAULT_DRAFT).quantization
    stored_bits = stored["bits"] if stored else None
    print(
        "| --draft-quant | drafter | MB on a GPU | tau expanded (fp32) | tau packed | tok/s expanded | tok/s packed |\n"
        "|---|---|---|---|---|---|---|"
    )
    for asked in DRAFT_QUANTS:
        expanded = draft_precision(asked, stored_bits, packed=False)
        forms = [expanded] if asked == FLOAT else [expanded, dataclasses.replace(expanded, packed=True)]
        results = [run(target, fuse(drafter(p, mx.float32).bind(target)), held_out, max_tokens) for p in forms]
        taus = " | ".join(tau for tau, _ in results) + " | -" * (2 - len(results))
        speeds = " | ".join(f"{speed:.1f}" for _, speed in results) + " | -" * (2 - len(results))
        described = draft_precision(asked, stored_bits, packed=True).describe()
        print(f"| {asked} | {described} | {gpu_megabytes(expanded):.1f} | {taus} | {speeds} |")


if __name__ == "__main__":
    typer.run(main)
