"""A decode step's verify, as one transaction over its rows:

    checkpoint  the target caches (when a row verifies more than its last token)
    propose     each row's proposal: its drafter's (one drafter pass for the rows drafting at
                one width) or the tokens its plan copies
    build       one target pass over every row's [last token] + proposal, and each row's
                choice: how many proposed tokens agree with the target's own (under its
                grammar's masks) and the target's token after them, for all rows at once
    evaluate    all of it in one evaluation (a step of two passes: one each, in `build_passes`)
    accept      each row records what it committed; the target's features at those positions
                go to its drafter's context (injected when it next drafts)
    roll back   the target caches to the tokens each row kept
    learn       the planner, from each row's acceptance and the step's time

`build_passes` is the first three, lazily (the decoder queues the next plain pass before this
one is read, as mlx-lm's generate_step does); `settle` is the rest.  Their signatures name
what they change.
"""

from dataclasses import dataclass
from typing import Optional

import mlx.core as mx

from ..drafters.model import Drafts
from ..sampling import SamplingParams, choose
from .grammar import masked
from .model import DFlashModel, Step
from .phases import PHASES
from .plan import Plan, Planner
from .request import Context, Row
from ..kernels.fused_ops import fusing
from .rows import run_ahead, tree_arrays


@dataclass
class Pass:
    """A target pass over some rows, lazily: what each row verifies and keeps."""

    uids: list[int]
    plans: list[Plan]
    blocks: mx.array  # (rows, width): each row's [last token] + proposal, then padding never accepted
    accepted: Optional[mx.array]  # (rows,) proposed tokens the target keeps (None: a plain pass)
    next_tokens: mx.array  # (rows,) the target's own token after them
    logits: mx.array
    features: Optional[mx.array]
    seconds: float = 0.0  # its own time, when computed apart from the step's other pass
    confidences: Optional[list] = None  # each row's drafted tokens' confidences, where they were read to cut it

    @property
    def width(self) -> int:
        return self.blocks.shape[1]

    @property
    def outputs(self) -> list[mx.array]:
        """What reading it needs computed."""
        return [self.blocks, self.next_tokens] + ([] if self.accepted is None else [self.accepted])

    def feed_drafter(self, row: Row) -> None:
        """`row`'s drafter context takes the features of the token this pass feeds (queued and
        never read: they would go in with its accepted tokens), so that it stays aligned with
        the caches, which hold that token."""
        j = self.uids.index(row.uid)
        row.context.add(None if self.features is None else self.features[j : j + 1, :1])

    def rows(self, uids: list[int]) -> "Pass":
        """This pass restricted to the rows of `uids` (rows removed since it was queued)."""
        if uids == self.uids:
            return self
        index = [self.uids.index(uid) for uid in uids]
        rows = mx.array(index, dtype=mx.int32)
        return Pass(
            uids,
            [self.plans[i] for i in index],
            self.blocks[rows],
            None if self.accepted is None else self.accepted[rows],
            self.next_tokens[rows],
            self.logits[rows],
            None if self.features is None else self.features[rows],
            confidences=None if self.confidences is None else [self.confidences[i] for i in index],
        )


# ------------------------------------------------------------ checkpoint, propose, build


def build_passes(
    model: DFlashModel,
    rows: list[Row],
    cache,
    passes: list[tuple[int, list[Plan]]],
    clock,
    planner: Optional[Planner] = None,
) -> list[tuple[int, Pass]]:
    """The step's passes, as (first row, pass), the caches checkpointed first: lazily when
    there is one; each computed before the next is built when there are two (a pass writes
    into the batch's arrays in place only once the one before has read them, and its time is
    its own).  The `planner` may cut a pass's verify by its drafts' confidence (`build`)."""
    if any(plan.width > 1 for _, plans in passes for plan in plans):
        cache.checkpoint()
    if len(passes) == 1:
        return [(0, build(model, rows, passes[0][1], None, 0, cache, planner))]
    done = []
    for start, plans in passes:
        tic, stop = clock(), start + len(plans)
        current = build(model, rows[start:stop], plans, None, 0, cache.rows(start, stop), planner)
        mx.eval(current.outputs, tree_arrays([c.state for c in cache.layers]))
        PHASES.evaluated()
        current.seconds = clock() - tic
        done.append((start, current))
    return done


