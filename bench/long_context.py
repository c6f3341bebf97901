"""Long prompts: prefill speed, decode speedup and peak memory of DFlash against plain mlx-lm at
2k, 4k and 8k prompt tokens (SmolLM2's context is 8k).

    python bench/long_context.py [--lengths 2048,4096,8000] [--max-tokens 128] [--reps 2]
        [--model gemma-3-270m --draft DIR] [--block-size 4] [--out bench/results/long-context]
    python bench/long_context.py --model gemma-3-270m --draft DIR --block-size 4 \
        --same-text path/to/long_file.py --cuts 3 --lengths 1024,16384

Each prompt is a source file of HumanEval stubs cut to the length, then a question about it
(the `long` set's shape, longer).  With `--same-text FILE`, each length's prompts are instead the
last N tokens (BOS first, no chat template: a base model's continuation) of one long document
before each of `--cuts` fixed cut points, so every length continues the same text and only the
context before it differs; pass a file the drafter was not trained on.  Per length and prompt
(and rep), plain mlx-lm (`stream_generate`, its own ops) and DFlash (the default adaptive plan,
or a fixed `--block-size` to compare a drafter's tau across lengths; a fresh request: no prompt
cache) run one after the other, in alternating order; medians over them, greedy.
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


def cut_points(total: int, longest: int, count: int) -> list[int]:
    """`count` distinct cut points spread over a document of `total` tokens, the first where its
    `longest` prompt just fits before it."""
    if count < 1 or total < longest + count:
        raise ValueError(
            f"the document has {total:,} tokens: {count} cut points need at least {longest + count:,} "
            "(the longest length and one token per cut); pass a longer file, fewer --cuts or shorter --lengths"
        )
    return [longest + (total - longest) * i // count for i in range(count)]


def same_text_prompts(ids: list[int], lengths: list[int], cuts: list[int], bos: Optional[int]) -> dict:
    """Per length, one prompt per cut: the `length` tokens before the cut, BOS first where the
    tokenizer has one (so a longer prompt ends with every shorter one's text)."""
    head = [] if bos is None else [bos]
    return {length: [head + ids[cut - (length - len(head)) : cut] for cut in cuts] for length in lengths}


def document_prompts(tokenizer, path: Path, lengths: list[int], count: int) -> tuple[dict, str]:
    """The same-text prompts of `path`, and a line saying what they are."""
    ids = tokenizer.encode(path.read_text(), add_special_tokens=False)
    cuts = cut_points(len(ids), max(lengths), count)
    about = f"Text: `{path}` ({len(ids):,} tokens), prompts ending at tokens {', '.join(f'{c:,}' for c in cuts)}"
    return same_text_prompts(ids, lengths, cuts, tokenizer.bos_token_id), about


def main(
    lengths: str = typer.Option("2048,4096,8000", "--lengths"),
    max_tokens: int = typer.Option(128, "--max-tokens"),
    reps: int = typer.Option(2, "--reps"),
    model: Optional[str] = typer.Option(None, "--model", help="Target (default: the default pair's)."),
    draft: Optional[str] = typer.Option(None, "--draft", help="Drafter dir (default: the registry's)."),
    block_size: Optional[int] = typer.Option(None, "--block-size", help="A fixed width (default: adaptive)."),
    same_text: Optional[Path] = typer.Option(
        None, "--same-text", help="A long document: every length's prompts end at the same cut points in it."
    ),
    cuts: int = typer.Option(3, "--cuts", help="Cut points in the --same-text document."),
    out: Optional[Path] = typer.Option(None, "--out"),
):
    sizes = [int(n) for n in lengths.split(",")]
    if same_text is not None and not same_text.is_file():
        raise typer.BadParameter(f"{same_text} is not a file", param_hint="--same-text")
    pair, tokenizer = load(model, draft)
    if same_text is None:
        prompts, about = {size: [long_prompt(tokenizer, size)] for size in sizes}, None
    else:
        try:
            prompts, about = document_prompts(tokenizer, same_text, sizes, cuts)
        except ValueError as e:
            raise typer.BadParameter(str(e), param_hint="--same-text") from None
    rows = []
    with progress() as bar:
        task = add_task(bar, "long", sum(len(p) for p in prompts.values()) * reps)
        run_plain(pair, tokenizer, format_prompt(tokenizer, "Hello!"), 8, "greedy", 0)  # warm-up
        run_dflash(pair, tokenizer, format_prompt(tokenizer, "Hello!"), 8, "greedy", 0, None)
        for size in sizes:
            runs = {"plain": [], "dflash": []}
            for turn, prompt in enumerate(p for p in prompts[size] for _ in range(reps)):
                order = ["plain", "dflash"] if turn % 2 == 0 else ["dflash", "plain"]
                for name in order:
                    run = run_plain if name == "plain" else run_dflash
                    extra = () if name == "plain" else (block_size,)
                    runs[name].append(run(pair, tokenizer, prompt, max_tokens, "greedy", turn % reps, *extra))
                bar.advance(task)
            median = statistics.median
            plain, ours = runs["plain"], runs["dflash"]
            rows.append(
                {
                    "prompt_tokens": len(prompts[size][0]),
                    "plain_prefill_tps": median(r.prompt_tps for r in plain),
                    "dflash_prefill_tps": median(r.prompt_tps for r in ours),
                    "plain_tps": median(r.generation_tps for r in plain),
                    "dflash_tps": median(r.generation_tps for r in ours),
                    "speedup": median(o.generation_tps / p.generation_tps for p, o in zip(plain, ours)),
                    "tau": median(r.tau for r in ours),
                    "taus": [round(r.tau, 3) for r in ours],
                    "plain_peak_gb": max(r.peak_memory_gb for r in plain),
                    "dflash_peak_gb": max(r.peak_memory_gb for r in ours),
                }
            )
    command = " ".join(["python bench/long_context.py", *sys.argv[1:]])
    lines = [
        f"Machine: {machine()}",
        f"Command: `{command}`",
        *([about] if about else []),
        "",
        "| prompt tokens | prefill tok/s plain / DFlash | decode tok/s plain / DFlash | speedup | tau (each prompt) "
        "| tau vs the shortest | peak GB plain / DFlash |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        each = ", ".join(f"{t:.2f}" for t in r["taus"])
        lines.append(
            f"| {r['prompt_tokens']} | {r['plain_prefill_tps']:.0f} / {r['dflash_prefill_tps']:.0f} "
            f"| {r['plain_tps']:.1f} / {r['dflash_tps']:.1f} | **{r['speedup']:.2f}x** | {r['tau']:.2f} ({each}) "
            f"| {r['tau'] / rows[0]['tau']:.0%} | {r['plain_peak_gb']:.2f} / {r['dflash_peak_gb']:.2f} |"
        )
    report = "\n".join(lines)
    print(report)
    if out is not None:
        out.mkdir(parents=True, exist_ok=True)
        (out / "results.json").write_text(json.dumps({"machine": machine(), "text": about, "rows": rows}, indent=1))
        (out / "results.md").write_text(report + "\n")


if __name__ == "__main__":
    typer.run(main)
