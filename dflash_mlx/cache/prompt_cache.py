"""Reuse of the work done for earlier prompts and answers (a chat's next turn, a shared system
prompt, an agent's many requests): snapshots of the target caches and the drafter's injected
context, looked up by a token trie (mlx-lm's PromptTrie), in an LRU bounded in bytes, and
optionally in a folder on disk that survives a restart.

Snapshots are taken when a request leaves (its prompt + answer, decode/decoder.py), after prefilling a
prompt when that prefill was long, and, when the caches cannot be cut back, before its last
token (a retried prompt).  A new prompt restores the snapshot sharing its
longest prefix and prefills only the rest.  A snapshot is used whole when the new prompt
extends its tokens (any cache kind, GatedDeltaNet states included); cut back to a shorter
shared prefix only when every cache can be cut (plain KV caches, and a drafter context that
has not dropped entries from a window).  Where a cache cannot be cut (a hybrid target's
recurrent state), snapshots are also taken every `snapshot_every` tokens along a prompt's
prefill, as vLLM's hybrid prefix caching does, so a prompt that departs from an earlier one
midway (a client re-rendering an old turn) restores the nearest one before it.  The last
prompt token is always prefilled: its pass chooses the first generated token.

Entries share what their tokens share: KV states that grow along the token axis (full-attention
layers, the drafter's context) are kept in pieces of `piece_tokens` positions, each named by a
hash of every token up to its end (vLLM's prefix blocks), held once however many entries begin
with those tokens (agents' sessions on one system prompt and tool list, a hybrid's snapshots
along one prefill); an entry owns only its tail and its other states.  Pieces and tails are
copies, so an entry's KV never keeps a live cache's buffer (or a whole batch's) alive; restoring
one concatenates its pieces into a fresh cache.  Its other states (sliding windows, recurrent
states) share their arrays with the caches they were taken from (MLX arrays are values: a deep
copy is a new handle on the same memory, and a later write copies only what it writes).

The disk tier (`folder`) holds the entries the RAM tier evicts, and every entry at `flush()`
(a server's shutdown), as mlx-lm's prompt-cache safetensors files named by a hash of the model
fingerprint and the tokens, bounded in bytes (least recently used first out).  Files are
written to a temporary name and renamed, so two processes sharing the folder never read half
a file; one from another model, or unreadable, is passed over with one line.  An entry whose
file cannot be read when a lookup reaches it (damaged, removed by another process) leaves the
folder, the index and the trie together, said in one line, and the lookup goes on to the
entries behind it.  Such notes go through `logging` (logger `dflash_mlx.cache.prompt_cache`).
"""

import copy
import hashlib
import json
import logging
import os
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import mlx.core as mx
from mlx.utils import tree_flatten
from mlx_lm.models.cache import KVCache, PromptTrie, load_prompt_cache, save_prompt_cache

from ..drafters.dflash import ContextKV
from ..target.rollback import TrimmableKV
from ..target.wrapper import TargetCache

MODEL = "target"  # the trie's one model: a PromptCache serves one model pair

logger = logging.getLogger(__name__)


@dataclass
class Snapshot:
    tokens: tuple[int, ...]
    target: TargetCache  # its token-axis KV caches hold only what follows `pieces`
    context: Optional[list]  # the drafter's ContextKV per layer (None without a drafter)
    nbytes: int  # what it owns: the shared pieces are counted once, in `Pieces`
    pieces: tuple = ()  # names of the shared pieces it begins with, in order
    on_disk: bool = False


def _nbytes(*trees) -> int:
    return sum(x.nbytes for tree in trees for _, x in tree_flatten(tree) if isinstance(x, mx.array))


def _states(target, context) -> list:
    return [c.state for c in target.layers] + [c.state for c in context or []]


def _size(nbytes: int) -> str:
    return f"{nbytes / 2**30:.2f} GiB" if nbytes >= 1 << 30 else f"{nbytes / 2**20:.1f} MiB"


def _token_axis_caches(target, context) -> list:
    """The caches holding keys and values for every position from the first, in one array each
    (plain KV caches, a drafter context without a window): the ones cut into shared pieces."""
    kv = [h.cache for h in target.handlers if isinstance(h, TrimmableKV)]
    return [c for c in kv + [c for c in context or [] if c.window is None] if c.keys is not None]


