"""Our decode loop against z-lab's own MLX loop (PyPI `dflash`, `model_mlx.stream_generate`)
and plain mlx-lm: same target weights, same drafter, same prompts, greedy, interleaved
(the order rotates from prompt to prompt), every decoder timed here the same way (tokens
after the first response over the time after it). Every output is checked equal to plain
greedy output.

    python bench/zlab_loop.py --sets gsm8k,humaneval,mtbench -n 5 --max-tokens 128 --block-sizes 16,4

z-lab's loader takes float weights, so the drafter is handed to it expanded to float32
(the precision ours computes in on the CPU); it drafts from the whole vocabulary, as any
runtime that ignores `draft_vocab.json` does.
"""

import argparse
import sys
import tempfile
from pathlib import Path
from statistics import median

sys.path.insert(0, str(Path(__file__).parent.parent))

import dflash_mlx  # noqa: F401  (OpenBLAS before mlx)
import mlx.core as mx
import mlx_lm
from dflash import model_mlx as zlab
from mlx_lm.generate import stream_generate as mlx_stream_generate

from dflash_mlx.api import format_prompt, load, stream_generate
from dflash_mlx.bench.harness import _timed
from dflash_mlx.bench.prompt_sets import load_prompts
from dflash_mlx.drafters import load_draft, save_draft
from dflash_mlx.kernels.fused_ops import unfused
from dflash_mlx.io.progress import add_task, progress
from dflash_mlx.convert.smollm2 import smollm2_path
from dflash_mlx.api.registry import DEFAULT_DRAFT


def zlab_drafter(path: Path, folder: Path):
    save_draft(load_draft(path, dtype=mx.float32, dequantize=True), folder)
    zlab.snapshot_download = lambda repo, **kwargs: repo  # a local dir, not a Hub id
    draft = zlab.load_draft(str(folder))
    draft.set_dtype(mx.float32)
    return draft


def run(responses):
    """(tokens, tok/s, tau) of one decoder's run; tau 1 for plain decoding (no drafting cycles)."""
    tokens, cycles = [], 0

    def collect():
        nonlocal cycles
        for r in responses:
            tokens.extend(r.tokens if hasattr(r, "tokens") else [r.token])
            cycles += getattr(r, "accepted", None) is not None
            yield r

    last, tps = _timed(collect())
    # z-lab reports no tau: its drafting cycles committed all tokens but the prefill's first
    tau = getattr(last, "tau", None) or ((len(tokens) - 1) / cycles if cycles else 1.0)
    return tokens, tps, tau


def without_eos(tokens: list[int], tokenizer) -> list[int]:
    """mlx-lm and z-lab report the end-of-sequence token, we do not."""
    return tokens[:-1] if tokens and tokens[-1] in tokenizer.eos_token_ids else tokens


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--draft", default=str(DEFAULT_DRAFT))
    parser.add_argument("--sets", default="gsm8k,humaneval,mtbench")
    parser.add_argument("-n", "--prompts", type=int, default=5)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--block-sizes", default="16,4")
    args = parser.parse_args()
    widths = [int(w) for w in args.block_sizes.split(",")]

    ours, tokenizer = load(None, draft=args.draft)
    theirs, _ = mlx_lm.load(str(smollm2_path()))  # a model of its own: z-lab's loop patches its layers
    zdraft = zlab_drafter(Path(args.draft), Path(tempfile.mkdtemp()) / "drafter")

    def plain(prompt):
        with unfused(ours.target.model):  # mlx-lm's own ops
            yield from mlx_stream_generate(ours.target.model, tokenizer, prompt, max_tokens=args.max_tokens)

    decoders = {"plain": plain}
    for w in widths:
        decoders[f"z-lab {w}"] = lambda p, w=w: zlab.stream_generate(
            theirs, zdraft, tokenizer, p, block_size=w, max_tokens=args.max_tokens
        )
        decoders[f"ours {w}"] = lambda p, w=w: stream_generate(ours, tokenizer, p, args.max_tokens, block_size=w)
    decoders["ours adaptive"] = lambda p: stream_generate(ours, tokenizer, p, args.max_tokens)

    sets = args.sets.split(",")
    results = {s: {d: [] for d in decoders} for s in sets}
    names = list(decoders)
    warm = format_prompt(tokenizer, "Hello!")
    for decode in decoders.values():
        run(decode(warm))
    with progress(True) as bar:
        task = add_task(bar, "z-lab loop", total=len(sets) * args.prompts, info="")
        for s in sets:
            for i, text in enumerate(load_prompts(s, args.prompts)):
                prompt = format_prompt(tokenizer, text)
                order = names[i % len(names) :] + names[: i % len(names)]
                outputs = {d: run(decoders[d](prompt)) for d in order}
                reference = without_eos(outputs["plain"][0], tokenizer)
                for d, (tokens, tps, tau) in outputs.items():
                    if without_eos(tokens, tokenizer) != reference:
                        print(f"note: {d} differs from plain greedy on {s} #{i}")
                    results[s][d].append((tps, tau))
                bar.update(task, advance=1, info=f"{s} #{i}")

    print(f"\nmedians, tok/s (tau); {args.prompts} prompts per set, {args.max_tokens} tokens, greedy\n")
    print("| set | " + " | ".join(names) + " | " + " | ".join(f"ours / z-lab at {w}" for w in widths) + " |")
    print("|---" * (1 + len(names) + len(widths)) + "|")
    for s in sets + ["all"]:
        rows = {d: [r for t in (sets if s == "all" else [s]) for r in results[t][d]] for d in names}
        cells = [
            f"{median(r[0] for r in rows[d]):.1f}" + ("" if d == "plain" else f" ({median(r[1] for r in rows[d]):.2f})")
            for d in names
        ]
        ratios = [f"{median(a[0] / b[0] for a, b in zip(rows[f'ours {w}'], rows[f'z-lab {w}'])):.2f}x" for w in widths]
        print(f"| {s} | " + " | ".join(cells) + " | " + " | ".join(ratios) + " |")


if __name__ == "__main__":
    main()
