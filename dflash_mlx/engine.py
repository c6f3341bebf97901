"""The DFlash decode loop, at the token level.

    prefill  the prompt through the target, injecting its features into the drafter
    repeat:
      draft     [last token, mask x (w-1)] -> w-1 tokens, one drafter pass
      verify    [last token] + draft       -> logits + features, one target pass
      accept    longest agreeing prefix (n tokens) + one token from the target
      roll back target caches to the n+1 tokens kept; their features go to the drafter

Without a drafter the same loop runs with w = 1: plain target decoding.  With a
WidthChooser (adaptive.py) and no fixed block size, each cycle's plan is chosen:
plain, the drafter at width w, or the prompt lookup's proposal (lookup.py), which
is verified the same way and costs no drafter pass.
Consecutive plain cycles are pipelined (the next pass is queued before the
current token is read), as in mlx-lm's generate_step.  The drafter reads the
target's features only when it drafts, so they are injected then, all the
positions since its last draft in one pass (`Context`).
"""

import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Iterator, Optional

import mlx.core as mx
from mlx.utils import tree_flatten

from .adaptive import PLAIN, Plan, WidthChooser
from .drafters import DFlashDraftModel
from .grammar import Grammar, masked
from .lookup import PromptLookup
from .prompt_cache import PromptCache
from .sampling import Noise, SamplingParams, TokenLogprob, accept, choose, new_seed, token_logprobs
from .target import Target, TargetCache

PREFILL_STEP = 512


@dataclass
class DFlashModel:
    """A target with an optional drafter bound to it."""

    target: Target
    draft: Optional[DFlashDraftModel] = None
    draft_note: str = ""  # why there is no drafter, when there is none
    chooser: Optional[WidthChooser] = None  # adaptive verify width, kept across generations

    @property
    def feature_layers(self) -> list[int]:
        return self.draft.target_layer_ids if self.draft else []


@dataclass
class DecodeStats:
    """Tokens committed per cycle (accepted drafts + the target's own token)."""

    block_size: int = 1
    accepted_lengths: list[int] = field(default_factory=list)
    widths: list[int] = field(default_factory=list)  # verify width of each cycle (1 = plain)
    sources: list[str] = field(default_factory=list)  # what proposed each cycle: plain, dflash or lookup
    prompt_seconds: float = 0.0
    decode_seconds: float = 0.0
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

    @property
    def source_counts(self) -> dict[str, int]:
        return dict(Counter(self.sources))

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


class Sequence:
    """One request's decoding state beside its target cache: the drafter's context, the
    sampling noise of each output position, the prompt lookup, the grammar, the stats."""

    def __init__(self, model: DFlashModel, prompt: mx.array, params: SamplingParams, seed: Optional[int],
                 stats: DecodeStats, lookup: bool, logprobs: Optional[int] = None,
                 grammar: Optional[Grammar] = None):
        self.params, self.stats, self.logprobs = params, stats, logprobs
        self.context = Context(model)
        self.position_noise = None if params.greedy else Noise(new_seed() if seed is None else seed,
                                                                model.target.vocab_size)
        self.lookup = PromptLookup(prompt.tolist()) if lookup else None
        self.constraint = grammar.start() if grammar is not None else None

    def noise(self, start: int, count: int) -> Optional[mx.array]:
        """(count, vocab) noise of output positions start.. (None when greedy)."""
        return None if self.position_noise is None else self.position_noise.at(start, count)

    def noise_at(self, position: int) -> Optional[mx.array]:
        return None if self.position_noise is None else self.position_noise.at(position, 1)[0]

    def allowed_next(self) -> Optional[mx.array]:
        """The grammar's mask of the next position (None without a grammar)."""
        return None if self.constraint is None else self.constraint.masks([])[0]

    def masks(self, proposal: list[int]) -> Optional[mx.array]:
        """The grammar's masks after each prefix of `proposal` (None without a grammar)."""
        return None if self.constraint is None else self.constraint.masks(proposal)

    def step(self, committed: list[int], accepted: int, logits: mx.array) -> Step:
        """The Step of tokens just committed, chosen from `logits` (one row per token)."""
        if self.constraint is not None:
            self.constraint.commit(committed)
        if self.lookup is not None:
            self.lookup.extend(committed)
        return Step(committed, accepted, None if self.logprobs is None else
                    token_logprobs(logits, committed, self.logprobs))


