"""Acceptance of the shared-noise (Gumbel) coupling against p/q rejection sampling.

sampling.py samples by the Gumbel-max trick with noise keyed by output position,
so a draft token is kept when the drafter's noisy argmax equals the target's.
Rejection sampling (accept x ~ q with probability min(1, p/q)) keeps a draft token
with probability sum_x min(p(x), q(x)), the most any exact scheme can.  This
measures both on the same drafted positions: held-out responses of a data dir,
random anchors, every block position, the target's p and the drafter's q built
by the same filters (teacher-forced contexts, so position k is measured as if
1..k-1 were accepted).

    python bench/coupling.py --data data/smollm2-135m --anchors 48 --noise 64
"""

import argparse
import random
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent.parent))

import dflash_mlx  # noqa: F401  (OpenBLAS before mlx)
import mlx.core as mx
import numpy as np

from dflash_mlx.api import load
from dflash_mlx.train.data import read_data
from dflash_mlx.sampling import SamplingParams, probabilities
from dflash_mlx.train.evaluate import split_held_out


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data", default="data/smollm2-135m")
    parser.add_argument("--draft", default=None, help="drafter dir (default: the shipped one)")
    parser.add_argument("--held-out", type=int, default=8)
    parser.add_argument("--anchors", type=int, default=48)
    parser.add_argument("--noise", type=int, default=64, help="noise draws per position for the Gumbel estimate")
    args = parser.parse_args()

    model, _ = load(None, args.draft, adaptive=False)
    target, draft = model.target, model.draft
    held_out, _ = split_held_out(read_data(args.data), args.held_out)
    rng = random.Random(0)
    B = draft.block_size
    settings = [SamplingParams(temp=1.0), SamplingParams(temp=0.7, top_p=0.95), SamplingParams(temp=0.3)]
    rejection = {p: [[] for _ in range(B - 1)] for p in settings}
    gumbel = {p: [[] for _ in range(B - 1)] for p in settings}
    per_seq = max(1, args.anchors // len(held_out))
    for example in held_out:
        tokens = example.tokens
        logits, features = target(mx.array(tokens)[None], target.make_cache(), draft.target_layer_ids)
        first, last = len(example.prompt_ids), len(tokens) - B
        for a in rng.sample(range(first, max(first + 1, last)), min(per_seq, max(1, last - first))):
            cache = draft.make_cache()
            draft.add_context(features[:, :a], cache)
            q_logits = draft(mx.array([[tokens[a]] + [draft.mask_token_id] * (B - 1)]), cache)[0]
            p_logits = logits[0, a : a + B - 1]
            for params in settings:
                p, q = probabilities(p_logits, params), probabilities(q_logits, params)
                kept = mx.minimum(p, q).sum(axis=-1)
                g = mx.random.gumbel((args.noise, 1, p.shape[-1]))
                same = (mx.argmax(mx.log(p) + g, axis=-1) == mx.argmax(mx.log(q) + g, axis=-1)).mean(axis=0)
                for k, (r, s) in enumerate(zip(np.array(kept).tolist(), np.array(same).tolist())):
                    rejection[params][k].append(r)
                    gumbel[params][k].append(s)
    print(f"{sum(len(v) for v in rejection[settings[0]][:1])} anchors, drafter {args.draft or 'shipped'}")
    print("| sampling | scheme | pos 1 | pos 2 | pos 4 | pos 8 | mean over 15 | expected tau (block 16) |")
    print("|---|---|---|---|---|---|---|---|")
    for params in settings:
        name = f"temp {params.temp}" + (f", top-p {params.top_p}" if params.top_p < 1 else "")
        for scheme, table in (("rejection (p/q)", rejection), ("shared noise (ours)", gumbel)):
            rates = [float(np.mean(v)) for v in table[params]]
            tau = 1 + sum(np.prod(rates[: k + 1]) for k in range(len(rates)))
            print(
                f"| {name} | {scheme} | {rates[0]:.3f} | {rates[1]:.3f} | {rates[3]:.3f} | {rates[7]:.3f} | "
                f"{np.mean(rates):.3f} | {tau:.2f} |"
            )


if __name__ == "__main__":
    main()
