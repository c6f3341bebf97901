"""Long prompts: prefill speed, decode speedup and peak memory of DFlash against plain mlx-lm at
2k, 4k and 8k prompt tokens (SmolLM2's context is 8k).

    python bench/long_context.py [--lengths 2048,4096,8000] [--max-tokens 128] [--reps 2]
        [--model gemma-3-270m --draft DIR] [--block-size 4] [--out bench/results/long-context]

Each prompt is a source file of HumanEval stubs cut to the length, then a question about it
(the `long` set's shape, longer).  Per length and rep, plain mlx-lm (`stream_generate`, its own
ops) and DFlash (the default adaptive plan, or a fixed `--block-size` to compare a drafter's tau
across lengths; a fresh request: no prompt cache) run one after the other, in alternating order;
medians over the reps, greedy.
"""

import json
import statistics
import sys
from pathlib import Path
from typing import Optional

import typer

import dflash_mlx  # noqa: F401  (loads OpenBLAS before mlx)
from dflash_mlx import load
from dflash_mlx.api import format_prompt
from dflash_mlx.bench.harness import machine, run_dflash, run_plain
from dflash_mlx.bench.prompt_sets import load_prompts
from dflash_mlx.io.progress import add_task, progress

QUESTION = "\n```\nExplain briefly what each function above does, then implement the last one."


def long_prompt(tokenizer, length: int) -> list[int]:
    """A chat prompt of `length` tokens: stubs as one file (cut at a line), then the question."""
    stubs = [prompt.split("```python\n", 1)[1].rsplit("\n```\n", 1)[0] for prompt in load_prompts("long")]
    lines = ("```python\n" + "\n\n".join(stubs)).splitlines(keepends=True)
    low, high = 1, len(lines)
    while low < high:  # the most lines that fit
        middle = (low + high + 1) // 2
        if len(format_prompt(tokenizer, "".join(lines[:middle]) + QUESTION)) <= length:
            low = middle
        else:
            high = middle - 1
    return format_prompt(tokenizer, "".join(lines[:low]) + QUESTION)


def main(
    lengths: str = typer.Option("2048,4096,8000", "--lengths"),
    max_tokens: int = typer.Option(128, "--max-tokens"),
    reps: int = typer.Option(2, "--reps"),
    model: Optional[str] = typer.Option(None, "--model", help="Target (default: the default pair's)."),
    draft: Optional[str] = typer.Option(None, "--draft", help="Drafter dir (default: the registry's)."),
    block_size: Optional[int] = typer.Option(None, "--block-size", help="A fixed width (default: adaptive)."),
    out: Optional[Path] = typer.Option(None, "--out"),
):
    pair, tokenizer = load(model, draft)
    sizes = [int(n) for n in lengths.split(",")]
    rows = []
    with progress() as bar:
        task = add_task(bar, "long", len(sizes) * reps)
        run_plain(pair, tokenizer, format_prompt(tokenizer, "Hello!"), 8, "greedy", 0)  # warm-up
        run_dflash(pair, tokenizer, format_prompt(tokenizer, "Hello!"), 8, "greedy", 0, None)
        for size in sizes:
            prompt = long_prompt(tokenizer, size)
            runs = {"plain": [], "dflash": []}
            for rep in range(reps):
                order = ["plain", "dflash"] if rep % 2 == 0 else ["dflash", "plain"]
                for name in order:
                    run = run_plain if name == "plain" else run_dflash
                    extra = () if name == "plain" else (block_size,)
                    runs[name].append(run(pair, tokenizer, prompt, max_tokens, "greedy", rep, *extra))
                bar.advance(task)
            median = statistics.median
            plain, ours = runs["plain"], runs["dflash"]
            rows.append(
                {
                    "prompt_tokens": len(prompt),
                    "plain_prefill_tps": median(r.prompt_tps for r in plain),
                    "dflash_prefill_tps": median(r.prompt_tps for r in ours),
                    "plain_tps": median(r.generation_tps for r in plain),
                    "dflash_tps": median(r.generation_tps for r in ours),
                    "speedup": median(o.generation_tps / p.generation_tps for p, o in zip(plain, ours)),
                    "tau": median(r.tau for r in ours),
                    "plain_peak_gb": max(r.peak_memory_gb for r in plain),
                    "dflash_peak_gb": max(r.peak_memory_gb for r in ours),
                }
            )
    command = " ".join(["python bench/long_context.py", *sys.argv[1:]])
    lines = [
        f"Machine: {machine()}",
        f"Command: `{command}`",
        "",
        "| prompt tokens | prefill tok/s plain / DFlash | decode tok/s plain / DFlash | speedup | tau | peak GB plain / DFlash |",
        "|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['prompt_tokens']} | {r['plain_prefill_tps']:.0f} / {r['dflash_prefill_tps']:.0f} "
            f"| {r['plain_tps']:.1f} / {r['dflash_tps']:.1f} | **{r['speedup']:.2f}x** | {r['tau']:.2f} "
            f"| {r['plain_peak_gb']:.2f} / {r['dflash_peak_gb']:.2f} |"
        )
    report = "\n".join(lines)
    print(report)
    if out is not None:
        out.mkdir(parents=True, exist_ok=True)
        (out / "results.json").write_text(json.dumps({"machine": machine(), "rows": rows}, indent=1))
        (out / "results.md").write_text(report + "\n")


if __name__ == "__main__":
    typer.run(main)
