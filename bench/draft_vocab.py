"""What a drafting vocabulary subset saves: the drafter's pass over the whole
vocabulary against the same drafter restricted to the k most frequent response
token ids of a data dir (and how many of the target's held-out greedy tokens the
subset contains, i.e. the most its drafts could ever match).

    python bench/draft_vocab.py --sizes 4096,8192 --repeats 20
"""

import argparse
import sys
import time
from collections import Counter
from pathlib import Path
from statistics import median

sys.path.insert(0, str(Path(__file__).parent.parent))

import dflash_mlx  # noqa: F401  (OpenBLAS before mlx)
import mlx.core as mx

from dflash_mlx.api import load
from dflash_mlx.train.data import read_data
from dflash_mlx.train.evaluate import split_held_out


def draft_ms(draft, cache, width: int, repeats: int) -> float:
    block = mx.full((1, width), draft.mask_token_id, dtype=mx.int32)
    times = []
    for attempt in range(repeats + 1):
        tic = time.perf_counter()
        mx.eval(draft(block, cache))
        if attempt:
            times.append(1e3 * (time.perf_counter() - tic))
    return median(times)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data", default="data/smollm2-135m")
    parser.add_argument("--draft", default=None)
    parser.add_argument("--sizes", default="4096,8192")
    parser.add_argument("--widths", default="2,4,8,16")
    parser.add_argument("--repeats", type=int, default=20)
    args = parser.parse_args()

    model, _ = load(None, args.draft, adaptive=False)
    target, draft = model.target, model.draft
    held_out, train = split_held_out(read_data(args.data), 8)
    counts = Counter(t for e in train for t in e.response_ids)
    held = [t for e in held_out for t in e.response_ids]
    features = target(mx.arange(256, dtype=mx.int32)[None], target.make_cache(), draft.target_layer_ids)[1]
    cache = draft.make_cache()
    draft.add_context(features, cache)
    widths = [int(w) for w in args.widths.split(",")]
    variants = [("whole vocabulary", None)] + [
        (f"top {k}", sorted(t for t, _ in counts.most_common(int(k)))) for k in args.sizes.split(",")
    ]
    print(
        "| drafting vocabulary | held-out greedy tokens inside | "
        + " | ".join(f"width {w} (ms)" for w in widths)
        + " |"
    )
    print("|---|---|" + "---|" * len(widths))
    for name, ids in variants:
        draft.restrict_vocab(ids)
        covered = 1.0 if ids is None else sum(t in set(ids) for t in held) / len(held)
        cells = [f"{draft_ms(draft, cache, w, args.repeats):.1f}" for w in widths]
        print(f"| {name} | {covered:.3f} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
