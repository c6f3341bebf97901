"""The drafting vocabulary (`draft_vocab.json`, FR-Spec style)."""

from typing import Optional

import mlx.core as mx

from .config import DraftLoadError


VOCAB_FILE = "draft_vocab.json"  # optional; other runtimes ignore it and draft from the whole vocabulary


class DraftVocabulary:
    """The subset of token ids a drafter proposes from (FR-Spec style): its lm_head then
    runs over those rows only.  Any proposal is verified, so this never changes the
    output, only how cheap and how good the drafts are."""

    def __init__(self, token_ids, vocab_size: Optional[int] = None):
        if token_ids is not None:
            ids = sorted(set(int(t) for t in token_ids))
            if not ids or ids[0] < 0 or (vocab_size is not None and ids[-1] >= vocab_size):
                raise DraftLoadError(f"drafting vocabulary ids must lie in 0..{vocab_size - 1}")
            token_ids = mx.array(ids, dtype=mx.int32)
        self.token_ids = token_ids
        self.head = None

    def bind(self, target) -> None:
        self.head = target.lm_head if self.token_ids is None else target.head_rows(self.token_ids)
