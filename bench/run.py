"""The benchmark harness: same as `dflash-mlx bench` (see --help).

    python bench/run.py --sets gsm8k,humaneval,mtbench --prompts-per-set 10 --max-tokens 128 \
        --modes greedy,sampled --out bench/results/smollm2
"""

import sys

import dflash_mlx  # noqa: F401  (loads OpenBLAS before mlx)
from dflash_mlx.cli import app

if __name__ == "__main__":
    sys.exit(app(["bench", *sys.argv[1:]]))
