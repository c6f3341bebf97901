"""Several requests decoded together: one target pass per step for all of them.

    join    the waiting prompts are prefilled together, one chunk each per step in one
            target pass (the running rows keep decoding in between), all but their last
            token; then their caches are merged into the batch, the last token being their
            first step's block
    step    every row proposes for a shared width w (its drafter context, or its prompt
            lookup; the rows drafting at one width share one drafter pass), one target
            pass verifies B x w tokens, each row accepts its own
            prefix and rolls back its own caches (the batch handlers in rollback.py)
    leave   finished and cancelled rows are filtered out between steps

With a cost model (adaptive.py), the width is chosen for the whole batch: the w that
maximises the tokens all rows are expected to commit per second, a pass over B x w tokens
plus the drafter passes.  On a CPU, where a pass is compute-bound, a large batch
decodes plain (w = 1); where the pass cost is flat in its length (a Mac GPU), drafting
pays at small and medium batch sizes.  Without one, each row drafts its own block.

Every row's output is what it gets alone: greedy chooses the same tokens, sampling draws
the same noise per (seed, position) (sampling.py), and a row's rollback restores its caches
to its own kept prefix.
"""

import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Optional

import mlx.core as mx

from .adaptive import PLAIN, AcceptanceEstimate, Plan, StepTimes
from .engine import PREFILL_STEP, DecodeStats, DFlashModel, Sequence, tree_arrays, draft_rows, restore_prefix
from .grammar import Grammar, masked
from .prompt_cache import PromptCache
from .sampling import SamplingParams, accept, choose
from .target import BatchTargetCache, TargetCache


@dataclass
class Row:
    """One request in the batch."""

    uid: int
    seq: Sequence
    prompt: list[int]
    max_tokens: int
    block: int  # its widest verify (its block size; 1 without a drafter)
    adaptive: bool  # its width follows the batch's plan (no block size asked for)
    unfilled: list[int] = field(default_factory=list)  # prompt tokens still to prefill (all but the last)
    token: int = -1  # the last committed token (the prompt's last, until its first step)
    produced: int = 0
    estimates: dict = field(default_factory=dict)  # kind -> AcceptanceEstimate

    @property
    def stats(self) -> DecodeStats:
        return self.seq.stats

    @property
    def left(self) -> int:
        return self.max_tokens - self.produced

    @property
    def most_tokens(self) -> int:
        """Prompt + max_tokens: the longest it can grow."""
        return len(self.prompt) + self.max_tokens


@dataclass
class BatchStep:
    """What one step did: the batch size and verify width, and each row's committed tokens."""

    size: int
    width: int
    steps: dict  # uid -> Step


def _joined(batch: Optional[BatchTargetCache], caches: list[TargetCache]) -> BatchTargetCache:
    """`batch` with rows holding `caches` appended (a new batch when there is none)."""
    rows = BatchTargetCache(caches)
    if batch is None:
        return rows
    batch.extend(rows)
    return batch


def _without(rows: list[Row], batch: Optional[BatchTargetCache], uids) -> tuple[list[Row], Optional[BatchTargetCache]]:
    """`rows` and their batch cache with the rows of `uids` dropped."""
    kept = [i for i, row in enumerate(rows) if row.uid not in uids]
    if len(kept) == len(rows):
        return rows, batch
    if not kept:
        return [], None
    batch.keep_rows(kept)
    return [rows[i] for i in kept], _settled(batch)


def _settled(batch: BatchTargetCache) -> BatchTargetCache:
    """`batch` with its rows' merge or filter computed now, not in the next decode step, whose
    time teaches StepTimes what a step of its shape costs (traced: a plain step after a join
    timed at 8x the curve, and its shape then judged too dear to run again)."""
    mx.eval(tree_arrays([c.state for c in batch.layers]))
    return batch


