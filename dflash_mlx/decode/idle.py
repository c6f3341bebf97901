"""Prompts to prefill while no request waits: the conversations as their next requests will
begin (a chat answer re-tokenised as the client sends it back, and the turn's closing tokens),
offered by the server while an agent runs its tools.  The decoder (decoder.py) prefills the
latest one on a row of its own, into the prompt cache; this keeps the offers and decides which
is still worth a pass."""

from collections import deque
from typing import Optional

from ..cache.prompt_cache import PromptCache
from .request import Row


def extends(prompt: list[int], prefix: list[int]) -> bool:
    return len(prompt) >= len(prefix) and prompt[: len(prefix)] == prefix


class IdlePrefills:
    """Offered prompts, latest last (the oldest forgotten past `keep`), and the prompts of recent
    requests: an offer they extend came too late (the next request came first)."""

    def __init__(self, prompt_cache: Optional[PromptCache], keep: int):
        self.prompt_cache = prompt_cache
        # an idle prefill of fewer new tokens saves the next turn less than the extra pass costs
        # when the client comes back at once (it waits for that pass): its closing tokens alone
        self.min_tokens = 32
        self.prompts: deque = deque(maxlen=keep)
        self._asked: deque = deque(maxlen=4 * keep)

    def offer(self, prompt: list[int]) -> None:
        if self.prompt_cache is None or any(extends(seen, prompt) for seen in self._asked):
            return
        for earlier in [p for p in self.prompts if extends(prompt, p)]:
            self.prompts.remove(earlier)  # the same conversation, further on
        self.prompts.append(prompt)

    def asked(self, prompt: list[int]) -> None:
        """A request's `prompt` started: the offers it extends are stale, and so will be any later."""
        self._asked.append(prompt)
        for stale in [p for p in self.prompts if extends(prompt, p)]:
            self.prompts.remove(stale)

    def next(self, rows: list[Row]) -> Optional[list[int]]:
        """The latest offer, unless the prompt cache or a decoding row's tokens (its answer so far,
        where its text reads back as the model wrote it) hold all of it but min_tokens; None
        when there is nothing worth a pass."""
        while self.prompts:
            prompt = self.prompts.pop()
            enough = prompt[: len(prompt) - self.min_tokens + 1]
            if self.prompt_cache.covered(prompt) < len(enough) and not any(
                extends(row.prompt + row.output, enough) for row in rows
            ):
                return prompt
        return None

    def clear(self) -> None:
        self.prompts.clear()
