"""The precision a drafter runs at (`--draft-quant`): its checkpoint's, or quantized or expanded
on loading.

A drafter's precision only changes how often its drafts are accepted, never the output: the
target verifies every drafted token.  On a GPU quantized weights are multiplied packed, which
saves memory beside a quantized target; MLX's CPU backend multiplies them several times slower
than float32 with BLAS (docs/design-decisions.md), so there they are expanded after quantizing:
the drafts are those of the quantized weights (mx.dequantize gives the values the quantized
matmul multiplies by, up to rounding), the speed and memory those of float weights."""

from dataclasses import dataclass
from typing import Optional

import mlx.core as mx
import mlx.nn as nn

from .model import DFlashDraftModel

FLOAT = 16  # --draft-quant 16: float weights, in the activation dtype (bf16 on a GPU)
DRAFT_QUANTS = (FLOAT, 8, 4)
DRAFT_GROUP_SIZE = 64  # mlx-lm's default, and what `convert draft` writes
# On a GPU a float drafter is quantized to this by default: the fewest bits that cost no measured
# acceptance.  4 bits cost 1.1-1.8% of tau (the shipped d12, 8 held-out prompts: 2.222 / 2.197 at
# 8 / 4 bits over 96 tokens, 1.977 / 1.941 over 256, 2026-11-28); 8 bits matched float for d2, the
# last drafter measured from a float checkpoint (1.357 both, 2026-11-23): docs/design-decisions.md
AUTO_DRAFT_BITS = 8


def runs_packed() -> bool:
    """Whether quantized drafter weights are multiplied as they are (a GPU) rather than expanded
    to float first (a CPU, where MLX's quantized matmul is the slower one)."""
    return mx.default_device() != mx.cpu


@dataclass(frozen=True)
class DraftPrecision:
    stored: Optional[int]  # the checkpoint's bits (None: float)
    bits: Optional[int]  # the bits of the weights' values once loaded (None: float)
    packed: bool  # quantized weights multiplied as they are, not expanded to float

    @property
    def changed(self) -> bool:
        """Whether loading makes it another drafter than its checkpoint (quantized, re-quantized,
        or expanded to run as float on a GPU): its own prompt-cache and cost-curve keys."""
        return self.bits != self.stored

    @property
    def name(self) -> str:
        return f"{self.bits}-bit" if self.bits else "float"

    @property
    def held(self) -> Optional[int]:
        """The precision its weights take memory at when that is not the checkpoint's (FLOAT,
        8 or 4); None: as stored."""
        in_memory = (self.bits if self.packed else None) or FLOAT
        return None if in_memory == (self.stored or FLOAT) else in_memory

    def describe(self) -> str:
        """One line: its precision, where it comes from, how it runs."""
        if self.bits is None:
            values = "float" + (f" (the {self.stored}-bit checkpoint expanded)" if self.stored else "")
        else:
            source = "as stored" if not self.changed else f"quantized on loading, group {DRAFT_GROUP_SIZE}"
            values = f"{self.name} ({source})"
        if self.bits is not None and not self.packed:
            values += ", expanded to float to run (MLX's CPU quantized matmul is slower)"
        return values


def draft_precision(asked: Optional[int], stored: Optional[int], packed: bool) -> DraftPrecision:
    """The precision a drafter stored at `stored` bits (None: float) runs at: `asked` (FLOAT,
    8 or 4) when given; else a quantized checkpoint's own, and a float one's where quantized
    weights run packed (AUTO_DRAFT_BITS) or on a CPU, float.  A ValueError for another `asked`."""
    check_draft_quant(asked)
    if asked is None:
        bits = stored or (AUTO_DRAFT_BITS if packed else None)
    else:
        bits = None if asked == FLOAT else asked
    return DraftPrecision(stored, bits, packed)


def quantize_draft(draft: DFlashDraftModel, bits: int, group_size: int, quantize_fc: bool = True) -> dict:
    """Quantize the drafter's linear layers and DFlash 2 codebooks in place (norms never); returns
    the config entry."""
    skipped = [] if quantize_fc else ["fc"]

    def predicate(path: str, module: nn.Module) -> bool:
        return (
            isinstance(module, (nn.Linear, nn.Embedding))
            and path not in skipped
            and module.weight.shape[-1] % group_size == 0
        )

    nn.quantize(draft, group_size=group_size, bits=bits, class_predicate=predicate)
    entry = {"group_size": group_size, "bits": bits, "mode": "affine"}
    entry.update({path: False for path in skipped})
    return entry


def check_draft_quant(asked: Optional[int]) -> None:
    if asked is not None and asked not in DRAFT_QUANTS:
        raise ValueError(f"draft_quant must be {FLOAT} (float), 8 or 4 (or None: automatic), got {asked!r}")


def apply_precision(draft: DFlashDraftModel, precision: DraftPrecision) -> DFlashDraftModel:
    """`draft` (loaded as stored) brought to `precision`: quantized the way `convert draft`
    quantizes (its layer rule), and expanded where quantized weights do not run packed."""
    if precision.changed:
        expand(draft)  # re-quantized from its values, not from its packed form
        if precision.bits is not None:
            draft.quantization = quantize_draft(draft, precision.bits, DRAFT_GROUP_SIZE)
    if not precision.packed:
        expand(draft)
    mx.eval(draft.parameters())
    return draft


def expand(draft: DFlashDraftModel) -> DFlashDraftModel:
    """Its quantized layers replaced by float ones holding the values they stand for, in the
    dtype of their scales (the activation dtype); a float drafter is left as it is."""
    if draft.quantization:
        from mlx_lm.utils import dequantize_model

        dequantize_model(draft)
        draft.quantization = None
    return draft
