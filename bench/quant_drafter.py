"""Acceptance and speed of the default drafter unquantized vs 8-bit vs 4-bit.

    python bench/quant_drafter.py [--prompts 8] [--max-tokens 96]

Held-out prompts: the last 8 examples of data/smollm2-135m (never trained on).
Greedy, block 16 fixed; tau and tok/s per variant, plus the drafter's size.
"""

import tempfile
import time
from pathlib import Path

import typer

import dflash_mlx  # noqa: F401  (loads OpenBLAS before mlx)
import mlx.core as mx
import mlx_lm

from dflash_mlx.convert.models import convert_draft, draft_size_mb
from dflash_mlx.train.data import read_data
from dflash_mlx.drafters import load_draft
from dflash_mlx.decode.decoder import decode
from dflash_mlx.decode.model import DecodeStats, DFlashModel
from dflash_mlx.convert.smollm2 import smollm2_path
from dflash_mlx.api.registry import DEFAULT_DRAFT
from dflash_mlx.sampling import SamplingParams
from dflash_mlx.target.wrapper import Target


def main(prompts: int = 8, max_tokens: int = 96):
    model, _ = mlx_lm.load(str(smollm2_path()))
    target = Target(model)
    held_out = [e.prompt_ids for e in read_data(Path(__file__).parents[1] / "data" / "smollm2-135m")[-prompts:]]
    tmp = Path(tempfile.mkdtemp())
    variants = {"bf16 (shipped)": DEFAULT_DRAFT}
    for bits in (8, 4):
        variants[f"{bits}-bit g64"] = convert_draft(
            str(DEFAULT_DRAFT), tmp / f"q{bits}", q_bits=bits, q_group_size=64, show_progress=False
        )
    print("| drafter | size MB | tau | tok/s |\n|---|---|---|---|")
    for name, path in variants.items():
        draft = load_draft(path, dtype=mx.float32).bind(target)
        lengths, tokens, seconds = [], 0, 0.0
        for prompt in held_out:
            stats = DecodeStats()
            tic = time.perf_counter()
            for step in decode(DFlashModel(target, draft), mx.array(prompt), SamplingParams(), max_tokens, 16, stats):
                tokens += len(step.tokens)
            seconds += time.perf_counter() - tic
            lengths += stats.accepted_lengths
        print(f"| {name} | {draft_size_mb(path):.1f} | {sum(lengths) / len(lengths):.3f} | {tokens / seconds:.1f} |")


if __name__ == "__main__":
    typer.run(main)
