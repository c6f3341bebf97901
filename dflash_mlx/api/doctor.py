"""`dflash-mlx doctor`: what dflash-mlx would run on this machine and why, without loading a
model or touching the network.

    report(model, quant, draft_quant)  the facts, as a dict (what `--json` prints)
    describe(report)                   the same as lines to read

With a model name it also says what loading it would take: the target and drafter it resolves
to, their quantization (the drafter's as `--draft-quant` would load it), their size and whether
that fits in memory.  A published pair is judged as `load` judges it (registry.py: the variant
that fits, its weights, drafter, KV caches and working memory against this machine's budget); any
other model by its weights, from files already on this machine, else from the parameter count in
its name, else unknown.
"""

import importlib.metadata
import platform
import re
from pathlib import Path
from typing import Optional

import mlx.core as mx
from huggingface_hub import try_to_load_from_cache

from ..convert.smollm2 import DEFAULT_MODEL
from ..decode.costs import costs_path
from ..io import blas
from ..io.storage import cache_dir, looks_like_path
from ..kernels import cpu, metal
from ..kernels.fused_ops import fusing
from . import registry
from .loading import alone_key
from .registry import DEFAULT_DRAFT, PUBLISHED, QUANT_BITS, resolve


def report(model: Optional[str] = None, quant: Optional[int] = None, draft_quant: Optional[int] = None) -> dict:
    facts = {
        "platform": f"{platform.system()} {platform.release()} ({platform.machine()})",
        "chip": metal.chip_name(),
        "memory": memory(),
        "python": platform.python_version(),
        "distribution": distribution(),
        "mlx": mx.__version__,
        "mlx_lm": _version("mlx-lm"),
        "default_device": str(mx.default_device()),
        "metal": metal_status(),
        "kernels": kernels(),
        "blas": blas.status(),
        "cost_curves": cost_curves(),
        "cache_dir": str(cache_dir()),
    }
    if model is not None:
        facts["model"] = model_plan(model, quant, draft_quant)
    return facts


DISTRIBUTION = "mlx-dflash"  # this project's name on PyPI (pyproject.toml)
OTHER_PROJECT = "dflash-mlx"  # PyPI's dflash-mlx is another DFlash port, whose import package is dflash_mlx too


def distribution() -> dict:
    """Which installed distributions provide the `dflash_mlx` import package, and a warning when
    one of them is not this project (the two would overwrite each other's files)."""
    owners = sorted(set(importlib.metadata.packages_distributions().get("dflash_mlx", [])))
    found = {"owners": [f"{name} {_version(name)}" for name in owners], "warning": None}
    if OTHER_PROJECT in owners and not _is_this_project(OTHER_PROJECT):
        found["warning"] = (
            f"the PyPI project {OTHER_PROJECT} (another DFlash port) is installed and also provides dflash_mlx: "
            f"pip uninstall {OTHER_PROJECT}, then reinstall this one from its repository (pip install -e .)"
        )
    elif OTHER_PROJECT in owners:
        found["warning"] = (
            f"an older install of this project under the name {OTHER_PROJECT} is still registered: "
            f"pip uninstall {OTHER_PROJECT}, then pip install -e . again"
        )
    return found


def _is_this_project(name: str) -> bool:
    """Whether distribution `name` installs this project's command (the other port's is `dflash`)."""
    scripts = importlib.metadata.distribution(name).entry_points.select(group="console_scripts")
    return any(script.value == "dflash_mlx.cli:app" for script in scripts)


def _version(package: str) -> str:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def memory() -> dict:
    """The machine's memory, and what a model may take of it, as `load` counts it (registry.py)."""
    total, _ = registry.device_memory()
    budget = registry.memory_budget()
    return {"total_gib": _gib(total), "usable_gib": _gib(budget.bytes), "usable": budget.source}


def metal_status() -> dict:
    available = mx.metal.is_available()
    if not available:
        why = "this MLX has no Metal back-end: Metal needs macOS on Apple silicon"
    elif mx.default_device() != mx.gpu:
        why = "Metal is there, but MLX's default device is the CPU"
    else:
        why = f"GPU: {mx.device_info(mx.gpu).get('device_name', 'unknown')}"
    return {"available": available, "why": why}


def kernels() -> dict:
    """Which kernels would run and why: the Metal ones and the CPU forms of fused_ops.py."""
    plan = metal.kernel_plan()
    path = metal.decisions_path()
    plan["self_check_file"] = f"{path} ({'present' if path.is_file() else 'not written yet'})"
    plan["self_check_key"] = (
        f"{metal.chip_name()}, {metal.os_version()}, MLX {mx.__version__}, kernel sources {metal.sources_hash()}: "
        "the kernels are checked again when any of them changes"
    )
    if fusing():
        plan["norms_and_rope"] = "compiled per module (fused_ops.py): MLX's CPU forms are many small ops"
        plan["matmul_weights"] = "stored column-major, for BLAS's faster NN kernel (fused_ops.py)"
        plan["attention_softmax"] = softmax_status()
    else:
        plan["norms_rope_attention"] = "MLX's own fast ops (single GPU kernels already)"
    return plan


