"""Prompt-lookup proposals: the second source of drafts, free to make.

When the text being written repeats text already seen (editing code, quoting the
prompt, filling a JSON template), the tokens that followed the last occurrence of
the current suffix are a good guess for what comes next.  The longest suffix of
1..max_ngram tokens that occurred before is looked up (its latest occurrence), and
the tokens that followed it are proposed, as in prompt lookup decoding and vLLM's
n-gram speculator (a match that runs into the present continues with its own
period).  They are verified like any draft, so the output is unchanged.  How long
the matched suffix was travels with the proposal: a 1-token match is a weak hint, a
4-token one a strong one, and the adaptive plan (plan.py) learns how often each
kind is accepted.
"""

from dataclasses import dataclass


@dataclass(frozen=True)
class Match:
    tokens: tuple = ()  # what followed the earlier occurrence (empty: no match)
    length: int = 0  # tokens of the current suffix that matched (suffix.py: their length class)
    source: str = "lookup"  # "lookup": this request's own tokens; "suffix": earlier answers (suffix.py)

    def __bool__(self) -> bool:
        return bool(self.tokens)


NO_MATCH = Match()


class PromptLookup:
    def __init__(self, tokens, min_ngram: int = 1, max_ngram: int = 4):
        self.min_ngram, self.max_ngram = min_ngram, max_ngram
        self.tokens: list[int] = []
        self._after: dict[tuple[int, ...], int] = {}  # n-gram -> where its latest continuation starts
        self.extend(tokens)

    def extend(self, tokens) -> None:
        """Append committed tokens; every n-gram now followed by a token is indexed."""
        for token in tokens:
            end = len(self.tokens)  # the n-grams ending here are followed by `token`
            for n in range(self.min_ngram, min(self.max_ngram, end) + 1):
                self._after[tuple(self.tokens[end - n : end])] = end
            self.tokens.append(int(token))

    def propose(self, limit: int) -> Match:
        """Up to `limit` tokens that followed the longest earlier match of the current suffix."""
        if limit <= 0:
            return NO_MATCH
        for n in range(min(self.max_ngram, len(self.tokens)), self.min_ngram - 1, -1):
            start = self._after.get(tuple(self.tokens[-n:]))
            if start is not None:
                # copied as an overlapping copy runs: past the end, the proposal repeats itself
                # (a repeating text keeps its period)
                proposal, end = [], len(self.tokens)
                for i in range(start, start + limit):
                    proposal.append(self.tokens[i] if i < end else proposal[i - end])
                return Match(tuple(proposal), n)
        return NO_MATCH
