"""One request's decoding state: its prompt and sampling, the noise of its output
positions, the drafter's context of target features, its prompt lookup (and the model's
session-wide store of earlier answers), its grammar, its
acceptance estimates and its statistics.  The step (decoder.py) reads it and `record`s
what each cycle committed."""

from dataclasses import dataclass, field
from typing import Optional

import mlx.core as mx

from .grammar import Grammar
from .lookup import Match, PromptLookup
from .model import DecodeStats, DFlashModel, Step
from .plan import Plan
from ..sampling import Noise, SamplingParams, new_seed, token_logprobs
from .suffix import SuffixStore


class Context:
    """The drafter's cache of injected target features, plus the features of
    positions committed since its last draft (injected when it next drafts:
    one batched pass instead of one per plain step)."""

    def __init__(self, model: DFlashModel):
        self.draft = model.draft
        self.cache = model.draft.make_cache() if model.draft is not None else None
        self.pending: list[mx.array] = []

    def add(self, features: Optional[mx.array]):
        if self.draft is not None:
            self.pending.append(features)

    def flush(self) -> list:
        """Inject what is pending; the drafter cache, ready to draft."""
        if self.pending:
            features = self.pending[0] if len(self.pending) == 1 else mx.concatenate(self.pending, axis=1)
            self.draft.add_context(features, self.cache)
            self.pending = []
        return self.cache


def check_token_ids(ids: list[int], vocab_size: int) -> None:
    """A ValueError naming the first id outside the vocabulary: an embedding read past its table
    gives whatever memory lies there, not an error."""
    bad = next((t for t in ids if not 0 <= t < vocab_size), None)
    if bad is not None:
        raise ValueError(f"prompt token id {bad} is outside the vocabulary (0..{vocab_size - 1})")


@dataclass
class Request:
    """A request as the step sees it.  `block_size` None lets the planner choose its widths
    (when the model has one); `logprobs` asks for the target's log-probabilities of each
    token with that many top alternatives; a `grammar` masks the target's choice."""

    prompt: list[int]
    max_tokens: int
    params: SamplingParams = SamplingParams()
    seed: Optional[int] = None
    block_size: Optional[int] = None
    logprobs: Optional[int] = None
    grammar: Optional[Grammar] = None
    stats: DecodeStats = field(default_factory=DecodeStats)
    # a prompt prefilled while idle (idle.py): no one reads its Step, and a request joining stops it
    background: bool = False
    uid: int = -1
    # set when decoding starts (begin)
    block: int = 1  # its widest verify (its block size; 1 without a drafter)
    adaptive: bool = False
    context: Optional[Context] = None
    lookup: Optional[PromptLookup] = None
    suffixes: Optional[SuffixStore] = None  # the model's earlier answers (suffix.py)
    noise: Optional[Noise] = None
    constraint: object = None  # the grammar's state
    estimates: dict = field(default_factory=dict)  # kind -> AcceptanceEstimate (plan.py)
    since_draft: int = 0
    copy_widths: dict = field(default_factory=dict)  # copy kind -> widest next proposal (plan.py)
    unfilled: list[int] = field(default_factory=list)  # prompt tokens still to prefill
    token: int = -1  # the last committed token
    output: list[int] = field(default_factory=list)  # every committed token

    def begin(self, model: DFlashModel) -> None:
        """Ready to decode with `model`: its drafter context, noise, lookup and grammar state."""
        check_token_ids(self.prompt, model.target.vocab_size)
        self.adaptive = model.draft is not None and self.block_size is None and model.planner is not None
        self.block = 1 if model.draft is None else (self.block_size or model.draft.block_size)
        self.stats.block_size = self.block
        self.context = Context(model)
        if not self.params.greedy:
            self.noise = Noise(new_seed() if self.seed is None else self.seed, model.target.vocab_size)
        self.lookup = PromptLookup(self.prompt, ends=model.end_tokens) if self.adaptive else None
        self.suffixes = model.suffixes if self.adaptive else None
        self.constraint = self.grammar.start() if self.grammar is not None else None
        if model.planner is not None:
            model.planner.start(self)

    @property
    def produced(self) -> int:
        return len(self.output)

    @property
    def context_length(self) -> int:
        """Tokens its caches hold: the prompt and what it committed."""
        return len(self.prompt) + len(self.output)

    @property
    def fed(self) -> list[int]:
        """The tokens its caches hold between steps: its prompt and all it committed but the
        last (fed with the next pass)."""
        return self.prompt + self.output[:-1]

    @property
    def left(self) -> int:
        return self.max_tokens - self.produced

    @property
    def most_tokens(self) -> int:
        """Prompt + max_tokens: the longest it can grow."""
        return len(self.prompt) + self.max_tokens

    def matches(self, limit: int) -> list[Match]:
        """The copies of up to `limit` tokens on offer: the prompt lookup's, and the session-wide
        store's (none without a lookup)."""
        if self.lookup is None or limit <= 0:
            return []
        found = [self.lookup.propose(limit)]
        if self.suffixes is not None:
            found.append(self.suffixes.propose(self.lookup.tokens, limit))
        return found

    def noise_at(self, start: int, count: int) -> Optional[mx.array]:
        """(count, vocab) noise of output positions start.. (None when greedy)."""
        return None if self.noise is None else self.noise.at(start, count)

    def forced(self, limit: int) -> list[int]:
        """Up to `limit` next tokens its grammar allows alone (none without a grammar)."""
        return [] if self.constraint is None else self.constraint.forced(limit)

    def masks(self, proposal: list[int]) -> Optional[mx.array]:
        """The grammar's masks after each prefix of `proposal` (None without a grammar)."""
        return None if self.constraint is None else self.constraint.masks(proposal)

    def record(self, plan: Optional[Plan], committed: list[int], accepted: int, logits: mx.array) -> Step:
        """A cycle committed `committed` (`accepted` of them drafted), chosen from `logits` (one
        row per token): the Step out, the state moved on.  `plan` None: the first token, chosen
        by the prompt's last pass (not a decode cycle)."""
        if self.constraint is not None:
            self.constraint.commit(committed)
        if self.lookup is not None:
            self.lookup.extend(committed)
        self.token = committed[-1]
        self.output += committed
        if plan is not None:
            self.stats.accepted_lengths.append(len(committed))
            self.stats.widths.append(plan.width)
            self.stats.sources.append(plan.source)
        return Step(
            committed, accepted, None if self.logprobs is None else token_logprobs(logits, committed, self.logprobs)
        )
