"""Drafter training: packed batches are exactly as specified, training learns, and
the result round-trips through the z-lab format and decodes losslessly."""

import json
import math
import random
from collections import Counter

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_map
import numpy as np
import pytest
from mlx_lm.generate import generate_step

from dflash_mlx.convert.models import convert_draft
from dflash_mlx.train.data import Example, read_data, read_datasets
from dflash_mlx.drafters import load_draft
from dflash_mlx.decode.decoder import decode
from dflash_mlx.decode.request import Request
from dflash_mlx.decode.model import DecodeStats, DFlashModel
from dflash_mlx.sampling import SamplingParams
from dflash_mlx.train.corpus import Window
from dflash_mlx.train.packing import PackedContext, pack, sample_blocks
from dflash_mlx.train.loss import RestrictedHead, block_hidden, selector_loss, loss_fn
from dflash_mlx.train.drafter import to_dflash2, grow, new_drafter, output_embeddings
from dflash_mlx.train.config import TrainConfig, stratified_layer_ids
from dflash_mlx.train.evaluate import evaluate_tau, position_acceptance, split_held_out
from dflash_mlx.train.fit import fit
from dflash_mlx.train.labels import label_counts, target_pass
from tiny_models import tiny_target

pytestmark = pytest.mark.slow  # training runs

MASK = 96


def test_stratified_layer_ids_match_z_lab():
    assert stratified_layer_ids(36, 5) == [1, 9, 17, 25, 33]
    assert stratified_layer_ids(30, 5) == [1, 8, 14, 20, 27]
    assert stratified_layer_ids(4, 1) == [2]


def test_new_drafter_starts_from_target_layers_that_fit():
    """Projections are copied at the target's head size; a norm only where it computes what the
    drafter's does (Gemma's scale by 1 + w would be read as w)."""
    for family, copied_norm in (("llama", True), ("gemma3_text", False)):
        target = tiny_target(family, seed=3)
        target.model.update(tree_map(lambda p: p + 0.5 if p.ndim == 1 else p, target.model.parameters()))
        draft = new_drafter(target, TrainConfig(block_size=4, num_layers=1, num_target_layers=2), MASK)
        source, layer = target.layers[-1], draft.layers[0]
        assert layer.self_attn.q_proj.weight.shape == source.self_attn.q_proj.weight.shape
        assert mx.array_equal(layer.self_attn.q_proj.weight, source.self_attn.q_proj.weight)
        norm_copied = mx.array_equal(layer.input_layernorm.weight, source.input_layernorm.weight).item()
        assert norm_copied == copied_norm, family
        if not copied_norm:
            assert mx.all(layer.input_layernorm.weight == 1).item()


def make_examples(rng, n=3):
    return [
        Example(
            "p",
            [rng.randrange(90) for _ in range(rng.randint(2, 6))],
            [rng.randrange(90) for _ in range(rng.randint(3, 30))],
        )
        for _ in range(n)
    ]


def test_labels_follow_the_targets_greedy_path():
    tokens = [5, 1, 2, 9, 4, 6]
    greedy = np.array([1, 2, 3, 4, 6, 7])  # agrees with the text after positions 0, 1, 3, 4
    # anchor 0: labels greedy[0]=1, greedy[1]=2 (text 1 agreed), greedy[2]=3 (text 2 agreed), stop (9 != 3)
    assert label_counts(tokens, greedy, 16).tolist() == [3, 2, 1, 3, 2, 1]
    assert label_counts(tokens, greedy, 3).tolist() == [2, 2, 1, 2, 2, 1]
    # a self-distilled sequence (text == greedy path) is labelled everywhere, up to the block
    assert label_counts([0, 1, 2, 3], np.array([1, 2, 3, 4]), 16).tolist() == [4, 3, 2, 1]


def packed(rng, seqs, features, greedy, block_size, budget, vocab=None):
    blocks = [sample_blocks(s, label_counts(s.tokens, g, block_size), budget, rng) for s, g in zip(seqs, greedy)]
    return blocks, pack(seqs, features, greedy, blocks, MASK, 3.0, vocab)


