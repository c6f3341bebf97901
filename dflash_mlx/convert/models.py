"""Prepare models for a Mac: drafters (optionally 4/8-bit) and targets (HF or GGUF).

Every conversion writes into a staging dir next to the output and renames it
at the end, so a failure leaves nothing half-written; an existing output is
only replaced with `force`.
"""

from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import mlx.core as mx

from ..drafters import load_draft, save_draft
from ..drafters.precision import quantize_draft
from ..io.progress import add_task, progress
from ..io.storage import fetch, staged, writable

DRAFT_DTYPES = {"bfloat16": mx.bfloat16, "float32": mx.float32}
Q_BITS = (4, 8)
Q_GROUP_SIZES = (32, 64, 128)


@dataclass
class Plan:
    """What a conversion will write (also what --dry-run prints)."""

    source: str
    output: Path
    steps: list[str]

    def __str__(self) -> str:
        return "\n".join([f"{self.source} -> {self.output}", *(f"  - {s}" for s in self.steps)])


def _check_quant(q_bits: Optional[int], q_group_size: int) -> None:
    if q_bits is not None and q_bits not in Q_BITS:
        raise ValueError(f"--q-bits must be one of {Q_BITS}, got {q_bits}")
    if q_group_size not in Q_GROUP_SIZES:
        raise ValueError(f"--q-group-size must be one of {Q_GROUP_SIZES}, got {q_group_size}")


# ---------------------------------------------------------------- drafters


def convert_draft(
    source: str,
    out,
    q_bits: Optional[int] = None,
    q_group_size: int = 64,
    quantize_fc: bool = True,
    dtype: str = "bfloat16",
    force: bool = False,
    dry_run: bool = False,
    show_progress: bool = True,
):
    """z-lab drafter (HF repo or dir) -> MLX drafter dir; returns the output Path (or the Plan)."""
    out = Path(out)
    _check_quant(q_bits, q_group_size)
    if dtype not in DRAFT_DTYPES:
        raise ValueError(
            f"drafter dtype must be one of {', '.join(DRAFT_DTYPES)} (float16 activations overflow in drafters)"
        )
    plan = Plan(source, out, [f"weights and activations in {dtype}"])
    plan.steps.append(
        f"quantize linear layers (and DFlash 2 codebooks) to {q_bits} bits, group {q_group_size}"
        + ("" if quantize_fc else ", fc kept in float")
        + "; norms stay float; a quantized "
        "drafter is expanded first (its rounding errors add up: prefer the float one)"
        if q_bits
        else f"no quantization (a quantized drafter is expanded to {dtype})"
    )
    plan.steps.append("write config.json (z-lab schema + mlx `quantization`) and model.safetensors")
    if dry_run:
        return plan
    if out.exists() and not force:
        raise FileExistsError(f"{out} already exists; pass --force to overwrite it")
    writable(out.parent)

    with progress(show_progress) as bar:
        task = add_task(bar, "convert drafter", total=3, info=Path(source).name)
        path = fetch(source, ["*.json", "*.safetensors"])
        # a quantized drafter is expanded: float weights are what SGLang, vLLM and z-lab read,
        # and what --q-bits quantizes
        draft = load_draft(path, dtype=DRAFT_DTYPES[dtype], dequantize=True)
        bar.advance(task)
        quantization = quantize_draft(draft, q_bits, q_group_size, quantize_fc) if q_bits else None
        mx.eval(draft.parameters())
        bar.advance(task)
        with staged(out, force) as staging:
            save_draft(draft, staging, quantization=quantization)
        bar.advance(task)
    return out


def draft_size_mb(path) -> float:
    return sum(f.stat().st_size for f in Path(path).glob("*.safetensors")) / 1e6


# ---------------------------------------------------------------- targets


def convert_target(
    source: str,
    out,
    q_bits: Optional[int] = None,
    q_group_size: int = 64,
    dtype: Optional[str] = None,
    force: bool = False,
    dry_run: bool = False,
    show_progress: bool = True,
):
    """HF target (repo or dir) through mlx-lm's converter, or a GGUF file through ours."""
    out = Path(out)
    _check_quant(q_bits, q_group_size)
    is_gguf = source.endswith(".gguf")
    if is_gguf:
        from .gguf import DTYPES

        if dtype is not None and dtype not in DTYPES:
            raise ValueError(f"GGUF --dtype must be one of {', '.join(DTYPES)}")
        if q_bits and dtype == "native":
            raise ValueError("--q-bits quantizes dequantized GGUF weights: not with --dtype native")
        what = (
            f"{q_bits}-bit (mlx-lm, group 64) from the dequantized weights"
            if q_bits
            else dtype or "native where MLX keeps the file's quantization, else float32"
        )
        plan = Plan(
            source,
            out,
            [f"GGUF -> mlx-lm dir ({what}); tokenizer.json and chat template rebuilt from the GGUF metadata"],
        )
    else:
        plan = Plan(
            source,
            out,
            [
                "mlx-lm convert"
                + (f", {q_bits}-bit group {q_group_size}" if q_bits else "")
                + (f", dtype {dtype}" if dtype else "")
            ],
        )
    if dry_run:
        return plan
    writable(out.parent)
    if is_gguf:
        from .gguf import convert_gguf

        return convert_gguf(source, out, dtype=dtype, q_bits=q_bits, force=force, show_progress=show_progress)

    import mlx_lm

    with staged(out, force) as staging:
        staging.rmdir()  # mlx-lm insists on creating the directory itself
        mlx_lm.convert(
            source, str(staging), quantize=bool(q_bits), q_bits=q_bits, q_group_size=q_group_size, dtype=dtype
        )
    return out
