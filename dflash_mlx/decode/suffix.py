"""Session-wide suffix drafts: what earlier answers said after the text being written now.

An agent's requests repeat one another: the same tool calls, the same file written back
with a change, the same boilerplate around every answer.  The prompt lookup (lookup.py)
sees only the current request; this store keeps every answer the model gave (with the
prompt tokens just before it) across requests, bounded in tokens, and proposes the most
frequent continuation of the longest earlier match of the current suffix, as
SuffixDecoding does with its global suffix tree (arXiv 2411.04975).  The proposal stops
where the share of earlier occurrences that agree with it falls below `min_share` (that
share is its confidence).  Verified like any draft, so the output is unchanged.

The index maps every `min_match`-gram to where it ended (its latest `max_positions`
occurrences); the match is extended backwards from each, so the deepest node of a suffix
tree is found without building one, in memory linear in the tokens kept.
"""

from array import array

from .lookup import MATCH_BUCKETS, NO_MATCH, Match, agreement, match_bucket

SEPARATOR = -1  # between documents: no match runs across it


class SuffixStore:
    """Earlier answers of this model, up to `capacity` tokens (the oldest are dropped first)."""

    def __init__(
        self,
        capacity: int = 1 << 17,
        min_match: int = 3,
        max_match: int = MATCH_BUCKETS[-1],
        max_positions: int = 64,
        min_share: float = 0.3,
        context: int = 8,
    ):
        self.capacity, self.min_match, self.max_match = capacity, min_match, max_match
        self.max_positions, self.min_share, self.context = max_positions, min_share, context
        self.tokens = array("i")
        self.base = 0  # the position of tokens[0] since the store began
        self._ends: dict[tuple[int, ...], list[int]] = {}  # n-gram -> positions just past it, latest last

    def __len__(self) -> int:
        return len(self.tokens)

    def add(self, prompt, answer) -> None:
        """Keep an answer, after the last `context` tokens of its prompt (so the start of a
        later answer finds it)."""
        if not answer:
            return
        self._append([SEPARATOR, *prompt[-self.context :], *answer])
        if len(self.tokens) > self.capacity:
            self._drop_oldest(len(self.tokens) - self.capacity // 2)

    def _append(self, tokens) -> None:
        start = len(self.tokens)
        self.tokens.extend(int(t) for t in tokens)
        n, ends = self.min_match, self._ends
        for i in range(max(start, n), len(self.tokens)):
            gram = tuple(self.tokens[i - n : i])
            if SEPARATOR in gram:
                continue
            positions = ends.setdefault(gram, [])
            positions.append(self.base + i)
            if len(positions) > 2 * self.max_positions:
                del positions[: -self.max_positions]

    def _drop_oldest(self, count: int) -> None:
        kept = self.tokens[count:]
        self.base += count
        self.tokens, self._ends = array("i"), {}
        self._append(kept)  # indexed at base + i again: positions stay the same

    def propose(self, context, limit: int) -> Match:
        """Up to `limit` tokens that most often followed the longest earlier match of the end
        of `context` (a Match of source "suffix", its length class as `length`)."""
        n = self.min_match
        if limit <= 0 or len(context) < n:
            return NO_MATCH
        ends = self._ends.get(tuple(context[-n:]))
        if not ends:
            return NO_MATCH
        tail = context[-self.max_match :]
        tokens, best, found = self.tokens, 0, []
        for end in reversed(ends[-self.max_positions :]):
            i = end - self.base
            if i < n or i >= len(tokens) or tokens[i] == SEPARATOR:
                continue  # dropped, or nothing after it
            length = agreement(tokens, i, tail, n)
            if length > best:
                best, found = length, [i]
            elif length == best:
                found.append(i)
        proposal, share = [], 1.0
        while found and len(proposal) < limit:
            counts: dict[int, int] = {}
            for i in found:
                if i < len(tokens) and tokens[i] != SEPARATOR:
                    counts[tokens[i]] = counts.get(tokens[i], 0) + 1
            if not counts:
                break
            token, count = max(counts.items(), key=lambda item: item[1])  # ties: the latest occurrence
            share *= count / len(found)
            if share < self.min_share:
                break
            proposal.append(token)
            found = [i + 1 for i in found if i < len(tokens) and tokens[i] == token]
        return Match(tuple(proposal), match_bucket(best), "suffix") if proposal else NO_MATCH
