"""Prefix reuse is exact: a prompt served from the prompt cache decodes exactly as cold."""

import hashlib
import json
import logging
import os
import shutil
from collections import Counter
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

from dflash_mlx import load
from dflash_mlx.decode import decoder as engine
from dflash_mlx.api.loading import _fingerprint
from dflash_mlx.decode.decoder import Decoder, decode
from dflash_mlx.decode.prefix import SHARED_MIN, shared_length
from dflash_mlx.io.storage import CACHE_ENV
from dflash_mlx.decode.model import DecodeStats, DFlashModel
from dflash_mlx.cache.prompt_cache import PromptCache, default_bytes
from dflash_mlx.decode.request import Request
from dflash_mlx.sampling import SamplingParams
from tiny_models import by_family, random_draft, tiny_target

SYSTEM = list(range(30, 70))  # a shared prefix (think: system prompt + earlier turns)
ANSWER = 12  # tokens an answer runs to: several verify cycles at block 4


def run(model, prompt, cache=None, params=SamplingParams(), seed=None):
    stats = DecodeStats()
    tokens = [
        t
        for s in decode(model, Request(list(prompt), ANSWER, params, seed=seed), prompt_cache=cache, stats=stats)
        for t in s.tokens
    ]
    return tokens, stats.cached_tokens


@pytest.mark.parametrize(
    "model_type, overrides",
    by_family(
        [
            ("llama", {}),
            ("llama", {"sliding_window": 16, "layer_types": ["sliding_attention", "full_attention"] * 2}),
            ("qwen3", {}),
            ("qwen3_moe", {}),
            ("qwen3_5", {}),
        ]
    ),
)
def test_cached_prompts_decode_exactly_as_cold(model_type, overrides):
    target = tiny_target(model_type, seed=2, **overrides)
    model = DFlashModel(target, random_draft(target, block_size=4))
    cache = PromptCache(piece_tokens=16)  # SYSTEM in two shared pieces and a tail; turn 5 cuts into a piece
    turns = [
        SYSTEM + [5, 6, 7],
        SYSTEM + [5, 6, 7, 8, 9, 10, 11],
        SYSTEM + [5, 6, 7, 8, 9, 10, 11],
        SYSTEM + [1, 2],
        SYSTEM[:20],
    ]
    reused = []
    for prompt in turns:
        cold, _ = run(model, prompt)
        warm, cached = run(model, prompt, cache)
        assert warm == cold
        reused.append(cached)
    # turn 2 extends turn 1's prompt (and cuttable caches reuse its answer's state as far as they agree)
    assert reused[0] == 0 and reused[1] in (len(turns[0]) - 1, len(turns[0])) and reused[2] == len(turns[2]) - 1
    kv_only = model_type != "qwen3_5" and not overrides
    # a shorter shared prefix needs caches that can be cut back (plain KV)
    assert (reused[3] == len(SYSTEM)) == kv_only and (reused[4] == 19) == kv_only
    params = SamplingParams(temp=0.8)
    assert run(model, turns[1], cache, params, seed=3)[0] == run(model, turns[1], None, params, seed=3)[0]


def run_batched(model, prompts, cache):
    """`prompts` decoded together in one batch: each one's tokens and cached prefix length."""
    decoder = Decoder(model, cache, max_batch=len(prompts))
    rows = [decoder.add(Request(list(prompt), ANSWER)) for prompt in prompts]
    while decoder.busy:
        decoder.step()
    return [(row.output, row.stats.cached_tokens) for row in rows]


