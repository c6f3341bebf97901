"""Drafter d8's learning curves: held-out tau (block 16, the 8 held-out prompts) against target
tokens seen since d7, for the two recipes compared at an equal budget from the same weights.

    python bench/d8_curve.py --out docs/train-logs/tau_curve_smollm2_d8.png

The first 150 steps (d7 -> step 150, seed 1) were one run whose log was lost with its machine:
their taus are the ones that session wrote down, at 1,975 tokens per step (the warm restarts'
mean: 4 responses + 4 text windows a step).  Both restarts start from the step-150 weights.
"""

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent.parent))

from dflash_mlx.bench.plots import held_out_taus, tau_curves  # noqa: E402

LOGS = Path(__file__).parent.parent / "docs" / "train-logs"
TOKENS_PER_STEP = 1975
FIRST_RUN = [(0, 1.77), (50, 1.76), (100, 1.77), (150, 1.82)]  # (steps since d7, held-out tau)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default=str(LOGS / "tau_curve_smollm2_d8.png"))
    args = parser.parse_args()
    first = [(step * TOKENS_PER_STEP, tau) for step, tau in FIRST_RUN]
    start = first[-1][0]
    curves = {
        "d7 -> step 150 (full blocks, seed 1)": first,
        "then full blocks": first[-1:] + held_out_taus(LOGS / "train_log_smollm2_d8_full_blocks.jsonl", start),
        "then --block-widths 2,3,4,16": first[-1:] + held_out_taus(LOGS / "train_log_smollm2_d8_widths.jsonl", start),
    }
    for label, points in curves.items():
        print(f"{label}: " + ", ".join(f"{tokens:,} -> {tau:.2f}" for tokens, tau in points))
    print(tau_curves(curves, args.out, "d8: held-out tau at block 16 (8 prompts, greedy)"))


if __name__ == "__main__":
    main()