def test_training_blocks_cut_to_drawn_verify_widths():
    """With widths, each block is as long as a verify width drawn from them (never longer than its
    labels allow), every width is drawn, the budget holds more blocks; without, nothing changes."""
    seq = Example("p", [1, 2, 3], list(range(10, 90)))  # a response: every position fully labelled
    counts = label_counts(seq.tokens, np.array(seq.tokens[1:] + [0]), 16)
    full = sample_blocks(seq, counts, 200, random.Random(1))
    assert full == sample_blocks(seq, counts, 200, random.Random(1), None)
    cut = sample_blocks(seq, counts, 200, random.Random(1), [2, 3, 4])
    assert all(1 <= n <= min(3, counts[a]) for a, n in cut)
    assert {n for a, n in cut} == {1, 2, 3}
    assert len(cut) > 2 * len(full) and sum(1 + n for _, n in cut) <= 200
    with pytest.raises(ValueError, match="block widths must be in 2..16"):
        TrainConfig(block_widths=[1, 4])
    with pytest.raises(ValueError, match="block widths must be in 2..4"):
        TrainConfig(block_size=4, block_positions=8, block_widths=[2, 8])


def test_packed_blocks_see_exactly_their_own_past_and_block():
    rng = random.Random(0)
    seqs = make_examples(rng, 3) + [Window("w", [rng.randrange(90) for _ in range(20)])]
    L = max(len(s.tokens) for s in seqs)
    features = mx.random.normal((len(seqs), L, 6))
    greedy = np.array(
        [
            [s.tokens[i + 1] if i + 1 < len(s.tokens) and rng.random() < 0.7 else rng.randrange(90) for i in range(L)]
            for s in seqs
        ]
    )
    blocks, batch = packed(rng, seqs, features, greedy, 5, 24, vocab=set(range(80)))
    visible = np.array(batch.visible)
    Q = visible.shape[2]
    labels = dict(
        zip(
            np.array(batch.label_index).tolist(), zip(np.array(batch.labels).tolist(), np.array(batch.weights).tolist())
        )
    )
    tokens = np.array(batch.block_tokens)[0]
    assert all(blocks) and batch.groups == len(seqs)
    for s, (seq, seq_blocks) in enumerate(zip(seqs, blocks)):
        counts = label_counts(seq.tokens, greedy[s], 5)
        assert sum(1 + n for _, n in seq_blocks) <= 24
        q = 0
        for a, n in seq_blocks:
            assert seq.first_anchor <= a < len(seq.tokens) and n == counts[a]
            for i in range(n + 1):
                row = visible[s, 0, q + i]
                assert np.nonzero(row[:L])[0].tolist() == list(range(a))  # exactly the positions before the anchor
                assert np.nonzero(row[L:])[0].tolist() == list(range(q, q + n + 1))  # its block, both ways
                assert batch.block_positions[s * Q + q + i].item() == a + i
                assert tokens[s * Q + q + i] == (seq.tokens[a] if i == 0 else MASK)
                label = labels.get(s * Q + q + i)
                if i == 0 or greedy[s, a + i - 1] >= 80:
                    assert label is None  # the anchor, and labels outside the vocabulary, are not predicted
                else:
                    assert label == (greedy[s, a + i - 1], pytest.approx(math.exp(-(i - 1) / 3.0)))
            q += n + 1
        for pad in range(q, Q):
            assert np.nonzero(visible[s, 0, pad])[0].tolist() == [L + pad]


DFLASH2 = dict(architecture="dflash2", conv_kernel_size=3, conv_group_size=8, selector_rank=8, selector_top_k=4)


def randomize_convolutions(draft):
    """Convolutions that mix positions (a new drafter's pass through), so leaking across packed blocks shows."""
    for layer in draft.layers:
        for conv in (layer.attention_conv, layer.mlp_conv):
            conv.base_kernel = 0.5 * mx.random.normal(conv.base_kernel.shape)
            conv.kernel_projection.weight = 0.2 * mx.random.normal(conv.kernel_projection.weight.shape)
    return draft