@pytest.mark.parametrize("model_type", ["qwen3_5", "qwen3_next"])
@pytest.mark.parametrize("batched", [False, True])
def test_a_hybrid_restores_the_nearest_snapshot_along_a_long_prompt(model_type, batched):
    """A GatedDeltaNet state cannot be cut back: snapshots every `snapshot_every` tokens along a
    prefill let a prompt that departs midway from an earlier one (a client re-rendering an old
    turn) restore the last one before the departure, and decode exactly as cold."""
    target = tiny_target(model_type, seed=2)
    model = DFlashModel(target, random_draft(target, block_size=4))
    cache = PromptCache(snapshot_every=16)
    long = list(range(20, 90))
    departed = long[:40] + [7, 8, 9]
    if batched:
        run_batched(model, [long, long[::-1]], cache)
        (answer, cached), _ = run_batched(model, [departed, [5, 6, 7]], cache)
    else:
        run(model, long, cache)
        answer, cached = run(model, departed, cache)
    assert cached == 32  # the snapshot at 32 tokens; the one at 48 is past the departure
    assert answer == run(model, departed)[0]
    kv = PromptCache(snapshot_every=16)
    run(DFlashModel(tiny_target("qwen3", seed=2)), long, kv)
    assert len(kv.entries) == 1  # cuttable caches need none along the way: the answer's serves any prefix


def test_shared_length_counts_the_common_beginning():
    tokens = list(range(1000))
    for where in (0, 1, 255, 256, 257, 999):
        assert shared_length(tokens, tokens[:where] + [-1] + tokens[where + 1 :], block=256) == where
    assert shared_length(tokens, tokens) == 1000 and shared_length(tokens[:600], tokens) == 600
    assert shared_length([], tokens) == 0


@pytest.mark.parametrize("model_type", ["llama", "qwen3_5"])
def test_requests_arriving_together_on_one_long_prefix_prefill_it_once(model_type, monkeypatch):
    """Parallel agent sessions on one system prompt: the second and third wait for the first's
    prefill to pass what they share and restore it (where states cannot be cut back, its
    snapshots until those still to come would save less than SHARED_MIN); a prefix shorter than
    SHARED_MIN is not waited for.  Every
    answer is the cold one.  (One prefill pass a step, as on a GPU: where the waits end
    depends on it.)"""
    monkeypatch.setattr(engine, "CPU_PREFILL_PASS", engine.PREFILL_STEP)
    target = tiny_target(model_type, seed=2)
    model = DFlashModel(target, random_draft(target, block_size=4))
    system = [3 + i % 90 for i in range(2 * SHARED_MIN + 10)]
    prompts = [system + [5, 6, 7], system + [8, 9], system[:40] + [3], system + [5, 6, 7]]
    cache = PromptCache(snapshot_every=32)
    answers = run_batched(model, prompts, cache)
    restored = [cached for _, cached in answers]
    assert restored[0] == 0 and restored[2] == 0
    if model_type == "llama":
        assert restored[1] == len(system) and restored[3] == len(prompts[3]) - 1
    else:  # it waits while the snapshots still to come would save it SHARED_MIN tokens or more
        shared = len(system) - len(system) % 32
        assert restored[1] % 32 == 0 and 0 < shared - restored[1] < SHARED_MIN
        assert restored[3] % 32 == 0 and restored[3] >= restored[1]
    assert [answer for answer, _ in answers] == [run(model, prompt)[0] for prompt in prompts]


def test_a_request_does_not_wait_for_a_prefill_that_would_give_it_little_more_than_the_cache_holds():
    """Two sessions' next turns on a system prompt the cache holds already: they share a few more
    tokens (fewer than SHARED_MIN) than it holds, so the second does not wait for the first's
    prefill to pass them; both get their first token in the same step, as cold."""
    target = tiny_target("qwen3", seed=2)
    model = DFlashModel(target, random_draft(target, block_size=4))
    system = list(range(3, 3 + SHARED_MIN + 20))
    cache = PromptCache()
    run(model, system, cache)
    common = list(range(87, 97))
    prompts = [system + common + [5, 6, 7], system + common + [8, 9]]
    decoder = Decoder(model, cache, max_batch=2)
    requests = [decoder.add(Request(prompt, ANSWER)) for prompt in prompts]
    assert set(decoder.step().steps) == {request.uid for request in requests}
    while decoder.busy:
        decoder.step()
    assert [r.stats.cached_tokens for r in requests] == [len(system), len(system)]
    assert [r.output for r in requests] == [run(model, prompt)[0] for prompt in prompts]


