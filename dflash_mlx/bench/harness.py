"""Benchmark: plain mlx-lm decoding vs DFlash on the same prompts, interleaved.

For every prompt, after a warm-up, the baseline (mlx-lm's own stream_generate on
the same weights) and DFlash run back to back (which goes first alternates from
prompt to prompt), greedy and/or sampled.  Speedup is the ratio of time per
output token, both timed by this loop from the first token on; medians are
reported per set and overall.
"""

import json
import platform
import statistics
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Optional

import mlx.core as mx
from mlx_lm.generate import stream_generate as mlx_stream_generate
from mlx_lm.sample_utils import make_sampler

from ..api import format_prompt, stream_generate
from ..kernels.fused_ops import unfused
from .prompt_sets import load_prompts
from ..decode.learning import without_answers
from ..decode.model import DFlashModel
from ..io.progress import add_task, progress

SAMPLED = {"temp": 0.7, "top_p": 0.95}


@dataclass
class Run:
    set: str
    prompt: int
    decoder: str  # "plain" | "dflash"
    mode: str  # "greedy" | "sampled"
    tokens: int
    generation_tps: float
    prompt_tps: float
    peak_memory_gb: float
    tau: float = 1.0
    histogram: list = field(default_factory=list)
    plain_cycles: int = 0
    cycles: int = 0
    lookup_cycles: int = 0


def _timed(responses):
    """The last response and the generation speed, timed here the same way for both
    decoders: tokens after the first response over the time after it."""
    first = last = None
    for last in responses:
        if first is None:
            first = (time.perf_counter(), last.generation_tokens)
    seconds, tokens = time.perf_counter() - first[0], last.generation_tokens - first[1]
    return last, tokens / seconds if tokens else 0.0


def run_plain(model: DFlashModel, tokenizer, prompt, max_tokens, mode, seed) -> Run:
    """Stock mlx-lm's stream_generate on the target: what its users get."""
    mx.random.seed(seed)
    sampler = make_sampler(**SAMPLED) if mode == "sampled" else None
    mx.reset_peak_memory()
    with unfused(model.target.model):  # mlx-lm's own ops, not our compiled norms and RoPEs
        last, tps = _timed(
            mlx_stream_generate(model.target.model, tokenizer, prompt, max_tokens=max_tokens, sampler=sampler)
        )
    return Run("", 0, "plain", mode, last.generation_tokens, tps, last.prompt_tps, mx.get_peak_memory() / 1e9)


def run_dflash(model: DFlashModel, tokenizer, prompt, max_tokens, mode, seed, block_size) -> Run:
    """Ours, timed the same way."""
    options = dict(temp=SAMPLED["temp"], top_p=SAMPLED["top_p"]) if mode == "sampled" else {}
    alone = without_answers(model)  # each prompt as a first request: the other modes' answers are not copied
    last, tps = _timed(
        stream_generate(alone, tokenizer, prompt, max_tokens, seed=seed, block_size=block_size, **options)
    )
    return Run(
        "",
        0,
        "dflash",
        mode,
        last.generation_tokens,
        tps,
        last.prompt_tps,
        last.peak_memory,
        last.tau,
        last.acceptance_histogram,
        last.sources.count("plain"),
        len(last.sources),
        last.sources.count("lookup"),
    )


def run_bench(
    model: DFlashModel,
    tokenizer,
    sets: list[str],
    prompts_per_set: int,
    max_tokens: int,
    modes: list[str],
    out_dir,
    block_size: Optional[int] = None,
    label: str = "",
    show_progress: bool = True,
) -> dict:
    """Run the benchmark; write results.json, results.md and plots into `out_dir`."""
    if model.draft is None:
        raise ValueError("the benchmark compares DFlash with plain decoding: this model has no drafter")
    if prompts_per_set <= 0 or max_tokens <= 0:
        raise ValueError(f"prompts_per_set and max_tokens must be > 0, got {prompts_per_set} and {max_tokens}")
    if not modes or set(modes) - {"greedy", "sampled"}:
        raise ValueError(f"modes must be greedy and/or sampled, got {modes}")
    prompts = {name: load_prompts(name, prompts_per_set) for name in sets}
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    runs: list[Run] = []
    total = sum(len(p) for p in prompts.values()) * len(modes)
    with progress(show_progress) as bar:
        task = add_task(bar, "bench", total=total, info="warm-up")
        warm = format_prompt(tokenizer, "Hello!")
        run_plain(model, tokenizer, warm, 8, "greedy", 0)
        run_dflash(model, tokenizer, warm, 8, "greedy", 0, block_size)
        for name, texts in prompts.items():
            for i, text in enumerate(texts):
                prompt = format_prompt(tokenizer, text)
                for mode in modes:
                    runners = {
                        "plain": lambda: run_plain(model, tokenizer, prompt, max_tokens, mode, i),
                        "dflash": lambda: run_dflash(model, tokenizer, prompt, max_tokens, mode, i, block_size),
                    }
                    # which decoder goes first alternates, so going first or second favours neither
                    order = ["plain", "dflash"] if i % 2 == 0 else ["dflash", "plain"]
                    done = {name: runners[name]() for name in order}
                    pair = [done["plain"], done["dflash"]]
                    for run in pair:
                        run.set, run.prompt = name, i
                    runs += pair
                    speedup = pair[1].generation_tps / max(pair[0].generation_tps, 1e-9)
                    bar.update(task, advance=1, info=f"{name} #{i} {mode}: {speedup:.2f}x tau {pair[1].tau:.2f}")
    results = {
        "label": label,
        "machine": machine(),
        "max_tokens": max_tokens,
        "block_size": block_size,
        "summary": summarize(runs, sets, modes),
        "runs": [asdict(r) for r in runs],
    }
    (out_dir / "results.json").write_text(json.dumps(results, indent=1))
    (out_dir / "results.md").write_text(markdown(results))
    try:
        from .plots import bench_plots

        bench_plots(results, out_dir)
    except ImportError as e:
        results["plots"] = str(e)
    return results


