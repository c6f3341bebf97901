"""The planner replayed offline (dflash_mlx/bench/replay.py): record what the default pair's
drafter drafts at every position and width of each held-out chat prompt's greedy answer, then
replay the planner against it, on the measured cost curve, over several seeds of timing noise.

    nice -n 5 python bench/plan_replay.py record [--prompts 8] [--max-tokens 96] [--out FILE]
    python bench/plan_replay.py replay [--table FILE] [--seeds 8] [--noise 0.1]

`record` decodes each prompt plain, then drafts at every width after every committed token
(~5 minutes for 8 prompts on the 2-core VM) and writes the table with the cost curve the planner
uses (`load`'s, cached per machine).  `replay` needs no model: per prompt, the median gain over
the seeds (plain's time over the planner's, both by the curve, without noise), its tau, and what
drafting alone could gain (the best fixed width; the best width at every step knowing the
outcome, a bound no planner reaches); then how well the planner's acceptance estimates foretold
what its wider steps committed.  The replay leaves out the loop's host work and the machine's
drift, which `bench/plain_gain.py` measures.
"""

import argparse
import json
import sys
from dataclasses import asdict
from pathlib import Path
from statistics import median

sys.path.insert(0, str(Path(__file__).parent.parent))

import dflash_mlx  # noqa: F401  (OpenBLAS before mlx)

from dflash_mlx.bench.replay import Recorded, Replay, bounds, calibration
from dflash_mlx.decode.costs import CostModel

HELD_OUT = Path(__file__).parents[1] / "data" / "smollm2-135m"
TABLE = Path("runs") / "plan_replay.json"


def record(args) -> None:
    import mlx.core as mx
    from rich.progress import track

    from dflash_mlx.api import load
    from dflash_mlx.decode.decoder import decode
    from dflash_mlx.decode.learning import kept, without_answers
    from dflash_mlx.decode.request import Request
    from dflash_mlx.sampling import SamplingParams
    from dflash_mlx.train.data import read_data

    model, _ = load(None)
    model = without_answers(model)
    draft, block = model.draft, model.draft.block_size
    prompts = [e.prompt_ids for e in read_data(HELD_OUT)[-args.prompts :]]
    recorded = []
    for prompt in track(prompts, description="recording"):
        answer = [
            t for step in decode(model, Request(prompt, args.max_tokens + block, block_size=1)) for t in step.tokens
        ]
        _, features = model.target(mx.array([prompt + answer]), model.target.make_cache(), model.feature_layers)
        mx.eval(features)
        context = draft.make_cache()
        draft.add_context(features[:, : len(prompt)], context)
        agreed, confidence = [], []
        for c in range(1, args.max_tokens + 1):  # c tokens committed, the c-th the last
            if c > 1:
                draft.add_context(features[:, len(prompt) + c - 2 : len(prompt) + c - 1], context)
            at, sure = {}, {}
            for width in range(2, block + 1):
                tokens = mx.array([[answer[c - 1]] + [draft.mask_token_id] * (width - 1)], dtype=mx.int32)
                drafts = draft.drafts(tokens, [context], [SamplingParams()], [None])
                drafted = drafts.tokens[0].tolist()
                n = 0
                while n < len(drafted) and c + n < len(answer) and drafted[n] == answer[c + n]:
                    n += 1
                at[width], sure[width] = n, [round(p, 4) for p in drafts.confidence[0].tolist()]
            agreed.append(at)
            confidence.append(sure)
        recorded.append({"prompt": prompt, "answer": answer, "agreed": agreed, "confidence": confidence})
    table = {
        "tokens": args.max_tokens,
        "block": block,
        "ends": sorted(model.end_tokens),
        "cost": asdict(kept(model).planner.cost),
        "prompts": recorded,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(table))
    print(f"wrote {args.out}: {len(recorded)} prompts, {args.max_tokens} tokens each, widths 2-{block}")


def replay(args) -> None:
    table = json.loads(args.table.read_text())
    cost, tokens, block = CostModel(**table["cost"]), table["tokens"], table["block"]
    prompts = [
        Recorded(
            p["prompt"],
            p["answer"],
            [{int(w): n for w, n in at.items()} for at in p["agreed"]],
            [{int(w): sure for w, sure in at.items()} for at in p["confidence"]],
        )
        for p in table["prompts"]
    ]
    runs = []
    for seed in range(args.seeds):
        session = Replay(cost, frozenset(table["ends"]), block, tokens, seed, args.noise)
        runs.append([session.prompt(p) for p in prompts])
    print(f"the cost curve: {cost.describe()}; {args.seeds} seeds, timing noise {args.noise}\n")
    print("| prompt | gain (median of seeds) | lowest | tau | best fixed width | knowing every outcome |")
    print("|---|---|---|---|---|---|")
    gains = []
    for i, recorded in enumerate(prompts):
        mine = [run[i] for run in runs]
        gains.append(median(r.gain for r in mine))
        width, fixed, clairvoyant = bounds(recorded, cost, block, tokens)
        print(
            f"| {i} | {gains[-1]:.2f}x | {min(r.gain for r in mine):.2f}x | {median(r.tau for r in mine):.2f} "
            f"| {fixed:.2f}x at {width} | {clairvoyant:.2f}x |"
        )
    per_seed = [median(r.gain for r in run) for run in runs]
    print(
        f"\nmedian gain over the prompts {median(gains):.2f}x; per seed {min(per_seed):.2f}-{max(per_seed):.2f}x; "
        f"lowest of any prompt and seed {min(r.gain for run in runs for r in run):.2f}x\n"
    )
    print("| proposer | width | steps | tokens expected a step | committed |\n|---|---|---|---|---|")
    for (source, widths), (steps, expected, committed) in calibration([r for run in runs for r in run]).items():
        print(f"| {source} | {widths} | {steps} | {expected:.2f} | {committed:.2f} |")


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    commands = parser.add_subparsers(dest="command", required=True)
    recording = commands.add_parser("record", help="record the held-out prompts' drafts (needs the default pair)")
    recording.add_argument("--prompts", type=int, default=8)
    recording.add_argument("--max-tokens", type=int, default=96)
    recording.add_argument("--out", type=Path, default=TABLE)
    replaying = commands.add_parser("replay", help="replay the planner against a recording")
    replaying.add_argument("--table", type=Path, default=TABLE)
    replaying.add_argument("--seeds", type=int, default=8)
    replaying.add_argument("--noise", type=float, default=0.1)
    args = parser.parse_args()
    if args.command == "replay" and not args.table.is_file():
        parser.error(f"no recording at {args.table}: make one with `python bench/plan_replay.py record`")
    if args.command == "replay" and "confidence" not in json.loads(args.table.read_text())["prompts"][0]:
        parser.error(
            f"{args.table} holds no drafts' confidences: make it again with `python bench/plan_replay.py record`"
        )
    if args.command == "record":
        record(args)
    else:
        replay(args)


if __name__ == "__main__":
    main()
