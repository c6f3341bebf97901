"""One drafter pass, ms per block width: a quantized drafter (default: the shipped 8-bit one)
packed (MLX's quantized matmul) and expanded to float32 on loading (what `load` does on
the CPU). 256 context tokens, medians.

    python bench/drafter_pass.py [--draft DIR] [--widths 4,16] [--repeats 15]
"""

import argparse
import sys
import time
from pathlib import Path
from statistics import median

sys.path.insert(0, str(Path(__file__).parent.parent))

import dflash_mlx  # noqa: F401  (OpenBLAS before mlx)
import mlx.core as mx
import mlx_lm

from dflash_mlx.drafters import load_draft
from dflash_mlx.convert.smollm2 import smollm2_path
from dflash_mlx.registry import DEFAULT_DRAFT
from dflash_mlx.target import Target


def pass_ms(draft, target, width: int, repeats: int) -> float:
    features = target(mx.array([list(range(100, 356))]), target.make_cache(), draft.target_layer_ids)[1]
    cache = draft.make_cache()
    draft.add_context(features, cache)
    block = mx.array([[7] + [draft.mask_token_id] * (width - 1)])
    times = []
    for _ in range(repeats):
        tic = time.perf_counter()
        mx.eval(draft(block, cache))
        times.append(time.perf_counter() - tic)
    return 1e3 * median(times)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--draft", default=str(DEFAULT_DRAFT), help="a quantized drafter dir")
    parser.add_argument("--widths", default="4,16")
    parser.add_argument("--repeats", type=int, default=15)
    args = parser.parse_args()
    widths = [int(w) for w in args.widths.split(",")]
    target = Target(mlx_lm.load(str(smollm2_path()))[0])
    print("| drafter | " + " | ".join(f"width {w}" for w in widths) + " |")
    print("|---" * (1 + len(widths)) + "|")
    for name, dequantize in (("packed", False), ("expanded to float32", True)):
        draft = load_draft(args.draft, dtype=mx.float32, dequantize=dequantize).bind(target)
        print(f"| {name} | " + " | ".join(f"{pass_ms(draft, target, w, args.repeats):.1f} ms" for w in widths) + " |")


if __name__ == "__main__":
    main()
