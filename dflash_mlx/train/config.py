"""What a training run is configured with."""

import math
from dataclasses import dataclass
from typing import Optional


def stratified_layer_ids(num_layers: int, n: int) -> list[int]:
    """n target layers evenly spaced from shallow (1) to deep (L-3), as z-lab picks them."""
    if n == 1:
        return [num_layers // 2]
    start, end = 1, max(num_layers - 3, 1 + n - 1)
    return sorted({round(start + i * (end - start) / (n - 1)) for i in range(n)})


@dataclass
class TrainConfig:
    block_size: int = 16
    num_layers: int = 1  # drafter layers
    architecture: str = "dflash"  # or "dflash2": block convolutions and a candidate selector
    conv_kernel_size: int = 4  # dflash2
    conv_group_size: int = 64  # dflash2: channels per convolution group
    selector_rank: int = 64  # dflash2
    selector_top_k: int = 8  # dflash2
    num_target_layers: int = 5  # how many target layers feed the drafter
    target_layer_ids: Optional[list[int]] = None  # default: stratified_layer_ids
    mask_token_id: Optional[int] = None  # default: choose_mask_token
    gamma: float = 4.0  # loss weight decay along the block
    init_from_target: bool = True  # copy the deepest target layers into the drafter layers
    init_from: Optional[str] = None  # or start from an existing drafter dir (warm start; its shape wins)
    epochs: int = 10  # passes over the self-distilled data (unless `steps` is given)
    steps: Optional[int] = None  # optimizer steps
    sequences_per_step: int = 8
    text_fraction: float = 0.0  # share of each step's sequences that are text windows
    text_window: int = 256  # tokens per text window (corpus.text_windows)
    block_positions: int = 256  # per sequence and step: random anchors until their blocks fill this
    # verify widths the training blocks are cut to, one drawn per block (None: as long as the labels
    # allow); the drafter then learns each position as the loop drafts it at those widths
    block_widths: Optional[list[int]] = None
    head_size: int = 8192  # output vocabulary of the loss: the most frequent token ids of the data
    distill: float = 0.0  # weight of KL(target || drafter) over the restricted vocabulary (1 - it: the hard label)
    lr: float = 1e-3
    min_lr_ratio: float = 0.05
    warmup_steps: int = 50
    weight_decay: float = 0.01
    grad_clip: float = 1.0
    checkpoint_every: int = 200
    eval_every: int = 0  # steps between held-out tau evaluations (0: only at the end)
    eval_prompts: int = 8  # held-out sequences, never trained on
    eval_max_tokens: int = 96
    seed: int = 0

    def __post_init__(self):
        if self.block_size < 2:
            raise ValueError(f"block size must be >= 2, got {self.block_size}")
        if self.architecture not in ("dflash", "dflash2"):
            raise ValueError(f"architecture must be dflash or dflash2, got {self.architecture!r}")
        if self.num_layers < 1 or self.num_target_layers < 1:
            raise ValueError("the drafter needs at least one layer and one target layer")
        for name in ("lr", "gamma", "weight_decay", "grad_clip", "min_lr_ratio", "text_fraction", "distill"):
            value = getattr(self, name)
            if not math.isfinite(value) or value < 0 or (value == 0 and name in ("lr", "gamma", "grad_clip")):
                raise ValueError(f"{name} must be a finite number > 0 (>= 0 for decay and ratios), got {value}")
        for name in (
            "epochs",
            "sequences_per_step",
            "head_size",
            "checkpoint_every",
            "eval_prompts",
            "eval_max_tokens",
        ):
            if getattr(self, name) < 1:
                raise ValueError(f"{name.replace('_', ' ')} must be >= 1, got {getattr(self, name)}")
        if self.steps is not None and self.steps < 1:
            raise ValueError(f"steps must be >= 1, got {self.steps}")
        if self.eval_every < 0 or self.warmup_steps < 0:
            raise ValueError("eval every and warmup steps must be >= 0")
        if not 0 <= self.text_fraction < 1:
            raise ValueError(f"text fraction must be in [0, 1), got {self.text_fraction}")
        if self.distill > 1:
            raise ValueError(f"distill is a weight in [0, 1], got {self.distill}")
        if self.block_positions < self.block_size:
            raise ValueError(f"block positions per sequence ({self.block_positions}) must be >= the block size")
        self.check_block_widths()

    def check_block_widths(self) -> None:
        """Training widths within 2..block size (checked again once a warm start sets the size)."""
        if self.block_widths is not None and (
            not self.block_widths or not all(2 <= w <= self.block_size for w in self.block_widths)
        ):
            raise ValueError(f"block widths must be in 2..{self.block_size} (the block size), got {self.block_widths}")
