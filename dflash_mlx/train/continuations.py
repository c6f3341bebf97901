"""Plain continuations of text files: training data for a base model, with no generation.

A base model is not asked questions: it continues text.  Each file is tokenized whole and cut
every `stride` tokens into a prompt (what the tokenizer puts before raw text, Gemma's BOS, then
the file's next tokens, `prompt_tokens` in all) and the `response_tokens` of text that follow it
as the response.  A cut is taken where the file holds prompt_tokens + response_tokens tokens
from its start; a shorter tail is dropped.  The responses are the text, not the target's
choices: fit labels a block position where the text agrees with them (labels.py).

Examples are named FILE:START (FILE relative to its glob's folder, START in tokens) and kept in
the order of the globs, each sorted: the held-out examples (the last ones) are the last file's.
"""

import glob
import json
import re
from pathlib import Path

from ..io.storage import atomic_write
from .data import Example

MAGIC = re.compile(r"[*?[]")


def text_files(globs: str) -> list[tuple[str, Path]]:
    """(name, path) of the files each comma-separated glob matches, each glob's sorted, in order;
    a name is the path below the glob's folder (the part before its first wildcard)."""
    found = {}
    for pattern in (g.strip() for g in globs.split(",") if g.strip()):
        parts = Path(pattern).parts
        fixed = next((i for i, part in enumerate(parts) if MAGIC.search(part)), len(parts) - 1)
        folder = Path(*parts[:fixed]) if fixed else Path(".")
        names = sorted(glob.glob(str(Path(*parts[fixed:])), root_dir=folder, recursive=True))
        names = [n for n in names if (folder / n).is_file()]
        if not names:
            raise FileNotFoundError(f"no file matches {pattern}; check the glob (quote it, so the shell leaves it)")
        for name in names:
            found.setdefault((folder / name).resolve(), name)
    if not found:
        raise ValueError("no text glob given; pass --text 'GLOB[,GLOB...]'")
    return [(name, path) for path, name in found.items()]


def continuations(
    tokenizer, files: list[tuple[str, Path]], prompt_tokens: int, response_tokens: int, stride: int
) -> list[Example]:
    """The plain continuations of `files` (text_files), as the module docstring cuts them."""
    span = prompt_tokens + response_tokens
    lead = tokenizer.encode("")  # what precedes raw text: the target sees it before a prompt
    if response_tokens < 1 or prompt_tokens <= len(lead):
        raise ValueError(f"a continuation needs a prompt of > {len(lead)} tokens and a response of >= 1")
    if stride < span:
        raise ValueError(f"a stride of {stride} tokens overlaps continuations of {span}; pass --stride {span} or more")
    text_in_prompt = prompt_tokens - len(lead)
    examples = []
    for name, path in files:
        tokens = tokenizer.encode(_read(path), add_special_tokens=False)
        if len(tokens) < span:
            raise ValueError(
                f"{path} holds {len(tokens)} tokens, fewer than one continuation's {span}; "
                "leave it out or pass a shorter --prompt-tokens / --max-tokens"
            )
        for start in range(0, len(tokens) - span + 1, stride):
            cut = start + text_in_prompt
            examples.append(Example(f"{name}:{start}", lead + tokens[start:cut], tokens[cut : cut + response_tokens]))
    return examples


def _read(path: Path) -> str:
    try:
        return path.read_text(encoding="utf-8")
    except UnicodeDecodeError:
        raise ValueError(f"{path} is not UTF-8 text; leave it out of --text") from None


def write_continuations(out_dir, fingerprint: dict, examples: list[Example], source: str) -> Path:
    """A data dir (train/data.py's format) holding `examples`, in a new or empty `out_dir`."""
    out_dir = Path(out_dir)
    if (out_dir / "meta.json").exists() or any(out_dir.glob("shard-*.jsonl")):
        raise FileExistsError(f"{out_dir} already holds data; pass another --out")
    longest = max(len(e.response_ids) for e in examples)
    meta = {"target": fingerprint, "max_tokens": longest, "decoding": "text", "source": source}
    atomic_write(out_dir / "shard-00000.jsonl", "".join(json.dumps(e.__dict__) + "\n" for e in examples))
    atomic_write(out_dir / "meta.json", json.dumps(meta, indent=2))  # last: a data dir is whole once it has one
    return out_dir