@pytest.mark.parametrize("architecture", ["dflash", "dflash2"])
def test_packed_training_pass_equals_the_decode_pass(architecture):
    """The training forward of a block is the decode-time forward of that block."""
    target = tiny_target("llama", seed=3)
    extra = DFLASH2 if architecture == "dflash2" else {}
    draft = new_drafter(target, TrainConfig(block_size=4, num_layers=2, num_target_layers=2, **extra), MASK)
    if architecture == "dflash2":
        draft = randomize_convolutions(draft)
    rng = random.Random(1)
    seqs = make_examples(rng, 3) + [Window("w", [rng.randrange(90) for _ in range(12)])]
    features, greedy, _ = target_pass(target, seqs, draft.target_layer_ids)
    blocks, batch = packed(rng, seqs, features, greedy, 4, 16)
    context = PackedContext(batch, draft.context(batch.features))
    out = draft.run_layers(batch.block_tokens, [context] * len(draft.layers))[0]
    Q = batch.visible.shape[2]
    for s, (seq, seq_blocks) in enumerate(zip(seqs, blocks)):
        alone_features = target(mx.array(seq.tokens)[None], target.make_cache(), draft.target_layer_ids)[1]
        q = 0
        for a, n in seq_blocks:
            cache = draft.make_cache()
            draft.add_context(alone_features[:, :a], cache)
            alone = draft.run_layers(mx.array([[seq.tokens[a]] + [MASK] * n]), cache)[0]
            np.testing.assert_allclose(
                np.array(out[s * Q + q : s * Q + q + n + 1]), np.array(alone), rtol=1e-4, atol=1e-4
            )
            q += n + 1


def test_distillation_targets_are_the_targets_distribution_at_each_label():
    """The teacher row of every predicted block position is the target's logits at
    the position whose greedy token is its label, and the loss mixes KL and CE."""
    target = tiny_target("llama", seed=3)
    draft = new_drafter(target, TrainConfig(block_size=4, num_layers=1, num_target_layers=2), MASK)
    rng = random.Random(2)
    seqs = make_examples(rng, 3) + [Window("w", [rng.randrange(90) for _ in range(12)])]
    head = RestrictedHead(output_embeddings(target), Counter(range(60)), 60)
    features, greedy, teacher = target_pass(target, seqs, draft.target_layer_ids, mx.array(head.token_ids))
    blocks = [sample_blocks(s, label_counts(s.tokens, g, 4), 16, rng) for s, g in zip(seqs, greedy)]
    batch = pack(seqs, features, greedy, blocks, MASK, 3.0, head.vocab, teacher)
    assert batch.teacher.shape == (batch.labels.size, 60) and batch.labels.size > 0
    assert np.array_equal(np.array(head.lookup[batch.labels]), np.array(batch.teacher.argmax(axis=-1)))
    ce, _ = loss_fn(draft, batch, head, 0.0)
    kl, _ = loss_fn(draft, batch, head, 1.0)
    half, _ = loss_fn(draft, batch, head, 0.5)
    assert kl.item() > 0 and abs(kl.item() - ce.item()) > 1e-3
    assert half.item() == pytest.approx((ce.item() + kl.item()) / 2, rel=1e-5)


def test_grown_drafter_computes_what_it_did():
    target = tiny_target("llama", seed=3)
    draft = new_drafter(target, TrainConfig(block_size=4, num_layers=1, num_target_layers=2), MASK)
    bigger = grow(draft, 3)
    assert len(bigger.layers) == 3 and bigger.args.num_hidden_layers == 3
    features = target(mx.array([[1, 2, 3, 4, 5]]), target.make_cache(), draft.target_layer_ids)[1]
    outs = []
    for d in (draft, bigger):
        cache = d.make_cache()
        d.add_context(features, cache)
        outs.append(np.array(d(mx.array([[7, MASK, MASK, MASK]]), cache)))
    np.testing.assert_allclose(outs[0], outs[1], rtol=1e-5, atol=1e-5)


def test_a_dflash1_drafter_grown_into_dflash2_drafts_the_same():
    target = tiny_target("llama", seed=3)
    draft = new_drafter(target, TrainConfig(block_size=6, num_layers=2, num_target_layers=2), MASK)
    grown = to_dflash2(draft, TrainConfig(**DFLASH2))
    assert grown.args.dflash2 and grown.args.selector_top_k == 4
    features = target(mx.array([[1, 2, 3, 4, 5, 6, 7]]), target.make_cache(), draft.target_layer_ids)[1]
    block = mx.array([[7] + [MASK] * 5])
    outs = []
    for d in (draft, grown):
        cache = d.make_cache()
        d.add_context(features, cache)
        outs.append((np.array(d(block, cache)), d.propose(block, cache, SamplingParams(), None).tolist()))
    np.testing.assert_allclose(outs[0][0], outs[1][0], rtol=1e-5, atol=1e-5)
    assert outs[0][1] == outs[1][1]


