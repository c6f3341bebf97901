"""Tokens a grammar forces, proposed as a draft: target passes and seconds per structured answer,
with and without those drafts, on the same prompts (interleaved), the text checked identical.

    python bench/grammar_forced.py [--model M] [-n 6] [--max-tokens 160] [--out bench/results/grammar-forced]

Two kinds of answer: a JSON object in a strict schema (keys fixed, whitespace free, so the forced
stretches are short) and a forced tool call in the hermes `<tool_call>` format (its frame and the
tool's name fixed: a long forced stretch).  The session-wide answer store is off, so no answer is
a copy of an earlier one.
"""

import json
import statistics
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Optional

import typer

import dflash_mlx  # noqa: F401  (loads OpenBLAS before mlx)
from dflash_mlx import Grammar, load, stream_generate
from dflash_mlx.decode.grammar import GrammarState
from dflash_mlx.decode.learning import without_answers
from dflash_mlx.io.progress import add_task, progress

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "age": {"type": "integer"},
        "role": {"enum": ["farmer", "wizard", "nurse", "baker"]},
        "home": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "year": {"type": "integer"}},
            "required": ["city", "year"],
            "additionalProperties": False,
        },
    },
    "required": ["name", "age", "role", "home"],
    "additionalProperties": False,
}
TOOL_CALL = (
    'start: "<tool_call>\\n{\\"name\\": \\"get_weather\\", \\"arguments\\": " args "}\\n</tool_call>"\n'
    'args: %json{"type": "object", "properties": {"city": {"type": "string"}, '
    '"unit": {"enum": ["celsius", "fahrenheit"]}}, "required": ["city", "unit"], "additionalProperties": false}'
)
CHARACTERS = ["a farmer", "a wizard", "a cat", "a baker", "a pirate", "a nurse", "a robot", "a queen"]
CITIES = ["Paris", "Rome", "Lisbon", "Oslo", "Cairo", "Lima", "Seoul", "Quito"]


@dataclass
class Run:
    kind: str
    prompt: int
    forced: bool
    passes: int
    grammar_passes: int
    tokens: int
    seconds: float


def answer(model, tokenizer, messages, grammar, max_tokens: int, forced: bool) -> tuple[str, Run]:
    real = GrammarState.forced
    if not forced:
        GrammarState.forced = lambda self, limit: []
    try:
        tic = time.perf_counter()
        responses = list(stream_generate(model, tokenizer, messages, max_tokens, grammar=grammar))
        seconds = time.perf_counter() - tic
    finally:
        GrammarState.forced = real
    last = responses[-1]
    text = "".join(r.text for r in responses)
    return text, Run("", 0, forced, len(last.widths), last.sources.count("grammar"), last.generation_tokens, seconds)


def table(runs: list[Run]) -> str:
    lines = [
        "| answer | forced drafts | target passes (median) | tokens (median) | seconds (median) | passes saved |",
        "|---|---|---|---|---|---|",
    ]
    for kind in sorted({r.kind for r in runs}):
        medians = {}
        for forced in (False, True):
            part = [r for r in runs if r.kind == kind and r.forced == forced]
            medians[forced] = [statistics.median(getattr(r, f) for r in part) for f in ("passes", "tokens", "seconds")]
        for forced in (False, True):
            passes, tokens, seconds = medians[forced]
            saved = f"{1 - passes / medians[False][0]:.0%}" if forced else ""
            lines.append(
                f"| {kind} | {'on' if forced else 'off'} | {passes:g} | {tokens:g} | {seconds:.2f} | {saved} |"
            )
    return "\n".join(lines)


def main(
    model: Optional[str] = typer.Option(None, help="target (default: the offline SmolLM2 pair)"),
    draft: Optional[str] = typer.Option(None),
    n: int = typer.Option(6, "-n", help="prompts of each kind"),
    max_tokens: int = typer.Option(160, "--max-tokens"),
    out: Path = typer.Option(Path("bench/results/grammar-forced"), help="results folder"),
):
    pair, tokenizer = load(model, draft)
    pair = without_answers(pair)  # no answer copied from an earlier one
    vocab = pair.target.vocab_size
    kinds = {
        "JSON object (strict schema)": (
            Grammar.json(tokenizer, vocab, PERSON),
            [f"Invent {who}. Reply in JSON." for who in CHARACTERS[:n]],
        ),
        "forced tool call": (
            Grammar(tokenizer, TOOL_CALL, vocab),
            [f"What is the weather in {city}? Call the get_weather tool." for city in CITIES[:n]],
        ),
    }
    runs, differing = [], 0
    with progress() as bar:
        task = add_task(bar, "answers", 2 * sum(len(prompts) for _, prompts in kinds.values()))
        for kind, (grammar, prompts) in kinds.items():
            for i, text in enumerate(prompts):
                messages = [{"role": "user", "content": text}]
                texts = []
                for forced in (i % 2 == 0, i % 2 == 1):  # interleaved: each order half the time
                    answered, run = answer(pair, tokenizer, messages, grammar, max_tokens, forced)
                    runs.append(replace(run, kind=kind, prompt=i))
                    texts.append(answered)
                    bar.advance(task)
                differing += texts[0] != texts[1]
    report = table(runs) + f"\n\nAnswers differing between the two: {differing} of {len(runs) // 2}.\n"
    print(report)
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.md").write_text(report)
    (out / "results.json").write_text(json.dumps([asdict(r) for r in runs], indent=1))


if __name__ == "__main__":
    typer.run(main)
