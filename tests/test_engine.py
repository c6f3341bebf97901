"""Greedy DFlash decoding is token-for-token identical to plain mlx-lm decoding."""

import functools
import random
from weakref import WeakKeyDictionary

import mlx.core as mx
import pytest
from mlx_lm.generate import generate_step
from mlx_lm.models.cache import make_prompt_cache

from dflash_mlx.decode.decoder import decode
from dflash_mlx.decode.request import Request
from dflash_mlx.decode.model import DecodeStats, DFlashModel
from dflash_mlx.sampling import SamplingParams
from dflash_mlx.target.wrapper import Target
from tiny_models import (
    by_family,
    VOCAB,
    Recording,
    oracle_draft,
    random_dflash2,
    random_draft,
    same_up_to_rounding,
    tiny_model,
    tiny_target,
)

MODEL_TYPES = [
    "llama",
    "qwen2",
    "qwen3",
    "qwen3_moe",
    "qwen3_5",
    "qwen3_5_moe",
    "qwen3_next",
    "gpt_oss",
    "gemma3_text",
    "gemma4_text",
    "gemma4",
    "deepseek_v3",
    "kimi_k25",
]
PROMPTS = [[1, 5, 9, 13, 2, 7, 40, 3], [60, 61, 62], list(range(20, 50))]
MAX_TOKENS = 40


_greedy: "WeakKeyDictionary[Target, dict]" = WeakKeyDictionary()


def plain_greedy(target, prompt, max_tokens=MAX_TOKENS):
    """mlx-lm's greedy tokens, kept per target object (tests compare many runs with the same)."""
    known = _greedy.setdefault(target, {})
    key = (tuple(prompt), max_tokens)
    if key not in known:
        known[key] = [int(t) for t, _ in generate_step(mx.array(prompt), target.model, max_tokens=max_tokens)]
    return list(known[key])


def dflash_greedy(target, draft, prompt, max_tokens=MAX_TOKENS, block_size=None):
    stats = DecodeStats()
    out = []
    for step in decode(
        DFlashModel(target, draft),
        Request(list(prompt), max_tokens, SamplingParams(), block_size=block_size),
        stats=stats,
    ):
        out += step.tokens
    return out, stats


@functools.cache
def family_target(model_type: str) -> Target:
    return tiny_target(model_type, seed=2)


@pytest.fixture(scope="module", params=by_family(MODEL_TYPES))
def target(request):
    return family_target(request.param)


def every_family_at(block_sizes: tuple, fast_size: int | None = None) -> list:
    """(family, block size) params: in the fast subset every size on llama and the other fast
    families at `fast_size` alone (at no size if None: their other sizes repeat what llama
    shows); every pair in the full run."""
    cases = [(family, size) for family in MODEL_TYPES for size in block_sizes]
    return by_family(cases, fast=lambda family, size: family == "llama" or size == fast_size)


def test_forward_matches_mlx_lm(target):
    """Against an untouched twin of the model (the target's has its stand-ins installed)."""
    prompt = mx.array([PROMPTS[0]])
    block = mx.array([[4, 8, 15, 16, 23]])
    twin = tiny_model(target.model_type, seed=2)
    reference_cache = make_prompt_cache(twin)
    twin(prompt, cache=reference_cache)
    expected = twin(block, cache=reference_cache)

    cache = target.make_cache()
    target(prompt, cache)
    logits, features = target(block, cache, feature_layers=[0, 3])
    assert same_up_to_rounding(logits, expected)
    assert features.shape == (1, 5, 2 * target.hidden_size)
    rows = mx.concatenate([block, block[:, ::-1]])
    at, _ = target(rows, target.make_cache(), logits_at=[4, 2])  # each row's own position
    whole, _ = target(rows, target.make_cache())
    assert at.shape[1] == 1 and mx.allclose(at[:, 0], mx.stack([whole[0, 4], whole[1, 2]]), atol=1e-5)


def test_the_first_token_comes_from_the_prompts_own_pass(target):
    """The pass that prefills a prompt's last token chooses the first token, so the time to first
    token is the prefill's alone; decoding goes on from it, exactly."""
    counting = Recording(target)
    prompt = PROMPTS[2]
    steps = decode(
        DFlashModel(counting, random_draft(target, block_size=4)), Request(list(prompt), 12, SamplingParams())
    )
    first = next(steps)
    assert counting.passes == [(1, len(prompt))]
    out = first.tokens + [token for step in steps for token in step.tokens]
    assert len(first.tokens) == 1 and out == plain_greedy(target, prompt, 12)


@pytest.mark.parametrize("model_type, block_size", every_family_at((2, 5, 16), fast_size=5))
def test_random_drafter_is_lossless(model_type, block_size):
    target = family_target(model_type)
    draft = random_draft(target, block_size=block_size)
    for prompt in PROMPTS:
        out, stats = dflash_greedy(target, draft, prompt)
        assert out == plain_greedy(target, prompt)
        # every cycle verified a full block (or what was left) and committed what it says; the
        # first token is the prompt's pass's
        assert 1 + sum(stats.accepted_lengths) == len(out) and stats.cycles == len(stats.widths)
        assert all(
            w == min(block_size, MAX_TOKENS - done)
            for w, done in zip(stats.widths, [1 + sum(stats.accepted_lengths[:i]) for i in range(stats.cycles)])
        )


