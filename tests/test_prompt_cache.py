"""Prefix reuse is exact: a prompt served from the prompt cache decodes exactly as cold."""

import mlx.core as mx
import pytest

from dflash_mlx.engine import decode
from dflash_mlx.model import DecodeStats, DFlashModel
from dflash_mlx.prompt_cache import PromptCache
from dflash_mlx.sampling import SamplingParams
from tiny_models import random_draft, tiny_target

SYSTEM = list(range(30, 70))  # a shared prefix (think: system prompt + earlier turns)


def run(model, prompt, cache=None, params=SamplingParams(), seed=None):
    stats = DecodeStats()
    tokens = [
        t
        for s in decode(model, mx.array(prompt), params, 24, stats=stats, seed=seed, prompt_cache=cache)
        for t in s.tokens
    ]
    return tokens, stats.cached_tokens


@pytest.mark.parametrize(
    "model_type, overrides",
    [
        ("llama", {}),
        ("llama", {"sliding_window": 16, "layer_types": ["sliding_attention", "full_attention"] * 2}),
        ("qwen3", {}),
        ("qwen3_moe", {}),
        ("qwen3_5", {}),
    ],
)
def test_cached_prompts_decode_exactly_as_cold(model_type, overrides):
    target = tiny_target(model_type, seed=2, **overrides)
    model = DFlashModel(target, random_draft(target, block_size=4))
    cache = PromptCache()
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
    assert reused[0] == 0 and reused[1] == len(turns[0]) - 1 and reused[2] == len(turns[2]) - 1
    kv_only = model_type != "qwen3_5" and not overrides
    # a shorter shared prefix needs caches that can be cut back (plain KV)
    assert (reused[3] == len(SYSTEM)) == kv_only and (reused[4] == 19) == kv_only
    params = SamplingParams(temp=0.8)
    assert run(model, turns[1], cache, params, seed=3)[0] == run(model, turns[1], None, params, seed=3)[0]


def test_the_cache_stays_within_its_bytes():
    target = tiny_target("qwen3", seed=2)
    model = DFlashModel(target, random_draft(target, block_size=4))
    probe = PromptCache()
    run(model, SYSTEM, probe)
    one = probe.nbytes
    cache = PromptCache(max_bytes=int(one * 2.5))
    for k in range(5):
        run(model, [k] + SYSTEM, cache)
    assert 0 < cache.nbytes <= cache.max_bytes and len(cache.entries) == 2
    assert [key[0] for key in cache.entries] == [3, 4]  # least recently used went first
