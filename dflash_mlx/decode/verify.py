"""One verify pass of the step: each row's proposal (its drafter's, or copied tokens), the
target over every row's [last token] + proposal, and each row's choice (its longest agreeing
prefix and the target's next token, under its grammar's masks), all lazily: the decoder
(decoder.py) reads them, rolls back and records."""

from dataclasses import dataclass
from typing import Optional

import mlx.core as mx

from ..sampling import SamplingParams, accept, choose
from .grammar import masked
from .model import DFlashModel
from .plan import Plan
from .request import Context, Row
from .rows import tree_arrays


@dataclass
class Pass:
    """A target pass over some rows, lazily: each row's (accepted count, next token)."""

    uids: list[int]
    plans: list[Plan]
    proposals: list[mx.array]
    choices: list[tuple[mx.array, mx.array]]
    logits: mx.array
    features: Optional[mx.array]
    seconds: float = 0.0  # its own time, when computed apart from the step's other pass

    def fed(self, row: Row) -> list[int]:
        """The tokens `row`'s caches hold with this pass queued: all it committed, the last fed
        by this pass (whose features then go to its drafter's context first, to stay aligned)."""
        if row.uid not in self.uids:
            return row.fed
        j = self.uids.index(row.uid)
        row.context.add(None if self.features is None else self.features[j : j + 1, :1])
        return row.prompt + row.output

    def rows(self, uids: list[int]) -> "Pass":
        """This pass restricted to the rows of `uids` (rows removed since it was queued)."""
        if uids == self.uids:
            return self
        index = [self.uids.index(uid) for uid in uids]
        rows = mx.array(index, dtype=mx.int32)
        return Pass(
            uids,
            [self.plans[i] for i in index],
            [self.proposals[i] for i in index],
            [self.choices[i] for i in index],
            self.logits[rows],
            None if self.features is None else self.features[rows],
        )


def draft_rows(
    model: DFlashModel,
    lasts: list[mx.array],
    contexts: list[Context],
    width: int,
    params: list[SamplingParams],
    noises: list[Optional[mx.array]],
) -> list[mx.array]:
    """Each row's width - 1 drafted tokens after its last token, in one drafter pass, with the
    noise of their output positions (`noises` cover the whole verify block): what it drafts alone."""
    anchors = mx.concatenate([last.reshape(1) for last in lasts]).astype(mx.int32)[:, None]
    mask = mx.full((len(lasts), width - 1), model.draft.mask_token_id, dtype=mx.int32)
    return model.draft.propose_rows(
        mx.concatenate([anchors, mask], axis=1),
        [c.flush() for c in contexts],
        params,
        [None if noise is None else noise[:-1] for noise in noises],
    )


def last_tokens(rows: list[Row]) -> list[mx.array]:
    return [mx.array([row.token], dtype=mx.int32) for row in rows]


def verify_pass(
    model: DFlashModel, rows: list[Row], plans: list[Plan], lasts: list[mx.array], ahead: int, cache
) -> Pass:
    """One target pass on `cache` verifying each row's proposal after its last token (lazily);
    `ahead`: output positions already taken by a pass not yet read."""
    width = max(plan.width for plan in plans)
    noises = [row.noise_at(row.produced + ahead, plan.width) for row, plan in zip(rows, plans)]
    proposals = propose(model, rows, plans, lasts, noises)
    blocks = [
        mx.concatenate(
            [last, proposal.astype(mx.int32), mx.zeros((width - plan.width,), dtype=mx.int32)]
        )  # never accepted: past the proposal
        for last, proposal, plan in zip(lasts, proposals, plans)
    ]
    logits, features = model.target(mx.stack(blocks), cache, model.feature_layers)
    choices = [
        accept(
            proposal,
            choose(
                masked(logits[i, : plan.width], row.masks(proposal.tolist()) if row.constraint is not None else None),
                row.params,
                noise,
            ),
        )
        for i, (row, plan, proposal, noise) in enumerate(zip(rows, plans, proposals, noises))
    ]
    return Pass([row.uid for row in rows], plans, proposals, choices, logits, features)


def propose(
    model: DFlashModel, rows: list[Row], plans: list[Plan], lasts: list[mx.array], noises: list
) -> list[mx.array]:
    """Each row's proposal: its copied tokens, or its drafter's, all rows drafting
    at one width in one drafter pass (its weights read once for all of them)."""
    proposals = [mx.array(plan.tokens, dtype=mx.int32) for plan in plans]
    for width in sorted({plan.width for plan in plans if plan.source == "dflash"}):
        drafting = [i for i, plan in enumerate(plans) if plan.source == "dflash" and plan.width == width]
        drafted = draft_rows(
            model,
            [lasts[i] for i in drafting],
            [rows[i].context for i in drafting],
            width,
            [rows[i].params for i in drafting],
            [noises[i] for i in drafting],
        )
        for i, proposal in zip(drafting, drafted):
            proposals[i] = proposal
    return proposals


def verify_passes(
    model: DFlashModel, rows: list[Row], cache, passes: list[tuple[int, list[Plan]]], clock
) -> list[tuple[int, Pass]]:
    """The passes built (lazily when there is one; each computed before the next is built
    when there are more: a pass writes into the batch's arrays in place only once the one
    before has read them, and its time is its own)."""
    if any(plan.width > 1 for _, plans in passes for plan in plans):
        cache.checkpoint()
    if len(passes) == 1:
        return [(0, verify_pass(model, rows, passes[0][1], last_tokens(rows), 0, cache))]
    done = []
    for start, plans in passes:
        tic, stop = clock(), start + len(plans)
        current = verify_pass(
            model,
            rows[start:stop],
            plans,
            last_tokens(rows[start:stop]),
            0,
            cache.rows(start, stop),
        )
        mx.eval(current.choices, current.proposals, tree_arrays([c.state for c in cache.layers]))
        current.seconds = clock() - tic
        done.append((start, current))
    return done
