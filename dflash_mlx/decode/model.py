"""The types both sides of the decode loop share: the model pair, a request's
statistics, and what one cycle committed."""

from collections import Counter
from dataclasses import dataclass, field
from typing import Optional

from mlx.utils import tree_flatten

from ..drafters import DFlashDraftModel
from ..sampling import TokenLogprob
from ..target.wrapper import Target


@dataclass(eq=False)  # compared, and kept apart (learning.kept), by identity
class DFlashModel:
    """A target with an optional drafter bound to it; what decoding learns is not its own
    (learning.py)."""

    target: Target
    draft: Optional[DFlashDraftModel] = None
    draft_note: str = ""  # why there is no drafter, when there is none
    fingerprint: str = ""  # names the weights (a saved cache state is only valid for them)
    end_tokens: frozenset = frozenset()  # the tokenizer's EOS: the prompt lookup copies from none (lookup.py)

    @property
    def feature_layers(self) -> list[int]:
        return self.draft.target_layer_ids if self.draft else []

    @property
    def weight_bytes(self) -> int:
        """Bytes of the target's weights and the drafter's own."""
        modules = [self.target.model] + ([self.draft] if self.draft is not None else [])
        return sum(a.nbytes for module in modules for _, a in tree_flatten(module.parameters()))


@dataclass
class DecodeStats:
    """Tokens committed per cycle (accepted drafts + the target's own token)."""

    block_size: int = 1
    adaptive: bool = False  # the planner chose the widths
    accepted_lengths: list[int] = field(default_factory=list)
    widths: list[int] = field(default_factory=list)  # verify width of each cycle (1 = plain)
    sources: list[str] = field(default_factory=list)  # what proposed each cycle: plain, dflash, lookup or suffix
    drafter_widths: list[int] = field(default_factory=list)  # its drafter pass's width (1: none; cut: wider)
    prompt_seconds: float = 0.0  # until the first token is out
    decode_seconds: float = 0.0  # after it
    cycle_seconds: list[float] = field(default_factory=list)  # each cycle's wall time (its step's)
    cached_tokens: int = 0  # prompt tokens restored from a prompt cache instead of prefilled

    @property
    def cycles(self) -> int:
        return len(self.accepted_lengths)

    @property
    def tau(self) -> float:
        """Mean tokens committed per target verification (bonus token included)."""
        return sum(self.accepted_lengths) / max(1, self.cycles)

    @property
    def plain_cycles(self) -> int:
        return sum(w == 1 for w in self.widths)

    def keep_of_last_cycle(self, kept: int) -> None:
        """The last cycle's tokens past the first `kept` are not the answer's (an EOS among
        them): it counts those only, or not at all when it committed none of the answer."""
        if kept:
            self.accepted_lengths[-1] = kept
        else:
            for per_cycle in (self.accepted_lengths, self.widths, self.sources, self.drafter_widths):
                per_cycle.pop()
            del self.cycle_seconds[self.cycles :]  # the dropped cycle's time, where it was kept

    @property
    def histogram(self) -> list[int]:
        """histogram[k-1] = number of cycles that committed k tokens, k = 1..block_size."""
        counts = Counter(self.accepted_lengths)
        return [counts.get(k, 0) for k in range(1, self.block_size + 1)]


@dataclass
class Step:
    tokens: list[int]  # committed this cycle, in order
    accepted: int  # how many of them were draft tokens
    logprobs: Optional[list[TokenLogprob]] = None  # per token, when asked for
    spent: bool = False  # the request's max_tokens are out with these tokens (request.Row.spent)
