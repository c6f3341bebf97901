"""Train a DFlash drafter against a frozen target (the paper's recipe, on MLX).

Each optimizer step:
    target    one batched pass over S sequences: the features of `target_layer_ids`
              and the target's greedy choice at every position (nothing is cached,
              so the data can be far larger than memory)
    labels    block position k after an anchor a is labelled with the target's
              greedy token at a+k-1 wherever the tokens a+1..a+k-1 are the target's
              own choices: every position of a self-distilled response, and the
              agreeing stretches of teacher-forced text (corpus.py)
    anchors   random, until their blocks [token at a, MASK x n] fill a budget per
              sequence; a block is as long as its labels (n <= B-1), or cut to a verify
              width drawn from `block_widths` (the widths the decode loop drafts at)
    attention bidirectional inside a block; a block sees the context features of
              its own sequence before its anchor, never another block
    dflash2   (architecture "dflash2") each block's convolutions see only its own
              block, and the candidate selector learns to pick the label among
              the top-k (teacher-forced predecessors), added to the loss
    loss      cross-entropy at the labelled positions, weight exp(-(k-1)/gamma) at
              block position k, over the target's frozen output embeddings
              restricted to the most frequent token ids of the data; optionally
              mixed with the KL divergence from the target's own distribution at
              that position (`distill`), which the target pass computes anyway

The drafter's embedding and lm_head are the target's: frozen, not saved.
"""

import json
import math
import random
import time
from collections import Counter
from dataclasses import fields
from pathlib import Path
from typing import Sequence

import mlx.core as mx
import mlx.nn as nn
import mlx.optimizers as optim
import numpy as np
from mlx.utils import tree_unflatten

from ..bench.plots import MissingMatplotlib, training_curve
from ..drafters import DFlashDraftModel, load_draft
from ..io.progress import add_task, progress
from ..target.wrapper import Target
from .corpus import Window
from .data import Example
from .checkpoint import TrainState, export, save_checkpoint
from .config import TrainConfig
from .drafter import choose_mask_token, grow, new_drafter, output_embeddings, to_dflash2
from .evaluate import held_out_tau, split_held_out
from .labels import label_counts, target_pass
from .loss import RestrictedHead, loss_fn
from .packing import PackedBatch, pack, sample_blocks


def _schedule(cfg: TrainConfig, total_steps: int):
    warmup = optim.linear_schedule(cfg.lr * 0.01, cfg.lr, max(cfg.warmup_steps, 1))
    decay = optim.cosine_decay(cfg.lr, max(total_steps - cfg.warmup_steps, 1), cfg.lr * cfg.min_lr_ratio)
    return optim.join_schedules([warmup, decay], [max(cfg.warmup_steps, 1)])


def _pick(items: list, step: int, per_step: int, seed: int) -> list[int]:
    """Indices of `items` for optimizer step `step`: consecutive slices of a
    fresh shuffle per pass over the items (so a resumed run sees the same data)."""
    if per_step == 0:
        return []
    out = []
    for cursor in range(step * per_step, (step + 1) * per_step):
        epoch, i = divmod(cursor, len(items))
        order = list(range(len(items)))
        random.Random(seed * 100003 + epoch).shuffle(order)
        out.append(order[i])
    return out


