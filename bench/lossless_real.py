"""Is DFlash lossless at a real model's numerics?  Greedy DFlash against plain mlx-lm, token for
token, in fp32, bf16 and 4-bit.

    python bench/lossless_real.py [--model M] [--draft D] [--variants fp32,bf16,4bit] [-n 8]
        [--max-tokens 128] [--out bench/results/lossless-real]

For each variant and prompt: plain mlx-lm's greedy tokens (`generate_step`, mlx-lm's own ops),
DFlash's (the default adaptive plan: drafts, copies and plain steps, verified in passes of
other widths; `--block-size` fixes the width), the first position where they differ, and there the reference's top-2 logit
gap (from one forward pass over the prompt and the reference's tokens before it).  A verify
pass of L tokens runs other matmul shapes than a one-token step, so the last bits of a logit
can differ: at a near-tie (a gap of a few ulps of the logits) the two may then choose
differently, and from there on write different, equally likely text.  In fp32 the gap that
can flip is ~1e-5 of a logit; in bf16 ~1e-2.  Both streams run without stopping at EOS.

`--variants`: fp32 and bf16 cast the model loaded in fp32; 4bit loads `--quant 4` (the
default model's native Q4_1 weights; a short name's mlx-community 4-bit repo).
"""

import json
import sys
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Optional

import typer

import dflash_mlx  # noqa: F401  (loads OpenBLAS before mlx)
import mlx.core as mx
from mlx_lm.generate import generate_step

from dflash_mlx import load
from dflash_mlx.api import format_prompt
from dflash_mlx.bench.prompt_sets import mixed_prompts
from dflash_mlx.decode.decoder import decode
from dflash_mlx.decode.request import Request
from dflash_mlx.kernels.fused_ops import unfused
from dflash_mlx.io.progress import add_task, progress
from dflash_mlx.sampling import SamplingParams

VARIANTS = ("fp32", "bf16", "4bit")
PROMPT_SETS = ["chat", "gsm8k", "humaneval", "mtbench"]


@dataclass
class Comparison:
    variant: str
    prompt: int
    tokens: int
    first_difference: Optional[int]  # output position where DFlash first chose otherwise (None: identical)
    gap: Optional[float]  # the reference's top-2 logit gap there
    tau: float


def plain_tokens(pair, prompt: list[int], max_tokens: int) -> list[int]:
    with unfused(pair.target.model):  # mlx-lm's own ops: what its users get
        return [int(t) for t, _ in generate_step(mx.array(prompt), pair.target.model, max_tokens=max_tokens)]


def dflash_tokens(pair, prompt: list[int], max_tokens: int, block_size: Optional[int]) -> tuple[list[int], float]:
    out, cycles = [], 0
    for step in decode(pair, Request(list(prompt), max_tokens, SamplingParams(), block_size=block_size)):
        out += step.tokens
        cycles += 1
    return out, len(out) / max(cycles, 1)


def top2_gap(pair, prefix: list[int]) -> float:
    """The top-2 logit gap of the target's next-token distribution after `prefix`."""
    with unfused(pair.target.model):
        logits = pair.target.model(mx.array(prefix)[None])[0, -1].astype(mx.float32)
    top = mx.sort(logits)[-2:]
    return float(top[1] - top[0])


def compare(
    pair, variant: str, index: int, prompt: list[int], max_tokens: int, block_size: Optional[int] = None
) -> Comparison:
    """One prompt: DFlash (the adaptive plan, or a fixed `block_size`) against plain mlx-lm."""
    reference = plain_tokens(pair, prompt, max_tokens)
    ours, tau = dflash_tokens(pair, prompt, max_tokens, block_size)
    first = next((i for i, (a, b) in enumerate(zip(reference, ours)) if a != b), None)
    gap = None if first is None else top2_gap(pair, prompt + reference[:first])
    return Comparison(variant, index, len(reference), first, gap, tau)


def load_variant(model: Optional[str], draft: Optional[str], variant: str):
    if variant not in VARIANTS:
        raise typer.BadParameter(f"variants are {', '.join(VARIANTS)}, got {variant!r}")
    pair, tokenizer = load(model, draft, quant=4 if variant == "4bit" else None)
    if variant == "bf16":
        pair.target.model.set_dtype(mx.bfloat16)
        pair.draft.set_dtype(mx.bfloat16)
    return pair, tokenizer


def table(rows: list[Comparison]) -> str:
    lines = [
        "| variant | prompts identical | first difference (position: top-2 gap) | tau |",
        "|---|---|---|---|",
    ]
    for variant in dict.fromkeys(r.variant for r in rows):
        part = [r for r in rows if r.variant == variant]
        same = sum(r.first_difference is None for r in part)
        differences = ", ".join(f"#{r.prompt} at {r.first_difference}: {r.gap:.2e}" for r in part if r.gap is not None)
        taus = sorted(r.tau for r in part)
        lines.append(f"| {variant} | {same} / {len(part)} | {differences or '-'} | {taus[len(taus) // 2]:.2f} |")
    return "\n".join(lines)


def main(
    model: Optional[str] = typer.Option(None, "--model", "-m"),
    draft: Optional[str] = typer.Option(None, "--draft"),
    variants: str = typer.Option(",".join(VARIANTS), "--variants"),
    prompts: int = typer.Option(8, "--prompts", "-n"),
    max_tokens: int = typer.Option(128, "--max-tokens"),
    block_size: Optional[int] = typer.Option(None, "--block-size", help="A fixed width (default: the adaptive plan)."),
    out: Optional[Path] = typer.Option(None, "--out"),
):
    rows: list[Comparison] = []
    names = [v.strip() for v in variants.split(",") if v.strip()]
    texts = mixed_prompts(PROMPT_SETS, prompts)
    with progress() as bar:
        task = add_task(bar, "lossless", len(names) * len(texts))
        for variant in names:
            pair, tokenizer = load_variant(model, draft, variant)
            if pair.draft is None:
                raise SystemExit(f"error: no drafter for {model or 'the default model'}; pass --draft")
            for i, text in enumerate(texts):
                rows.append(compare(pair, variant, i, format_prompt(tokenizer, text), max_tokens, block_size))
                bar.advance(task)
    report = f"Greedy DFlash vs plain mlx-lm, {len(texts)} prompts, {max_tokens} tokens\n\n{table(rows)}"
    print(report)
    if out is not None:
        out.mkdir(parents=True, exist_ok=True)
        (out / "results.json").write_text(json.dumps([asdict(r) for r in rows], indent=1))
        command = " ".join(["python bench/lossless_real.py", *sys.argv[1:]])
        (out / "results.md").write_text(f"Command: `{command}`\n\n{report}\n")


if __name__ == "__main__":
    typer.run(main)
