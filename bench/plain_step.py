"""What one plain decoding step costs in our loop against mlx-lm's, greedy and sampled.

    python bench/plain_step.py [--prompts 3] [--tokens 64] [--rounds 2]

DFlash decodes plainly whenever drafting cannot pay, so its floor is the speed
of its own plain step.  Three decoders run interleaved on the same prompts:
  mlx-lm    generate_step (mlx-lm's sampler for sampled mode)
  ours      engine.decode without a drafter
  ours+ctx  engine.decode with the drafter at width 1 (plain steps that still
            feed the drafter the target's features, as adaptive decoding does)
Time per token = (last token time - first token time) / (tokens - 1), the same
for all three; medians over prompts and rounds, in ms.
"""

import statistics
import time

import typer

import dflash_mlx  # noqa: F401  (loads OpenBLAS before mlx)
import mlx.core as mx
from mlx_lm.generate import generate_step
from mlx_lm.sample_utils import make_sampler

from dflash_mlx import format_prompt, load
from dflash_mlx.bench.harness import SAMPLED
from dflash_mlx.bench.prompt_sets import load_prompts
from dflash_mlx.engine import decode
from dflash_mlx.model import DFlashModel
from dflash_mlx.fused_ops import unfused
from dflash_mlx.io.progress import add_task, progress
from dflash_mlx.sampling import SamplingParams


def ms_per_token(steps) -> float:
    """Consume an iterator of (tokens produced so far) and time it from the first yield."""
    first = last = None
    count = 0
    for produced in steps:
        last = time.perf_counter()
        if first is None:
            first, start_count = last, produced
        count = produced
    return 1e3 * (last - first) / max(count - start_count, 1)


def mlx_lm_steps(model: DFlashModel, prompt: mx.array, tokens: int, sampled: bool):
    sampler = make_sampler(**SAMPLED) if sampled else None
    with unfused(model.target.model):  # mlx-lm's own ops
        for n, _ in enumerate(generate_step(prompt, model.target.model, max_tokens=tokens, sampler=sampler)):
            yield n + 1


def our_steps(model: DFlashModel, prompt: mx.array, tokens: int, sampled: bool, block_size=None):
    params = SamplingParams(**SAMPLED) if sampled else SamplingParams()
    produced = 0
    for step in decode(model, prompt, params, tokens, block_size=block_size):
        produced += len(step.tokens)
        yield produced


def main(prompts: int = 3, tokens: int = 64, rounds: int = 2):
    model, tokenizer = load(adaptive=False)
    no_draft = DFlashModel(model.target)
    decoders = {
        "mlx-lm": lambda p, s: mlx_lm_steps(model, p, tokens, s),
        "ours": lambda p, s: our_steps(no_draft, p, tokens, s),
        "ours+ctx": lambda p, s: our_steps(model, p, tokens, s, block_size=1),
    }
    texts = load_prompts("gsm8k", prompts)
    encoded = [mx.array(format_prompt(tokenizer, t)) for t in texts]
    times = {(name, mode): [] for name in decoders for mode in ("greedy", "sampled")}
    with progress() as bar:
        task = add_task(bar, "plain steps", total=rounds * len(encoded) * 2 * len(decoders))
        for _ in range(rounds):
            for i, prompt in enumerate(encoded):
                for mode in ("greedy", "sampled"):
                    for name, run in decoders.items():
                        mx.random.seed(i)
                        times[name, mode].append(ms_per_token(run(prompt, mode == "sampled")))
                        bar.advance(task)
    print("| decoder | greedy ms/token | sampled ms/token | vs mlx-lm (greedy / sampled) |")
    print("|---|---|---|---|")
    base = {mode: statistics.median(times["mlx-lm", mode]) for mode in ("greedy", "sampled")}
    for name in decoders:
        g, s = (statistics.median(times[name, mode]) for mode in ("greedy", "sampled"))
        print(f"| {name} | {g:.1f} | {s:.1f} | {base['greedy'] / g:.2f}x / {base['sampled'] / s:.2f}x |")


if __name__ == "__main__":
    typer.run(main)