def softmax_status() -> str:
    """Whether the C++ row softmax (kernels/cpu.py) is built, without building it (~10 s)."""
    try:
        path = cpu.library_path()
    except cpu.BuildError as e:
        return f"MLX ops: the C++ row softmax cannot be built here ({e})"
    if path.exists():
        return f"the C++ row softmax, built ({path})"
    return "the C++ row softmax, not built yet: built at the first model load (~10 s) or by scripts/setup.sh"


def cost_curves(key: Optional[str] = "*") -> dict:
    """This machine's stored cost curves (decode/costs.py: a curve's key names the chip) whose key
    matches the glob `key` (None: none can)."""
    pattern = costs_path(key or "", cache_dir())
    chip = metal.chip_name().replace("/", "_").replace(" ", "_")  # as costs_path spells it in a name
    found = sorted(str(p) for p in pattern.parent.glob(pattern.name) if chip in p.name) if key else []
    return {"folder": str(pattern.parent), "files": found, "present": bool(found)}


def model_curves(target: str, draft: Optional[str]) -> dict:
    """The stored cost curves of a model: its drafter's, or without one the target's alone (keyed
    by its folder's name and weights, as load keys it: loading.alone_key)."""
    if draft:
        return cost_curves(f"*-{Path(draft).name}-*")
    folder = _local_dir(target)
    if folder is None or not cost_curves(f"{folder.name}-*")["present"]:  # not loaded here: no weights to hash
        return cost_curves(None)
    return cost_curves(f"{alone_key(folder)}-*")


def _local_dir(target: str) -> Optional[Path]:
    """Where `target`'s files are on this machine (a folder, or its Hugging Face snapshot), else None."""
    folder = Path(target).expanduser()
    if folder.is_dir():
        return folder
    if looks_like_path(target):
        return None
    try:
        config = try_to_load_from_cache(target, "config.json")
    except ValueError:  # a name the hub refuses
        return None
    return Path(config).parent if isinstance(config, str) else None


# ------------------------------------------------------------------- a model


def model_plan(model: str, quant: Optional[int], draft_quant: Optional[int] = None) -> dict:
    """What loading `model` would take: resolved offline (short names, repos and dirs are only
    named here: nothing is downloaded or converted)."""
    if model in PUBLISHED:
        return _published_plan(model, quant, draft_quant)
    if model == DEFAULT_MODEL:
        target, target_bytes, draft, quantized = _default_target(quant)
    else:
        resolved = resolve(model, None, quant)
        target, draft, quantized = resolved.target, resolved.draft, "as stored"
        target_bytes = registry.stored_weight_bytes(target) or _from_name(target)
    draft_bytes = registry.stored_weight_bytes(draft) if draft else 0
    total = None if target_bytes is None or draft_bytes is None else target_bytes + draft_bytes
    usable = registry.memory_budget().bytes
    return {
        "target": target,
        "draft": draft or "none",
        "quant": quantized,
        "draft_quant": registry.planned_draft_precision(draft, draft_quant).describe() if draft else "no drafter",
        "target_gib": _gib(target_bytes),
        "draft_gib": _gib(draft_bytes),
        "footprint_gib": _gib(total),
        "usable_gib": _gib(usable),
        "fits": "unknown" if total is None else ("yes" if total <= usable else "no"),
        "why": "the weights alone (their files here, else the parameters in the name at the dtype's size)",
        "cost_curve": model_curves(target, draft),
    }


def _published_plan(name: str, quant: Optional[int], draft_quant: Optional[int]) -> dict:
    """A published pair, as `load` judges it: without `quant`, its 8-bit variant where it fits, else
    its 4-bit one (registry.fitting_variant); with one, that variant whatever it needs; the drafter at the
    precision `draft_quant` would load it at."""
    pair = PUBLISHED[name]
    budget = registry.memory_budget()
    precision = registry.planned_draft_precision(pair.draft, draft_quant)
    why = None
    if quant is None:
        try:
            choice = registry.fitting_variant(name, pair.draft, draft_held=precision.held)
            quant, why = choice.quant, choice.reason
        except ValueError as refused:  # load refuses it: say so, sized at its smallest variant
            quant, why = min(QUANT_BITS), str(refused)
    need = registry.footprint(name, quant, pair.draft, registry.BATCH_CAP_TOKENS, precision.held)
    return {
        "target": registry.variant_repo(pair, quant),
        "draft": pair.draft,
        "quant": registry.label(name, quant),
        "draft_quant": precision.describe(),
        "target_gib": _gib(need.weights),
        "draft_gib": _gib(need.draft),
        "kv_cache_gib": _gib(need.kv),
        "working_gib": _gib(need.working),
        "footprint_gib": _gib(need.total),
        "usable_gib": _gib(budget.bytes),
        "fits": "yes" if need.total <= budget.bytes else "no",
        "why": why or f"--quant {quant}: loaded whatever it needs",
        "cost_curve": model_curves(registry.variant_repo(pair, quant), pair.draft),
    }