def fit(
    target: Target,
    tokenizer,
    examples: list[Example],
    out_dir,
    cfg: TrainConfig,
    text: Sequence[Window] = (),
    resume: bool = True,
    show_progress: bool = True,
    log=print,
) -> DFlashDraftModel:
    """Train (or resume) a drafter into `out_dir` on self-distilled `examples`
    (the last cfg.eval_prompts held out) plus teacher-forced `text` windows;
    returns the trained drafter.  Target features are computed per step, so
    the data can be far larger than memory and is never revisited unless asked."""
    out_dir = Path(out_dir)
    checkpoint = out_dir / "checkpoint"
    if len(examples) <= cfg.eval_prompts:
        raise ValueError(f"need more than {cfg.eval_prompts} examples (the held-out set), got {len(examples)}")
    if resume and (checkpoint / "state.json").is_file():
        saved = json.loads((checkpoint / "state.json").read_text())
        # the architecture and recipe are the checkpoint's; only the length can change
        known = {f.name for f in fields(TrainConfig)}  # a checkpoint of an older version may hold more
        cfg = TrainConfig(
            **{**{k: v for k, v in saved["config"].items() if k in known}, "epochs": cfg.epochs, "steps": cfg.steps}
        )
        draft = load_draft(checkpoint / "drafter", dtype=mx.float32).bind(target)
        state = TrainState(**saved["state"])
        log(f"resuming at step {state.step} (epoch {state.epoch})")
    elif cfg.init_from:
        draft = load_draft(cfg.init_from, dtype=mx.float32, dequantize=True).bind(target)
        draft = grow(draft, cfg.num_layers)
        if cfg.architecture == "dflash2" and not draft.args.dflash2:
            draft = to_dflash2(draft, cfg)
        cfg.architecture = "dflash2" if draft.args.dflash2 else "dflash"
        cfg.block_size, cfg.num_layers = draft.block_size, len(draft.layers)
        cfg.target_layer_ids, cfg.mask_token_id = draft.target_layer_ids, draft.mask_token_id
        cfg.check_block_widths()  # against the warm start's block size
        state = TrainState()
        log(f"starting from the drafter in {cfg.init_from} ({cfg.num_layers} layers)")
    else:
        if cfg.mask_token_id is None:  # a resumed or warm-started drafter brings its own
            cfg.mask_token_id = choose_mask_token(tokenizer)
        draft = new_drafter(target, cfg, cfg.mask_token_id)
        state = TrainState()
    draft.train()
    if cfg.text_fraction > 0 and not text:  # checked after a resume too: its recipe is the checkpoint's
        raise ValueError("text_fraction > 0 needs text windows")

    held_out, train_set = split_held_out(examples, cfg.eval_prompts)
    layer_ids = draft.target_layer_ids
    text_per_step = round(cfg.sequences_per_step * cfg.text_fraction) if text else 0
    chat_per_step = cfg.sequences_per_step - text_per_step
    counts = Counter(t for e in train_set for t in e.response_ids)
    counts.update(t for w in text for t in w.tokens)
    head = RestrictedHead(output_embeddings(target), counts, cfg.head_size)
    draft.restrict_vocab(head.token_ids)  # it drafts from the ids it was trained to predict
    total_steps = cfg.steps or cfg.epochs * math.ceil(len(train_set) / max(chat_per_step, 1))
    log(
        f"{len(train_set)} training sequences ({sum(len(e.response_ids) for e in train_set)} response tokens), "
        f"{len(text)} text windows; {chat_per_step} + {text_per_step} per step, {total_steps} steps; "
        f"restricted head {len(head.token_ids)} tokens, target layers {layer_ids}"
    )

    optimizer = optim.AdamW(learning_rate=_schedule(cfg, total_steps), weight_decay=cfg.weight_decay)
    optimizer.init(draft.trainable_parameters())
    if resume and (checkpoint / "optimizer.safetensors").is_file() and state.step:
        optimizer.state = tree_unflatten(list(mx.load(str(checkpoint / "optimizer.safetensors")).items()))
    value_and_grad = nn.value_and_grad(draft, lambda m, b: loss_fn(m, b, head, cfg.distill))
    teacher_ids = mx.array(head.token_ids) if cfg.distill > 0 else None

    def train_step(batch):
        (loss, correct), grads = value_and_grad(draft, batch)
        grads, grad_norm = optim.clip_grad_norm(grads, cfg.grad_clip)
        optimizer.update(draft, grads)
        return loss, correct, grad_norm

    def batch_for(step: int) -> tuple[PackedBatch, int]:
        seqs = [train_set[i] for i in _pick(train_set, step, chat_per_step, cfg.seed)]
        seqs += [text[i] for i in _pick(text, step, text_per_step, cfg.seed + 1)]
        features, greedy, teacher = target_pass(target, seqs, layer_ids, teacher_ids)
        rng = random.Random(cfg.seed * 1000003 + step)
        blocks = [
            sample_blocks(s, label_counts(s.tokens, g, cfg.block_size), cfg.block_positions, rng, cfg.block_widths)
            for s, g in zip(seqs, greedy)
        ]
        batch = pack(seqs, features, greedy, blocks, cfg.mask_token_id, cfg.gamma, head.vocab, teacher)
        return batch, sum(len(s.tokens) for s in seqs)

    with progress(show_progress) as bar:
        task = add_task(bar, "train (steps)", total=total_steps, info="")
        bar.update(task, completed=state.step)
        while state.step < total_steps:
            tic = time.perf_counter()
            batch, tokens = batch_for(state.step)
            features_done = time.perf_counter()
            loss, correct, grad_norm = train_step(batch)
            mx.eval(loss, correct, draft.parameters(), optimizer.state)
            seconds = time.perf_counter() - tic
            correct = np.array(correct)
            first = correct[batch.block_offsets == 0]
            state.step += 1
            state.epoch = state.step * chat_per_step / len(train_set)
            state.tokens_seen += tokens
            record = {
                "step": state.step,
                "epoch": round(state.epoch, 3),
                "tokens_seen": state.tokens_seen,
                "loss": round(loss.item(), 4),
                "acc": round(float(correct.mean()), 4),
                "acc_pos1": round(float(first.mean()), 4) if first.size else None,
                "lr": float(optimizer.learning_rate),
                "grad_norm": round(grad_norm.item(), 3),
                "predictions": len(correct),
                "predictions_per_s": round(len(correct) / seconds, 1),
                "target_s": round(features_done - tic, 2),
                "step_s": round(seconds, 2),
            }
            state.history.append(record)
            bar.update(
                task,
                advance=1,
                info=f"loss {record['loss']:.3f} acc {record['acc']:.3f} "
                f"acc@1 {record['acc_pos1'] or 0:.3f} {record['predictions_per_s']:.0f} pred/s",
            )
            if state.step % 25 == 0:
                log(" ".join(f"{k} {v}" for k, v in record.items()))
            if cfg.eval_every and state.step % cfg.eval_every == 0:
                record["tau"] = held_out_tau(target, draft, held_out, cfg)
                log(f"step {state.step}: held-out tau {record['tau']:.2f}")
            if state.step % cfg.checkpoint_every == 0 or state.step == total_steps:
                save_checkpoint(checkpoint, draft, optimizer, cfg, state)
    tau = held_out_tau(target, draft, held_out, cfg)
    state.history.append({"step": state.step, "tokens_seen": state.tokens_seen, "tau": tau})
    log(f"held-out tau {tau:.2f} (block {cfg.block_size}, {len(held_out)} prompts, greedy)")
    save_checkpoint(checkpoint, draft, optimizer, cfg, state)
    export(draft, out_dir)
    try:
        training_curve(out_dir / "train_log.jsonl", out_dir / "train_curve.png")
    except MissingMatplotlib as e:
        log(f"no training plot: {e}")
    return draft
