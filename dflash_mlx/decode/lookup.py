"""Prompt-lookup proposals: the second source of drafts, free to make.

When the text being written repeats text already seen (editing code, quoting the
prompt, filling a JSON template), the tokens that followed an earlier occurrence of
the current suffix are a good guess for what comes next, as in prompt lookup
decoding and vLLM's n-gram speculator (a match that runs into the present continues
with its own period).  Where the last `max_ngram` tokens occurred before, the
occurrence whose preceding text agrees longest with the text before them is copied
(an agent's conversation holds the file it rewrites several times, and its lines
share their openings: the latest occurrence of four tokens is often the wrong line);
else the longest shorter suffix, found near where the text was last copied from (after
an edit, the copy resumes where it left off) or at its latest occurrence.  They are verified like
any draft, so the output is unchanged.  How long the match was travels with the
proposal (1-3 tokens, or its class: up to 4, 8, 16 or 32): a 1-token match is a weak
hint, a 20-token one a strong one, and the adaptive plan (plan.py) learns how often
each kind is accepted.

Nothing is copied from an end-of-turn token on (`ends`, the tokenizer's EOS): in a chat prompt
one follows every turn, the closing fence of a code block the user sent included, so an answer
opening with a fence was offered the template's turn change where it writes the fence's language
and the code after it, as the opening fence has them.
"""

from dataclasses import dataclass
from typing import Optional


@dataclass(frozen=True)
class Match:
    tokens: tuple = ()  # what followed the earlier occurrence (empty: no match)
    length: int = 0  # tokens of the current suffix that matched (suffix.py: their length class)
    source: str = "lookup"  # "lookup": this request's own tokens; "suffix": earlier answers (suffix.py)

    def __bool__(self) -> bool:
        return bool(self.tokens)


NO_MATCH = Match()
MATCH_BUCKETS = (4, 8, 16, 32)  # long matches are judged in these classes (a kind each)


def match_bucket(length: int) -> int:
    """The class of a match of `length` tokens: the first bucket at least as long."""
    return next((b for b in MATCH_BUCKETS if length <= b), MATCH_BUCKETS[-1])


def agreement(tokens, i: int, tail, n: int) -> int:
    """How many tokens before position `i` of `tokens` agree with the end of `tail`, given that
    the last `n` do (at most len(tail))."""
    length = n
    while length < len(tail) and i - length > 0 and tokens[i - length - 1] == tail[-length - 1]:
        length += 1
    return length


class PromptLookup:
    def __init__(
        self,
        tokens,
        min_ngram: int = 1,
        max_ngram: int = 4,
        max_positions: int = 16,
        near: int = 16,
        ends: frozenset = frozenset(),
    ):
        self.min_ngram, self.max_ngram, self.max_positions, self.near = min_ngram, max_ngram, max_positions, near
        self.ends = ends  # tokens a copy never starts at (an end of turn)
        self.tokens: list[int] = []
        self.cursor: Optional[int] = None  # where the text's next token was last copied from
        self._after: dict[tuple[int, ...], int] = {}  # shorter n-gram -> where its latest continuation starts
        self._starts: dict[tuple[int, ...], list[int]] = {}  # max_ngram-gram -> its latest continuations' starts
        self.extend(tokens)

    def extend(self, tokens) -> None:
        """Append committed tokens; every n-gram now followed by a token is indexed."""
        for token in tokens:
            end = len(self.tokens)  # the n-grams ending here are followed by `token`
            if token not in self.ends:
                self._index(end)
            self.tokens.append(int(token))
        if self.cursor is not None:
            self.cursor += len(tokens)

    def _index(self, end: int) -> None:
        """The n-grams ending at `end` (the token about to be appended there follows them)."""
        for n in range(self.min_ngram, min(self.max_ngram - 1, end) + 1):
            self._after[tuple(self.tokens[end - n : end])] = end
        if end >= self.max_ngram:
            starts = self._starts.setdefault(tuple(self.tokens[end - self.max_ngram : end]), [])
            starts.append(end)
            if len(starts) > 2 * self.max_positions:
                del starts[: -self.max_positions]

    def propose(self, limit: int) -> Match:
        """Up to `limit` tokens that followed the best earlier match of the current suffix."""
        if limit <= 0:
            return NO_MATCH
        tokens, n = self.tokens, self.max_ngram
        starts = self._starts.get(tuple(tokens[-n:])) if len(tokens) >= n else None
        if starts:
            tail = tokens[-MATCH_BUCKETS[-1] :]
            length, self.cursor = max((agreement(tokens, i, tail, n), i) for i in starts[-self.max_positions :])
            return Match(self._copy(self.cursor, limit), match_bucket(length))
        for n in range(min(self.max_ngram - 1, len(tokens)), self.min_ngram - 1, -1):
            start = self._near_cursor(n)
            if start is None:
                start = self._after.get(tuple(tokens[-n:]))
            if start is not None:
                self.cursor = start
                return Match(self._copy(start, limit), n)
        return NO_MATCH

    def _near_cursor(self, n: int) -> Optional[int]:
        """Where the last `n` tokens occurred within `near` tokens of the cursor (the nearest):
        after an edit (a renamed variable, an added hint) the copy resumes where it left off, not
        at the latest occurrence of a comma."""
        if self.cursor is None:
            return None
        tokens, end, cursor = self.tokens, len(self.tokens), self.cursor
        pattern, found = tokens[-n:], None
        for i in range(max(n, cursor - self.near), min(end - 1, cursor + self.near) + 1):
            if (
                tokens[i - n : i] == pattern
                and tokens[i] not in self.ends
                and (found is None or abs(i - cursor) < abs(found - cursor))
            ):
                found = i
        return found

    def _copy(self, start: int, limit: int) -> tuple:
        """`limit` tokens from `start`, as an overlapping copy runs: past the end, the proposal
        repeats itself (a repeating text keeps its period); none after an end of turn."""
        proposal, end = [], len(self.tokens)
        for i in range(start, start + limit):
            proposal.append(self.tokens[i] if i < end else proposal[i - end])
            if proposal[-1] in self.ends:
                break
        return tuple(proposal)