def prefill(model: DFlashModel, prompt: mx.array, tcache: TargetCache, context: Context) -> Iterator[mx.array]:
    """Run the prompt through the target in chunks; yield each chunk's last-position logits."""
    layers = model.feature_layers
    for start in range(0, prompt.size, PREFILL_STEP):
        chunk = prompt[None, start : start + PREFILL_STEP]
        logits, features = model.target(chunk, tcache, layers, logits_for_last_only=True)
        context.add(features)
        mx.eval(logits, tree_arrays([c.state for c in tcache.layers]), tree_arrays([c.state for c in context.flush() or []]))
        if start + PREFILL_STEP < prompt.size:
            mx.clear_cache()
        yield logits[0, -1]


def restore_prefix(model: DFlashModel, tokens: list[int], context: Context, prompt_cache: Optional[PromptCache],
                   stats: DecodeStats) -> tuple[TargetCache, int]:
    """A target cache holding the longest prefix of `tokens` that `prompt_cache` has (its
    drafter context restored into `context`) and that prefix's length; without one, a fresh
    cache and 0."""
    if prompt_cache is not None and (hit := prompt_cache.fetch(tokens)) is not None:
        tcache, context.cache, start = hit
    else:
        tcache, start = model.target.make_cache(), 0
    stats.cached_tokens = start
    return tcache, start


def prefill_prompt(model: DFlashModel, prompt: mx.array, context: Context, prompt_cache: Optional[PromptCache],
                   stats: DecodeStats) -> tuple[TargetCache, mx.array]:
    """Prefill all but the last prompt token, then the last one alone (as mlx-lm does), so
    a prompt gives the same logits whether or not `prompt_cache` held its prefix: the
    longest stored prefix is restored, and the state before the last token is stored.
    The target cache and the last position's logits."""
    tokens = prompt.tolist()
    tcache, start = restore_prefix(model, tokens, context, prompt_cache, stats)
    if len(tokens) - 1 > start:
        for _ in prefill(model, prompt[start:-1], tcache, context):
            pass
        if prompt_cache is not None:
            prompt_cache.store(tokens[:-1], tcache, context.flush())
    *_, logits = prefill(model, prompt[-1:], tcache, context)
    return tcache, logits


def tree_arrays(tree) -> list[mx.array]:
    return [x for _, x in tree_flatten(tree) if isinstance(x, mx.array)]


def draft(model: DFlashModel, last: mx.array, context: Context, width: int, params: SamplingParams,
          noise: Optional[mx.array]) -> mx.array:
    """Propose width - 1 tokens after `last` in one drafter pass (width >= 2), with the
    noise of their output positions (`noise` covers the whole verify block)."""
    return draft_rows(model, [last], [context], width, [params], [noise])[0]


def draft_rows(model: DFlashModel, lasts: list[mx.array], contexts: list[Context], width: int,
               params: list[SamplingParams], noises: list[Optional[mx.array]]) -> list[mx.array]:
    """draft() for several rows at one width, in one drafter pass: each row's proposal is
    what it drafts alone."""
    anchors = mx.concatenate([last.reshape(1) for last in lasts]).astype(mx.int32)[:, None]
    mask = mx.full((len(lasts), width - 1), model.draft.mask_token_id, dtype=mx.int32)
    return model.draft.propose_rows(mx.concatenate([anchors, mask], axis=1), [c.flush() for c in contexts],
                                    params, [None if noise is None else noise[:-1] for noise in noises])


def plain_step(model: DFlashModel, last: mx.array, tcache: TargetCache, context: Context,
               params: SamplingParams, noise: Optional[mx.array],
               mask: Optional[mx.array] = None) -> tuple[mx.array, mx.array]:
    """One target pass over `last` alone (nothing to verify or roll back): the next token and
    the logits it was chosen from, lazily.  The position's features are kept for the drafter."""
    logits, features = model.target(last.reshape(1, 1).astype(mx.int32), tcache, model.feature_layers)
    context.add(features)
    return choose(masked(logits[0, -1], mask), params, noise), logits[0]


def verify(model: DFlashModel, last: mx.array, proposal: mx.array, tcache: TargetCache):
    """Target logits and features at [last] + proposal, with the caches checkpointed."""
    tokens = mx.concatenate([last.reshape(1).astype(mx.int32), proposal.astype(mx.int32)])[None]
    tcache.checkpoint()
    logits, features = model.target(tokens, tcache, model.feature_layers)
    return logits[0], features


