"""Our default decoding's gain over our own plain decoding: the figure that transfers to a Mac,
since both sides run the same loop, caches and ops.  By default the default pair (SmolLM2-135M +
the shipped drafter, as `load` loads them) on its held-out chat prompts; `--model` another model
(one without a drafter is served by copies alone: the prompt lookup), `--sets` prompts from the
benchmark's sets (dflash_mlx/bench/prompt_sets.py: `copy` answers repeat their prompt, the
others are ordinary), wrapped in the chat template unless `--raw` (a base model continues text).

    nice -n 5 python bench/plain_gain.py [--prompts 8] [--max-tokens 96]
    nice -n 5 python bench/plain_gain.py --model gemma-3-270m --sets copy,humaneval,chat --prompts 4 --raw

Each prompt is decoded greedily by ours at width 1 (plain) and by ours in its default mode
(adaptive widths; copies from earlier answers off, each prompt a first request), the two taking
turns of 8 tokens (dflash_mlx/bench/turns.py: each timed by its own clock, stopped during the
other's turns, from its first token on; which starts alternates from prompt to prompt), so a
slower stretch of the machine falls on both; every output is checked equal to the plain one.
Prints the per-prompt speeds, the median gain and the lowest, per set.  `--plain-twice` runs
plain against plain the same way: the spread of a ratio that is 1, this machine's noise.

With a drafter, then the cost curve (decode/costs.py: target passes of each width on a 256-token
cache and the drafter's pass, each timed alone, round-robin) and, per prompt, the verify-bound
gain: what it would gain if each of its cycles cost only its target pass and its drafter pass as
timed alone, and a plain token one 1-token pass.  The verify-bound gain's distance from tau is
what the verify costs on this machine; the measured gain's distance from it is what the loop's
host work (and what the curve does not model) leaves.  Last, each kind of cycle (plain, drafted,
copied; by width) with its median wall time beside the curve's charge for it: the loop's own
work per kind of cycle.
"""

import argparse
import sys
from copy import deepcopy
from dataclasses import replace
from datetime import date
from pathlib import Path
from statistics import median

sys.path.insert(0, str(Path(__file__).parent.parent))

import dflash_mlx  # noqa: F401  (OpenBLAS before mlx)

from dflash_mlx.api import format_prompt, load
from dflash_mlx.bench.harness import machine
from dflash_mlx.bench.prompt_sets import load_prompts
from dflash_mlx.bench.replay import cycle_class
from dflash_mlx.bench.turns import Turns, decode_in_turns
from dflash_mlx.decode.costs import CostModel, measure_costs
from dflash_mlx.decode.learning import Learning, keep, kept, without_answers
from dflash_mlx.decode.model import DecodeStats
from dflash_mlx.decode.plan import is_copy
from dflash_mlx.kernels.metal import chip_name
from dflash_mlx.train.data import read_data

HELD_OUT = Path(__file__).parents[1] / "data" / "smollm2-135m"


def verify_bound(cost: CostModel, stats: DecodeStats) -> float:
    """The gain over plain decoding if every cycle cost its target pass and drafter pass as the
    curve times them alone (a plain token: one 1-token pass)."""
    seconds = sum(curve_charge(cost, width, drafter) for width, drafter in zip(stats.widths, stats.drafter_widths))
    return sum(stats.accepted_lengths) * cost.verify(1) / seconds


def curve_charge(cost: CostModel, width: int, drafter_width: int) -> float:
    """What the curve charges a greedy cycle: its target pass, and its drafter's pass at the width
    it drafted at (wider than the verify where a cut narrowed it; 1: none)."""
    return cost.verify(width) + (cost.drafter_pass(drafter_width) if drafter_width > 1 else 0.0)