def test_a_prompt_prefilled_for_later_is_kept_without_joining_the_decoding_rows(monkeypatch):
    """A one-token request (the server's prefill of a next turn) beside a decoding row: kept in
    the prompt cache when its prefill ends, the decoding batch neither widened nor narrowed for
    it (each costs a copy of every row), and the decoding row's answer as alone."""
    target = tiny_target("qwen3", seed=2)
    model = DFlashModel(target, random_draft(target, block_size=4))
    cache = PromptCache()
    decoder = Decoder(model, cache, max_batch=3)
    decoding = decoder.add(Request(SYSTEM + [5, 6], ANSWER))
    decoder.step()
    decoder.step()
    reshaped = []
    for name in ("extend", "keep_rows"):
        monkeypatch.setattr(decoder.cache, name, lambda *args, name=name: reshaped.append(name))
    later = decoder.add(Request(SYSTEM[::-1] + [7], 1))
    assert later.uid in decoder.step().steps
    assert decoder.rows == [decoding] and not reshaped
    monkeypatch.undo()
    assert cache.covered(later.prompt) == len(later.prompt)
    while decoder.busy:
        decoder.step()
    assert decoding.output == run(model, decoding.prompt)[0]
    assert run(model, later.prompt + [9], cache)[1] == len(later.prompt)


def test_a_request_restores_what_it_shares_with_a_row_decoding():
    """A prompt shorter than a prefill chunk is not kept when its prefill ends; a request asking
    it again (or sharing its beginning) while its answer is being written restores it from the
    decoding row's state, cut back to what they share, and answers as cold."""
    target = tiny_target("qwen3", seed=2)
    model = DFlashModel(target, random_draft(target, block_size=4))
    system = list(range(3, 3 + SHARED_MIN + 20))
    cache = PromptCache()
    decoder = Decoder(model, cache, max_batch=3)
    first = decoder.add(Request(system + [5, 6, 7], ANSWER))
    decoder.step()  # prefilled: decoding
    decoder.step()
    later = [decoder.add(Request(system + [5, 6, 7], ANSWER)), decoder.add(Request(system[:-10] + [9], ANSWER))]
    while decoder.busy:
        decoder.step()
    assert [r.stats.cached_tokens for r in later] == [len(system) + 2, len(system) - 10]
    assert [r.output for r in [first] + later] == [run(model, r.prompt)[0] for r in [first] + later]


def test_the_cache_stays_within_its_bytes():
    target = tiny_target("qwen3", seed=2)
    model = DFlashModel(target, random_draft(target, block_size=4))
    probe = PromptCache()
    run(model, SYSTEM, probe)
    one = probe.nbytes
    cache = PromptCache(max_bytes=int(one * 2.5))
    for k in range(5):
        run(model, [k] + SYSTEM, cache)
    # each run keeps its prompt's state and its answer's; the least recently used went first
    kept = {key[0] for key in cache.entries}
    assert 0 < cache.nbytes <= cache.max_bytes and {3, 4} <= kept and not kept & {0, 1}


SESSION_FAMILIES = [
    ("llama", {}),
    ("llama", {"sliding_window": 16, "layer_types": ["sliding_attention", "full_attention"] * 2}),
    ("qwen3", {}),
    ("qwen3_moe", {}),
    ("qwen3_5", {}),
    ("qwen3_next", {}),
    ("gpt_oss", {}),
    ("gemma4_text", {}),
    ("deepseek_v3", {}),
]


@pytest.mark.parametrize("model_type", ["llama", "qwen3_5"])
def test_a_session_keeps_one_entry_where_its_states_can_be_cut_back(model_type):
    """Each turn's answer extends the last turn's state: where caches can be cut back, the longer
    entry serves every prefix of it and the older ones go (memory per session, not per turn);
    a hybrid's recurrent state cannot be cut back, so its earlier states stay."""
    target = tiny_target(model_type, seed=2)
    model = DFlashModel(target, random_draft(target, block_size=4))
    cache, prompt = PromptCache(), SYSTEM + [5, 6, 7]
    for turn in range(3):
        answer, _ = run(model, prompt, cache)
        prompt = prompt + answer + [11 + turn, 12, 13]
    cuttable = model_type == "llama"
    assert (len(cache.entries) == 1) == cuttable, list(map(len, cache.entries))
    # the first turn asked again: served from the last entry, cut back, or (a hybrid) from the
    # state its prefill kept before the prompt's last token
    retried = SYSTEM + [5, 6, 7]
    warm, cached = run(model, retried, cache)
    assert warm == run(model, retried)[0]
    assert cached == len(retried) - 1


