"""Held-out evaluation: tau and per-position acceptance in the real decode loop."""

from typing import Optional

from ..drafters import DFlashDraftModel
from ..decode.decoder import decode
from ..decode.model import DecodeStats, DFlashModel
from ..decode.request import Request
from ..target.wrapper import Target
from .data import Example
from .config import TrainConfig


def split_held_out(examples: list[Example], n: int) -> tuple[list[Example], list[Example]]:
    """(held out, training): the last `n` examples of a data dir are never trained on."""
    return examples[-n:], examples[:-n]


def committed_lengths(
    target: Target, draft: DFlashDraftModel, prompts: list[list[int]], max_tokens: int, block_size: Optional[int] = None
) -> list[int]:
    """Tokens committed per cycle in the real greedy decode loop, over all prompts."""
    lengths = []
    for prompt in prompts:
        stats = DecodeStats()
        for _ in decode(
            DFlashModel(target, draft), Request(list(prompt), max_tokens, block_size=block_size), stats=stats
        ):
            pass
        lengths += stats.accepted_lengths
    return lengths


def evaluate_tau(
    target: Target, draft: DFlashDraftModel, prompts: list[list[int]], max_tokens: int, block_size: Optional[int] = None
) -> float:
    """Mean tokens committed per cycle (tau) in the real greedy decode loop."""
    lengths = committed_lengths(target, draft, prompts, max_tokens, block_size)
    return sum(lengths) / max(len(lengths), 1)


def position_acceptance(lengths: list[int], width: int) -> list[float]:
    """Acceptance rate of block position k given positions 1..k-1 were accepted, k = 1..width-1
    (a cycle that committed n tokens accepted n - 1 drafts)."""
    rates = []
    for k in range(1, width):
        reached = sum(n - 1 >= k - 1 for n in lengths)
        rates.append(sum(n - 1 >= k for n in lengths) / reached if reached else 0.0)
    return rates


def held_out_tau(target, draft, held_out: list[Example], cfg: TrainConfig) -> float:
    draft.eval()
    tau = evaluate_tau(target, draft, [e.prompt_ids for e in held_out], cfg.eval_max_tokens)
    draft.train()
    return tau
