"""Drafter training: packed batches are exactly as specified, training learns, and
the result round-trips through the z-lab format and decodes losslessly."""

import json
import math
import random

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.generate import generate_step

from dflash_mlx.data import Example, read_data
from dflash_mlx.draft import load_draft
from dflash_mlx.engine import DecodeStats, DFlashModel, decode
from dflash_mlx.sampling import SamplingParams
from dflash_mlx.train import (
    PackedContext,
    TrainConfig,
    evaluate_tau,
    fit,
    new_drafter,
    pack,
    sample_anchors,
    stratified_layer_ids,
)
from tiny_models import tiny_target

MASK = 96


def test_stratified_layer_ids_match_z_lab():
    assert stratified_layer_ids(36, 5) == [1, 9, 17, 25, 33]
    assert stratified_layer_ids(30, 5) == [1, 8, 14, 20, 27]
    assert stratified_layer_ids(4, 1) == [2]


def make_examples(rng, n=3):
    return [Example("p", [rng.randrange(90) for _ in range(rng.randint(2, 6))],
                    [rng.randrange(90) for _ in range(rng.randint(3, 30))]) for _ in range(n)]


def test_packed_blocks_see_exactly_their_own_past_and_block():
    rng = random.Random(0)
    examples = make_examples(rng, 4)
    features = [mx.random.normal((len(e.tokens), 6)) for e in examples]
    cfg = TrainConfig(block_size=5, gamma=3.0, anchors_per_block_span=2.0)
    anchors = [sample_anchors(e, cfg, rng) for e in examples]
    batch = pack(examples, features, anchors, cfg.block_size, MASK, cfg.gamma)
    visible = np.array(batch.visible)
    N = batch.features.shape[1]
    seq_of_context = np.concatenate([[s] * max(a) for s, a in enumerate(anchors)])
    labels = dict(zip(np.array(batch.label_index).tolist(), zip(np.array(batch.labels).tolist(),
                                                                np.array(batch.weights).tolist())))
    q = 0
    for s, (example, seq_anchors) in enumerate(zip(examples, anchors)):
        assert all(len(example.prompt_ids) <= a <= len(example.tokens) - 2 for a in seq_anchors)
        for a in seq_anchors:
            for i in range(cfg.block_size):
                row = visible[q + i]
                ctx = np.nonzero(row[:N])[0]
                # only this sequence's context, exactly the positions before the anchor
                assert (seq_of_context[ctx] == s).all()
                assert np.array(batch.context_positions)[ctx].tolist() == list(range(a))
                # only this block's positions, in both directions
                assert np.nonzero(row[N:])[0].tolist() == list(range(q, q + cfg.block_size))
                assert batch.block_positions[q + i].item() == a + i
                assert batch.block_tokens[0, q + i].item() == (example.tokens[a] if i == 0 else MASK)
                if i > 0 and a + i < len(example.tokens):
                    token, weight = labels[q + i]
                    assert token == example.tokens[a + i]
                    assert weight == pytest.approx(math.exp(-(i - 1) / cfg.gamma))
                else:
                    assert q + i not in labels  # the anchor and positions past the end are not predicted
            q += cfg.block_size
    assert q == visible.shape[0]


def test_packed_training_pass_equals_the_decode_pass():
    """The training forward of a block is the decode-time forward of that block."""
    target = tiny_target("llama", seed=3)
    draft = new_drafter(target, TrainConfig(block_size=4, num_layers=2, num_target_layers=2), MASK)
    rng = random.Random(1)
    examples = make_examples(rng, 3)
    features = [target(mx.array(e.tokens)[None], target.make_cache(), draft.target_layer_ids)[1][0]
                for e in examples]
    anchors = [sample_anchors(e, TrainConfig(block_size=4, anchors_per_block_span=2.0), rng) for e in examples]
    batch = pack(examples, features, anchors, 4, MASK, 4.0)
    context = PackedContext(batch, draft.context(batch.features))
    packed = draft.run_layers(batch.block_tokens, [context] * len(draft.layers))[0]
    q = 0
    for example, f, seq_anchors in zip(examples, features, anchors):
        for a in seq_anchors:
            cache = draft.make_cache()
            draft.add_context(f[None, :a], cache)
            block = mx.array([[example.tokens[a]] + [MASK] * 3])
            alone = draft.run_layers(block, cache)[0]
            np.testing.assert_allclose(np.array(packed[q : q + 4]), np.array(alone), rtol=1e-4, atol=1e-4)
            q += 4