class BatchDecoder:
    """Up to `max_batch` requests decoded together.  With `max_batch_tokens`, a request joins
    only while the batch's caches stay within that many tokens (rows x the longest row, padding
    included, at its longest: mlx-lm's batch caches hold every row at the longest one's length);
    a request too long for the bound runs alone once the batch is empty."""

    def __init__(self, model: DFlashModel, prompt_cache: Optional[PromptCache] = None, max_batch: int = 8,
                 max_batch_tokens: Optional[int] = None):
        self.model, self.prompt_cache = model, prompt_cache
        self.max_batch, self.max_batch_tokens = max_batch, max_batch_tokens
        self.rows: list[Row] = []  # decoding, in the batch cache's row order
        self.cache: Optional[BatchTargetCache] = None
        self.filling: list[Row] = []  # prefilling together, in the fill cache's row order
        self.fill_cache: Optional[BatchTargetCache] = None
        self.waiting: list[Row] = []  # queued until there is room
        self.step_times = model.chooser.step_times if model.chooser is not None else StepTimes()
        self._next_uid = 0
        self._decodes = 0  # decode steps run
        self._plain_at: dict[int, int] = {}  # batch size -> the decode step its plain shape last ran at

    @property
    def busy(self) -> bool:
        return bool(self.rows or self.filling or self.waiting)

    def add(self, prompt: mx.array, params: SamplingParams, max_tokens: int, block_size: Optional[int] = None,
            seed: Optional[int] = None, logprobs: Optional[int] = None, grammar: Optional[Grammar] = None,
            stats: Optional[DecodeStats] = None) -> int:
        """Queue a request (arguments as engine.decode's); its uid.  Its Steps come out of step()."""
        model = self.model
        adaptive = model.draft is not None and block_size is None and model.chooser is not None
        block = 1 if model.draft is None else (block_size or model.draft.block_size)
        stats = stats if stats is not None else DecodeStats()
        stats.block_size = block
        seq = Sequence(model, prompt, params, seed, stats, adaptive, logprobs, grammar)
        uid, self._next_uid = self._next_uid, self._next_uid + 1
        self.waiting.append(Row(uid, seq, prompt.tolist(), max_tokens, block, adaptive))
        return uid

    def remove(self, *uids: int) -> None:
        """Drop requests (finished, stopped or cancelled); their rows are freed before the next step."""
        self.waiting = [row for row in self.waiting if row.uid not in uids]
        self.filling, self.fill_cache = _without(self.filling, self.fill_cache, uids)
        decoding = bool(self.rows)
        self.rows, self.cache = _without(self.rows, self.cache, uids)
        if decoding and not self.rows:
            self.step_times.flush()  # idle: keep what this batch learnt for the next process

    def step(self) -> BatchStep:
        """One prefill chunk of the requests joining (those with room start theirs), then one
        decode step of the batch.  Rows that reach their max_tokens leave by themselves."""
        self._admit()
        if self.filling:
            self._fill()
        steps, size, width = {}, len(self.rows), 0
        if self.rows:
            width = self._decode(steps)
        self.remove(*(row.uid for row in self.rows if row.left <= 0))  # one filter for all that ended
        return BatchStep(size, width, steps)

    # ------------------------------------------------------------ joining

    def _admit(self) -> None:
        """Waiting requests start their prefill (first come, first served: a long request waits
        for room instead of being overtaken for ever) from the longest prefix the prompt cache
        holds; one with nothing left to prefill joins the decoding batch at once."""
        while self.waiting and self._room_for(self.waiting[0]):
            row = self.waiting.pop(0)
            tcache, start = restore_prefix(self.model, row.prompt, row.seq.context, self.prompt_cache, row.stats)
            row.unfilled = row.prompt[start:-1]
            if row.unfilled:
                self.filling.append(row)
                self.fill_cache = _joined(self.fill_cache, [tcache])
            else:
                self._enter([row], [tcache])

    def _room_for(self, row: Row) -> bool:
        others = self.rows + self.filling
        if len(others) >= self.max_batch:
            return False
        if not others or self.max_batch_tokens is None:
            return True
        longest = max([row.most_tokens] + [r.most_tokens for r in self.filling]
                      + ([self.cache.width + max(r.left for r in self.rows)] if self.rows else []))
        return (len(others) + 1) * longest <= self.max_batch_tokens

    def _fill(self) -> None:
        """The next chunk of every filling row's prompt, in one target pass (right-padded to the
        longest chunk, PREFILL_STEP tokens in all, so the running rows wait for one chunk's pass
        only); the rows whose prompt is in join the decoding batch."""
        rows, tic = self.filling, time.perf_counter()
        span = max(PREFILL_STEP // len(rows), 1)
        chunks = [row.unfilled[:span] for row in rows]
        lengths = [len(chunk) for chunk in chunks]
        tokens = mx.array([chunk + [0] * (max(lengths) - len(chunk)) for chunk in chunks])
        self.fill_cache.pad_right(lengths)
        _, features = self.model.target(tokens, self.fill_cache, self.model.feature_layers, logits_for_last_only=True)
        self.fill_cache.finalize()
        for i, (row, n) in enumerate(zip(rows, lengths)):
            row.seq.context.add(None if features is None else features[i : i + 1, :n])
            row.unfilled = row.unfilled[n:]
        mx.eval(tree_arrays([c.state for c in self.fill_cache.layers]),
                tree_arrays([c.state for row in rows for c in row.seq.context.flush() or []]))
        seconds = time.perf_counter() - tic
        for row in rows:
            row.stats.prompt_seconds += seconds
        done = [i for i, row in enumerate(rows) if not row.unfilled]
        if done:
            self._enter([rows[i] for i in done], [self.fill_cache.extract(i) for i in done])
            self.filling, self.fill_cache = _without(rows, self.fill_cache, {rows[i].uid for i in done})

    def _enter(self, rows: list[Row], tcaches: list[TargetCache]) -> None:
        """Rows holding all of their prompt but its last token join the decoding batch (the last
        token is their first step's, as in a decode step); what was prefilled is kept for reuse."""
        for row, tcache in zip(rows, tcaches):
            if self.prompt_cache is not None and row.stats.cached_tokens < len(row.prompt) - 1:
                self.prompt_cache.store(row.prompt[:-1], tcache, row.seq.context.flush())
            row.token = row.prompt[-1]
        self.cache = _settled(_joined(self.cache, tcaches))
        self.rows += rows

    # ------------------------------------------------------------ decoding

    def _decode(self, steps: dict) -> int:
        started = time.perf_counter()
        model, rows = self.model, self.rows
        plans = self._plan()
        modelled = self._seconds(rows, plans) if model.chooser is not None else None
        width = max(plan.width for plan in plans)
        noises = [row.seq.noise(row.produced, plan.width) for row, plan in zip(rows, plans)]
        lasts = [mx.array([row.token], dtype=mx.int32) for row in rows]
        proposals = self._proposals(plans, lasts, noises)
        blocks = [mx.concatenate([last, proposal.astype(mx.int32),
                                  mx.zeros((width - plan.width,), dtype=mx.int32)])  # never accepted: past the proposal
                  for last, proposal, plan in zip(lasts, proposals, plans)]
        if width > 1:
            self.cache.checkpoint()
        logits, features = model.target(mx.stack(blocks), self.cache, model.feature_layers)
        accepted = [accept(proposal, choose(masked(logits[i, : plan.width], row.seq.masks(proposal.tolist())
                                                  if row.seq.constraint else None), row.seq.params, noise))
                    for i, (row, plan, proposal, noise) in enumerate(zip(rows, plans, proposals, noises))]
        mx.eval(accepted, proposals)
        keeps = []
        for i, (row, plan, proposal, (n, next_token)) in enumerate(zip(rows, plans, proposals, accepted)):
            n = n.item()
            committed = proposal[:n].tolist() + [next_token.item()]
            keeps.append(n + 1)
            row.seq.context.add(None if features is None else features[i : i + 1, : n + 1])
            self._learn(row, plan, n)
            row.token, row.produced = committed[-1], row.produced + len(committed)
            stats = row.stats
            stats.accepted_lengths.append(len(committed))
            stats.widths.append(plan.width)
            stats.sources.append(plan.source)
            steps[row.uid] = row.seq.step(committed, n, logits[i, : n + 1])
        if width > 1:
            self.cache.rollback(keeps)
        seconds = time.perf_counter() - started
        if modelled is not None:
            self.step_times.observe(len(rows), width, modelled, seconds)
        self._decodes += 1
        if width == 1:
            self._plain_at[len(rows)] = self._decodes
        for row in rows:
            row.stats.decode_seconds += seconds
        return width

    def _proposals(self, plans: list[Plan], lasts: list[mx.array], noises: list) -> list[mx.array]:
        """Each row's proposal: its prompt lookup's tokens, or its drafter's, all rows drafting
        at one width in one drafter pass (its weights read once for all of them)."""
        proposals = [mx.array(plan.tokens, dtype=mx.int32) for plan in plans]
        for width in sorted({plan.width for plan in plans if plan.source == "dflash"}):
            drafting = [i for i, plan in enumerate(plans) if plan.source == "dflash" and plan.width == width]
            drafted = draft_rows(self.model, [lasts[i] for i in drafting], [self.rows[i].seq.context for i in drafting],
                                 width, [self.rows[i].seq.params for i in drafting], [noises[i] for i in drafting])
            for i, proposal in zip(drafting, drafted):
                proposals[i] = proposal
        return proposals

    def _plan(self) -> list[Plan]:
        """Each row's plan for this step (the widest sets the batch's verify width)."""
        rows, chooser = self.rows, self.model.chooser
        fixed = [Plan(min(row.block, row.left), "dflash") if min(row.block, row.left) > 1 else PLAIN
                 for row in rows]
        if chooser is None or not any(row.adaptive for row in rows):
            return fixed
        matches = [row.seq.lookup.propose(min(chooser.max_width, row.left) - 1) if row.adaptive else None
                   for row in rows]
        sums = {}  # (row, kind) -> E[committed | width] for every width: summed once per step

        def expected(row: Row, plan: Plan) -> float:
            if plan.width == 1:
                return 1.0
            if (row.uid, plan.kind) not in sums:
                sums[row.uid, plan.kind] = self._estimate(row, plan.kind).expected_committed()
            return sums[row.uid, plan.kind][plan.width]

        least = max((plan.width for row, plan in zip(rows, fixed) if not row.adaptive), default=1)
        if least == 1 and self._decodes - self._plain_at.get(len(rows), 0) >= chooser.explore_every:
            # Re-time the plain step now and then: the figure it is judged by may be old (shorter
            # contexts) or one bad step, and a plain shape judged too dear is otherwise never run again.
            return [PLAIN] * len(rows)
        best, best_value = None, 0.0
        for width in range(least, chooser.max_width + 1):
            plans = [self._row_plan(row, width, match, expected) if row.adaptive else plan
                     for row, plan, match in zip(rows, fixed, matches)]
            seconds = self.step_times.seconds(len(rows), max(plan.width for plan in plans), self._seconds(rows, plans))
            value = sum(map(expected, rows, plans)) / seconds
            if best is None or value > best_value:
                best, best_value = plans, value
        return best

    def _row_plan(self, row: Row, width: int, match, expected) -> Plan:
        """The row's likeliest-accepted proposal of at most `width` tokens verified."""
        limit = min(width, row.left)
        if limit < 2:
            return PLAIN
        candidates = [Plan(limit, "dflash")] if self.model.draft is not None else []
        if match:
            longest = min(len(match.tokens) + 1, limit)
            candidates.append(Plan(longest, "lookup", match.tokens[: longest - 1], match.length))
        return max(candidates, key=lambda plan: expected(row, plan), default=PLAIN)

    def _seconds(self, rows: list[Row], plans: list[Plan]) -> float:
        """One step's time by the cost curve: a target pass over every row's block at the widest
        plan's width, one drafter pass per width the drafting rows draft at, and each row's
        sampling distributions.  The plan scales it by what steps of that shape really took
        (StepTimes)."""
        cost = self.model.chooser.cost
        width = max(plan.width for plan in plans)
        drafting = Counter(plan.width for plan in plans if plan.source == "dflash" and plan.width > 1)
        return (cost.verify(len(rows) * width)
                + sum(cost.drafter_pass(w, count) for w, count in drafting.items())
                + sum(cost.sampling(plan.width, row.seq.params, drafted=plan.source == "dflash")
                      for row, plan in zip(rows, plans)))

    def _estimate(self, row: Row, kind: str) -> AcceptanceEstimate:
        if kind not in row.estimates:
            row.estimates[kind] = self.model.chooser.fresh_estimate(kind)
        return row.estimates[kind]

    def _learn(self, row: Row, plan: Plan, accepted: int) -> None:
        if not row.adaptive:
            return
        for estimate in row.estimates.values():
            estimate.age()
        if plan.width > 1:
            self._estimate(row, plan.kind).observe(plan.width, accepted)
            self.model.chooser.learn(plan.kind, plan.width, accepted)
