"""What a decode step or a DFlash cycle costs beyond its layers: our loop against mlx-lm's
`generate_step` on a tiny target whose compute is negligible (a 6-layer qwen3, hidden 64, with
a 2-layer drafter, random weights), so what is measured is the host's work per step (Python,
graph building, evaluations, small ops), which a Mac pays as this CPU does.

    nice -n 5 python bench/loop_overhead.py            # contexts 128 / 2k / 8k, 8 runs of 48 tokens
    nice -n 5 python bench/loop_overhead.py --quick    # contexts 128 / 2k, 8 runs of 16 tokens (~2 min quiet)

Milliseconds per plain step (mlx-lm; ours at width 1) or per DFlash cycle (ours at fixed
widths 4 / 8 / 16, `adaptive` off: no planner): the median of every step after the first
token over all runs (on a loaded machine a burst of other work then moves few of them), and
the lower quartile of them (the least disturbed); the decoders run interleaved (each repeat
runs every decoder at every context once), all on the same weights and prompt.
A random drafter's tokens are all rejected, so every cycle commits one token and the same
positions are decoded by every decoder; every timed cycle runs at its full width (a request's
last cycles are cut to the tokens left, so ours ask for a block more than is timed).  Then one
cycle at blocks 4 and 16 broken into its phases (decode/phases.py: each phase's work evaluated
before its timer stops), the number of evaluations a cycle asks for, and the ops (graph nodes,
`mx.export_to_dot`) of a cycle's two passes: each op is built in Python and scheduled, whatever
its size.
"""

import argparse
import sys
import tempfile
import time
from datetime import date
from itertools import islice, product
from pathlib import Path
from statistics import quantiles

sys.path.insert(0, str(Path(__file__).parent.parent))

import dflash_mlx  # noqa: F401  (OpenBLAS before mlx)
import mlx.core as mx
from mlx.utils import tree_map
from mlx_lm.generate import generate_step
from mlx_lm.models import qwen3

from dflash_mlx.bench.harness import machine
from dflash_mlx.decode.decoder import decode
from dflash_mlx.decode.model import DFlashModel
from dflash_mlx.decode.phases import PHASES
from dflash_mlx.decode.request import Request
from dflash_mlx.drafters import DFlashDraftModel, DraftArgs
from dflash_mlx.kernels.fused_ops import fuse
from dflash_mlx.kernels.metal import chip_name
from dflash_mlx.sampling import SamplingParams
from dflash_mlx.target.wrapper import Target

VOCAB, HIDDEN, LAYERS, DRAFT_LAYERS, BLOCK = 512, 64, 6, 2, 16
CONFIG = dict(
    model_type="qwen3",
    hidden_size=HIDDEN,
    num_hidden_layers=LAYERS,
    intermediate_size=128,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    rms_norm_eps=1e-6,
    vocab_size=VOCAB,
    rope_theta=10000.0,
    tie_word_embeddings=True,
    max_position_embeddings=32768,
)


def tiny_qwen3(seed: int = 0) -> qwen3.Model:
    mx.random.seed(seed)
    model = qwen3.Model(qwen3.ModelArgs.from_dict(CONFIG))
    model.update(tree_map(lambda p: p * 3.0 if p.ndim >= 2 else p, model.parameters()))
    mx.eval(model.parameters())
    return model


def tiny_drafter(target: Target) -> DFlashDraftModel:
    mx.random.seed(1)
    args = DraftArgs(
        hidden_size=HIDDEN,
        num_hidden_layers=DRAFT_LAYERS,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        intermediate_size=128,
        vocab_size=VOCAB,
        target_layer_ids=[1, 4],
        mask_token_id=VOCAB - 1,
        block_size=BLOCK,
        num_target_layers=LAYERS,
        rms_norm_eps=1e-6,
        rope_theta=10000.0,
    )
    draft = DFlashDraftModel(args)
    mx.eval(draft.parameters())
    return fuse(draft.bind(target))  # as `load` runs it


def intervals(steps, count: int) -> list[tuple[float, float]]:
    """(wall, host) seconds between consecutive items of `steps` after its first (a step or a
    cycle each), `count` of them.  Host seconds are this thread's CPU time: Python, graph
    building and scheduling, which a Mac pays too; MLX computes the kernels on its own thread,
    and this one sleeps while it waits for them."""
    next(steps)
    times = [(time.perf_counter(), time.thread_time())]
    for _ in islice(steps, count):
        times.append((time.perf_counter(), time.thread_time()))
    return [(b[0] - a[0], b[1] - a[1]) for a, b in zip(times, times[1:])]


def mlx_lm_step(model, prompt: mx.array, tokens: int) -> list[tuple[float, float]]:
    """(wall, host) seconds of each of mlx-lm's generate_step steps after its first token."""
    return intervals(generate_step(prompt, model, max_tokens=tokens, prefill_step_size=512), tokens)


def full_width(model: DFlashModel, prompt: mx.array, tokens: int, width: int):
    """A request's steps whose first `tokens` cycles all run at `width`: it asks for `width`
    tokens more (a cycle is cut to the tokens left: the last ones of a request are narrower)."""
    return decode(model, Request(prompt.tolist(), tokens + width, block_size=width))


def our_cycle(model: DFlashModel, prompt: mx.array, tokens: int, width: int) -> list[tuple[float, float]]:
    """(wall, host) seconds of each of our cycles at a fixed width (1: plain steps) after the first token."""
    steps = full_width(model, prompt, tokens, width)
    try:
        return intervals(steps, tokens)
    finally:
        steps.close()


