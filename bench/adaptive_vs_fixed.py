"""The adaptive plan against every fixed width, per prompt, in one interleaved run.

    python bench/adaptive_vs_fixed.py [--sets gsm8k,humaneval,mtbench,copy] [-n 4] [--widths 2,3,4,8]
                                      [--max-tokens 128] [--out bench/results/adaptive-vs-fixed.md]

For each prompt: plain mlx-lm, the adaptive plan (drafter + prompt lookup), and the drafter at
each fixed width, in a rotating order, greedy, timed the same way (`dflash-mlx bench`'s harness).
Reports per prompt the speedup of each over mlx-lm, the best fixed width in hindsight, and the
adaptive plan's ratio to it; medians per set.
"""

import statistics
from pathlib import Path

import typer

import dflash_mlx  # noqa: F401  (loads OpenBLAS before mlx)
from dflash_mlx import format_prompt, load
from dflash_mlx.bench.harness import _dflash, _plain, machine
from dflash_mlx.bench.prompt_sets import load_prompts
from dflash_mlx.io.progress import add_task, progress


def main(
    sets: str = "gsm8k,humaneval,mtbench,copy",
    n: int = typer.Option(4, "-n"),
    widths: str = "2,3,4,8",
    max_tokens: int = 128,
    out: str = "bench/results/adaptive-vs-fixed.md",
):
    model, tokenizer = load()
    fixed = [int(w) for w in widths.split(",")]
    names = ["plain", "adaptive"] + [f"w{w}" for w in fixed]
    rows = []
    prompts = [(name, i, text) for name in sets.split(",") for i, text in enumerate(load_prompts(name, n))]
    with progress() as bar:
        task = add_task(bar, "adaptive vs fixed", total=len(prompts))
        warm = format_prompt(tokenizer, "Hello!")
        _plain(model, tokenizer, warm, 8, "greedy", 0)
        _dflash(model, tokenizer, warm, 8, "greedy", 0, None)
        for k, (name, i, text) in enumerate(prompts):
            prompt = format_prompt(tokenizer, text)
            runs = {
                "plain": lambda: _plain(model, tokenizer, prompt, max_tokens, "greedy", i),
                "adaptive": lambda: _dflash(model, tokenizer, prompt, max_tokens, "greedy", i, None),
            }
            for w in fixed:
                runs[f"w{w}"] = lambda w=w: _dflash(model, tokenizer, prompt, max_tokens, "greedy", i, w)
            order = names[k % len(names) :] + names[: k % len(names)]  # nobody always goes first
            done = {label: runs[label]() for label in order}
            speed = {label: done[label].generation_tps / done["plain"].generation_tps for label in names[1:]}
            best = max(fixed, key=lambda w: speed[f"w{w}"])
            rows.append(
                {
                    "set": name,
                    "prompt": i,
                    **speed,
                    "best": best,
                    "vs_best": speed["adaptive"] / speed[f"w{best}"],
                    "tau": done["adaptive"].tau,
                    "lookup": done["adaptive"].lookup_cycles / max(done["adaptive"].cycles, 1),
                }
            )
            bar.update(
                task,
                advance=1,
                info=f"{name} #{i}: adaptive {speed['adaptive']:.2f}x, best fixed w{best} {speed[f'w{best}']:.2f}x",
            )
    lines = [
        f"{machine()}; greedy, {max_tokens} tokens; speedup over plain mlx-lm (same prompts, interleaved)",
        "",
        "| set | prompt | adaptive | "
        + " | ".join(f"width {w}" for w in fixed)
        + " | best fixed | adaptive / best fixed | adaptive tau | lookup cycles |",
        "|---" * (6 + len(fixed)) + "|",
    ]
    for r in rows:
        lines.append(
            f"| {r['set']} | {r['prompt']} | {r['adaptive']:.2f}x | "
            + " | ".join(f"{r[f'w{w}']:.2f}x" for w in fixed)
            + f" | {r['best']} | {r['vs_best']:.2f} | {r['tau']:.2f} | {100 * r['lookup']:.0f}% |"
        )
    for name in sets.split(",") + ["all"]:
        chosen = [r for r in rows if name == "all" or r["set"] == name]
        med = {label: statistics.median(r[label] for r in chosen) for label in names[1:] + ["vs_best"]}
        lines.append(
            f"| **{name} median** | | **{med['adaptive']:.2f}x** | "
            + " | ".join(f"{med[f'w{w}']:.2f}x" for w in fixed)
            + f" | | {med['vs_best']:.2f} | | |"
        )
    text = "\n".join(lines) + "\n"
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    Path(out).write_text(text)
    print(text)


if __name__ == "__main__":
    typer.run(main)
