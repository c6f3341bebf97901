"""A request: what the caller asked (Request, built and checked once by build_request, never
changed) and what the decoder tracks of it (Row: the noise of its output positions, the
drafter's context of target features, its prompt lookup and the model's session-wide store of
earlier answers, its grammar state, the planner's acceptance estimates, its output and
statistics).  The step (decoder.py) reads a Row and `record`s what each cycle committed."""

import math
import numbers
from dataclasses import dataclass
from typing import Optional, Sequence, Union

import mlx.core as mx

from .grammar import Grammar
from .learning import Learning, widest_verify
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
        features = self.take()
        if features is not None:
            self.draft.add_context(features, self.cache)
        return self.cache

    def take(self) -> Optional[mx.array]:
        """The pending features (1, S, n_layers * hidden), no longer pending (None: none): the
        drafter's next pass injects them (`DFlashDraftModel.drafts`' `fresh`)."""
        if not self.pending:
            return None
        features = self.pending[0] if len(self.pending) == 1 else mx.concatenate(self.pending, axis=1)
        self.pending = []
        return features


# ---------------------------------------------------------------- a request, checked once

SAMPLING_RANGES = {"temperature": (0, math.inf), "top_p": (0, 1)}  # what sampling takes (the Python API, the CLI)
MAX_LOGPROBS = 20  # top alternatives per token


class BadValue(ValueError):
    """A value a request may not ask, naming its `field` (as the caller wrote it) and the fix;
    `code`: a machine-readable reason where the reference API gives one."""

    def __init__(self, field: str, message: str, code: Optional[str] = None):
        super().__init__(message)
        self.field, self.code = field, code


class BadType(BadValue, TypeError):
    """A value of the wrong type (a TypeError too, as Python's own checks raise)."""


class OutOfRange(BadValue):
    """A number outside the API's reference range [low, high]: each API words it as its reference does."""

    def __init__(self, field: str, value, low, high):
        bounds = f">= {low}" if high == math.inf else f"between {low} and {high}"
        super().__init__(field, f"{field} must be {bounds}, got {value}")
        self.value, self.low, self.high = value, low, high


@dataclass(frozen=True)
class Bounds:
    """What a request may ask of the model: token ids below `vocab_size`, verify widths up to
    `widest` (the drafter's block; 1 without a drafter), prompt + answer within `context`
    (None: its config does not say)."""

    vocab_size: int
    widest: int = 1
    context: Optional[int] = None


def check_token_ids(ids: list[int], vocab_size: int) -> None:
    """A ValueError naming the first id outside the vocabulary: an embedding read past its table
    gives whatever memory lies there, not an error."""
    bad = next((t for t in ids if not 0 <= t < vocab_size), None)
    if bad is not None:
        raise BadValue("prompt", f"prompt token id {bad} is outside the vocabulary (0..{vocab_size - 1})")


def _integer(value, name: str, low: Optional[int] = None) -> Optional[int]:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise BadType(name, f"{name} must be an integer, got {type(value).__name__}")
    if low is not None and value < low:
        raise BadValue(name, f"{name} must be at least {low}, got {value}")
    return int(value)


def _real(value, name: str, bounds: tuple) -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise BadType(name, f"{name} must be a number, got {type(value).__name__}")
    if not math.isfinite(value):
        raise BadValue(name, f"{name} must be finite, got {value}")
    low, high = bounds
    if not low <= value <= high:
        raise OutOfRange(name, value, low, high)
    return float(value)


NAMES = ("max_tokens", "temperature", "top_p", "top_k", "seed", "block_size", "logprobs", "stop")


@dataclass(frozen=True)
class Values:
    """A request's values checked on their own (before the model is known: the CLI checks its
    flags so before loading); build_request checks them against the model."""

    max_tokens: int
    params: SamplingParams
    seed: Optional[int]
    block_size: Optional[int]
    logprobs: Optional[int]
    stop: tuple[str, ...]