def test_the_selector_loss_is_zero_only_where_the_label_is_no_candidate():
    target = tiny_target("llama", seed=3)
    draft = randomize_convolutions(
        new_drafter(target, TrainConfig(block_size=4, num_layers=1, num_target_layers=2, **DFLASH2), MASK)
    )
    rng = random.Random(2)
    seqs = make_examples(rng, 3)
    head = RestrictedHead(output_embeddings(target), Counter(range(97)), 97)
    features, greedy, _ = target_pass(target, seqs, draft.target_layer_ids)
    blocks = [sample_blocks(s, label_counts(s.tokens, g, 4), 16, rng) for s, g in zip(seqs, greedy)]
    batch = pack(seqs, features, greedy, blocks, MASK, 3.0, head.vocab)
    hidden = block_hidden(draft, batch)
    logits = hidden @ head.weight.T
    losses = np.array(selector_loss(draft, batch, head, hidden, logits))
    top = np.argsort(-np.array(logits), axis=-1)[:, :4]
    in_top = (top == np.array(head.lookup[batch.labels])[:, None]).any(-1)
    assert in_top.any() and (~in_top).any()
    assert (losses[~in_top] == 0).all() and (losses[in_top] > 0).all()


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
    cfg = TrainConfig(
        block_size=4,
        num_layers=1,
        num_target_layers=2,
        mask_token_id=MASK,
        epochs=15,
        sequences_per_step=8,
        lr=3e-3,
        warmup_steps=10,
        eval_prompts=6,
        eval_max_tokens=32,
        checkpoint_every=100,
    )
    logs = []
    draft = fit(target, None, examples, out, cfg, show_progress=False, log=logs.append)
    return target, examples, out, draft, logs


def test_training_reduces_the_loss_and_learns(trained):
    target, examples, out, draft, _ = trained
    history = [json.loads(line) for line in (out / "train_log.jsonl").read_text().splitlines()]
    losses = [r["loss"] for r in history if "loss" in r]
    assert np.mean(losses[-10:]) < 0.7 * np.mean(losses[:5])
    assert (out / "train_curve.png").stat().st_size > 1000  # the curve is drawn, not silently skipped
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
        out_tokens = [
            t
            for s in decode(DFlashModel(target, reloaded), Request(prompt.tolist(), 30, SamplingParams()), stats=stats)
            for t in s.tokens
        ]
        assert out_tokens == reference


def test_dflash2_training_learns_and_stays_lossless(tmp_path):
    """(With training blocks cut to verify widths 2-3 of its block of 4.)"""
    target = tiny_target("qwen3", seed=4)
    examples = self_distilled(target, 96, 40)
    cfg = TrainConfig(
        block_size=4,
        num_layers=1,
        num_target_layers=2,
        mask_token_id=MASK,
        epochs=6,
        sequences_per_step=8,
        lr=3e-3,
        warmup_steps=5,
        eval_prompts=6,
        eval_max_tokens=24,
        checkpoint_every=100,
        block_widths=[2, 3],
        **DFLASH2,
    )
    draft = fit(target, None, examples, tmp_path, cfg, show_progress=False, log=lambda *_: None)
    history = [json.loads(line) for line in (tmp_path / "train_log.jsonl").read_text().splitlines()]
    losses = [r["loss"] for r in history if "loss" in r]
    assert np.mean(losses[-5:]) < 0.7 * np.mean(losses[:3])
    assert float(mx.abs(draft.candidate_selector.successor_codebook.weight).max()) > 0  # the selector trained
    reloaded = load_draft(tmp_path, dtype=mx.float32).bind(target)
    assert json.loads((tmp_path / "config.json").read_text())["architectures"] == ["DFlash2DraftModel"]
    for example in examples[-3:]:
        prompt = mx.array(example.prompt_ids)
        reference = [int(t) for t, _ in generate_step(prompt, target.model, max_tokens=24)]
        stats = DecodeStats()
        got = [
            t
            for s in decode(DFlashModel(target, reloaded), Request(prompt.tolist(), 24, SamplingParams()), stats=stats)
            for t in s.tokens
        ]
        assert got == reference
    assert stats.tau > 1


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
        fit(
            target,
            None,
            [Example("p", [1, 2], [3, 4])] * 3,
            tmp_path / "o",
            TrainConfig(mask_token_id=MASK),
            show_progress=False,
        )


