"""Several rows drafted in one drafter pass against one pass per row (the batch's drafting),
the default pair on this machine: ms per step's drafting, medians.  Each row has its own
context (256-396 tokens of target features).

    python bench/drafter_rows.py [--widths 2,4,8] [--rows 1,2,4,8] [--repeats 25]
"""

import argparse
import sys
import time
from pathlib import Path
from statistics import median

sys.path.insert(0, str(Path(__file__).parent.parent))

import dflash_mlx  # noqa: F401  (OpenBLAS before mlx)
import mlx.core as mx

from dflash_mlx import engine
from dflash_mlx.request import Context
from dflash_mlx.api import load
from dflash_mlx.bench.harness import machine
from dflash_mlx.sampling import SamplingParams


def ms(run, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        tic = time.perf_counter()
        mx.eval(run())
        times.append(time.perf_counter() - tic)
    return 1e3 * median(times)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--widths", default="2,4,8")
    parser.add_argument("--rows", default="1,2,4,8")
    parser.add_argument("--repeats", type=int, default=25)
    args = parser.parse_args()
    rows = [int(r) for r in args.rows.split(",")]
    model, _ = load(None, adaptive=False)
    target, draft = model.target, model.draft
    contexts = []
    for i in range(max(rows)):
        context = Context(model)
        tokens = mx.array([[(100 + 7 * i + j) % target.vocab_size for j in range(256 + 20 * i)]])
        context.add(target(tokens, target.make_cache(), draft.target_layer_ids)[1])
        context.flush()
        contexts.append(context)
    greedy = SamplingParams()
    print(f"Machine: {machine()}\nCommand: python {' '.join(sys.argv)}\n")
    print("| width | rows | one pass for all rows | one pass per row | saved |")
    print("|---|---|---|---|---|")
    for width in (int(w) for w in args.widths.split(",")):
        for n in rows:
            lasts = [mx.array([7 + i]) for i in range(n)]
            together = ms(
                lambda: engine.draft_rows(model, lasts, contexts[:n], width, [greedy] * n, [None] * n), args.repeats
            )
            apart = ms(
                lambda: [
                    engine.draft_rows(model, [last], [context], width, [greedy], [None])
                    for last, context in zip(lasts, contexts[:n])
                ],
                args.repeats,
            )
            print(f"| {width} | {n} | {together:.1f} ms | {apart:.1f} ms | {apart / together:.2f}x |", flush=True)


if __name__ == "__main__":
    main()