def check_values(
    max_tokens,
    temperature=0.0,
    top_p=1.0,
    top_k=0,
    seed=None,
    block_size=None,
    logprobs=None,
    stop: Union[str, Sequence[str]] = (),
    ranges: dict = SAMPLING_RANGES,
    names: Optional[dict] = None,
) -> Values:
    """Each value's type and range checked (sampling within `ranges`, the API's reference ranges;
    a seed is any integer, reduced to 64 bits).  `names`: the fields as the caller calls them
    (max_tokens may be max_output_tokens, temperature --temp), for the errors."""
    name = {**dict(zip(NAMES, NAMES)), **(names or {})}
    max_tokens = _integer(max_tokens, name["max_tokens"])
    if max_tokens is None or max_tokens <= 0:
        raise BadValue(name["max_tokens"], f"{name['max_tokens']} must be > 0, got {max_tokens}")
    temp = _real(temperature, name["temperature"], ranges["temperature"])
    p = _real(top_p, name["top_p"], ranges["top_p"])
    if p == 0:
        raise BadValue(name["top_p"], f"{name['top_p']} must be > 0")
    params = SamplingParams(temp, p, _integer(top_k, name["top_k"], low=0))
    seed = _integer(seed, name["seed"])
    logprobs = _integer(logprobs, name["logprobs"])
    if logprobs is not None and not 0 <= logprobs <= MAX_LOGPROBS:
        raise BadValue(
            name["logprobs"],
            f"{name['logprobs']} must be an integer between 0 and {MAX_LOGPROBS} (top alternatives per token), "
            f"got {logprobs}",
        )
    stop = [stop] if isinstance(stop, str) else stop
    if not isinstance(stop, (list, tuple)) or not all(isinstance(s, str) for s in stop):
        raise BadType(name["stop"], f"{name['stop']} must be a string or a list of strings")
    block_size = _integer(block_size, name["block_size"], low=1)
    seed = None if seed is None else seed % (1 << 64)
    return Values(max_tokens, params, seed, block_size, logprobs, tuple(stop))


def build_request(
    prompt: list[int],
    max_tokens,
    bounds: Bounds,
    *,
    grammar: Optional[Grammar] = None,
    cut_to_context: bool = False,
    names: Optional[dict] = None,
    **values,
) -> "Request":
    """The one place a caller's values become a Request: each checked (check_values: a BadValue,
    or a BadType, naming the field and the fix), then against the model's `bounds`.
    `block_size` None: the planner chooses the widths (Request.begin).  `max_tokens` is refused
    when prompt + max_tokens would not fit the context, or, with `cut_to_context` (a server:
    clients ask for what a hosted model writes), cut to the room the prompt leaves.  `values`:
    check_values' (temperature, top_p, top_k, seed, block_size, logprobs, stop, ranges)."""
    name = {**dict(zip(NAMES, NAMES)), **(names or {})}
    checked = check_values(max_tokens, names=names, **values)
    check_token_ids(prompt, bounds.vocab_size)
    block_size = checked.block_size
    if block_size is not None and block_size > bounds.widest:
        raise BadValue(
            name["block_size"],
            f"{name['block_size']} must be between 1 and {bounds.widest} (the drafter's block), got {block_size}"
            if bounds.widest > 1
            else f"{name['block_size']} must be 1 without a drafter, got {block_size}",
        )
    budget = _within_context(len(prompt), checked.max_tokens, bounds.context, cut_to_context, name["max_tokens"])
    return Request(
        list(prompt),
        budget,
        checked.params,
        checked.seed,
        block_size,
        checked.logprobs,
        grammar,
        stop=checked.stop,
        ends_at_context=budget < checked.max_tokens,
    )


def _within_context(prompt: int, max_tokens: int, context: Optional[int], cut: bool, name: str) -> int:
    """`max_tokens`, or (`cut`) what the context leaves after the prompt when that is less.  A
    prompt that leaves no room is refused in the Anthropic API's words, which Claude Code reads
    to compact the conversation."""
    if not context or prompt + max_tokens <= context:
        return max_tokens
    if not cut:
        raise BadValue(
            name,
            f"prompt ({prompt} tokens) + {name} ({max_tokens}) exceeds the model's context of {context} "
            f"tokens; shorten the prompt or lower {name}",
        )
    if prompt >= context:
        raise BadValue(
            "prompt",
            f"prompt is too long: {prompt} tokens > {context - 1} maximum "
            f"(the model's context is {context} tokens, the answer needs one)",
            code="context_length_exceeded",
        )
    return context - prompt