def self_distilled(target, n, length, seed=0):
    """The tiny target's own greedy continuations of short prompts over a small
    alphabet: a repetitive corpus whose held-out trajectories resemble the training ones."""
    rng = random.Random(seed)
    examples = []
    for _ in range(n):
        prompt = [rng.randrange(12) for _ in range(3)]
        response = [int(t) for t, _ in generate_step(mx.array(prompt), target.model, max_tokens=length)]
        examples.append(Example("p", prompt, response))
    return examples


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    target = tiny_target("qwen3", seed=4)
    examples = self_distilled(target, 160, 48)
    out = tmp_path_factory.mktemp("drafter")
    cfg = TrainConfig(block_size=4, num_layers=1, num_target_layers=2, mask_token_id=MASK, epochs=15,
                      sequences_per_step=8, lr=3e-3, warmup_steps=10, eval_prompts=6, eval_max_tokens=32,
                      checkpoint_every=100)
    logs = []
    draft = fit(target, None, examples, out, cfg, show_progress=False, log=logs.append)
    return target, examples, out, draft, logs


def test_training_reduces_the_loss_and_learns(trained):
    target, examples, out, draft, _ = trained
    history = [json.loads(line) for line in (out / "train_log.jsonl").read_text().splitlines()]
    losses = [r["loss"] for r in history if "loss" in r]
    assert np.mean(losses[-10:]) < 0.7 * np.mean(losses[:5])
    # the real decode loop accepts drafted tokens on held-out prompts
    tau = evaluate_tau(target, draft, [e.prompt_ids for e in examples[-6:]], 32)
    assert tau > 1.3
    assert history[-1]["tau"] == pytest.approx(tau, rel=0.05)


def test_trained_drafter_round_trips_and_is_lossless(trained):
    target, examples, out, draft, _ = trained
    reloaded = load_draft(out, dtype=mx.float32).bind(target)
    config = json.loads((out / "config.json").read_text())
    assert config["dflash_config"]["mask_token_id"] == MASK and config["block_size"] == 4
    assert not any(k.startswith(("embed_tokens", "lm_head")) for k in mx.load(str(out / "model.safetensors")))
    for example in examples[-4:]:
        prompt = mx.array(example.prompt_ids)
        reference = [int(t) for t, _ in generate_step(prompt, target.model, max_tokens=30)]
        stats = DecodeStats()
        out_tokens = [t for s in decode(DFlashModel(target, reloaded), prompt, SamplingParams(), 30, stats=stats)
                      for t in s.tokens]
        assert out_tokens == reference


def test_resume_continues_from_the_checkpoint(trained, tmp_path):
    target, examples, out, _, _ = trained
    state = json.loads((out / "checkpoint" / "state.json").read_text())
    cfg = TrainConfig(**{**state["config"], "epochs": state["config"]["epochs"] + 1})
    logs = []
    fit(target, None, examples, out, cfg, show_progress=False, log=logs.append)
    assert any(f"resuming at step {state['state']['step']}" in line for line in logs)
    resumed = json.loads((out / "checkpoint" / "state.json").read_text())["state"]
    assert resumed["step"] > state["state"]["step"]


def test_bad_training_input(tmp_path):
    with pytest.raises(ValueError, match="block size must be >= 2"):
        TrainConfig(block_size=1)
    (tmp_path / "meta.json").write_text(json.dumps({"target": {"model_type": "llama", "num_layers": 30}}))
    with pytest.raises(ValueError, match="different target"):
        read_data(tmp_path, {"model_type": "qwen3", "num_layers": 28})
    with pytest.raises(ValueError, match="no responses"):
        read_data(tmp_path, {"model_type": "llama", "num_layers": 30})
    with pytest.raises(FileNotFoundError, match="make-data"):
        read_data(tmp_path / "nowhere")
    target = tiny_target("llama")
    with pytest.raises(ValueError, match="held-out"):
        fit(target, None, [Example("p", [1, 2], [3, 4])] * 3, tmp_path / "o", TrainConfig(mask_token_id=MASK),
            show_progress=False)
