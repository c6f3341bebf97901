"""Greedy DFlash decoding is token-for-token identical to plain mlx-lm decoding."""

import random

import mlx.core as mx
import pytest
from mlx_lm.generate import generate_step

from dflash_mlx.engine import DecodeStats, DFlashModel, decode
from dflash_mlx.sampling import SamplingParams
from tiny_models import oracle_draft, random_draft, tiny_target

MODEL_TYPES = ["llama", "qwen2", "qwen3", "qwen3_moe", "qwen3_5", "qwen3_5_moe"]
PROMPTS = [[1, 5, 9, 13, 2, 7, 40, 3], [60, 61, 62], list(range(20, 50))]
MAX_TOKENS = 40


def plain_greedy(target, prompt, max_tokens=MAX_TOKENS):
    tokens = generate_step(mx.array(prompt), target.model, max_tokens=max_tokens)
    return [int(t) for t, _ in tokens]


def dflash_greedy(target, draft, prompt, max_tokens=MAX_TOKENS, block_size=None):
    stats = DecodeStats()
    out = []
    for step in decode(DFlashModel(target, draft), mx.array(prompt), SamplingParams(), max_tokens,
                       block_size, stats):
        out += step.tokens
    return out, stats


@pytest.fixture(scope="module", params=MODEL_TYPES)
def target(request):
    return tiny_target(request.param, seed=2)


def test_forward_matches_mlx_lm(target):
    prompt = mx.array([PROMPTS[0]])
    block = mx.array([[4, 8, 15, 16, 23]])
    reference_cache = target.make_cache().layers
    target.model(prompt, cache=reference_cache)
    expected = target.model(block, cache=reference_cache)

    cache = target.make_cache()
    target(prompt, cache)
    logits, features = target(block, cache, feature_layers=[0, 3])
    assert mx.array_equal(logits, expected)
    assert features.shape == (1, 5, 2 * target.hidden_size)


@pytest.mark.parametrize("block_size", [2, 3, 5, 8, 16])
def test_random_drafter_is_lossless(target, block_size):
    draft = random_draft(target, block_size=block_size)
    for prompt in PROMPTS:
        out, stats = dflash_greedy(target, draft, prompt)
        assert out == plain_greedy(target, prompt)
        assert stats.histogram[0] < stats.cycles or stats.tau >= 1


@pytest.mark.parametrize("block_size", [2, 4, 7, 16])
def test_oracle_drafter_full_and_partial_acceptance(target, block_size):
    prompt = PROMPTS[0]
    reference = plain_greedy(target, prompt, MAX_TOKENS + 16)
    rng = random.Random(block_size)
    full = oracle_draft(target, prompt + reference, block_size=block_size)
    out, stats = dflash_greedy(target, full, prompt)
    assert out == reference[:MAX_TOKENS]
    assert stats.histogram[-1] >= stats.cycles - 1  # every cycle but the clipped last is full

    wrong = {rng.randrange(len(prompt), len(prompt) + MAX_TOKENS) for _ in range(8)}
    partial = oracle_draft(target, prompt + reference, wrong=wrong, block_size=block_size)
    out, stats = dflash_greedy(target, partial, prompt)
    assert out == reference[:MAX_TOKENS]
    if block_size > 2:
        assert sum(1 for k in stats.histogram[1:-1] if k) >= 1  # some partial acceptances


def test_sliding_window_target_rolls_back():
    """Window smaller than the context: rollback must slice the rotating cache."""
    target = tiny_target("llama", seed=3, layer_types=["sliding_attention", "full_attention"] * 2,
                         sliding_window=6)
    for prompt in PROMPTS:
        reference = plain_greedy(target, prompt, MAX_TOKENS + 16)
        wrong = set(range(len(prompt) + 3, len(prompt) + MAX_TOKENS, 5))
        for draft in (random_draft(target), oracle_draft(target, prompt + reference, wrong=wrong)):
            assert dflash_greedy(target, draft, prompt)[0] == reference[:MAX_TOKENS]


def test_sliding_window_drafter_is_lossless():
    target = tiny_target("qwen3", seed=2)
    draft = random_draft(target, layer_types=["sliding_attention", "full_attention"], sliding_window=4)
    prompt = PROMPTS[2]
    assert dflash_greedy(target, draft, prompt)[0] == plain_greedy(target, prompt)


@pytest.mark.parametrize("max_tokens", [1, 2, 7, 16])
def test_max_tokens_inside_a_block(max_tokens):
    target = tiny_target("llama", seed=2)
    prompt = PROMPTS[0]
    reference = plain_greedy(target, prompt, 40)
    draft = oracle_draft(target, prompt + reference, block_size=8)
    out, _ = dflash_greedy(target, draft, prompt, max_tokens=max_tokens)
    assert out == reference[:max_tokens]


@pytest.mark.parametrize("model_type", ["llama", "qwen3_5"])
def test_rollback_restores_the_exact_state(model_type):
    """After verifying 6 tokens and keeping k, the cache is the cache of prompt + k tokens."""
    target = tiny_target(model_type, seed=2)
    prompt, block, probe = mx.array([PROMPTS[0]]), mx.array([[9, 8, 7, 6, 5, 4]]), mx.array([[11]])
    for keep in range(1, 7):
        cache = target.make_cache()
        target(prompt, cache)
        cache.checkpoint()
        target(block, cache)
        cache.rollback(keep)
        got, _ = target(probe, cache)

        fresh = target.make_cache()
        target(prompt, fresh)
        target(block[:, :keep], fresh)
        want, _ = target(probe, fresh)
        assert mx.allclose(got, want, atol=1e-5, rtol=1e-5), keep
