"""The decoder's prefix-cache policy: what a joining request restores from the prompt cache,
what is kept of requests as they prefill and as they leave (states after long prefills and
after answers, snapshots along prefills of caches that cannot be cut back, answers for later
copies), and when a request waits to restore what another is prefilling instead of
prefilling it beside it.  The decoder (decoder.py) asks; this decides and keeps."""

from typing import Optional

from ..cache.prompt_cache import PromptCache
from ..target.wrapper import TargetCache
from .idle import extends
from .model import DFlashModel
from .request import Row

SHARED_MIN = 64  # a prefix shared with a prompt being prefilled worth waiting for (keeping its state costs a copy)


def shared_length(a: list[int], b: list[int], block: int = 256) -> int:
    """How many leading tokens `a` and `b` have in common (compared a block at a time)."""
    n = min(len(a), len(b))
    if a[:n] == b[:n]:
        return n
    start = 0
    while a[start : start + block] == b[start : start + block]:
        start += block
    return start + next(i for i in range(block) if a[start + i] != b[start + i])


class PrefixPolicy:
    """The prompt cache as the decoder uses it (every call a no-op without one)."""

    def __init__(self, model: DFlashModel, prompt_cache: Optional[PromptCache]):
        self.model, self.cache = model, prompt_cache
        # a cache that cannot be cut back is snapshotted along long prefills (prompt_cache.py)
        self.snapshot_every = prompt_cache and prompt_cache.snapshot_interval(model.target.make_cache())

    def restore(self, request: Row) -> tuple[TargetCache, int]:
        """A target cache holding the longest prefix of the request's prompt the prompt cache
        has (its drafter context restored) and that prefix's length; else a fresh cache and 0."""
        if self.cache is not None and (hit := self.cache.fetch(request.prompt)) is not None:
            tcache, request.context.cache, start = hit
        else:
            tcache, start = self.model.target.make_cache(), 0
        request.stats.cached_tokens = start
        return tcache, start

    def keep_answer(self, row: Row, cache, i: int, fed: list[int]) -> None:
        """A leaving row's answer into the model's store of answers, and its state (row `i` of
        `cache`, holding the tokens `fed`) into the prompt cache."""
        if row.suffixes is not None:
            row.suffixes.add(row.prompt, row.output)
        if self.cache is not None:
            self.cache.store(fed, cache.extract(i), row.context.flush())

    def keep_prefill(self, row: Row, cache, i: int, at_least: int) -> None:
        """A row that has just prefilled its prompt, kept now when it prefilled `at_least` tokens
        (other requests may share it before this one ends); else the state after the answer,
        kept when the row leaves, serves the next turn and a retry alike (a cache that cannot be
        cut back kept the prompt but its last token on the way, for a retry)."""
        prefilled = len(row.prompt) - row.stats.cached_tokens
        if self.cache is not None and prefilled >= at_least and not self.snapshot_every:
            self.cache.store(row.prompt, cache.extract(i), row.context.flush())

    def cut_back(self, row: Row) -> bool:
        """Whether a kept state of another prompt serves `row` up to where they part."""
        return self.snapshot_every is None and all(c.window is None for c in row.context.cache or [])

    def awaited(self, row: Row, filling: list[Row]) -> Optional[tuple[Row, int]]:
        """The filling request that has not yet prefilled the tokens its prompt shares with `row`'s,
        SHARED_MIN or more of them beyond what the prompt cache holds for `row` already (two turns
        of one conversation, say, differ only in their new tokens: waiting would save none), and
        how many of them `row` restores once it has (where caches cannot be cut back, up to the
        last snapshot inside).  A request continuing an idle prefill's prompt waits for all of it,
        whatever its caches: that prompt's state is kept whole at its end."""
        for other in filling:
            if other.background and extends(row.prompt, other.prompt):
                return other, len(other.prompt)
        if self.cache is None or not (self.cut_back(row) or self.snapshot_every) or not filling:
            return None
        covered = self.cache.covered(row.prompt[:-1])
        for other in filling:
            shared = shared_length(other.prompt, row.prompt[:-1])
            if self.snapshot_every:
                shared -= shared % self.snapshot_every
            if shared - covered >= SHARED_MIN and len(other.prompt) - len(other.unfilled) < shared:
                return other, shared
        return None

    def keep_shared(self, row: Row, rows: list[Row], cache) -> None:
        """A decoding row's state (of `rows`, in `cache`, each holding all it committed but its
        last token) kept for `row` to restore when their tokens share SHARED_MIN or more beyond
        what the prompt cache holds (a prompt too short to be kept at its prefill's end, asked
        again or shared while its answer is being written)."""
        if self.cache is None or not rows or not self.cut_back(row):
            return
        usable = row.prompt[:-1]
        covered = self.cache.covered(usable)
        for i, other in enumerate(rows):
            if shared_length(other.fed, usable) - covered >= SHARED_MIN:
                self.cache.store(other.fed, cache.extract(i), other.context.flush())
                return

    def chunk_length(self, row: Row, span: int) -> int:
        """`span` tokens, or fewer to end at the next snapshot along the prompt (the last
        before its last token is one: a retried prompt restores it)."""
        if not self.snapshot_every:
            return span
        filled = len(row.prompt) - len(row.unfilled)
        return min(span, self.snapshot_every - filled % self.snapshot_every, max(len(row.unfilled) - 1, 1))

    def awaited_by(self, waiting: list[Row], filling: list[Row]) -> list[tuple[Row, int]]:
        """What the `waiting` requests wait for (where caches can be cut back, a row's state is
        kept once it has passed that; where they cannot, the snapshots along the prefill serve)."""
        if self.snapshot_every:
            return []
        return [a for w in waiting if (a := self.awaited(w, filling))]

    def keep_along(self, row: Row, cache, i: int, awaited: list[tuple[Row, int]]) -> None:
        """A row part-way through its prefill (row `i` of `cache`) kept at a snapshot point, or
        once it has passed what a waiting request waits for."""
        if not row.unfilled:
            return
        filled = len(row.prompt) - len(row.unfilled)
        snapshot = self.snapshot_every and (filled % self.snapshot_every == 0 or len(row.unfilled) == 1)
        if snapshot or any(other is row and shared <= filled for other, shared in awaited):
            self.cache.store(row.prompt[:filled], cache.extract(i), row.context.flush())