def report(lines: list[str], out: Optional[Path], name: str = "results.md", data: Optional[dict] = None) -> None:
    """Print `lines`; with `out`, write them to out/name (and `data` to out/results.json)."""
    print("\n".join(lines))
    if out:
        out = Path(out)
        out.mkdir(parents=True, exist_ok=True)
        if data is not None:
            (out / "results.json").write_text(json.dumps(data, indent=1))
        (out / name).write_text("\n".join(lines) + "\n")


def machine() -> str:
    return (
        f"{platform.system()} {platform.machine()}, {platform.processor() or 'cpu'}, mlx {mx.__version__}, "
        f"{'Metal' if mx.metal.is_available() else 'CPU'}"
    )


def summarize(runs: list[Run], sets: list[str], modes: list[str]) -> list[dict]:
    rows = []
    for mode in modes:
        for name in sets + ["all"]:
            chosen = [r for r in runs if r.mode == mode and (name == "all" or r.set == name)]
            plain = [r for r in chosen if r.decoder == "plain"]
            dflash = [r for r in chosen if r.decoder == "dflash"]
            if not plain:
                continue
            speedups = [d.generation_tps / max(p.generation_tps, 1e-9) for p, d in zip(plain, dflash)]
            histogram = [sum(col) for col in zip(*[d.histogram for d in dflash])] if dflash else []
            rows.append(
                {
                    "set": name,
                    "mode": mode,
                    "prompts": len(plain),
                    "plain_tps": statistics.median(r.generation_tps for r in plain),
                    "dflash_tps": statistics.median(r.generation_tps for r in dflash),
                    "speedup": statistics.median(speedups),
                    "min_speedup": min(speedups),
                    "tau": statistics.mean(r.tau for r in dflash),
                    "plain_prompt_tps": statistics.median(r.prompt_tps for r in plain),
                    "dflash_prompt_tps": statistics.median(r.prompt_tps for r in dflash),
                    "plain_peak_gb": max(r.peak_memory_gb for r in plain),
                    "dflash_peak_gb": max(r.peak_memory_gb for r in dflash),
                    "plain_cycle_share": sum(r.plain_cycles for r in dflash) / max(sum(r.cycles for r in dflash), 1),
                    "lookup_cycle_share": sum(r.lookup_cycles for r in dflash) / max(sum(r.cycles for r in dflash), 1),
                    "histogram": histogram,
                }
            )
    return rows


def markdown(results: dict) -> str:
    lines = [
        f"{results['label']} — {results['machine']}, max {results['max_tokens']} tokens, "
        f"block {results['block_size'] or 'adaptive'}; medians over prompts",
        "",
        "| set | mode | prompts | plain tok/s | DFlash tok/s | speedup (median) | min | tau | "
        "plain / lookup cycles | prompt tok/s (plain / DFlash) | peak GB (plain / DFlash) |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in results["summary"]:
        lines.append(
            f"| {r['set']} | {r['mode']} | {r['prompts']} | {r['plain_tps']:.1f} | {r['dflash_tps']:.1f} | "
            f"{r['speedup']:.2f}x | {r['min_speedup']:.2f}x | {r['tau']:.2f} | {100 * r['plain_cycle_share']:.0f}% / "
            f"{100 * r.get('lookup_cycle_share', 0):.0f}% | "
            f"{r['plain_prompt_tps']:.0f} / {r['dflash_prompt_tps']:.0f} | "
            f"{r['plain_peak_gb']:.2f} / {r['dflash_peak_gb']:.2f} |"
        )
    return "\n".join(lines) + "\n"
