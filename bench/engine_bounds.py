"""Speed bounds of the decode loop on the default target, before a trained drafter exists.

Plain mlx-lm greedy decoding vs DFlash with (a) a random drafter (nearly every
draft rejected: the loop's overhead floor) and (b) an oracle drafter that proposes
the target's own greedy tokens (full acceptance: the ceiling a perfect drafter
reaches at that block size).  Runs are interleaved per prompt; medians reported.

    python bench/engine_bounds.py [--max-tokens 64]
"""

import statistics
import sys
import time
from pathlib import Path

import typer

import dflash_mlx  # noqa: F401  (loads OpenBLAS before mlx)
import mlx.core as mx
import mlx_lm
from mlx_lm.generate import generate_step

from dflash_mlx import format_prompt
from dflash_mlx.engine import decode
from dflash_mlx.model import DecodeStats, DFlashModel
from dflash_mlx.convert.smollm2 import smollm2_path
from dflash_mlx.sampling import SamplingParams
from dflash_mlx.target import Target

sys.path.insert(0, str(Path(__file__).parents[1] / "tests"))
from tiny_models import oracle_draft, random_draft  # noqa: E402

PROMPTS = [
    "Write a short poem about the sea.",
    "Explain how a bicycle stays upright.",
    "Write a Python function that checks whether a number is prime.",
]
LAYERS = (1, 8, 15, 22, 28)


def timed(fn):
    start = time.perf_counter()
    out = fn()
    return out, time.perf_counter() - start


def main(max_tokens: int = 64):
    model, tokenizer = mlx_lm.load(str(smollm2_path()))
    target = Target(model)
    rows = {}
    for text in PROMPTS:
        prompt = format_prompt(tokenizer, text)

        def plain():
            return [int(t) for t, _ in generate_step(mx.array(prompt), model, max_tokens=max_tokens)]

        plain()  # warm-up
        reference, seconds = timed(plain)
        rows.setdefault("plain mlx-lm", []).append((max_tokens / seconds, 1.0))
        for name, block, drafter in [
            ("random drafter, block 4", 4, random_draft(target, layer_ids=LAYERS, block_size=4)),
            ("oracle drafter, block 8", 8, None),
            ("oracle drafter, block 16", 16, None),
        ]:
            drafter = drafter or oracle_draft(target, prompt + reference + [0] * 16, layer_ids=LAYERS, block_size=block)
            stats = DecodeStats()
            pair = DFlashModel(target, drafter)
            out, seconds = timed(
                lambda: [
                    t
                    for s in decode(pair, mx.array(prompt), SamplingParams(), max_tokens, stats=stats)
                    for t in s.tokens
                ][:max_tokens]
            )
            assert out == reference, "DFlash output differs from plain greedy"
            rows.setdefault(name, []).append((max_tokens / seconds, stats.tau))
    print(f"SmolLM2-135M fp32, {max_tokens} tokens, {len(PROMPTS)} prompts, medians")
    print("| decoder | tok/s | tau |\n|---|---|---|")
    for name, values in rows.items():
        print(
            f"| {name} | {statistics.median(v[0] for v in values):.1f} | {statistics.median(v[1] for v in values):.2f} |"
        )


if __name__ == "__main__":
    typer.run(main)
