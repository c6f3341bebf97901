"""The DFlash decode loop: one step for one request or many.

    join     waiting prompts are prefilled together, a chunk each per target pass, a few
             passes a step (from the longest prefix the prompt cache holds; one that begins
             as a prompt being prefilled waits to restore what they share); the pass that
             ends a prompt chooses its first token, and the row joins the decoding rows
    plan     each row's proposal and the step's verify width (plan.py)
    propose  per row: the drafter ([last token, MASK x (w-1)], one pass for the rows drafting
             at one width), tokens copied by the prompt lookup or from earlier answers, or
             nothing (plain decoding)
    verify   one target pass over every row's [last token] + proposal: logits + features
    accept   each row keeps its longest agreeing prefix + one token of the target's own
    roll back each row's target caches to the tokens it kept; their features go to the
             drafter's context (injected when it next drafts)

One request alone is a batch of one (`decode`), on the target's own caches; several share
mlx-lm's batch caches (rollback.py rolls each row back to its own prefix).  When a step is
plain for every row and so is the next, the next pass is queued before this one's tokens
are read (as mlx-lm's generate_step does), so its graph is built while this one computes.

Every row's output is what it gets alone: greedy chooses the same tokens, sampling draws
the same noise per (seed, position) (sampling.py), whatever the widths and the batch.
"""

import logging
import time
from contextlib import ExitStack
from dataclasses import dataclass, field
from typing import Callable, Iterator, Optional

import mlx.core as mx
from mlx_lm.generate import generation_stream, wired_limit

from ..kernels.fused_ops import fusing
from .idle import IdlePrefills
from .learning import Learning, kept, widest_verify
from .model import DecodeStats, DFlashModel, Step
from .plan import PLAIN, Plan, Planner, fixed_plan, step_passes
from ..cache.prompt_cache import PromptCache
from .phases import PHASES
from .prefill import fill_chunk
from .prefix import PrefixPolicy
from .rows import joined, settled, without
from .verify import Pass, build, build_passes, settle
from .request import Request, Row
from .suffix import SuffixStore
from ..sampling import SamplingParams

logger = logging.getLogger(__name__)

PREFILL_STEP = 512  # prompt tokens a step prefills (the decoding rows wait for them once a step)
# On a CPU a pass's attention computes every score of its queries against its own keys, the
# masked half too: passes of 256 and 512 time alike there, 128 ~5% dearer (docs/serving.md)
CPU_PREFILL_PASS = 256


@dataclass
class BatchStep:
    """What one step did: the batch size and verify width (the widest of its passes), each row's
    committed tokens, its target passes (two when its rows verified apart), and the rows that
    failed on their own (their tokens refused: dropped, the others decoded on)."""

    size: int
    width: int
    steps: dict  # uid -> Step
    passes: int = 0
    failed: dict = field(default_factory=dict)  # uid -> Exception


class StepFailed(Exception):
    """A step raised: every request it was decoding or prefilling (`uids`) was dropped, nothing
    of them kept (their caches may hold tokens fed and never rolled back); the requests still
    waiting, and the decoder, go on."""

    def __init__(self, error: Exception, uids: set[int]):
        super().__init__(str(error))
        self.error, self.uids = error, uids


def prefill_pass() -> int:
    """Prompt tokens a prefill pass takes (all filling rows together)."""
    return min(CPU_PREFILL_PASS, PREFILL_STEP) if fusing() else PREFILL_STEP


