"""Prompts prefilled together (one padded target pass, as mlx-lm's BatchGenerator does) against
one at a time (as our batch joins rows), on the default target: medians of 5, ms.

    python bench/prefill_together.py [--prompts 4] [--lengths 100,200]
"""

import argparse
import sys
import time
from pathlib import Path
from statistics import median

sys.path.insert(0, str(Path(__file__).parent.parent))

import dflash_mlx  # noqa: F401  (OpenBLAS before mlx)
import mlx.core as mx
from mlx_lm.models.cache import make_prompt_cache

from dflash_mlx.api import load
from dflash_mlx.bench.harness import machine


def seconds(run, repeats: int = 5) -> float:
    times = []
    for _ in range(repeats):
        tic = time.perf_counter()
        mx.eval(run())
        times.append(time.perf_counter() - tic)
    return median(times)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--lengths", default="100,200")
    args = parser.parse_args()
    model, _ = load(None, use_draft=False)
    net, n = model.target.model, args.prompts
    print(f"Machine: {machine()}\nCommand: python {' '.join(sys.argv)}\n")
    print(f"| prompt tokens | one prompt | {n} together | {n} one at a time |")
    print("|---|---|---|---|")
    for length in (int(x) for x in args.lengths.split(",")):
        one = mx.random.randint(0, 1000, (1, length))
        many = mx.random.randint(0, 1000, (n, length))
        alone = seconds(lambda: net(one, cache=make_prompt_cache(net)))
        together = seconds(lambda: net(many, cache=make_prompt_cache(net)))
        print(f"| {length} | {1e3 * alone:.0f} ms | {1e3 * together:.0f} ms | {1e3 * n * alone:.0f} ms |", flush=True)


if __name__ == "__main__":
    main()