@pytest.mark.parametrize("model_type, overrides", by_family(SESSION_FAMILIES))
@pytest.mark.parametrize("drafter", [True, False])
def test_the_state_after_an_answer_serves_the_next_turn(model_type, overrides, drafter):
    """A session: each turn's prompt is the last one + its answer + a new message.  The state
    after each answer is kept, so a turn prefills only what is new (GatedDeltaNet states and
    sliding windows included: the entry is a whole prefix), and decodes exactly as cold.  Plain
    decoding too (its passes are pipelined: the last token may already be fed)."""
    target = tiny_target(model_type, seed=2, **overrides)
    model = DFlashModel(target, random_draft(target, block_size=4) if drafter else None)
    cache = PromptCache(piece_tokens=8)
    prompt, answered = SYSTEM + [5, 6, 7], 0  # answered: tokens of the last prompt + answer
    for turn in range(3):
        answer, cached = run(model, prompt, cache)
        assert answer == run(model, prompt)[0], (model_type, turn)
        assert cached >= answered - 1, (model_type, turn, cached, answered)
        answered = len(prompt) + len(answer)
        prompt = prompt + answer + [11 + turn, 12, 13]


def test_an_answer_closed_early_is_kept_too():
    """stream_generate closes the decode at EOS or a stop string: the state up to there is kept."""
    target = tiny_target("qwen3_5", seed=2)
    model = DFlashModel(target, random_draft(target, block_size=4))
    cache = PromptCache()
    steps = decode(model, Request(list(SYSTEM), ANSWER, SamplingParams()), prompt_cache=cache)
    said = [t for _, step in zip(range(3), steps) for t in step.tokens]
    steps.close()
    answer, cached = run(model, SYSTEM + said + [1, 2], cache)
    assert cached >= len(SYSTEM) + len(said) - 1
    assert answer == run(model, SYSTEM + said + [1, 2])[0]


@pytest.mark.parametrize(
    "model_type, overrides",
    [
        ("llama", {}),
        ("llama", {"sliding_window": 16, "layer_types": ["sliding_attention", "full_attention"] * 2}),
        ("qwen3_5", {}),
        ("gpt_oss", {}),
    ],
)
def test_entries_on_disk_survive_a_restart_and_restore_exactly(model_type, overrides, tmp_path):
    """A session's state written to the folder (at shutdown, flush) is read by a new process's
    cache (a new PromptCache on the same folder): the next turn prefills only what is new."""
    target = tiny_target(model_type, seed=2, **overrides)
    model = DFlashModel(target, random_draft(target, block_size=4))
    first = PromptCache(folder=tmp_path, fingerprint="pair-a", piece_tokens=8)  # written whole
    answer, _ = run(model, SYSTEM, first)
    first.flush()
    # the answer's state, and the prompt's where the caches cannot be cut back to it (hybrids)
    cuttable = first.snapshot_interval(target.make_cache()) is None  # not hybrids, not sliding windows
    assert len(list(tmp_path.glob("*.safetensors"))) == (1 if cuttable else 2)
    restarted = PromptCache(folder=tmp_path, fingerprint="pair-a")
    follow_up = SYSTEM + answer + [3, 4]
    warm, cached = run(model, follow_up, restarted)
    assert cached == len(SYSTEM) + len(answer) - 1
    assert warm == run(model, follow_up)[0]
    # the first prompt asked again after a restart: the state after its answer, cut back to it
    again = PromptCache(folder=tmp_path, fingerprint="pair-a")
    repeated, cached = run(model, SYSTEM, again)
    assert repeated == answer and cached == len(SYSTEM) - 1  # hybrids: the prompt's own state, kept at join
    # another model's cache in the same folder is passed over, not read
    assert run(model, follow_up, PromptCache(folder=tmp_path, fingerprint="pair-b"))[1] == 0


