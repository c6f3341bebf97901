"""Agent sessions decoded together in one process, with and without passes apart (Planner.passes:
a batch whose rows want different widths verified in two passes, each at its own width), and each
session alone for the floor a compute-bound machine sets.

    python bench/passes_apart.py [--sessions 4] [--turns 5] [--max-tokens 400] [--reps 2] [--alone]
        [--out bench/results/passes-apart]

The sessions are bench/agent_session.py's (coding and writing in turn, each turn's answer kept in
the conversation), driven through BatchGenerator with a prompt cache as the server drives it (no
HTTP, no idle-time prefill): each session sends its next turn as soon as its answer ends.  Every
replay starts with an empty prompt cache and store of earlier answers; what the planner learnt
(step times, acceptance) carries over, as in a server that has been running.  Per rep
the two variants run in turn, the first alternating; medians over the reps.  Reported per variant:
wall time of all sessions, time to first token per turn (median over sessions), and the batch
steps that verified apart.  Greedy; the answers of both variants are compared.
"""

import statistics
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import Optional

import typer

import dflash_mlx  # noqa: F401  (loads OpenBLAS before mlx)
from agent_session import sessions

from dflash_mlx import BatchGenerator, load
from dflash_mlx.bench.harness import machine, report
from dflash_mlx.prompt_cache import PromptCache
from dflash_mlx.suffix import SuffixStore


def replay(model, tokenizer, chosen: list[dict], turns: int, max_tokens: int) -> dict:
    """All `chosen` sessions at once: wall seconds, each session's TTFT per turn and answers, and
    how many steps verified apart.  The model's store of earlier answers starts empty (it would
    hold the answers of the replays before, and copy them)."""
    model = replace(model, suffixes=SuffixStore())
    generator = BatchGenerator(model, tokenizer, max_batch=8, prompt_cache=PromptCache(1 << 30), max_batch_tokens=32768)
    generator.warm_up()
    apart = 0
    states = [
        dict(session=s, messages=[{"role": "system", "content": s["system"]}], turn=0, uid=None, ttft=[], answers=[])
        for s in chosen
    ]
    started = time.perf_counter()
    try:
        while True:
            for state in states:
                if state["uid"] is None and state["turn"] < min(turns, len(state["session"]["turns"])):
                    state["messages"].append({"role": "user", "content": state["session"]["turns"][state["turn"]]})
                    state["uid"] = generator.insert(state["messages"], max_tokens)
                    state["asked"], state["text"] = time.perf_counter(), ""
            if not generator.busy:
                break
            out = generator.next()
            apart += generator.last_step.passes > 1
            for uid, response in out:
                state = next(s for s in states if s["uid"] == uid)
                if not state["text"] and len(state["ttft"]) == state["turn"]:
                    state["ttft"].append(time.perf_counter() - state["asked"])
                state["text"] += response.text
                if response.finish_reason:
                    state["messages"].append({"role": "assistant", "content": state["text"]})
                    state["answers"].append(state["text"])
                    state["uid"], state["turn"] = None, state["turn"] + 1
    finally:
        generator.close()
    return dict(
        seconds=time.perf_counter() - started,
        ttft=[s["ttft"] for s in states],
        answers=[s["answers"] for s in states],
        apart=apart,
    )


def main(
    count: int = typer.Option(4, "--sessions"),
    turns: int = typer.Option(5, "--turns"),
    max_tokens: int = typer.Option(400, "--max-tokens"),
    reps: int = typer.Option(2, "--reps"),
    alone: bool = typer.Option(False, "--alone", help="Also each session alone, one after another."),
    out: Optional[Path] = typer.Option(None, "--out"),
):
    model, tokenizer = load()
    chosen = sessions(count, turns)
    variants = {"passes apart": model.planner.apart_gain, "one pass a step": float("inf")}
    runs = {name: [] for name in variants}
    for rep in range(reps):
        order = list(variants) if rep % 2 == 0 else list(reversed(variants))
        for name in order:
            model.planner.apart_gain = variants[name]
            runs[name].append(replay(model, tokenizer, chosen, turns, max_tokens))
            print(f"rep {rep + 1} {name}: {runs[name][-1]['seconds']:.1f} s", file=sys.stderr, flush=True)
    model.planner.apart_gain = variants["passes apart"]
    lines = [
        f"Machine: {machine()}",
        f"Command: `python {' '.join(sys.argv)}`",
        "",
        f"{count} sessions of {turns} turns decoded together in one process, medians over {reps} rep(s).",
        "",
        "| variant | all sessions, s (reps) | TTFT per turn, s (median over sessions) | steps apart |",
        "|---|---|---|---|",
    ]
    for name, done in runs.items():
        ttft = [statistics.median(r["ttft"][s][t] for r in done for s in range(count)) for t in range(turns)]
        seconds = [r["seconds"] for r in done]
        lines.append(
            f"| {name} | {statistics.median(seconds):.1f} ({' / '.join(f'{x:.1f}' for x in seconds)}) | "
            f"{' / '.join(f'{t:.2f}' for t in ttft)} | {statistics.median(r['apart'] for r in done):.0f} |"
        )
    answers = {name: done[0]["answers"] for name, done in runs.items()}
    lines += [
        "",
        f"Answers equal across variants and reps: {all(r['answers'] == answers['passes apart'] for done in runs.values() for r in done)}",
    ]
    if alone:
        seconds = [replay(model, tokenizer, [s], turns, max_tokens)["seconds"] for s in chosen]
        lines.append(
            f"Each session alone, one after another: {sum(seconds):.1f} s ({' + '.join(f'{x:.1f}' for x in seconds)})"
        )
    report(lines, out)


if __name__ == "__main__":
    typer.run(main)
