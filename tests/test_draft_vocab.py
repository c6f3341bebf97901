"""A drafter restricted to a subset of the vocabulary (draft_vocab.json): cheaper drafts,
never a different output."""

import json

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest

from dflash_mlx.decode import verify as engine
from dflash_mlx.drafters import DraftLoadError, load_draft, save_draft
from dflash_mlx.decode.decoder import decode
from dflash_mlx.decode.request import Request
from dflash_mlx.decode.model import DFlashModel
from dflash_mlx.sampling import SamplingParams
from test_engine import PROMPTS, plain_greedy
from tiny_models import random_draft, tiny_target

SUBSET = list(range(0, 97, 3))


@pytest.fixture(scope="module")
def target():
    return tiny_target("qwen3", seed=2)


def run(target, draft, prompt, params=SamplingParams(), seed=None, block_size=None):
    return [
        t
        for s in decode(DFlashModel(target, draft), Request(list(prompt), 40, params, seed=seed, block_size=block_size))
        for t in s.tokens
    ]


def test_restricted_drafts_come_from_the_subset_and_stay_lossless(target, monkeypatch):
    draft = random_draft(target, block_size=4).restrict_vocab(SUBSET)
    proposed = []
    real = engine.draft_rows

    def spy(*args):
        out = real(*args)
        proposed.extend(t for row in out.tokens for t in row.tolist())
        return out

    monkeypatch.setattr(engine, "draft_rows", spy)
    for prompt in PROMPTS:
        assert run(target, draft, prompt) == plain_greedy(target, prompt)
    assert proposed and set(proposed) <= set(SUBSET)
    params = SamplingParams(temp=0.9, top_p=0.95)
    assert run(target, draft, PROMPTS[0], params, seed=5) == run(target, None, PROMPTS[0], params, seed=5)


def test_the_subset_head_is_the_full_heads_columns(target):
    full = random_draft(target, block_size=4)
    sub = random_draft(target, block_size=4).restrict_vocab(SUBSET)
    block = mx.array([[5] + [full.mask_token_id] * 3])
    cache_a, cache_b = full.make_cache(), sub.make_cache()
    feats = mx.random.normal((1, 6, 2 * target.hidden_size))
    full.add_context(feats, cache_a)
    sub.add_context(feats, cache_b)
    np.testing.assert_allclose(np.array(full(block, cache_a))[..., SUBSET], np.array(sub(block, cache_b)), rtol=1e-5)


def test_quantized_head_rows(target):
    quantized = tiny_target("llama", seed=4, hidden_size=64, head_dim=16)
    nn.quantize(quantized.model, group_size=32, bits=4)
    h = mx.random.normal((3, 64))
    full = quantized.lm_head(h)
    rows = quantized.head_rows(mx.array(SUBSET))(h)
    np.testing.assert_allclose(np.array(full)[:, SUBSET], np.array(rows), rtol=1e-4, atol=1e-4)


def test_the_subset_round_trips_and_bad_files_are_refused(target, tmp_path):
    draft = random_draft(target, block_size=4).restrict_vocab(SUBSET)
    save_draft(draft, tmp_path / "d")
    assert json.loads((tmp_path / "d" / "draft_vocab.json").read_text())["token_ids"] == SUBSET
    assert load_draft(tmp_path / "d").vocab_ids.tolist() == SUBSET
    save_draft(random_draft(target, block_size=4), tmp_path / "plain")
    assert not (tmp_path / "plain" / "draft_vocab.json").exists()
    for bad in ('{"ids": [1]}', "[", '{"token_ids": [1, 100000]}'):
        (tmp_path / "d" / "draft_vocab.json").write_text(bad)
        with pytest.raises(DraftLoadError, match="draft_vocab.json|vocabulary"):
            load_draft(tmp_path / "d").bind(target)


def test_a_restricted_drafter_drafts_in_another_thread(target):
    """The server decodes in its engine thread: nothing bound in the main thread may stay lazy."""
    import threading

    draft = random_draft(target, block_size=4).restrict_vocab(SUBSET)
    out, errors = [], []

    def work():
        try:
            out.append(run(target, draft, PROMPTS[0]))
        except Exception as e:  # reported below
            errors.append(e)

    thread = threading.Thread(target=work)
    thread.start()
    thread.join()
    assert not errors and out[0] == plain_greedy(target, PROMPTS[0])