def _default_target(quant: Optional[int]) -> tuple[str, Optional[int], Optional[str], str]:
    """The offline default, as convert/smollm2.py names its converted dir (not converted here):
    (target dir, its weights' bytes, the shipped drafter, its quantization)."""
    dtype = {4: "native", 16: "bfloat16"}.get(quant) or ("bfloat16" if mx.metal.is_available() else "float32")
    folder = cache_dir() / "models" / f"{DEFAULT_MODEL}-{dtype}"
    size = registry.stored_weight_bytes(str(folder))
    if size is None:
        parameters = parameters_in_name(DEFAULT_MODEL)
        size = int(parameters * {"native": 5 / 8, "bfloat16": 2, "float32": 4}[dtype])  # Q4_1: 5 bits
    quantized = "Q4_1, as the GGUF ships it" if quant == 4 else f"none ({dtype}, converted from the GGUF)"
    return str(folder), size, str(DEFAULT_DRAFT) if DEFAULT_DRAFT.is_dir() else None, quantized


def _from_name(repo: str) -> Optional[int]:
    """Bytes of a repo's weights from the parameter count in its name: at the bits of its
    "-4bit" / "-8bit" suffix (mlx-lm's quantization), else bf16."""
    parameters = parameters_in_name(repo)
    if parameters is None:
        return None
    suffix = re.search(r"-(4|8)bit$", repo)
    bits = QUANT_BITS[int(suffix.group(1))] if suffix else 16
    return int(parameters * bits / 8)


def parameters_in_name(name: str) -> Optional[float]:
    """The parameter count a model's name states ("Qwen3.5-9B", "gpt-oss-20b", "SmolLM2-135M";
    the total of a mixture of experts, "30B-A3B", comes first); None when it states none."""
    found = re.search(r"(?<![\w.])(\d+(?:\.\d+)?)([BbMm])(?![\w.])", name.rsplit("/", 1)[-1].replace("_", "-"))
    if found is None:
        return None
    return float(found.group(1)) * (1e9 if found.group(2) in "Bb" else 1e6)


def _gib(size: Optional[int]):
    return None if size is None else round(size / registry.GIB, 2)


# ------------------------------------------------------------------- reading it


def describe(facts: dict) -> str:
    """The report as `item: value` lines, grouped."""
    memory = facts["memory"]
    lines = [
        f"platform: {facts['platform']}",
        f"chip: {facts['chip']}",
        f"memory: {memory['total_gib']} GiB ({memory['usable_gib']} GiB usable: {memory['usable']})",
        f"python: {facts['python']}",
        _distribution_line(facts["distribution"]),
        f"mlx: {facts['mlx']}",
        f"mlx-lm: {facts['mlx_lm']}",
        f"default device: {facts['default_device']}",
        f"metal: {'available' if facts['metal']['available'] else 'not available'} ({facts['metal']['why']})",
        "kernels:",
        *(f"  {name}: {how}" for name, how in facts["kernels"].items()),
        f"blas: {facts['blas']}",
        _curves_line("cost curves", facts["cost_curves"]),
        f"cache dir: {facts['cache_dir']}",
    ]
    if "model" in facts:
        lines += ["model:", *_model_lines(facts["model"])]
    return "\n".join(lines)


def _distribution_line(found: dict) -> str:
    owners = ", ".join(found["owners"]) or "none registered (run from a source tree?)"
    return f"distribution: {owners}" + (f"\n  warning: {found['warning']}" if found["warning"] else "")


def _curves_line(label: str, curves: dict) -> str:
    if not curves["present"]:
        return f"{label}: none for this machine yet in {curves['folder']} (measured at the first load of a model)"
    return f"{label}: " + ", ".join(curves["files"])


def _model_lines(plan: dict) -> list[str]:
    def size(gib):
        return "unknown" if gib is None else f"{gib} GiB"

    return [
        f"  target: {plan['target']} ({size(plan['target_gib'])})",
        f"  draft: {plan['draft']} ({size(plan['draft_gib'])})",
        f"  quant: {plan['quant']}",
        f"  draft quant: {plan['draft_quant']}",
        f"  footprint: {size(plan['footprint_gib'])} of {size(plan['usable_gib'])} usable; fits: {plan['fits']}",
        f"  why: {plan['why']}",
        "  " + _curves_line("cost curve", plan["cost_curve"]),
    ]