def build(
    model: DFlashModel,
    rows: list[Row],
    plans: list[Plan],
    lasts: Optional[mx.array],
    ahead: int,
    cache,
    planner: Optional[Planner] = None,
) -> Pass:
    """One target pass on `cache` verifying each row's proposal after its last token, lazily:
    `lasts` (rows,) when those tokens are not yet read (a pass queued behind the one choosing
    them; every row plain), else each row's committed last; `ahead`: the output positions a
    pass not yet read has taken.  Where the `planner` says a narrower verify may pay, the
    drafts are read first and the verify cut by their confidence (`cut`)."""
    width = max(plan.width for plan in plans)
    noises = [row.noise_at(row.produced + ahead, plan.width) for row, plan in zip(rows, plans)]
    confidences = None
    if lasts is not None:
        blocks = lasts[:, None]
    else:
        blocks, drafted = propose(model, rows, plans, width, noises)
        if planner is not None and planner.cuts(rows, plans):
            plans, blocks, confidences = cut(planner, rows, plans, blocks, drafted)
            noises = [None if noise is None else noise[: plan.width] for noise, plan in zip(noises, plans)]
        elif any(plan.source == "dflash" for plan in plans):
            mx.async_eval(blocks)  # the drafter computes while the target's graph is built
    PHASES.lap("draft", blocks)
    logits, features = model.target(blocks, cache, model.feature_layers)
    accepted, next_tokens = choices(rows, plans, blocks, logits, noises)
    return Pass([row.uid for row in rows], plans, blocks, accepted, next_tokens, logits, features, 0.0, confidences)


def cut(
    planner: Planner, rows: list[Row], plans: list[Plan], blocks: mx.array, drafted: list[tuple[list[int], mx.array]]
) -> tuple[list[Plan], mx.array, list]:
    """The drafts and their confidence (`drafted`: propose's) read (an evaluation before the
    verify is built), and the plans cut by them (`Planner.cut`), the blocks to the widest:
    (plans, blocks, each row's drafted tokens' confidences, None where it did not draft)."""
    mx.eval(blocks, [confidence for _, confidence in drafted])
    PHASES.evaluated()
    confidences = [None] * len(rows)
    for drafting, confidence in drafted:
        for i, row_confidence in zip(drafting, confidence.tolist()):
            confidences[i] = row_confidence
    plans = planner.cut(rows, plans, confidences)
    return plans, blocks[:, : max(plan.width for plan in plans)], confidences


def propose(
    model: DFlashModel, rows: list[Row], plans: list[Plan], width: int, noises: list
) -> tuple[mx.array, list[tuple[list[int], mx.array]]]:
    """(rows, width): each row's last token, its proposal (copied tokens, or its drafter's: one
    drafter pass for the rows drafting at one width, its weights read once for them all), then
    padding (never accepted: past the proposal); and each drafter pass's rows (indices) with the
    drafter's confidence in their drafted tokens (lazily: computed only where a cut reads it)."""
    known = [[row.token, *plan.tokens] + [0] * (width - 1 - len(plan.tokens)) for row, plan in zip(rows, plans)]
    blocks = mx.array(known, dtype=mx.int32)
    confidences = []
    for w in sorted({plan.width for plan in plans if plan.source == "dflash"}):
        drafting = [i for i, plan in enumerate(plans) if plan.source == "dflash" and plan.width == w]
        drafted, confidence = draft_rows(
            model,
            [rows[i].token for i in drafting],
            [rows[i].context for i in drafting],
            w,
            [rows[i].params for i in drafting],
            [noises[i] for i in drafting],
        )
        confidences.append((drafting, confidence))
        if len(drafting) == len(rows) and w == width:
            return mx.concatenate([blocks[:, :1], drafted], axis=1), confidences
        blocks[mx.array(drafting), 1:w] = drafted
    return blocks, confidences


def draft_rows(
    model: DFlashModel,
    lasts: list[int],
    contexts: list[Context],
    width: int,
    params: list[SamplingParams],
    noises: list[Optional[mx.array]],
) -> Drafts:
    """(rows, width - 1): each row's drafted tokens after its last token, in one drafter pass,
    with the noise of their output positions (`noises` cover the whole verify block): what it
    drafts alone; and the drafter's confidence in them."""
    blocks = mx.array([[last] + [model.draft.mask_token_id] * (width - 1) for last in lasts], dtype=mx.int32)
    return model.draft.drafts(
        blocks,
        [c.cache for c in contexts],
        params,
        [None if noise is None else noise[:-1] for noise in noises],
        [c.take() for c in contexts],  # injected by the drafting pass itself
    )


def choices(
    rows: list[Row], plans: list[Plan], blocks: mx.array, logits: mx.array, noises: list
) -> tuple[Optional[mx.array], mx.array]:
    """(rows,) how many proposed tokens each row keeps (None for a plain pass), and (rows,) the
    target's token after them: the longest prefix of the proposal equal to the target's own
    choices at [last token] + proposal (the same noise the drafter drew: sampling.py), then its
    choice at the first that differs.  Greedy rows without a grammar choose in one argmax."""
    width = blocks.shape[1]
    if all(row.params.greedy and row.constraint is None for row in rows):
        chosen = mx.argmax(logits, axis=-1)
    else:
        chosen = mx.stack(
            [
                row_choice(row, plan, blocks[i], logits[i], noise, width)
                for i, (row, plan, noise) in enumerate(zip(rows, plans, noises))
            ]
        )
    if width == 1:
        return None, chosen[:, 0]
    return accepted_prefix(blocks, chosen, mx.array([plan.width - 1 for plan in plans]))