def prompts_of(args, tokenizer) -> list[tuple[str, list[int]]]:
    """(set, token ids) of each prompt: the last `--prompts` held-out chat prompts, or `--prompts`
    of each set, spread over it (the copy set's kinds follow one another)."""
    if not args.sets:
        return [("held-out", e.prompt_ids) for e in read_data(HELD_OUT)[-args.prompts :]]
    chosen = []
    for name in args.sets.split(","):
        texts = load_prompts(name)
        for text in texts[:: max(1, len(texts) // args.prompts)][: args.prompts]:
            chosen.append((name, format_prompt(tokenizer, text, chat_template=not args.raw)))
    return chosen


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="a short name, repo or dir (default: the default pair)")
    parser.add_argument("--sets", default="", help="comma-separated prompt sets (default: the held-out chat prompts)")
    parser.add_argument("--prompts", type=int, default=8, help="prompts (of each set)")
    parser.add_argument("--max-tokens", type=int, default=96)
    parser.add_argument("--raw", action="store_true", help="the sets' prompts without the chat template")
    parser.add_argument("--plain-twice", action="store_true", help="plain against plain: the machine's noise")
    parser.add_argument("--repeats", type=int, default=1, help="per prompt, the median gain of this many")
    args = parser.parse_args()
    model, tokenizer = load(args.model)
    model = without_answers(model)  # each prompt as a first request
    prompts = prompts_of(args, tokenizer)
    ours_block = 1 if args.plain_twice else None
    plain_model = learning_apart(model)
    decode_in_turns([(plain_model, 1), (model, None)], prompts[0][1][:64], 8)  # first calls' set-up, not timed
    ours = "plain again" if args.plain_twice else "DFlash" if model.draft is not None else "copies"
    print(f"{machine()}, {chip_name()}, {date.today()}; `{' '.join(['python', *sys.argv])}`\n")
    print(f"| set | prompt | plain tok/s | {ours} tok/s | gain | tau | copy cycles | same output |")
    print("|---|---|---|---|---|---|---|---|")
    gains: dict[str, list[float]] = {}
    measured = []  # (gain, statistics) of each prompt
    for i, (name, prompt) in enumerate(prompts):
        plain, mine = measure((plain_model, model), prompt, args.max_tokens, ours_block, args.repeats, first=i % 2)
        gain, stats = mine.tokens_per_second / plain.tokens_per_second, mine.stats
        gains.setdefault(name, []).append(gain)
        measured.append((gain, stats))
        copies = sum(is_copy(source) for source in stats.sources)
        print(
            f"| {name} | {i} | {plain.tokens_per_second:.1f} | {mine.tokens_per_second:.1f} | {gain:.2f}x | "
            f"{stats.tau:.2f} | {copies} of {stats.cycles} | {mine.tokens == plain.tokens} |"
        )
    print()
    for name, values in [*gains.items(), ("all", [g for values in gains.values() for g in values])]:
        print(f"{name}: median gain {median(values):.2f}x, lowest {min(values):.2f}x over {len(values)} prompts")
    if model.draft is not None and not args.plain_twice:
        print_verify_bound(model, measured)


def learning_apart(model):
    """`model` again, with a planner of its own: plain decoding's steps, timed beside ours, are
    not what ours learns its step times from (a user's plain steps would be its own)."""
    apart = replace(model)
    keep(apart, Learning(deepcopy(kept(model).planner)))
    return apart


def measure(models, prompt: list[int], max_tokens: int, ours_block, repeats: int, first: int) -> tuple[Turns, Turns]:
    """Plain's and ours' decodings of `prompt` (by `models`' first and second) in turns,
    `repeats` times, each time from the planner the earlier prompts left (what a repeat learns
    is not carried into the next): the pair whose gain is the median (the last repeat's learning
    carries on to the next prompt)."""
    plain_model, model = models
    learnt = deepcopy(kept(model).planner)
    pairs = []
    for repeat in range(repeats):
        if repeat:
            keep(model, Learning(deepcopy(learnt)))
        decodings = [(plain_model, 1), (model, ours_block)]
        pairs.append(decode_in_turns(decodings, prompt, max_tokens, first=(first + repeat) % 2))
    if any(mine.tokens != plain.tokens for plain, mine in pairs):
        return next((plain, mine) for plain, mine in pairs if mine.tokens != plain.tokens)  # shown as not the same
    return sorted(pairs, key=lambda pair: pair[1].tokens_per_second / pair[0].tokens_per_second)[(repeats - 1) // 2]


def print_verify_bound(model, measured: list) -> None:
    """The cost curve, and each prompt's verify-bound gain beside its measured one."""
    cost = measure_costs(model.target, model.draft, context=256)
    print(f"\nthe cost curve: {cost.describe()}\n")
    print("| prompt | tau | verify-bound gain | measured gain | measured / verify-bound |\n|---|---|---|---|---|")
    shares = []
    for i, (gain, stats) in enumerate(measured):
        bound = verify_bound(cost, stats)
        shares.append(gain / bound)
        print(f"| {i} | {stats.tau:.2f} | {bound:.2f}x | {gain:.2f}x | {shares[-1]:.2f} |")
    bounds = [verify_bound(cost, stats) for _, stats in measured]
    print(f"\nmedian verify-bound gain {median(bounds):.2f}x; measured / verify-bound {median(shares):.2f} (median)")
    print_step_costs(cost, [stats for _, stats in measured])


def print_step_costs(cost: CostModel, measured: list[DecodeStats]) -> None:
    """Each kind of cycle's wall time (median over every prompt's cycles of that kind) beside what
    the curve charges it (`curve_charge`: its target pass and, drafted, the drafter's pass at the
    width it drafted at).  What lies beyond the curve is the loop's own work (a plain step queued
    behind the one before runs beside it: it can take less)."""
    kinds: dict[tuple[str, str], list[tuple[float, float]]] = {}
    for stats in measured:
        cycles = zip(stats.widths, stats.drafter_widths, stats.sources, stats.cycle_seconds)
        for width, drafter_width, source, seconds in cycles:
            kinds.setdefault(cycle_class(source, width), []).append((seconds, curve_charge(cost, width, drafter_width)))
    print("\n| cycle | widths | cycles | ms a cycle (median) | the curve's | beyond it |\n|---|---|---|---|---|---|")
    for (proposer, widths), cycles in sorted(kinds.items()):
        wall, curve = median(s for s, _ in cycles), median(c for _, c in cycles)
        print(
            f"| {proposer} | {widths} | {len(cycles)} | {1e3 * wall:.1f} | {1e3 * curve:.1f} | {1e3 * (wall - curve):+.1f} |"
        )


if __name__ == "__main__":
    main()