# the drafter's own proposals (its selector) are the same whatever the target: the fast subset
# runs it on llama, the full run on every family
@pytest.mark.parametrize("model_type, block_size", every_family_at((3, 16)))
def test_dflash2_drafter_is_lossless(model_type, block_size):
    target = family_target(model_type)
    draft = random_dflash2(target, block_size=block_size)
    for prompt in PROMPTS:
        assert dflash_greedy(target, draft, prompt)[0] == plain_greedy(target, prompt)


@pytest.mark.parametrize("model_type, block_size", every_family_at((2, 7, 16), fast_size=7))
def test_oracle_drafter_full_and_partial_acceptance(model_type, block_size):
    target = family_target(model_type)
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
    target = tiny_target("llama", seed=3, layer_types=["sliding_attention", "full_attention"] * 2, sliding_window=6)
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


@pytest.mark.parametrize(
    "model_type", by_family(["llama", "qwen3_5", "qwen3_next", "gpt_oss", "gemma4_text", "deepseek_v3"])
)
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
        assert mx.allclose(got, want, atol=1e-4, rtol=1e-4), keep  # replayed vs recomputed state: rounding only


def test_targets_whose_caches_cannot_roll_back_are_refused():
    """lfm2 keeps a short-convolution state in an ArraysCache that is no GatedDeltaNet's."""
    from dflash_mlx.target.wrapper import Target
    from mlx_lm.models import lfm2

    args = lfm2.ModelArgs(
        model_type="lfm2",
        vocab_size=97,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
        norm_eps=1e-5,
        conv_bias=False,
        conv_L_cache=3,
        block_dim=32,
        block_ff_dim=64,
        block_multiple_of=16,
        block_ffn_dim_multiplier=1.0,
        block_auto_adjust_ff_dim=False,
        full_attn_idxs=[1],
        rope_theta=10000.0,
    )
    with pytest.raises(ValueError, match="'lfm2' is not supported: 1 recurrent layer caches are not GatedDeltaNet"):
        Target(lfm2.Model(args))


@pytest.mark.parametrize("model_type", ["qwen3_5", "qwen3_next"])
def test_recording_gated_delta_equals_mlx_lm(model_type):
    """The verify-pass mirror (gated_delta.py) computes what mlx-lm's mixer computes."""
    from mlx_lm.models.cache import ArraysCache

    from dflash_mlx.target.gated_delta import gated_delta_forward

    mixer = tiny_target(model_type, seed=4).layers[0].linear_attn.inner
    x = mx.random.normal((1, 6, 32), key=mx.random.key(0))
    theirs, ours = ArraysCache(size=2), ArraysCache(size=2)
    for block in (x[:, :4], x[:, 4:]):  # from an empty state, then from the state it left
        expected = mixer(block, None, theirs)
        got, tape = gated_delta_forward(mixer, block, None, ours)
        assert tape.length == block.shape[1]
        assert mx.allclose(got, expected, atol=1e-5) and mx.allclose(ours[1], theirs[1], atol=1e-5)
        assert mx.array_equal(ours[0], theirs[0])


def test_gemma4_unified_loads_as_gemma4_and_is_lossless():
    """mlx-lm maps the encoder-free multimodal `gemma4_unified` onto its gemma4 model."""
    from mlx_lm.utils import _get_classes
    from tiny_models import _config

    _, config = _config("gemma4")
    config["model_type"] = "gemma4_unified"
    model_class, args_class = _get_classes(config)
    mx.random.seed(2)
    target = Target(model_class(args_class.from_dict(config)))
    mx.eval(target.model.parameters())
    out, stats = dflash_greedy(target, random_draft(target, block_size=5), PROMPTS[0], block_size=5)
    assert out == plain_greedy(target, PROMPTS[0]) and len(stats.accepted_lengths) > 0


def test_decoding_wires_memory_and_runs_on_the_generation_stream(monkeypatch, capsys):
    """As mlx-lm's generation does: while a decode runs, the wired limit is the GPU's recommended
    working set (restored after), a model larger than that set is warned about, and every step runs
    on mlx-lm's generation stream; alone and in a batch.  Metal's facts are mocked (none here)."""
    from mlx_lm.generate import generation_stream

    from dflash_mlx.decode.decoder import Decoder

    limits, streams, real_stream = [], [], mx.stream
    monkeypatch.setattr(mx, "device_info", lambda: {"max_recommended_working_set_size": 1000})
    monkeypatch.setattr(mx, "set_wired_limit", lambda n: limits.append(n) or 7)
    monkeypatch.setattr(mx, "stream", lambda s: streams.append(s) or real_stream(s))
    target = tiny_target("llama", seed=5)
    model = DFlashModel(target, random_draft(target, block_size=4))
    out = [t for s in decode(model, Request(list(PROMPTS[0]), 8, SamplingParams())) for t in s.tokens]
    assert len(out) == 8 and limits == [1000, 7]  # raised to the recommended size, then restored
    assert "close to the maximum recommended size" in capsys.readouterr().out  # tiny, but 1000 bytes is less
    assert streams and all(s is generation_stream for s in streams)
    decoder = Decoder(model, max_batch=2)
    decoder.close()
    decoder.close()  # twice is harmless
    assert limits == [1000, 7, 1000, 7]


@pytest.mark.parametrize("prompt", [[1, 2, VOCAB], [-1, 2]])
def test_a_prompt_outside_the_vocabulary_is_refused(prompt):
    """An embedding read past its table gives whatever memory lies there (an answer that
    changes from run to run), so the decoder refuses such ids as the API does."""
    target = tiny_target("qwen3")
    with pytest.raises(ValueError, match=r"is outside the vocabulary \(0\.\.96\)"):
        next(decode(DFlashModel(target, None), Request(list(prompt), 4, SamplingParams())))
