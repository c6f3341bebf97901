"""Reuse of the work done for earlier prompts (a chat's next turn, a shared system
prompt): snapshots of the target caches and the drafter's injected context,
taken after prefilling all of a prompt but its last token, in an LRU bounded in bytes.

A new prompt restores the snapshot sharing its longest prefix and prefills only
the rest.  A snapshot is used whole when the new prompt extends its tokens (any
cache kind, GatedDeltaNet states included); cut back to a shorter shared prefix
only when every cache can be cut (plain KV caches, and a drafter context that
has not dropped entries from a window).  The last prompt token is always
prefilled, so the first generated token comes from a fresh pass.
"""

import copy
from collections import OrderedDict
from dataclasses import dataclass

import mlx.core as mx
from mlx.utils import tree_flatten

from .rollback import TrimmableKV


@dataclass
class Snapshot:
    tokens: tuple[int, ...]
    target: object  # TargetCache
    context: list  # the drafter's ContextKV per layer (None without a drafter)
    nbytes: int


def _nbytes(*trees) -> int:
    return sum(x.nbytes for tree in trees for _, x in tree_flatten(tree) if isinstance(x, mx.array))


def _states(target, context) -> list:
    return [c.state for c in target.layers] + [c.state for c in context or []]


class PromptCache:
    def __init__(self, max_bytes: int = 1 << 30):
        self.max_bytes = max_bytes
        self.entries: "OrderedDict[tuple[int, ...], Snapshot]" = OrderedDict()
        self.hits = 0
        self.reused_tokens = 0

    @property
    def nbytes(self) -> int:
        return sum(e.nbytes for e in self.entries.values())

    def fetch(self, prompt: list[int]):
        """(target cache, drafter context, tokens covered) restored for `prompt`, or None."""
        usable = len(prompt) - 1  # the last token is always prefilled
        best, best_len = None, 0
        for key, entry in self.entries.items():
            shared = _common_prefix(key, prompt, usable)
            if shared == len(key) or (shared > 0 and _cuttable(entry)):
                if shared > best_len:
                    best, best_len = entry, shared
        if best is None:
            return None
        self.entries.move_to_end(best.tokens)
        target, context = copy.deepcopy(best.target), copy.deepcopy(best.context)
        if best_len < len(best.tokens):
            _cut(target, context, len(best.tokens) - best_len)
        self.hits += 1
        self.reused_tokens += best_len
        return target, context, best_len

    def store(self, tokens: list[int], target, context) -> None:
        key = tuple(tokens)
        if not key or key in self.entries:
            return
        mx.eval(_states(target, context))
        entry = Snapshot(key, copy.deepcopy(target), copy.deepcopy(context), _nbytes(_states(target, context)))
        if entry.nbytes > self.max_bytes:
            return
        self.entries[key] = entry
        while self.nbytes > self.max_bytes:
            self.entries.popitem(last=False)


def _common_prefix(a, b, limit: int) -> int:
    n = min(len(a), len(b), limit)
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n


def _cuttable(entry: Snapshot) -> bool:
    return all(isinstance(h, TrimmableKV) for h in entry.target.handlers) and all(
        c.window is None for c in entry.context or []
    )


def _cut(target, context, drop: int) -> None:
    for h in target.handlers:
        h.cache.trim(drop)
    for c in context or []:
        c.trim(drop)
