"""Offline text for drafter training: Python standard-library sources (PSF licence).

Teacher-forced windows of existing text need no generation.  One target pass
over a window (at prefill speed, ~4x the tokens/s of generation here) gives the
target's greedy choice at every position: the exact label for block position 1
of an anchor anywhere in the window, and for position k wherever the text agreed
with the target's choices for the k-1 positions before (train.label_counts).

The sources are read from the running interpreter's standard library (code,
docstrings, and the prose of the Python docs in `pydoc_data/topics.py`).
Windows that share an 8-word span with any benchmark prompt are dropped.
"""

import random
import re
import sysconfig
from dataclasses import dataclass
from pathlib import Path

SHINGLE = 8  # words


@dataclass
class Window:
    """A span of text tokens; every position after the first may anchor a block."""

    source: str
    tokens: list[int]
    first_anchor: int = 1


def shingles(text: str, ignore: str = "") -> set[tuple[str, ...]]:
    """The 8-word spans of `text` (lower case, word characters only)."""
    words = re.findall(r"\w+", text.replace(ignore, "").lower()) if ignore else re.findall(r"\w+", text.lower())
    return {tuple(words[i : i + SHINGLE]) for i in range(len(words) - SHINGLE + 1)}


def benchmark_shingles() -> set[tuple[str, ...]]:
    """Every 8-word span of every benchmark prompt set (for overlap checks)."""
    from ..bench.prompt_sets import BOXED, SETS, load_prompts

    return set().union(*(shingles(p, BOXED) for name in SETS for p in load_prompts(name)))


def stdlib_files() -> list[Path]:
    """The standard library's own .py files (no tests, no installed packages)."""
    root = Path(sysconfig.get_paths()["stdlib"])
    skip = {"site-packages", "test", "tests", "idle_test", "__pycache__", "lib2to3"}
    return sorted(p for p in root.rglob("*.py") if not skip & set(p.relative_to(root).parts))


def text_windows(
    tokenizer, length: int = 256, max_windows: int | None = None, seed: int = 0, exclude: set | None = None
) -> list[Window]:
    """Shuffled `length`-token windows of the standard library's sources.

    Files are tokenized whole and cut into consecutive windows (a short tail is
    dropped); `exclude` is a set of 8-word spans no window may contain."""
    if length < 2:
        raise ValueError(f"text windows need at least 2 tokens, got {length}")
    files = stdlib_files()
    random.Random(seed).shuffle(files)
    windows = []
    for path in files:
        try:
            text = path.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue
        tokens = tokenizer.encode(text, add_special_tokens=False)
        for start in range(0, len(tokens) - length + 1, length):
            piece = tokens[start : start + length]
            if exclude and shingles(tokenizer.decode(piece)) & exclude:
                continue
            windows.append(Window(f"{path.name}:{start}", piece))
        if max_windows and len(windows) >= max_windows:
            break
    random.Random(seed + 1).shuffle(windows)
    return windows[:max_windows] if max_windows else windows
