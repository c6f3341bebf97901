"""DFlash's gain over our own plain decoding on the default pair (SmolLM2-135M + the shipped
drafter, as `load` loads them), on the held-out chat prompts: the figure that transfers to a
Mac, since both sides run the same loop, caches and ops.

    nice -n 5 python bench/plain_gain.py [--prompts 8] [--max-tokens 96]

Each prompt is decoded greedily by ours at width 1 (plain) and by ours in its default mode
(adaptive widths; copies from earlier answers off, each prompt a first request), the order
alternating from prompt to prompt, each timed from its first token; every DFlash output is
checked equal to the plain one.  Prints the per-prompt speeds, the median gain and the lowest.
"""

import argparse
import sys
import time
from datetime import date
from pathlib import Path
from statistics import median

sys.path.insert(0, str(Path(__file__).parent.parent))

import dflash_mlx  # noqa: F401  (OpenBLAS before mlx)

from dflash_mlx.api import load
from dflash_mlx.bench.harness import machine
from dflash_mlx.decode.decoder import decode
from dflash_mlx.decode.learning import without_answers
from dflash_mlx.decode.model import DecodeStats
from dflash_mlx.decode.request import Request
from dflash_mlx.kernels.metal import chip_name
from dflash_mlx.train.data import read_data

HELD_OUT = Path(__file__).parents[1] / "data" / "smollm2-135m"


def timed(model, prompt: list[int], max_tokens: int, block_size) -> tuple[list[int], float, float]:
    """(tokens, tok/s after the first token, tau)."""
    stats, tokens = DecodeStats(), []
    steps = decode(model, Request(prompt, max_tokens, block_size=block_size), stats=stats)
    tokens += next(steps).tokens
    tic, first = time.perf_counter(), len(tokens)
    for step in steps:
        tokens += step.tokens
    return tokens, (len(tokens) - first) / (time.perf_counter() - tic), stats.tau


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=96)
    args = parser.parse_args()
    model, _ = load(None)
    model = without_answers(model)  # each prompt as a first request
    prompts = [e.prompt_ids for e in read_data(HELD_OUT)[-args.prompts :]]
    for block_size in (1, None):
        timed(model, prompts[0][:64], 8, block_size)  # the first calls' set-up outside the timing
    print(f"{machine()}, {chip_name()}, {date.today()}; `{' '.join(['python', *sys.argv])}`\n")
    print("| prompt | plain tok/s | DFlash tok/s | gain | tau | same output |\n|---|---|---|---|---|---|")
    gains = []
    for i, prompt in enumerate(prompts):
        order = (1, None) if i % 2 == 0 else (None, 1)
        runs = {block_size: timed(model, prompt, args.max_tokens, block_size) for block_size in order}
        (plain, plain_tps, _), (ours, ours_tps, tau) = runs[1], runs[None]
        gains.append(ours_tps / plain_tps)
        print(f"| {i} | {plain_tps:.1f} | {ours_tps:.1f} | {gains[-1]:.2f}x | {tau:.2f} | {ours == plain} |")
    print(f"\nmedian gain {median(gains):.2f}x, lowest {min(gains):.2f}x over {len(gains)} prompts")


if __name__ == "__main__":
    main()