def test_the_ram_tier_spills_to_a_bounded_folder(tmp_path, caplog):
    target = tiny_target("qwen3", seed=2)
    model = DFlashModel(target, random_draft(target, block_size=4))
    probe = PromptCache()
    run(model, [9] + SYSTEM, probe)  # as long as the entries below
    entry = max(e.nbytes for e in probe.entries.values())
    cache = PromptCache(max_bytes=entry, folder=tmp_path, disk_bytes=6 * entry, fingerprint="pair")
    for k in range(5):
        run(model, [k] + SYSTEM, cache)
    files = list(tmp_path.glob("*.safetensors"))
    assert len(cache.entries) == 1 and files  # evicted from RAM, kept on disk
    assert sum(f.stat().st_size for f in files) <= 6 * entry * 1.1  # bounded (+ file headers)
    warm, cached = run(model, [4] + SYSTEM + [9], cache)
    assert cached >= len(SYSTEM) and warm == run(model, [4] + SYSTEM + [9])[0]
    caplog.clear()  # (a state longer than the one-entry cache was said too)
    (tmp_path / "broken.safetensors").write_bytes(b"not a safetensors file")
    PromptCache(folder=tmp_path, fingerprint="pair")
    said = [r.getMessage() for r in caplog.records]
    assert len(said) == 1 and "broken.safetensors" in said[0] and "passed over" in said[0]


def one_session_on_disk(model, folder) -> tuple[tuple, tuple]:
    """Two entries in `folder`, the first a prefix of the second (a session's two turns, each
    written at a shutdown): their tokens."""
    first = PromptCache(folder=folder, fingerprint="pair")
    answer, _ = run(model, SYSTEM, first)
    first.flush()
    second = PromptCache(folder=folder, fingerprint="pair")
    run(model, SYSTEM + answer + [3, 4], second)
    second.flush()
    shorter, longer = sorted(PromptCache(folder=folder, fingerprint="pair").disk.index, key=len)
    assert longer[: len(shorter)] == shorter
    return shorter, longer


@pytest.mark.parametrize("damage", ["truncated", "deleted"])
def test_an_unreadable_entry_is_removed_and_the_shorter_one_behind_it_serves(damage, tmp_path, caplog):
    """An entry's file damaged or gone after start-up (by hand, or by another process sharing the
    folder): the lookup meeting it says so in one line, takes it out of the folder and of the
    lookup alike, and restores the valid shorter entry behind it; later lookups are never
    offered it again."""
    target = tiny_target("llama", seed=2)
    model = DFlashModel(target, random_draft(target, block_size=4))
    shorter, longer = one_session_on_disk(model, tmp_path)
    cache = PromptCache(folder=tmp_path, fingerprint="pair")
    broken = cache.disk.index[longer]
    if damage == "truncated":
        broken.write_bytes(broken.read_bytes()[:100])
    else:
        broken.unlink()
    caplog.clear()
    prompt = list(longer) + [5, 6]
    warm, cached = run(model, prompt, cache)
    said = [r.getMessage() for r in caplog.records]
    assert len(said) == 1 and broken.name in said[0] and "removed" in said[0], said
    assert not broken.exists() and longer not in cache.disk.index
    assert cache.disk.candidates(list(longer)) == [(shorter, len(shorter))]
    assert cached == len(shorter) and warm == run(model, prompt)[0]
    caplog.clear()
    assert run(model, prompt, cache)[1] == len(prompt) - 1 and not caplog.records


def test_an_entry_on_disk_larger_than_the_ram_tier_serves_and_is_not_kept(tmp_path):
    """A restart with a smaller --prompt-cache-bytes: an entry on disk larger than the whole RAM
    tier restores the request it serves, and is not kept in RAM (it would push every other
    entry out, and still not fit)."""
    target = tiny_target("llama", seed=2)
    model = DFlashModel(target, random_draft(target, block_size=4))
    first = PromptCache(folder=tmp_path, fingerprint="pair")
    answer, _ = run(model, SYSTEM, first)
    first.flush()
    small = PromptCache(max_bytes=1024, folder=tmp_path, fingerprint="pair")
    follow_up = SYSTEM + answer + [3, 4]
    warm, cached = run(model, follow_up, small)
    assert cached == len(SYSTEM) + len(answer) - 1 and warm == run(model, follow_up)[0]
    assert not small.entries and small.nbytes == 0


