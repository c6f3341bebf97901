"""What decoding learns across requests: the planner (acceptance rates, step times) and the
earlier answers proposed from (suffix.py).  A Decoder holds one; the model pair holds none.

A process keeps one per loaded model (`kept`), so every decoder made over that model without
its own -- generate() and stream_generate() calls, a BatchGenerator, the server's worker --
learns into and drafts from the same one, as a session's answers should be."""

from dataclasses import dataclass, replace
from typing import Optional
from weakref import WeakKeyDictionary

from .model import DFlashModel
from .plan import Planner
from .suffix import SuffixStore


@dataclass(eq=False)
class Learning:
    planner: Optional[Planner] = None  # adaptive verify widths; None: fixed widths, nothing learnt
    suffixes: Optional[SuffixStore] = None  # earlier answers, read by adaptive requests only


def widest_verify(model: DFlashModel, learning: Learning) -> int:
    """The widest verify a request of `model` has unless it asks for less: the drafter's block;
    without a drafter, the planner's widest copy, or 1 without a planner (plain decoding: only a
    planner judges when a copy's wide verify pays, from the measured cost curve)."""
    if model.draft is not None:
        return model.draft.block_size
    return learning.planner.max_width if learning.planner is not None else 1


_kept: "WeakKeyDictionary[DFlashModel, Learning]" = WeakKeyDictionary()


def kept(model: DFlashModel) -> Learning:
    """The learning this process keeps for `model` (a new, empty one the first time)."""
    return _kept.setdefault(model, Learning())


def keep(model: DFlashModel, learning: Learning) -> None:
    """Make `learning` the one this process keeps for `model`."""
    _kept[model] = learning


def without_answers(model: DFlashModel) -> DFlashModel:
    """`model` again, sharing the planner the process keeps for it but not its earlier answers
    (each prompt is drafted as a first request)."""
    alone = replace(model)
    keep(alone, Learning(kept(model).planner))
    return alone
