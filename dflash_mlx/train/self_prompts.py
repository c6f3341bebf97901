"""Prompts the target writes itself (Magpie-style).

Given only its chat template's opening of a user turn, a chat model samples what a
user might ask: prompts that look like what its users send, in the proportions it
learned, with no dataset to download.  Kept: finished turns (the model closed the
turn itself) of 4+ words and 20-600 characters, once each, sharing no 8-word span
with any benchmark prompt set (train/corpus.py), without chat control tokens.
"""

import json
import re
from pathlib import Path

import mlx.core as mx
from mlx_lm.generate import BatchGenerator
from mlx_lm.sample_utils import make_sampler
from mlx_lm.tokenizer_utils import TokenizerWrapper

from ..io.progress import add_task, progress
from .corpus import shingles

MARK = "\u2063USER\u2063"  # a placeholder no template rewrites


def user_turn_prefix(tokenizer: TokenizerWrapper) -> list[int]:
    """The chat template's text before a user message (its system prompt included)."""
    if not tokenizer.has_chat_template:
        raise ValueError("self-written prompts need a chat model: this tokenizer has no chat template")
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": MARK}], tokenize=False, add_generation_prompt=False
    )
    if MARK not in text:
        raise ValueError("the chat template does not show the user's message as given; cannot find its user turn")
    return tokenizer.encode(text[: text.index(MARK)], add_special_tokens=False)


def _normal(text: str) -> str:
    return " ".join(text.lower().split())


def keep(text: str, seen: set[str], banned: set) -> bool:
    words = text.split()
    return (
        20 <= len(text) <= 600
        and len(words) >= 4
        and _normal(text) not in seen
        and not re.search(r"<\|[a-z_]+\|>|<\/?s>", text)
        and not shingles(text) & banned
    )


def make_prompts(
    model,
    tokenizer: TokenizerWrapper,
    out,
    count: int,
    banned: set,
    temp: float = 1.0,
    top_p: float = 0.95,
    seed: int = 0,
    batch_size: int = 64,
    max_tokens: int = 96,
    show_progress: bool = True,
) -> Path:
    """Append self-written prompts to the .jsonl file `out` until it holds `count` (resumes)."""
    out = Path(out)
    rows = (
        [json.loads(line)["prompt"] for line in out.read_text().splitlines() if line.strip()] if out.is_file() else []
    )
    seen = {_normal(p) for p in rows}
    prefix = user_turn_prefix(tokenizer)
    stop = [[t] for t in tokenizer.eos_token_ids]
    mx.random.seed(seed + len(rows))  # a resumed run draws new prompts
    with progress(show_progress) as bar, out.open("a") as sink:
        task = add_task(bar, "make-prompts", total=count, info=f"{len(rows)} kept")
        bar.update(task, completed=min(len(rows), count))
        barren = 0  # rounds in a row that kept nothing
        while len(rows) < count:
            if barren == 5:
                raise ValueError(
                    f"the target wrote no usable prompt in 5 rounds of {batch_size}; "
                    "try another --temp, or write the prompts yourself"
                )
            before = len(rows)
            generator = BatchGenerator(
                model,
                stop_tokens=stop,
                sampler=make_sampler(temp, top_p),
                completion_batch_size=batch_size,
                prefill_batch_size=min(8, batch_size),
            )
            uids = generator.insert([prefix] * batch_size, [max_tokens] * batch_size)
            tokens, finished = {u: [] for u in uids}, set()
            while batch := generator.next_generated():
                for r in batch:
                    if r.finish_reason == "stop":
                        finished.add(r.uid)
                    elif r.finish_reason is None:
                        tokens[r.uid].append(r.token)
            generator.close()
            for uid in uids:
                text = tokenizer.decode(tokens[uid]).strip()
                if uid in finished and len(rows) < count and keep(text, seen, banned):
                    rows.append(text)
                    seen.add(_normal(text))
                    sink.write(json.dumps({"prompt": text}) + "\n")
            sink.flush()
            barren = barren + 1 if len(rows) == before else 0
            bar.update(task, completed=len(rows), info=f"{len(rows)} kept")
    return out