def breakdown(model: DFlashModel, prompt: mx.array, tokens: int, width: int) -> tuple[dict, float, int]:
    """Milliseconds per cycle in each phase, the cycle's total with the timers on, and the
    evaluations the loop asks for per cycle."""
    steps = full_width(model, prompt, tokens, width)
    next(steps)
    with PHASES.timing() as phases:
        tic = time.perf_counter()
        cycles = sum(1 for _ in islice(steps, tokens))
        total = time.perf_counter() - tic
    steps.close()
    return {k: 1e3 * v / cycles for k, v in phases.seconds.items()}, 1e3 * total / cycles, phases.evaluations / cycles


def graph_ops(*arrays) -> int:
    """Ops in the graph evaluating `arrays` would run (the rectangles of mx.export_to_dot)."""
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "graph.dot"
        mx.export_to_dot(str(path), *arrays)
        return path.read_text().count("shape=rectangle")


def pass_ops(model: DFlashModel, prompt: mx.array, width: int) -> tuple[int, int]:
    """Ops of a cycle's drafter pass (as the loop runs it: one committed position's features
    injected on the way) and of its target pass (logits and features), after `prompt`."""
    cache, dcache = model.target.make_cache(), model.draft.make_cache()
    _, features = model.target(prompt[None], cache, model.feature_layers)
    model.draft.add_context(features[:, :-1], dcache)
    mx.eval(features, [c.state for c in dcache])
    block = mx.array([[0] + [model.draft.mask_token_id] * (width - 1)])
    drafted = model.draft.drafts(block, [dcache], [SamplingParams()], [None], [features[:, -1:]]).tokens
    draft_ops = graph_ops(drafted)
    mx.eval(drafted)
    cache.checkpoint()
    mx.eval(model.target(block, cache, model.feature_layers))  # the caches grown as they are mid-decode
    cache.rollback(1)
    return draft_ops, graph_ops(*model.target(block, cache, model.feature_layers))


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="contexts 128 and 2k, 8 runs of 16 tokens")
    parser.add_argument("--contexts", default=None, help="comma-separated prompt lengths (default 128,2048,8192)")
    parser.add_argument("--repeats", type=int, default=None)
    parser.add_argument("--tokens", type=int, default=None)
    args = parser.parse_args()
    contexts = [int(c) for c in (args.contexts or ("128,2048" if args.quick else "128,2048,8192")).split(",")]
    repeats = args.repeats or 8
    tokens = args.tokens or (16 if args.quick else 48)
    widths = [1, 4, 8, 16]

    stock = tiny_qwen3()
    target = Target(tiny_qwen3())
    ours = DFlashModel(target, tiny_drafter(target))
    prompts = {c: mx.random.randint(0, VOCAB - 1, (c,)) for c in contexts}
    decoders = {"mlx-lm": lambda p: mlx_lm_step(stock, p, tokens)}
    for w in widths:
        decoders[f"ours {w}"] = lambda p, w=w: our_cycle(ours, p, tokens, w)
    warm = prompts[contexts[0]]
    for run in decoders.values():
        run(warm)
    times = {(c, d): [] for c in contexts for d in decoders}
    names = list(decoders)
    for r in range(repeats):
        for c in contexts:
            for d in names[r % len(names) :] + names[: r % len(names)]:
                times[c, d] += decoders[d](prompts[c])

    print(f"\n{machine()}, {chip_name()}, {date.today()}; `{' '.join(['python', *sys.argv])}`")
    clocks = (("ms", 0, "wall-clock"), ("host ms", 1, "the main thread's CPU time (host work)"))
    for (unit, clock, clock_name), (name, q) in product(clocks, (("median", 2), ("lower quartile", 1))):
        ms = {key: 1e3 * quantiles([t[clock] for t in values], n=4)[q - 1] for key, values in times.items()}
        print(
            f"\n{unit} per plain step or DFlash cycle, {clock_name}, {name} of the steps of {repeats}"
            f" interleaved runs of {tokens} tokens\n"
        )
        print(
            "| context | mlx-lm plain step | ours plain step | cycle, block 4 | block 8 | block 16 | 4 / plain | 16 / plain |"
        )
        print("|---|---|---|---|---|---|---|---|")
        for c in contexts:
            plain = ms[c, "ours 1"]
            print(
                f"| {c:,} | "
                + " | ".join(f"{ms[c, d]:.2f}" for d in names)
                + f" | {ms[c, 'ours 4'] / plain:.2f}x | {ms[c, 'ours 16'] / plain:.2f}x |"
            )

    print(
        "\nOne cycle by phase, ms, the least disturbed of 3 runs (timers on: each phase's work evaluated before its timer stops)\n"
    )
    rows = {  # the least disturbed of three runs
        (c, w): min((breakdown(ours, prompts[c], tokens, w) for _ in range(3)), key=lambda run: run[1])
        for c in contexts
        for w in (4, BLOCK)
    }
    phases = sorted({k for parts, _, _ in rows.values() for k in parts}, key=list(PHASE_ORDER).index)
    print("| context | block | " + " | ".join(phases) + " | total | evaluations / cycle |")
    print("|---" * (len(phases) + 4) + "|")
    for (c, w), (parts, total, evaluations) in rows.items():
        print(
            f"| {c:,} | {w} | "
            + " | ".join(f"{parts.get(k, 0.0):.2f}" for k in phases)
            + f" | {total:.2f} | {evaluations:.2f} |"
        )

    print("\nOps a cycle builds (graph nodes), by pass\n")
    print("| context | block | drafter pass | target pass |")
    print("|---|---|---|---|")
    for c in contexts:
        for w in (4, BLOCK):
            print(f"| {c:,} | {w} | " + " | ".join(str(n) for n in pass_ops(ours, prompts[c], w)) + " |")


PHASE_ORDER = ("plan", "draft", "verify build", "evaluate", "accept", "roll back", "record")

if __name__ == "__main__":
    main()