@mx.compile
def accepted_prefix(blocks: mx.array, chosen: mx.array, proposed: mx.array) -> tuple[mx.array, mx.array]:
    """(rows,) how many of each row's `proposed` tokens (blocks[:, 1:]) equal the target's
    choices before them, and (rows,) its choice after those (one compiled graph per shape)."""
    agree = (blocks[:, 1:] == chosen[:, :-1]) & (mx.arange(blocks.shape[1] - 1) < proposed[:, None])
    agreed = mx.cumprod(agree.astype(mx.int32), axis=1).sum(axis=1)
    return agreed, mx.take_along_axis(chosen, agreed[:, None], axis=1)[:, 0]


def row_choice(row: Row, plan: Plan, block: mx.array, logits: mx.array, noise, width: int) -> mx.array:
    """(width,) the target's choices at one row's positions (its plan's width of them, under its
    grammar's masks after each prefix of the proposal; then zeros)."""
    masks = None
    if row.constraint is not None:  # the masks follow the proposal: a drafted one is read first
        masks = row.masks(list(plan.tokens) if plan.source != "dflash" else block[1 : plan.width].tolist())
    chosen = choose(masked(logits[: plan.width], masks), row.params, noise)
    return chosen if plan.width == width else mx.pad(chosen, (0, width - plan.width))


# ------------------------------------------------------------ evaluate, accept, roll back, learn


def settle(
    done: list[tuple[int, Pass]], rows: list[Row], cache, planner: Optional[Planner], started: float, clock
) -> tuple[dict[int, Step], dict[int, Exception], float]:
    """The step's passes evaluated (once), then read: each row records what it committed (its
    output, grammar, lookup, statistics and drafter context move on: `rows` change), the
    target `cache` is rolled back to the tokens each row kept, and the `planner` learns from
    the step (begun at `started`).  Each row's Step (uid -> Step), the rows whose own state
    refused their tokens (uid -> error; rolled back with the others), and when the tokens were
    read."""
    mx.eval([out for _, current in done for out in current.outputs])
    PHASES.evaluated()
    PHASES.lap("evaluate")
    read_at = clock()
    steps, failed, keeps = accept(done, rows)
    PHASES.lap("accept")
    if max(current.width for _, current in done) > 1:
        cache.rollback_rows(keeps)
        if not fusing():  # on a CPU the cores that would compute ahead are the ones building the graph
            run_ahead(rows, cache)
    PHASES.lap("roll back")
    learn(planner, done, rows, keeps, clock() - started)
    PHASES.lap("record")
    return steps, failed, read_at


def accept(done: list[tuple[int, Pass]], rows: list[Row]) -> tuple[dict, dict, list[int]]:
    """Each row's committed tokens recorded into it (read from the evaluated passes, three reads
    a pass); (steps, failed, tokens each row keeps in the caches)."""
    steps, failed, keeps = {}, {}, []
    for start, current in done:
        blocks, next_tokens = current.blocks.tolist(), current.next_tokens.tolist()
        accepted = [0] * len(blocks) if current.accepted is None else current.accepted.tolist()
        for i, (plan, block, n, token) in enumerate(zip(current.plans, blocks, accepted, next_tokens)):
            row = rows[start + i]
            keeps.append(n + 1)
            row.context.add(None if current.features is None else current.features[i : i + 1, : n + 1])
            try:
                steps[row.uid] = row.record(plan, block[1 : n + 1] + [token], n, current.logits[i, : n + 1])
            except Exception as error:
                failed[row.uid] = error
    return steps, failed, keeps


def learn(planner: Optional[Planner], done: list[tuple[int, Pass]], rows: list[Row], keeps: list[int], seconds: float):
    """Each row's decode time, and the planner's acceptance estimates and step times (a pass run
    apart from the other is judged by its own time, and its share of reading them both)."""
    for start, current in done:
        part = rows[start : start + len(current.plans)]
        if planner is not None:
            share = seconds if len(done) == 1 else current.seconds * seconds / sum(c.seconds for _, c in done)
            accepted = [k - 1 for k in keeps[start : start + len(part)]]
            planner.learn(part, current.plans, accepted, share, current.confidences)
        for row in part:
            row.stats.decode_seconds += seconds
            if len(row.stats.cycle_seconds) < row.stats.cycles:  # not a row whose tokens were refused
                row.stats.cycle_seconds.append(seconds)