def decode(
    model: DFlashModel,
    prompt: mx.array,
    params: SamplingParams,
    max_tokens: int,
    block_size: Optional[int] = None,
    stats: Optional[DecodeStats] = None,
    seed: Optional[int] = None,
    prompt_cache: Optional[PromptCache] = None,
    logprobs: Optional[int] = None,
    grammar: Optional[Grammar] = None,
) -> Iterator[Step]:
    """Yield committed tokens cycle by cycle until `max_tokens` are out (the
    caller stops earlier on EOS or stop strings by closing the generator).
    Sampling draws its noise per output position from `seed` (sampling.py), so
    a seeded run gives the same tokens whatever widths the cycles use.  With a
    `prompt_cache`, the longest prefix it holds is restored instead of prefilled.
    With `logprobs` (a count of top alternatives, 0 for none), each Step also carries
    the target's log-probabilities of its tokens, read from the logits that chose them.
    A `grammar` masks the target's choice at every position (grammar.py)."""
    adaptive = model.draft is not None and block_size is None and model.chooser is not None
    width = 1 if model.draft is None else (block_size or model.draft.block_size)
    stats = stats if stats is not None else DecodeStats()
    stats.block_size = width
    seq = Sequence(model, prompt, params, seed, stats, adaptive, logprobs, grammar)
    if adaptive:
        model.chooser.start()

    def plan_for(limit: int) -> Plan:
        if adaptive:
            return model.chooser.choose(limit, params, seq.lookup.propose(limit - 1))
        return Plan(min(width, limit), "dflash") if min(width, limit) > 1 else PLAIN

    tic = time.perf_counter()
    tcache, logits = prefill_prompt(model, prompt, seq.context, prompt_cache, stats)
    token = choose(masked(logits, seq.allowed_next()), params, seq.noise_at(0))
    token = mx.array(token.item())
    stats.prompt_seconds = time.perf_counter() - tic
    tic = time.perf_counter()
    yield seq.step([token.item()], 0, logits[None])
    produced = 1

    queued, decided = None, None  # a plain step already in flight; a plan chosen ahead
    while produced < max_tokens:
        started = time.perf_counter()
        left = max_tokens - produced
        plan, decided = decided or plan_for(left), None
        if plan.width == 1:
            next_token, logits = queued or plain_step(model, token, tcache, seq.context, params,
                                                      seq.noise_at(produced), seq.allowed_next())
            # A plain cycle teaches the chooser nothing, so the next plan is known before
            # this token is: queue the next plain step now, and the graph of step t+1 is
            # built while step t computes.  Unless the plan would take the prompt lookup's
            # proposal, which depends on this token: that one is decided once it is read.
            queued = None
            if left > 1:
                decided = plan_for(left - 1)
                if decided.source == "lookup":
                    decided = None
                elif decided.width == 1 and seq.constraint is None:  # a grammar's next mask needs this token
                    queued = plain_step(model, next_token, tcache, seq.context, params, seq.noise_at(produced + 1))
                    mx.async_eval(queued[0])
            n, committed, logits = 0, [next_token.item()], logits[-1:]
        else:
            block_noise = seq.noise(produced, plan.width)
            if plan.source == "lookup":
                proposal = mx.array(plan.tokens, dtype=mx.int32)
            else:
                proposal = draft(model, token, seq.context, plan.width, params, block_noise)
            logits, features = verify(model, token, proposal, tcache)
            n, next_token = accept(proposal, choose(masked(logits, seq.masks(proposal.tolist())), params, block_noise))
            mx.eval(n, next_token, proposal)
            n = n.item()
            tcache.rollback(n + 1)
            seq.context.add(features[:, : n + 1])
            committed, logits = proposal[:n].tolist() + [next_token.item()], logits[: n + 1]
        if adaptive:
            model.chooser.record(plan, n, time.perf_counter() - started, params)
        token = next_token
        produced += len(committed)
        stats.accepted_lengths.append(len(committed))
        stats.widths.append(plan.width)
        stats.sources.append(plan.source)
        stats.decode_seconds = time.perf_counter() - tic
        yield seq.step(committed, n, logits)