class Decoder:
    """Up to `max_batch` requests decoded together, one `step()` at a time.  With `max_batch`
    1 a request decodes on the target's own caches (any target, the pipeline-parallel one
    included); above, on mlx-lm's batch caches.  With `max_batch_tokens`, a request joins only
    while the batch's caches stay within that many tokens (rows x the longest row, padding
    included, at its longest: batch caches hold every row at the longest one's length); a
    request too long for the bound runs alone once the batch is empty.  While no request
    waits, prompts offered by `prefill_when_idle` are prefilled into the prompt cache, one at a
    time, on a row beyond `max_batch` (where requests batch): a request joining stops that,
    unless it continues that very prompt (it then waits for it, and restores it).

    As mlx-lm's generation does, it computes on mlx-lm's generation stream and, from its
    creation to `close()`, with the GPU's wired memory limit at its recommended size (the
    weights stay resident between steps; a warning when they do not fit)."""

    def __init__(
        self,
        model: DFlashModel,
        prompt_cache: Optional[PromptCache] = None,
        max_batch: int = 8,
        max_batch_tokens: Optional[int] = None,
        clock: Optional[Callable[[], float]] = None,
        learning: Optional[Learning] = None,
    ):
        self.model, self.clock = model, clock or time.perf_counter
        self.learning = learning if learning is not None else kept(model)  # the process's, unless given one
        self.prefix = PrefixPolicy(model, prompt_cache)
        self.max_batch, self.max_batch_tokens = max_batch, max_batch_tokens
        self.rows: list[Row] = []  # decoding, in the cache's row order
        self.cache = None  # TargetCache (max_batch 1) or BatchTargetCache
        self.filling: list[Row] = []  # prefilling together, in the fill cache's row order
        self.fill_cache = None
        self.waiting: list[Row] = []  # queued until there is room
        self.idle = IdlePrefills(prompt_cache, max_batch)
        self._queued: Optional[Pass] = None  # the next plain pass, already running
        self._read_at = 0.0  # when the last step's tokens were read
        self._next_uid = 0
        self.stream = generation_stream
        self._wired = ExitStack()
        self._wired.enter_context(wired_limit([m for m in (model.target.model, model.draft) if m], [self.stream]))

    def close(self) -> None:
        """The wired memory limit as it was before, and what was learnt kept (safe to call twice)."""
        self._keep_learnt()
        self._wired.close()

    @property
    def busy(self) -> bool:
        return bool(self.rows or self.filling or self.waiting or self.idle.prompts)

    def add(self, request: Request, stats: Optional[DecodeStats] = None) -> Row:
        """Queue a request; its row (its uid, what it committed, its statistics: into `stats`
        when given).  Its Steps come out of step()."""
        row, self._next_uid = Row(request, self._next_uid, self.model, self.learning, stats), self._next_uid + 1
        self.waiting.append(row)
        self.idle.asked(request.prompt)
        return row

    def prefill_when_idle(self, prompt: list[int]) -> None:
        """Prefill `prompt` into the prompt cache once no request waits (idle.py: the latest
        offer first; one a request or the cache already holds is not)."""
        self.idle.offer(prompt)

    def remove(self, *uids: int) -> None:
        """Drop requests (finished, stopped or cancelled); their rows are freed before the next step,
        and what they decoded is kept in the prompt cache (a chat's next turn starts from it) and
        in the model's store of answers (later requests copy from it)."""
        with mx.stream(self.stream):
            for i, row in enumerate(self.rows):
                if row.uid not in uids:
                    continue
                if self._queued is not None:  # its pass feeds the row's last token too
                    self._queued.feed_drafter(row)
                self.prefix.keep_answer(
                    row, self.cache, i, row.fed if self._queued is None else row.prompt + row.output
                )
        self.discard(*uids)

    def discard(self, *uids: int) -> None:
        """Drop requests keeping nothing of them (they failed: what they decoded is not an answer)."""
        self.waiting = [row for row in self.waiting if row.uid not in uids]
        self.filling, self.fill_cache = without(self.filling, self.fill_cache, uids)
        self.rows, self.cache = without(self.rows, self.cache, uids)
        if self._queued is not None:
            self._queued = self._queued.rows([row.uid for row in self.rows]) if self.rows else None

    def step(self) -> BatchStep:
        """One prefill chunk of the requests joining (those with room start theirs), then one
        decode step of the rows, unless the chunk ended prompts: their first tokens go out at
        once and the rows decode at the next step.  Rows that reach their max_tokens leave by
        themselves.  A queued pass is for the rows as they were: it is taken before anyone joins."""
        with mx.stream(self.stream):
            steps, failed, size, width, passes = {}, {}, 0, 0, 0
            try:
                pipelined = self._queued is not None
                if not pipelined:
                    self._join(steps)
                if self.rows and not steps:
                    size, (width, passes) = len(self.rows), self._decode(steps, failed)
                if pipelined:
                    self._join(steps)
            except Exception as error:
                raise StepFailed(error, self._abandon(error)) from error
            self.discard(*failed)
            self.remove(*(row.uid for row in self.rows if row.spent))  # one filter for all that ended
        if not self.busy:
            self._keep_learnt()
        return BatchStep(size, width, steps, passes, failed)

    def _keep_learnt(self) -> None:
        """What the planner learnt of this machine's step times, written for the next process
        (when the decoder falls idle or closes)."""
        if self.learning.planner is not None:
            self.learning.planner.step_times.flush()

    def _abandon(self, error: Exception) -> set[int]:
        """After a failed step: the uids of every request it was decoding or prefilling, dropped
        with their caches and the pass queued for them, nothing of them kept (an idle prefill's
        failure, which no client hears of, is logged)."""
        if any(row.background for row in self.filling):
            logger.error("an idle prefill failed: %s", error, exc_info=error)
        uids = {row.uid for row in self.rows + self.filling if not row.background}
        self.rows, self.cache, self.filling, self.fill_cache, self._queued = [], None, [], None, None
        return uids

    # ------------------------------------------------------------ joining

    def _join(self, steps: dict) -> None:
        """Waiting requests admitted, then PREFILL_STEP tokens of the filling prompts, in passes
        of `prefill_pass()` tokens, until a pass ends a prompt (its first token goes out now)."""
        self._admit()
        size = prefill_pass()
        for _ in range(PREFILL_STEP // size):
            if not self.filling or self._fill(steps, size):
                break

    def _admit(self) -> None:
        """Waiting requests start their prefill (first come, first served: a long request waits
        for room instead of being overtaken for ever) from the longest prefix the prompt cache
        holds (never the last token: its pass chooses the first one).  A request whose prompt
        begins as one being prefilled (parallel agent sessions on one system prompt and set of
        tools) waits until that prefill has passed what they share, and restores it instead of
        prefilling it beside it: both get their first token sooner on a compute-bound machine."""
        for row in list(self.waiting):
            if not self._room_for(row):
                break
            if self.prefix.awaited(row, self.filling) is not None:
                continue
            self.waiting.remove(row)
            self.discard(*(other.uid for other in self.filling if other.background))  # idle time is over
            self._start(row)
        if not self.waiting:
            self._start_idle_prefill()

    def _start(self, row: Row) -> None:
        """`row` starts its prefill."""
        if self._queued is None:  # (a queued pass, never there while requests wait, would have fed one more token)
            self.prefix.keep_shared(row, self.rows, self.cache)
        tcache, start = self.prefix.restore(row)
        row.unfilled = row.prompt[start:]
        self.filling.append(row)
        self.fill_cache = joined(self.fill_cache, [tcache], self.max_batch > 1)

    def _start_idle_prefill(self) -> None:
        """The latest prompt offered for an idle prefill, if one is worth it, starts on a row of its
        own: beyond max_batch where requests batch (idle time beside a full batch is used too)."""
        busy = self.rows + self.filling
        if any(row.background for row in busy) or len(busy) >= self.max_batch + (self.max_batch > 1):
            return
        if (prompt := self.idle.next(self.rows)) is not None:
            # width 1: a prompt state and drafter context to keep, no draft or answer to learn from
            self.add(Request(prompt, 1, block_size=1, background=True))
            self._start(self.waiting.pop())

    def _room_for(self, row: Row) -> bool:
        others = [other for other in self.rows + self.filling if not other.background]
        if len(others) >= self.max_batch:
            return False
        if not others or self.max_batch_tokens is None:
            return True
        longest = max(
            [row.most_tokens]
            + [r.most_tokens for r in self.filling]
            + ([self.cache.width + max(r.left for r in self.rows)] if self.rows else [])
        )
        return (len(others) + 1) * longest <= self.max_batch_tokens

    def _fill(self, steps: dict, size: int) -> bool:
        """The next chunk of every filling row's prompt, in one target pass (right-padded to the
        longest chunk, `size` tokens in all); the rows whose prompt is in have their first token
        chosen from its logits (their Step goes into `steps`) and join the decoding rows, but for
        those it answers whole (max_tokens 1: a prompt prefilled for later), kept there and then.
        Whether any did."""
        rows, tic = self.filling, self.clock()
        awaited = self.prefix.awaited_by(self.waiting[: self.max_batch], rows)
        firsts, logits = fill_chunk(self.model, rows, self.fill_cache, size, self.prefix, awaited)
        seconds = self.clock() - tic
        for row in rows:
            row.stats.prompt_seconds += seconds
        for i, chosen in firsts.items():
            step = rows[i].record(None, chosen.tolist(), 0, logits[i])
            if not rows[i].background:
                steps[rows[i].uid] = step
        done = list(firsts)
        if len(done) < len(rows):
            mx.clear_cache()  # a long prompt's chunks: their activations are not kept
        entering = [i for i in done if not rows[i].spent]
        for i in done:
            if rows[i].spent:  # answered by its first token (a prompt prefilled for later): kept, never decoding
                self.prefix.keep_answer(rows[i], self.fill_cache, i, rows[i].prompt)
        if len(entering) == len(rows):  # all in: their batch becomes (or joins) the decoding one, not copied
            joining, self.filling, self.fill_cache = self.fill_cache, [], None
            self._enter(rows, joining)
        elif done:
            joining = [self.fill_cache.extract(i) for i in entering]
            self.filling, self.fill_cache = without(rows, self.fill_cache, {rows[i].uid for i in done})
            if entering:
                self._enter([rows[i] for i in entering], joined(None, joining, self.max_batch > 1))
        return bool(done)

    def _enter(self, rows: list[Row], joining) -> None:
        """Rows holding all of their prompt (in `joining`, their cache) and their first token
        join the decoding rows; a long prefill is kept for reuse."""
        for i, row in enumerate(rows):
            self.prefix.keep_prefill(row, joining, i, PREFILL_STEP)
        if self.cache is None:
            self.cache = joining
        else:
            self.cache.extend(joining)
        self.cache = settled(self.cache)
        self.rows += rows

    # ------------------------------------------------------------ decoding

    def _decode(self, steps: dict, failed: dict) -> tuple[int, int]:
        """One decode step of the rows, plan -> propose -> verify -> accept -> roll back (verify.py):
        its width and its number of target passes.  A row whose tokens its own state refuses (a
        grammar's) goes into `failed`, rolled back with the others."""
        started = self.clock()
        PHASES.start()
        queued, self._queued = self._queued, None
        if queued is not None:
            # queued during the step before, and computed beside it: what it costs is the time
            # between the two steps' tokens (from its own start it looks nearly free, and the
            # planner would then judge every drafting step against a plain step that is not)
            started, done = self._read_at, [(0, queued)]
        else:
            passes = self._passes()  # first: it may reorder the rows and their cache
            PHASES.lap("plan")
            done = build_passes(self.model, self.rows, self.cache, passes, self.clock, self.learning.planner)
        width = max(current.width for _, current in done)
        if width == 1 and len(done) == 1:
            mx.async_eval(done[0][1].next_tokens)  # its own task: reading it must not wait for the pass queued next
            self._queue_next(self.rows, done[0][1])
        PHASES.lap("verify build")
        settled_steps, settled_failed, self._read_at = settle(
            done, self.rows, self.cache, self.learning.planner, started, self.clock
        )
        steps.update(settled_steps)
        failed.update(settled_failed)
        return width, len(done)

    def _passes(self) -> list[tuple[int, list[Plan]]]:
        """The step's target passes, as (first row, plans of its rows) (plan.step_passes), the
        batch's rows reordered first when they are not in the passes' order."""
        order, passes = step_passes(
            self.learning.planner, self.rows, self.model.draft is not None, self.cache.splittable
        )
        if order != list(range(len(self.rows))):
            self.rows = [self.rows[i] for i in order]
            self.cache.keep_rows(order)
            settled(self.cache)  # the copy is not the pass's: it would teach the planner a dear shape
        return passes

    def _queue_next(self, rows: list[Row], current: Pass) -> None:
        """After a plain pass, the next one too when nothing joins, no row ends or has a grammar
        (whose next mask needs this token) and the plan ahead is plain for every row."""
        if self.waiting or self.filling or any(row.left <= 1 or row.constraint is not None for row in rows):
            return
        planner = self.learning.planner
        plans = (
            planner.plan(rows, self.model.draft is not None, lookahead=1)
            if planner
            else [fixed_plan(row.block, row.left - 1) for row in rows]
        )
        if any(plan != PLAIN for plan in plans):
            return
        self._queued = build(self.model, rows, plans, current.next_tokens, 1, self.cache)
        mx.async_eval(self._queued.next_tokens)


def decode(
    model: DFlashModel,
    request: Request,
    prompt_cache: Optional[PromptCache] = None,
    clock: Optional[Callable[[], float]] = None,
    stats: Optional[DecodeStats] = None,
) -> Iterator[Step]:
    """One request decoded alone (a batch of one): its Steps until its max_tokens are out (the
    caller stops earlier on EOS or stop strings by closing the generator), timed by `clock`
    (time.perf_counter by default), its statistics into `stats`.  With a `prompt_cache`, the
    longest prefix it holds is restored instead of prefilled.  It learns into what the process
    keeps for `model` (learning.kept)."""
    decoder = Decoder(model, prompt_cache, max_batch=1, clock=clock)
    uid = decoder.add(request, stats).uid
    try:
        while decoder.busy:
            try:
                done = decoder.step()
            except StepFailed as failed:
                raise failed.error
            if uid in done.failed:
                raise done.failed[uid]
            if uid in done.steps:
                yield done.steps[uid]
    finally:
        decoder.remove(uid)  # closed early (EOS, a stop string): its state is kept all the same
        decoder.close()


def warm_up(model: DFlashModel, max_batch: int = 1) -> None:
    """A short request decoded and dropped, drafting and then plain, on a decoder of the
    server's shape (no prompt cache; no answers, acceptance or step times kept), so that a fresh
    server's first request does not pay for the first calls (kernels built, buffers allocated).
    Without a drafter the copies are what verifies wide: the request is decoded twice, the second
    time copying the first answer as the store of earlier answers proposes it (a planner over the
    model's cost curve and a store of its own, both dropped after)."""
    planner = kept(model).planner
    copies = model.draft is None and planner is not None
    learning = Learning(Planner(planner.cost, planner.max_width), SuffixStore()) if copies else Learning()
    decoder = Decoder(model, max_batch=max_batch, learning=learning)
    prompt = [i % model.target.vocab_size for i in range(prefill_pass() + 16)]
    widest = widest_verify(model, learning)
    # a verify of the drafter's whole block (plain without one; without a drafter, the same answer
    # again, copied), then plain steps
    runs = [(None, 1 + widest)] * (2 if copies else 1) + [(1, 3)]
    try:
        for block, tokens in runs:
            decoder.add(Request(prompt, tokens, SamplingParams(), block_size=block))
            while decoder.busy:
                decoder.step()
    finally:
        decoder.close()