def _live_nbytes(target, context) -> int:
    """Bytes of what `target` and `context` hold (not the room their buffers keep for more)."""
    kv = _token_axis_caches(target, context)
    live = [(c.keys[..., : _length(c), :], c.values[..., : _length(c), :]) for c in kv]
    others = [c.state for c in target.layers + list(context or []) if not any(c is k for k in kv)]
    return _nbytes(live, others)


def _length(cache) -> int:
    return cache.offset if isinstance(cache, KVCache) else cache.span().length


def _hold(cache, keys: mx.array, values: mx.array, length: int) -> None:
    """`cache` holding `keys`/`values` (room for more past `length`), its first `length` live."""
    cache.keys, cache.values, cache.offset = keys, values, length
    if isinstance(cache, ContextKV):
        cache._end = length


class Pieces:
    """Token-aligned pieces of token-axis KV states, shared by the entries whose tokens begin
    alike; a piece goes when the last entry holding it does."""

    def __init__(self, tokens: int):
        self.tokens = tokens
        self.arrays: dict[bytes, list[mx.array]] = {}  # name -> keys, values of each cache in turn
        self.holders: dict[bytes, int] = {}
        self.nbytes = 0

    def names(self, tokens: tuple, count: int) -> list[bytes]:
        """Names of the first `count` pieces of `tokens`: each hashes every token up to its end."""
        names, digest = [], b""
        for start in range(0, count * self.tokens, self.tokens):
            chunk = ",".join(map(str, tokens[start : start + self.tokens]))
            digest = hashlib.sha256(digest + chunk.encode()).digest()
            names.append(digest)
        return names

    def hold(self, name: bytes, caches: list, index: int) -> None:
        """One more holder of piece `name`, cut from `caches` (the `index`-th piece) if new."""
        if name not in self.arrays:
            cut = slice(index * self.tokens, (index + 1) * self.tokens)
            arrays = [mx.contiguous(a[..., cut, :]) for c in caches for a in (c.keys, c.values)]
            mx.eval(arrays)
            self.arrays[name] = arrays
            self.holders[name] = 0
            self.nbytes += sum(a.nbytes for a in arrays)
        self.holders[name] += 1

    def release(self, names) -> None:
        for name in names:
            self.holders[name] -= 1
            if not self.holders[name]:
                del self.holders[name]
                self.nbytes -= sum(a.nbytes for a in self.arrays.pop(name))


def device_memory() -> tuple[int, Optional[int]]:
    """This machine's memory in bytes, and the GPU's recommended working set where MLX reports one (a Mac)."""
    info = mx.device_info()
    total = info.get("memory_size") or os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    recommended = info.get("max_recommended_working_set_size")
    return int(total), int(recommended) if recommended else None


def machine_memory() -> int:
    """Bytes the device may hold: the GPU's recommended working set on a Mac, else the RAM."""
    total, recommended = device_memory()
    return recommended or total