def test_position_acceptance_is_conditional():
    # cycles committing 1, 2, 3 and 3 tokens at width 3: position 1 accepted in 3 of 4, position 2 in 2 of 3
    assert position_acceptance([1, 2, 3, 3], 3) == [0.75, pytest.approx(2 / 3)]


def test_training_starts_from_a_quantized_drafter(trained, tmp_path):
    """The shipped drafter is 8-bit: a warm start expands it and trains float weights."""
    target, examples, out, _, _ = trained
    q8 = convert_draft(str(out), tmp_path / "q8", q_bits=8, q_group_size=32, show_progress=False)
    cfg = TrainConfig(
        init_from=str(q8),
        num_layers=1,
        sequences_per_step=4,
        steps=2,
        warmup_steps=1,
        eval_prompts=2,
        eval_max_tokens=8,
        checkpoint_every=100,
    )
    draft = fit(target, None, examples, tmp_path / "warm", cfg, show_progress=False, log=lambda *_: None)
    assert not any(isinstance(m, nn.QuantizedLinear) for _, m in draft.named_modules())
    assert "quantization" not in json.loads((tmp_path / "warm" / "config.json").read_text())


def test_several_data_dirs_keep_the_first_dirs_held_out_examples(tmp_path):
    fingerprint = {"model_type": "llama", "num_layers": 30}
    for name, count in (("first", 10), ("added", 5)):
        folder = tmp_path / name
        folder.mkdir()
        (folder / "meta.json").write_text(json.dumps({"target": fingerprint}))
        rows = [Example(f"{name} {i}", [1, 2], [3, 4]) for i in range(count)]
        (folder / "shard-00000.jsonl").write_text("".join(json.dumps(e.__dict__) + "\n" for e in rows))
    both = read_datasets(f"{tmp_path / 'first'},{tmp_path / 'added'}", fingerprint)
    assert len(both) == 15
    held_out, training = split_held_out(both, 3)
    assert [e.prompt for e in held_out] == ["first 7", "first 8", "first 9"]
    assert {e.prompt for e in training} >= {f"added {i}" for i in range(5)}
    with pytest.raises(ValueError, match="no data dir"):
        read_datasets(" , ", fingerprint)


def test_make_data_runs_on_a_gated_delta_target_from_the_cli(tiny_dirs, tmp_path):
    """`train make-data` on a Qwen3.5-style target (GatedDeltaNet layers): the loaded target is
    used as it is, not wrapped a second time (which hid its recurrent mixers and refused it)."""
    import shutil

    from mlx_lm.utils import save_config, save_model
    from typer.testing import CliRunner

    from dflash_mlx.cli import app
    from tiny_models import _config, tiny_model

    model_dir = tmp_path / "qwen3_5"
    _, config = _config("qwen3_5")
    config["vocab_size"] = 320  # the tiny tokenizer's
    save_model(model_dir, tiny_model("qwen3_5", seed=1, vocab_size=320))
    save_config(config, model_dir / "config.json")
    for tokenizer_file in tiny_dirs[0].glob("tokenizer*"):
        shutil.copy(tokenizer_file, model_dir)
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("hello there\nsay something\n")
    result = CliRunner().invoke(
        app,
        [
            "train",
            "make-data",
            "--model",
            str(model_dir),
            "--prompts",
            str(prompts),
            "--out",
            str(tmp_path / "data"),
            "--max-tokens",
            "6",
            "--batch-size",
            "2",
        ],
    )
    assert result.exit_code == 0, result.output
    shard = [json.loads(line) for line in (tmp_path / "data" / "shard-00000.jsonl").read_text().splitlines()]
    assert len(shard) == 2 and all(0 < len(e["response_ids"]) <= 6 for e in shard)
