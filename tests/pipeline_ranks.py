"""Run under `mlx.launch` by test_distributed.py: a tiny target split over the ranks.

    pipeline_ranks.py MODEL_TYPE SPLIT lossless   greedy DFlash (several block sizes) and plain
                                                  decoding equal one process's plain greedy output
    pipeline_ranks.py MODEL_TYPE SPLIT kill|stall the last rank dies (SIGKILL) or goes silent
                                                  mid-generation; rank 0 must end with one line
Rank 0 prints one "ok ..." line per check; any failure raises.
"""

import os
import re
import signal
import sys
import time

sys.path.insert(0, os.path.dirname(__file__))

import dflash_mlx  # noqa: F401  (BLAS before mlx)
import mlx.core as mx
from mlx.utils import tree_flatten
from mlx_lm.generate import generate_step

from dflash_mlx.distributed import DistributedError
from dflash_mlx.distributed.pipeline import PipelineTarget
from dflash_mlx.decode.decoder import decode
from dflash_mlx.decode.request import Request
from dflash_mlx.decode.model import DecodeStats, DFlashModel
from dflash_mlx.sampling import SamplingParams
from dflash_mlx.target.wrapper import Target
from tiny_models import random_draft, tiny_model

PROMPT = [1, 5, 9, 13, 2, 7, 40, 3, 60, 61]
MAX_TOKENS = 40


def layers_held(target) -> int:
    """Decoder layers with weights in this rank's model."""
    names = [k for k, _ in tree_flatten(target.model.parameters())]
    return len({m.group(1) for k in names if (m := re.search(r"layers\.(\d+)\.", k))})


def generate(target, draft, block_size):
    out = []
    for step in decode(
        DFlashModel(target, draft),
        Request(list(PROMPT), MAX_TOKENS, SamplingParams(), block_size=block_size),
        stats=DecodeStats(),
    ):
        out += step.tokens
    return out


def stop_after(forward, passes: int, mode: str):
    """This rank's target passes; after `passes` of them it dies or goes silent."""
    done = []

    def wrapped(*args):
        if len(done) == passes:
            if mode == "kill":
                os.kill(os.getpid(), signal.SIGKILL)
            time.sleep(600)  # alive, but never answers again
        done.append(1)
        return forward(*args)

    return wrapped


def main():
    model_type, split, mode = sys.argv[1], [int(n) for n in sys.argv[2].split(",")], sys.argv[3]
    group = mx.distributed.init(strict=True)
    target = PipelineTarget(tiny_model(model_type, seed=2), group, split, timeout=30.0 if mode == "lossless" else 5.0)
    assert layers_held(target) == target.end - target.start == split[target.rank]
    assert [i for i, layer in enumerate(target.layers) if layer is not None] == list(range(target.start, target.end))
    if not target.is_driver:
        if mode != "lossless" and target.rank == group.size() - 1:
            target._forward = stop_after(target._forward, 6, mode)
        target.follow()
        return
    whole = Target(tiny_model(model_type, seed=2))
    draft = random_draft(whole, block_size=16, layer_ids=(0, 2)).bind(target)
    if mode != "lossless":
        try:
            generate(target, draft, 4)
        except DistributedError as e:
            print(f"error: {e}", flush=True)
            sys.exit(1)
        raise AssertionError("generation went on without the last rank")
    expected = [int(t) for t, _ in generate_step(mx.array(PROMPT), whole.model, max_tokens=MAX_TOKENS)]
    for block_size in (None, 2, 3, 7, 16):
        got = generate(target, draft if block_size else None, block_size)
        assert got == expected, (block_size, got, expected)
        print(f"ok {model_type} split {split} block {block_size or 'plain'}", flush=True)
    ranks = target.finish()
    assert all(r.passes > 0 and r.bytes_sent > 0 for r in ranks) and len(ranks) == group.size()
    print(f"ok figures from {len(ranks)} ranks", flush=True)


if __name__ == "__main__":
    main()