def default_bytes(weights: int, memory: int) -> int:
    """The prompt cache's default bound: a quarter of what `memory` leaves after the `weights`
    (the rest for the decoding caches and activations), at least 1 GiB: an agent's prompt of
    20k tokens on an 8B model is ~3 GB of fp16 keys and values, which a fixed 1 GiB would never keep."""
    return max(1 << 30, (memory - weights) // 4)


class PromptCache:
    def __init__(
        self,
        max_bytes: int = 1 << 30,
        folder: Optional[Path] = None,
        disk_bytes: int = 8 << 30,
        fingerprint: str = "",
        snapshot_every: int = 2048,
        piece_tokens: int = 128,
    ):
        self.max_bytes, self.snapshot_every = max_bytes, snapshot_every
        self.pieces = Pieces(piece_tokens)
        self.entries: "OrderedDict[tuple[int, ...], Snapshot]" = OrderedDict()  # least recently used first
        self.trie = PromptTrie()
        self.disk = DiskTier(Path(folder), disk_bytes, fingerprint) if folder is not None else None
        self.hits = 0
        self.reused_tokens = 0
        self.refused = 0  # states larger than the whole cache, not kept (said once)

    @property
    def nbytes(self) -> int:
        owned = sum(e.nbytes for e in list(self.entries.values()))  # list(): one read, safe beside the engine thread
        return owned + self.pieces.nbytes

    def snapshot_interval(self, target: TargetCache) -> Optional[int]:
        """Tokens between snapshots along a prefill for caches like `target`'s: None when every
        cache can be cut back (the last snapshot then serves any shorter shared prefix)."""
        return None if all(isinstance(h, TrimmableKV) for h in target.handlers) else self.snapshot_every

    def fetch(self, prompt: list[int]):
        """(target cache, drafter context, tokens covered) restored for `prompt`, or None."""
        usable = list(prompt[: len(prompt) - 1])  # the last token is always prefilled
        found = self._nearest(usable)
        read: list[Snapshot] = []
        if self.disk is not None:
            found = self._nearer_on_disk(usable, found, read)
        restored = None if found is None else self._restore(*found, room=len(prompt) - found[1])
        for entry in read:  # kept after the restore: keeping them may evict the entry it came from
            if entry.nbytes <= self.max_bytes:  # else it would push every other entry out, and still not fit
                self._insert(entry)
        return restored

    def _nearer_on_disk(self, usable: list[int], found, read: list) -> Optional[tuple[Snapshot, int]]:
        """The disk entry sharing more of `usable` than `found` (a RAM entry and that length, or
        None) and that length, else `found`; every entry read is added to `read`.  A file that
        cannot be read leaves the disk tier, and the lookup is asked again: an entry behind it
        may serve."""
        while True:
            for tokens, shared in self.disk.candidates(usable):
                if shared <= (found[1] if found else 0) or tokens in self.entries:
                    continue  # the RAM lookup has judged its entries already
                entry = self.disk.read(tokens)
                if entry is None:
                    break
                read.append(entry)
                if shared == len(entry.tokens) or _cuttable(entry):
                    return entry, shared
            else:
                return found

    def _restore(self, best: Snapshot, shared: int, room: int):
        """Fresh caches holding `best`'s first `shared` tokens, with room for `room` more."""
        if best.tokens in self.entries:  # (one read from disk joins them after)
            self.entries.move_to_end(best.tokens)
        target, context = self._whole(best, room)
        if shared < len(best.tokens):
            _cut(target, context, len(best.tokens) - shared)
        self.hits += 1
        self.reused_tokens += shared
        return target, context, shared

    def covered(self, tokens: list[int]) -> int:
        """How many leading tokens of `tokens` the memory tier holds a state for (nothing restored)."""
        found = self._nearest(list(tokens))
        return found[1] if found else 0

    def _whole(self, entry: Snapshot, room: int = 0):
        """Fresh caches holding all of `entry` (its pieces, then its own tail), with room for
        `room` more positions so the prefill that follows writes in place."""
        target, context = copy.deepcopy(entry.target), copy.deepcopy(entry.context)
        pieces = [self.pieces.arrays[name] for name in entry.pieces]
        for i, cache in enumerate(_token_axis_caches(target, context)):
            length = _length(cache)
            keys = [p[2 * i] for p in pieces] + [cache.keys]  # an entry's caches hold its tail
            values = [p[2 * i + 1] for p in pieces] + [cache.values]
            if room:
                keys.append(mx.zeros((*keys[-1].shape[:2], room, keys[-1].shape[3]), keys[-1].dtype))
                values.append(mx.zeros((*values[-1].shape[:2], room, values[-1].shape[3]), values[-1].dtype))
            _hold(cache, mx.concatenate(keys, axis=2), mx.concatenate(values, axis=2), length)
        return target, context

    def _nearest(self, usable: list[int]) -> Optional[tuple[Snapshot, int]]:
        """The RAM entry sharing the longest usable prefix with `usable`, and that length."""
        if not self.entries:
            return None
        for tokens, shared in candidates(self.trie, usable):
            entry = self.entries[tokens]
            if shared == len(tokens) or _cuttable(entry):
                return entry, shared
        return None

    def store(self, tokens: list[int], target, context) -> None:
        key = tuple(tokens)
        if not key or key in self.entries:
            return
        mx.eval(_states(target, context))
        entry = Snapshot(key, copy.deepcopy(target), copy.deepcopy(context), _live_nbytes(target, context))
        if entry.nbytes > self.max_bytes:
            self._refuse(entry)
            return
        if _cuttable(entry):
            self._drop_prefixes(key)
        self._insert(entry)

    def _refuse(self, entry: Snapshot) -> None:
        if not self.refused:
            logger.warning(
                "a prompt's state (%d tokens, %s) is larger than the whole prompt cache (%s), so it is not kept "
                "and a request sharing it prefills it again; raise the cache's bytes (--prompt-cache-bytes) to keep it",
                len(entry.tokens),
                _size(entry.nbytes),
                _size(self.max_bytes),
            )
        self.refused += 1

    def _share(self, entry: Snapshot) -> None:
        """`entry`'s token-axis states cut into shared pieces (held, or made once) and its own
        tail; it keeps no array of the caches it was taken from."""
        caches = _token_axis_caches(entry.target, entry.context)
        count = min((_length(c) for c in caches), default=0) // self.pieces.tokens
        names = self.pieces.names(entry.tokens, count)
        for index, name in enumerate(names):
            self.pieces.hold(name, caches, index)
        start = count * self.pieces.tokens
        for cache in caches:
            length = _length(cache)
            keys, values = (mx.contiguous(a[..., start:length, :]) for a in (cache.keys, cache.values))
            _hold(cache, keys, values, length)
        mx.eval(_states(entry.target, entry.context))
        entry.pieces, entry.nbytes = tuple(names), _nbytes(_states(entry.target, entry.context))

    def _drop_prefixes(self, key: tuple) -> None:
        """RAM entries whose tokens begin `key`: an entry that can be cut back serves them all (a
        session's every turn would otherwise keep the states of all the turns before it)."""
        while self.entries and (shorter := self.trie.search(MODEL, list(key)).shorter):
            self.trie.pop(MODEL, shorter)
            self.pieces.release(self.entries.pop(tuple(shorter)).pieces)

    def _insert(self, entry: Snapshot) -> None:
        self._share(entry)
        self.entries[entry.tokens] = entry
        self.trie.add(MODEL, list(entry.tokens), entry)
        while self.nbytes > self.max_bytes:
            _, evicted = self.entries.popitem(last=False)
            self.trie.pop(MODEL, list(evicted.tokens))
            self._spill(evicted)  # the RAM tier spills to the disk tier
            self.pieces.release(evicted.pieces)

    def _spill(self, entry: Snapshot) -> None:
        if self.disk is not None and not entry.on_disk:
            target, context = self._whole(entry)
            entry.on_disk = self.disk.write(entry.tokens, target, context)

    def flush(self) -> None:
        """Every RAM entry not yet on disk written there (a server's shutdown)."""
        for entry in self.entries.values():
            self._spill(entry)


def candidates(trie: PromptTrie, usable: list[int]) -> list[tuple[tuple, int]]:
    """Entries of `trie` that could serve `usable`, best first, with the tokens each shares with
    it: the exact one; else one extending past their common prefix (usable when its caches can be
    cut back: a session's state after an answer serves its prompt asked again), then the longest
    that is a prefix of `usable`."""
    if not usable:
        return []
    result = trie.search(MODEL, usable)
    if result.exact is not None:
        return [(tuple(result.exact), len(usable))]
    found = []
    if result.longer is not None and result.common_prefix > len(result.shorter or ()):
        found.append((tuple(result.longer), result.common_prefix))
    if result.shorter:
        found.append((tuple(result.shorter), len(result.shorter)))
    return found


def _cuttable(entry: Snapshot) -> bool:
    return all(isinstance(h, TrimmableKV) for h in entry.target.handlers) and all(
        c.window is None for c in entry.context or []
    )


def _cut(target, context, drop: int) -> None:
    for h in target.handlers:
        h.cache.trim(drop)
    for c in context or []:
        c.trim(drop)


class DiskTier:
    """Snapshots as safetensors files in `folder` (mlx-lm's prompt-cache format: the target's
    layer caches, then the drafter's context as KV caches), bounded to `max_bytes`."""

    def __init__(self, folder: Path, max_bytes: int, fingerprint: str):
        self.folder, self.max_bytes, self.fingerprint = folder, max_bytes, fingerprint
        folder.mkdir(parents=True, exist_ok=True)
        self.index: dict[tuple[int, ...], Path] = {}
        self.trie = PromptTrie()
        passed_over = []
        for path in sorted(folder.glob("*.safetensors")):
            meta = self._metadata(path)
            if meta is None:
                passed_over.append(path.name)
            else:
                self._add(tuple(json.loads(meta["tokens"])), path)
        if passed_over:
            logger.warning(
                "%d file(s) in the prompt cache folder %s are another model's or unreadable (e.g. %s); passed over",
                len(passed_over),
                folder,
                passed_over[0],
            )

    def _name(self, tokens: tuple) -> Path:
        digest = hashlib.sha256(f"{self.fingerprint}:{','.join(map(str, tokens))}".encode()).hexdigest()[:24]
        return self.folder / f"{digest}.safetensors"

    def _add(self, tokens: tuple, path: Path) -> None:
        self.index[tokens] = path
        self.trie.add(MODEL, list(tokens), path)

    def _forget(self, tokens: tuple) -> Path:
        """`tokens`' entry out of the index and the trie together (a lookup offered an entry the
        index no longer has would retry it forever, and never reach the entries behind it)."""
        self.trie.pop(MODEL, list(tokens))
        return self.index.pop(tokens)

    def _metadata(self, path: Path) -> Optional[dict]:
        """The file's metadata when it is one of this model's entries (another model's may share
        the folder: not ours to read or remove); None otherwise."""
        try:
            _, flat = mx.load(str(path), return_metadata=True)
            meta = {key[2:]: value for key, value in flat.items() if key.startswith("0.")}  # mlx-lm's layout
            json.loads(meta["tokens"])
        except Exception:  # truncated, not safetensors at all, not an entry
            return None
        return meta if meta.get("fingerprint") == self.fingerprint else None

    def candidates(self, usable: list[int]) -> list[tuple[tuple, int]]:
        """Stored entries worth reading for `usable` (module `candidates`)."""
        return candidates(self.trie, usable) if self.index else []

    def read(self, tokens: tuple) -> Optional[Snapshot]:
        """The entry stored for `tokens`; None when its file cannot be read (it is then removed)."""
        path = self.index[tokens]
        try:
            layers, meta = load_prompt_cache(str(path), return_metadata=True)
            if meta.get("fingerprint") != self.fingerprint or tuple(json.loads(meta["tokens"])) != tokens:
                raise ValueError("another model's entry")
            count = int(meta["target_layers"])
            contexts = json.loads(meta["context"])
            context = None
            if contexts is not None:
                context = []
                for kv, (offset, window, end) in zip(layers[count:], contexts):
                    c = ContextKV(window)
                    c.keys, c.values, c.offset, c._end = kv.keys, kv.values, offset, end
                    context.append(c)
            target = TargetCache(layers=layers[:count])
            os.utime(path)  # recently used: the last to go
        except Exception as e:  # truncated, removed by another process, overwritten
            self._remove_unreadable(tokens, e)
            return None
        return Snapshot(tokens, target, context, _nbytes(_states(target, context)), on_disk=True)

    def _remove_unreadable(self, tokens: tuple, error: Exception) -> None:
        """`tokens`' entry, whose file could not be read, forgotten and its file removed: said once."""
        path = self._forget(tokens)
        try:
            path.unlink(missing_ok=True)
            outcome = "removed"
        except OSError as e:  # a folder this process may read but not write
            outcome = f"passed over (it could not be removed: {e.strerror})"
        logger.warning("the prompt cache file %s could not be read (%s); %s", path, type(error).__name__, outcome)

    def write(self, tokens: tuple, target: TargetCache, context: Optional[list]) -> bool:
        """An entry's whole state written to its file; whether it was."""
        path = self._name(tokens)
        contexts = None
        kv = []
        if context is not None:
            contexts = [[c.offset, c.window, c._end] for c in context]
            kv = [KVCache.from_state((c.keys[..., : c._end, :], c.values[..., : c._end, :], c._end)) for c in context]
        meta = {
            "fingerprint": self.fingerprint,
            "tokens": json.dumps(list(tokens)),
            "target_layers": str(len(target.layers)),
            "context": json.dumps(contexts),
        }
        temporary = path.with_name(f".{path.stem}.{os.getpid()}.tmp.safetensors")
        try:
            save_prompt_cache(str(temporary), list(target.layers) + kv, meta)
            os.replace(temporary, path)
        except OSError as e:
            temporary.unlink(missing_ok=True)
            logger.warning("could not write a prompt cache entry to %s (%s)", self.folder, e.strerror)
            return False
        self._add(tokens, path)
        self._bound()
        return True

    def _bound(self) -> None:
        files = sorted(self.folder.glob("*.safetensors"), key=lambda p: p.stat().st_mtime)
        total = sum(p.stat().st_size for p in files)
        for path in files:
            if total <= self.max_bytes:
                break
            total -= path.stat().st_size
            path.unlink(missing_ok=True)
            for tokens in [t for t, p in self.index.items() if p == path]:
                self._forget(tokens)