@dataclass(frozen=True)
class Request:
    """What a caller asked, built and checked once (build_request) and never changed.
    `block_size` None lets the planner choose its widths (when the model has one); `logprobs`
    asks for the target's log-probabilities of each token with that many top alternatives; a
    `grammar` masks the target's choice; `stop` strings cut the text (api.generation.Responses)."""

    prompt: list[int]
    max_tokens: int
    params: SamplingParams = SamplingParams()
    seed: Optional[int] = None
    block_size: Optional[int] = None
    logprobs: Optional[int] = None
    grammar: Optional[Grammar] = None
    stop: tuple[str, ...] = ()
    ends_at_context: bool = False  # max_tokens was cut to the context's end (its finish is "context")
    # a prompt prefilled while idle (idle.py): no one reads its Step, and a request joining stops it
    background: bool = False


class Row:
    """A request as the decoder tracks it (`uid`): its widest verify (`block`) and whether the
    planner chooses its widths (`adaptive`), its drafter context, noise, prompt lookup and
    grammar state; the planner's estimates; what is left to prefill, what it committed
    (`output`) and its statistics (`stats`, the caller's to read when it passes one)."""

    def __init__(
        self, request: Request, uid: int, model: DFlashModel, learning: Learning, stats: Optional[DecodeStats] = None
    ):
        # the edge refused these already (build_request); the decoder's own callers (decode(), the
        # training's evaluation) are guarded too: an embedding read past its table reads memory
        check_token_ids(request.prompt, model.target.vocab_size)
        self.request, self.uid = request, uid
        self.stats = stats if stats is not None else DecodeStats()
        self.adaptive = request.block_size is None and learning.planner is not None
        # without a drafter a fixed width is plain decoding: copies alone propose, as the planner chooses
        fixed = request.block_size if model.draft is not None else 1
        self.block = widest_verify(model, learning) if self.adaptive else (fixed or widest_verify(model, learning))
        self.stats.block_size, self.stats.adaptive = self.block, self.adaptive
        self.context = Context(model)
        self.noise = None
        if not request.params.greedy:
            self.noise = Noise(new_seed() if request.seed is None else request.seed, model.target.vocab_size)
        self.lookup = PromptLookup(request.prompt, ends=model.end_tokens) if self.adaptive else None
        self.suffixes: Optional[SuffixStore] = learning.suffixes if self.adaptive else None  # earlier answers
        self.constraint = request.grammar.start() if request.grammar is not None else None  # the grammar's state
        self.estimates: dict = {}  # kind -> AcceptanceEstimate (plan.py)
        self.since_draft, self.probe_gap, self.learnt = 0, 0, 0
        self.copy_widths: dict = {}  # copy kind -> widest next proposal (plan.py)
        self.unfilled: list[int] = []  # prompt tokens still to prefill
        self.token = -1  # the last committed token
        self.output: list[int] = []  # every committed token
        if learning.planner is not None:
            learning.planner.start(self)

    @property
    def prompt(self) -> list[int]:
        return self.request.prompt

    @property
    def params(self) -> SamplingParams:
        return self.request.params

    @property
    def background(self) -> bool:
        return self.request.background

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
        return self.request.max_tokens - self.produced

    @property
    def spent(self) -> bool:
        """Whether it has committed its max_tokens (it then leaves the decoder; its answer ends at
        its "length")."""
        return self.left <= 0

    @property
    def most_tokens(self) -> int:
        """Prompt + max_tokens: the longest it can grow."""
        return len(self.prompt) + self.request.max_tokens

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
            self.stats.drafter_widths.append(plan.drafter_width)
        logprobs = self.request.logprobs
        return Step(
            committed, accepted, None if logprobs is None else token_logprobs(logits, committed, logprobs), self.spent
        )
