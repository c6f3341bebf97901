"""Where the time of one DFlash cycle goes, phase by phase, against a plain decoding step.

    python bench/profile_cycle.py [--widths 16,8,4,2] [--cycles 24] [--prompts 3]

For each fixed verify width the engine's own functions run with an mx.eval
barrier after each phase (draft, verify, accept, rollback + context injection)
and the rest of the cycle (token bookkeeping) is timed as Python overhead.
Plain = mlx-lm's generate_step, per token, same prompts.  Medians in ms.
The last column is the tau a cycle of that width needs to match plain decoding.
"""

import statistics
import time

import typer

import dflash_mlx  # noqa: F401  (loads OpenBLAS before mlx)
import mlx.core as mx
from mlx_lm.generate import generate_step

from dflash_mlx import format_prompt, load
from dflash_mlx.bench.prompt_sets import load_prompts
from dflash_mlx.engine import Context, draft, prefill, verify
from dflash_mlx.fused_ops import unfused
from dflash_mlx.io.progress import add_task, progress
from dflash_mlx.sampling import SamplingParams, accept, choose

PHASES = ("draft", "verify", "accept", "rollback", "python")


def profile_width(model, prompt: mx.array, width: int, cycles: int) -> tuple[dict[str, list[float]], list[int]]:
    params = SamplingParams()
    tcache, context = model.target.make_cache(), Context(model)
    token = choose(prefill(model, prompt, tcache, context), params, None)
    times = {phase: [] for phase in PHASES}
    committed_per_cycle = []
    for _ in range(cycles):
        marks = [time.perf_counter()]
        proposal = draft(model, token, context, width, params, None)
        mx.eval(proposal)
        marks.append(time.perf_counter())
        logits, features = verify(model, token, proposal, tcache)
        mx.eval(logits, features)
        marks.append(time.perf_counter())
        n, next_token = accept(proposal, choose(logits, params, None))
        n = n.item()
        marks.append(time.perf_counter())
        tcache.rollback(n + 1)
        context.add(features[:, : n + 1])
        mx.eval([c.state for c in context.flush()], [c.state for c in tcache.layers])
        marks.append(time.perf_counter())
        committed = proposal[:n].tolist() + [next_token.item()]
        token = next_token
        committed_per_cycle.append(len(committed))
        marks.append(time.perf_counter())
        for phase, start, stop in zip(PHASES, marks, marks[1:]):
            times[phase].append(1e3 * (stop - start))
    return times, committed_per_cycle


def plain_step_ms(model, prompt: mx.array, steps: int) -> list[float]:
    times, tic = [], None
    with unfused(model.target.model):  # mlx-lm's own ops
        for _ in generate_step(prompt, model.target.model, max_tokens=steps + 1):
            if tic is not None:
                times.append(1e3 * (time.perf_counter() - tic))
            tic = time.perf_counter()
    return times


def main(widths: str = "16,8,4,2", cycles: int = 24, prompts: int = 3):
    model, tokenizer = load(adaptive=False)
    texts = load_prompts("gsm8k", prompts)
    encoded = [mx.array(format_prompt(tokenizer, t)) for t in texts]
    widths = [int(w) for w in widths.split(",")]
    rows, plain = {w: {p: [] for p in PHASES} for w in widths}, []
    taus = {w: [] for w in widths}
    with progress() as bar:
        task = add_task(bar, "profile", total=len(encoded) * (len(widths) + 1))
        for prompt in encoded:
            plain += plain_step_ms(model, prompt, cycles)
            bar.advance(task)
            for w in widths:
                times, committed = profile_width(model, prompt, w, cycles)
                for phase in PHASES:
                    rows[w][phase] += times[phase]
                taus[w] += committed
                bar.advance(task)
    plain_ms = statistics.median(plain)
    print(f"plain mlx-lm step: {plain_ms:.1f} ms/token ({1e3 / plain_ms:.1f} tok/s)\n")
    print("| width | " + " | ".join(f"{p} ms" for p in PHASES) + " | cycle ms | tau here | tau to match plain |")
    print("|---" * (len(PHASES) + 4) + "|")
    for w in widths:
        medians = {p: statistics.median(rows[w][p]) for p in PHASES}
        cycle = sum(medians.values())
        tau = statistics.mean(taus[w])
        print(f"| {w} | " + " | ".join(f"{medians[p]:.1f}" for p in PHASES)
              + f" | {cycle:.1f} | {tau:.2f} | {cycle / plain_ms:.2f} |")


if __name__ == "__main__":
    typer.run(main)
