"""Time to first token of a cold prompt by the size of our prefill passes, against stock
mlx-lm's stream_generate (its own ops, 2048-token prefill steps), on the default target.

    python bench/prefill_passes.py [--lengths 380,1500,3000] [--passes 512,256,128] [--reps 2]
        [--out bench/results/prefill-passes]

Prompts are the long-context bench's (source files cut to the length, then a question).  Per
rep, every variant runs once, in an order rotated each rep; medians over the reps, seconds.
A pass size is engine.CPU_PREFILL_PASS (a step prefills PREFILL_STEP tokens in such passes).
"""

import statistics
import sys
import time
from pathlib import Path
from typing import Optional

import typer

import dflash_mlx  # noqa: F401  (loads OpenBLAS before mlx)
import mlx.core as mx
from long_context import long_prompt
from mlx_lm.generate import stream_generate as mlx_stream_generate

from dflash_mlx import engine, load
from dflash_mlx.bench.harness import machine, report
from dflash_mlx.fused_ops import unfused
from dflash_mlx.sampling import SamplingParams


def first_token_seconds(run) -> float:
    tic = time.perf_counter()
    responses = run()
    next(responses)
    seconds = time.perf_counter() - tic
    responses.close()
    return seconds


def main(
    lengths: str = typer.Option("380,1500,3000", "--lengths"),
    passes: str = typer.Option("512,256,128", "--passes"),
    reps: int = typer.Option(2, "--reps"),
    out: Optional[Path] = typer.Option(None, "--out"),
):
    model, tokenizer = load(None, use_draft=False)
    sizes = [int(p) for p in passes.split(",")]
    variants = ["mlx-lm"] + [f"pass {size}" for size in sizes]
    lines = [
        f"Machine: {machine()}",
        f"Command: `python {' '.join(sys.argv)}`",
        "",
        "| prompt tokens | " + " | ".join(variants) + " |",
        "|---" * (len(variants) + 1) + "|",
    ]

    def seconds(variant: str, prompt: list[int]) -> float:
        if variant == "mlx-lm":
            with unfused(model.target.model):  # re-laid out before the clock starts
                return first_token_seconds(
                    lambda: mlx_stream_generate(model.target.model, tokenizer, prompt, max_tokens=1)
                )
        engine.CPU_PREFILL_PASS = int(variant.split()[1])
        return first_token_seconds(lambda: engine.decode(model, mx.array(prompt), SamplingParams(), 1))

    for variant in variants:  # warm-up: first calls trace and allocate
        seconds(variant, long_prompt(tokenizer, 64))
    for length in [int(n) for n in lengths.split(",")]:
        prompt = long_prompt(tokenizer, length)
        times = {variant: [] for variant in variants}
        for rep in range(reps):
            for variant in variants[rep % len(variants) :] + variants[: rep % len(variants)]:
                times[variant].append(seconds(variant, prompt))
                print(f"{len(prompt)} {variant}: {times[variant][-1]:.2f} s", file=sys.stderr, flush=True)
        cells = [f"{statistics.median(times[variant]):.2f} s" for variant in variants]
        lines.append(f"| {len(prompt)} | " + " | ".join(cells) + " |")
    report(lines, out)


if __name__ == "__main__":
    typer.run(main)