def test_an_entry_on_disk_is_not_kept_twice_in_ram(tmp_path):
    """A hybrid's entry read from disk for a prompt departing from it midway cannot serve it (its
    recurrent state cannot be cut back) but is kept in RAM; prompts departing later, offered it
    again by the disk tier, do not read and keep it a second time (the copy it would replace
    would hold its shared pieces forever)."""
    target = tiny_target("qwen3_5", seed=2)
    model = DFlashModel(target, random_draft(target, block_size=4))
    long = list(range(20, 90))
    first = PromptCache(folder=tmp_path, fingerprint="pair", piece_tokens=8)
    run(model, long, first)
    first.flush()
    cache = PromptCache(folder=tmp_path, fingerprint="pair", piece_tokens=8)
    reads, read = [], cache.disk.read
    cache.disk.read = lambda tokens: reads.append(tokens) or read(tokens)
    for departure in (40, 45, 50):
        run(model, long[:departure] + [1], cache)
        held = Counter(name for entry in cache.entries.values() for name in entry.pieces)
        assert held == Counter(cache.pieces.holders), departure
    assert len(reads) == 1


def rewrite_in_place(path: Path, seed: int) -> None:
    """`path`'s float32 weights given other values, written over the old ones in the same file
    (its header, so its size, unchanged), and its mtime set back to what it was."""
    before = path.stat()
    rng = np.random.default_rng(seed)
    with open(path, "r+b") as f:
        length = int.from_bytes(f.read(8), "little")
        header = json.loads(f.read(length))
        for tensor in [t for name, t in header.items() if name != "__metadata__" and t["dtype"] == "F32"]:
            start, end = (8 + length + offset for offset in tensor["data_offsets"])
            f.seek(start)
            weights = np.frombuffer(f.read(end - start), dtype=np.float32)
            noise = rng.normal(size=weights.shape).astype(np.float32) * np.abs(weights).mean()
            f.seek(start)
            f.write((weights + noise).tobytes())
    os.utime(path, ns=(before.st_atime_ns, before.st_mtime_ns))
    assert path.stat().st_size == before.st_size and path.stat().st_mtime_ns == before.st_mtime_ns


def test_weights_changed_in_place_never_meet_the_old_weights_saved_states(tiny_dirs, tmp_path, monkeypatch):
    """A model dir whose weights are rewritten in place (same file, same size, mtime set back),
    served again on the same prompt cache folder: its fingerprint says what the weights are, so
    the old weights' states are not read and the answer is the changed model's own.  Read with
    the old fingerprint (names and sizes: unchanged), they would change it."""
    monkeypatch.setenv(CACHE_ENV, str(tmp_path / "cache"))
    model_dir = shutil.copytree(tiny_dirs[0], tmp_path / "model")
    old, _ = load(str(model_dir), use_draft=False, adaptive=False)
    folder = tmp_path / "prompt-cache"
    cache = PromptCache(folder=folder, fingerprint=old.fingerprint)
    answer, _ = run(old, SYSTEM, cache)
    cache.flush()
    rewrite_in_place(model_dir / "model.safetensors", seed=5)
    changed, _ = load(str(model_dir), use_draft=False, adaptive=False)
    assert changed.fingerprint != old.fingerprint
    follow_up = SYSTEM + answer + [3, 4]
    cold = run(changed, follow_up)[0]
    warm, cached = run(changed, follow_up, PromptCache(folder=folder, fingerprint=changed.fingerprint))
    assert cached == 0 and warm == cold
    stale, cached = run(changed, follow_up, PromptCache(folder=folder, fingerprint=old.fingerprint))
    assert cached > 0 and stale != cold


