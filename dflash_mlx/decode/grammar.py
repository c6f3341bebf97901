"""Structured output: a grammar masks the target's choice at every position.

The mask applies where the output is decided, the target's choice: at a verify
of [last token] + proposal, row i is masked with the grammar's state after the
committed text plus proposal[:i].  Drafts and prompt-lookup proposals stay
unconstrained; a token the grammar forbids is simply not the target's choice
there, so the proposal is rejected at that position, and the output is exactly
what constrained plain decoding gives (greedy token for token; sampled, the same
masked distribution and, seeded, the same tokens).  Where the grammar allows one
token alone for a stretch (a schema's keys, a forced tool call's name), those
tokens are the proposal (`forced`): verified with the target's next choice in one
pass, and certain to be accepted, since the mask leaves nothing else.

Grammars come from llguidance (the constrained-decoding engine llama.cpp, vLLM
and SGLang use; an optional dependency: the `serve` extra).
"""

import json
from functools import lru_cache
from typing import Optional

import mlx.core as mx
import numpy as np


def _llguidance():
    try:
        import llguidance
        import llguidance.hf
    except ImportError:
        raise RuntimeError(
            "structured output needs llguidance: pip install llguidance (or pip install -e '.[serve]' in the repository)"
        ) from None
    return llguidance


# JSON on one line, as json.dumps and chat templates write it: a model that would rather write
# whitespace than a value cannot write it for ever
ONE_LINE = {"whitespace_flexible": False, "key_separator": ": ", "item_separator": ", "}


@lru_cache(maxsize=4)
def _ll_tokenizer(hf_tokenizer, eos: tuple):
    return _llguidance().hf.from_tokenizer(hf_tokenizer, eos_token=list(eos))  # ~1 s: once per tokenizer


class Grammar:
    """A compiled grammar for one tokenizer; `start()` gives the state one generation advances."""

    def __init__(self, tokenizer, grammar: str, vocab_size: int):
        llguidance = _llguidance()
        hf = getattr(tokenizer, "_tokenizer", tokenizer)
        self.tokenizer = _ll_tokenizer(
            hf, tuple(sorted(getattr(tokenizer, "eos_token_ids", None) or [hf.eos_token_id]))
        )
        self.grammar, self.vocab_size = grammar, vocab_size
        is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(grammar, self.tokenizer)
        if is_error:
            raise ValueError(f"the grammar is not valid: {'; '.join(messages)}")

    @classmethod
    def json(cls, tokenizer, vocab_size: int, schema: Optional[dict] = None, one_line: bool = False) -> "Grammar":
        """JSON that validates against `schema` (any JSON object when None); `one_line`: laid out
        as json.dumps writes it (the server's structured output), else with any whitespace."""
        schema = {"type": "object"} if schema is None else schema
        if not isinstance(schema, dict):
            raise ValueError("a JSON schema must be an object")
        if one_line:  # unless the schema lays itself out
            schema = {"x-guidance": ONE_LINE, **schema}
        grammar = _llguidance().LLMatcher.grammar_from_json_schema(json.dumps(schema))
        return cls(tokenizer, grammar, vocab_size)

    def start(self) -> "GrammarState":
        return GrammarState(_llguidance().LLMatcher(self.tokenizer, self.grammar, log_level=0), self.vocab_size)


class GrammarState:
    """Where one generation is in the grammar."""

    def __init__(self, matcher, vocab_size: int):
        self.matcher, self.vocab_size = matcher, vocab_size

    def _mask(self) -> np.ndarray:
        """The tokens allowed next (once the grammar is complete, only the end tokens)."""
        bits = np.unpackbits(np.frombuffer(self.matcher.compute_bitmask(), dtype=np.uint8), bitorder="little")
        mask = np.zeros(self.vocab_size, dtype=bool)
        n = min(self.vocab_size, bits.size)
        mask[:n] = bits[:n].astype(bool)
        return mask

    def masks(self, proposal: list[int]) -> mx.array:
        """(len(proposal) + 1, vocab) bool: the tokens allowed after each prefix of `proposal`
        (row 0: after what is committed).  Rows past a forbidden proposal token repeat the
        last mask: the target's choice differs from the proposal there, so they are never used."""
        rows, consumed = [self._mask()], 0
        for token in proposal:
            # a stopped matcher takes the end token without recording it: rolling back
            # `consumed` would then undo a committed token
            if self.matcher.is_stopped() or not rows[-1][token]:
                break
            if not self.matcher.consume_token(token):  # the mask let through what the parser refuses
                rows[-1] = rows[-1].copy()
                rows[-1][token] = False
                break
            consumed += 1
            rows.append(self._mask())
        self.matcher.rollback(consumed)
        rows += [rows[-1]] * (len(proposal) + 1 - len(rows))
        return mx.array(np.stack(rows))

    def forced(self, limit: int) -> list[int]:
        """Up to `limit` tokens the grammar allows alone from here (a JSON object's fixed keys,
        a tool call's name): proposed as a draft, they cost no target pass of their own."""
        if limit <= 0 or self.matcher.is_stopped():
            return []
        return list(self.matcher.compute_ff_tokens())[:limit]

    def commit(self, tokens: list[int]) -> None:
        for token in tokens:
            if self.matcher.is_stopped():
                return
            if not self.matcher.consume_token(token):
                raise RuntimeError(f"grammar: token {token} was chosen against the mask ({self.matcher.get_error()})")


def masked(logits: mx.array, mask: Optional[mx.array]) -> mx.array:
    """Logits with the tokens a grammar forbids at -inf (unchanged without a mask)."""
    return logits if mask is None else mx.where(mask, logits, mx.array(-float("inf"), dtype=logits.dtype))