def test_weights_are_hashed_again_only_when_their_file_changes(tmp_path, monkeypatch):
    """Hashing a multi-GB model takes seconds: a weight file's digest is stored in the cache
    folder and read back while the file's size, mtime and ctime stay; a rewrite is hashed again
    (its mtime set back too).  A cache folder that cannot be written costs a hashing, not the load."""
    monkeypatch.setenv(CACHE_ENV, str(tmp_path / "cache"))
    hashed, file_digest = [], hashlib.file_digest
    monkeypatch.setattr(hashlib, "file_digest", lambda f, name: hashed.append(f.name) or file_digest(f, name))
    folder = tmp_path / "model"
    folder.mkdir()
    (folder / "config.json").write_text('{"model_type": "llama"}')
    mx.save_safetensors(str(folder / "model.safetensors"), {"w": mx.arange(64, dtype=mx.float32)})
    first = _fingerprint(folder)
    assert len(hashed) == 1 and (tmp_path / "cache").is_dir()
    assert _fingerprint(folder) == first and len(hashed) == 1
    rewrite_in_place(folder / "model.safetensors", seed=3)
    rewritten = _fingerprint(folder)
    assert rewritten != first and len(hashed) == 2
    (tmp_path / "a-file").write_text("")
    monkeypatch.setenv(CACHE_ENV, str(tmp_path / "a-file" / "cache"))  # no folder can be made there
    assert _fingerprint(folder) == rewritten and len(hashed) == 3


@pytest.mark.parametrize("model_type", by_family(["qwen3", "qwen3_5"]))
def test_sessions_on_one_system_prompt_hold_it_once(model_type):
    """Entries keep the positions their tokens share once (pieces named by the tokens up to their
    end): four sessions on one system prompt hold it once, not four times, and restore exactly;
    a piece goes with the last entry holding it."""
    target = tiny_target(model_type, seed=2)
    model = DFlashModel(target, random_draft(target, block_size=4))
    sessions = [SYSTEM + [k, k + 1] for k in range(4)]
    whole, shared = PromptCache(piece_tokens=1 << 20), PromptCache(piece_tokens=8)
    for prompt in sessions:
        run(model, prompt, whole)
        run(model, prompt, shared)
    assert shared.pieces.nbytes > 0 and shared.nbytes < 0.7 * whole.nbytes, (shared.nbytes, whole.nbytes)
    for prompt in sessions:
        follow_up = prompt + [9, 8]
        warm, cached = run(model, follow_up, shared)
        assert warm == run(model, follow_up)[0] and cached >= len(prompt) - 1

    def held(cache):
        return Counter(name for entry in cache.entries.values() for name in entry.pieces)

    assert held(shared) == Counter(shared.pieces.holders) and set(held(shared)) == set(shared.pieces.arrays)
    alone = PromptCache(piece_tokens=8)
    run(model, [1, 2, 3], alone)
    shared.max_bytes = alone.nbytes  # room for that prompt's entries only: every session's go
    run(model, [1, 2, 3], shared)
    assert shared.entries.keys() == alone.entries.keys() and shared.nbytes == alone.nbytes
    assert set(shared.pieces.arrays) == set(held(shared)) == set(alone.pieces.arrays)


def test_a_state_larger_than_the_cache_is_said_once(caplog):
    """A prompt cache too small for a prompt's state keeps nothing of it: said in one line (the
    first time), not left for the user to discover as slow turns."""
    target = tiny_target("qwen3", seed=2)
    model = DFlashModel(target, random_draft(target, block_size=4))
    small = PromptCache(max_bytes=1024)
    for prompt in (SYSTEM, SYSTEM + [1, 2]):
        assert run(model, prompt, small)[1] == 0
    said = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert not small.entries and small.refused >= 2
    assert len(said) == 1 and "larger than the whole prompt cache" in said[0] and "--prompt-cache-bytes" in said[0]


def test_the_default_bound_leaves_room_for_the_weights_and_decoding():
    gib = 1 << 30
    assert default_bytes(weights=4 * gib + gib // 2, memory=32 * gib) == (27 * gib + gib // 2) // 4
    assert default_bytes(weights=14 * gib, memory=16 * gib) == gib  # never below 1 GiB
