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
              sequence; a block is as long as its labels (n <= B-1)
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
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Optional, Sequence

import mlx.core as mx
import mlx.nn as nn
import mlx.optimizers as optim
import numpy as np
from mlx.utils import tree_flatten, tree_map, tree_unflatten

from .corpus import Window
from .data import Example
from .draft import DFlashDraftModel, DraftArgs, load_draft, save_draft
from .engine import DecodeStats, DFlashModel, decode
from .progress import add_task, progress
from .sampling import SamplingParams
from .target import Target


def stratified_layer_ids(num_layers: int, n: int) -> list[int]:
    """n target layers evenly spaced from shallow (1) to deep (L-3), as z-lab picks them."""
    if n == 1:
        return [num_layers // 2]
    start, end = 1, max(num_layers - 3, 1 + n - 1)
    return sorted({round(start + i * (end - start) / (n - 1)) for i in range(n)})


@dataclass
class TrainConfig:
    block_size: int = 16
    num_layers: int = 1  # drafter layers
    architecture: str = "dflash"  # or "dflash2": block convolutions and a candidate selector
    conv_kernel_size: int = 4  # dflash2
    conv_group_size: int = 64  # dflash2: channels per convolution group
    selector_rank: int = 64  # dflash2
    selector_top_k: int = 8  # dflash2
    num_target_layers: int = 5  # how many target layers feed the drafter
    target_layer_ids: Optional[list[int]] = None  # default: stratified_layer_ids
    mask_token_id: Optional[int] = None  # default: choose_mask_token
    gamma: float = 4.0  # loss weight decay along the block
    init_from_target: bool = True  # copy the deepest target layers into the drafter layers
    init_from: Optional[str] = None  # or start from an existing drafter dir (warm start; its shape wins)
    epochs: int = 10  # passes over the self-distilled data (unless `steps` is given)
    steps: Optional[int] = None  # optimizer steps
    sequences_per_step: int = 8
    text_fraction: float = 0.0  # share of each step's sequences that are text windows
    text_window: int = 256  # tokens per text window (corpus.text_windows)
    block_positions: int = 256  # per sequence and step: random anchors until their blocks fill this
    head_size: int = 8192  # output vocabulary of the loss: the most frequent token ids of the data
    distill: float = 0.0  # weight of KL(target || drafter) over the restricted vocabulary (1 - it: the hard label)
    lr: float = 1e-3
    min_lr_ratio: float = 0.05
    warmup_steps: int = 50
    weight_decay: float = 0.01
    grad_clip: float = 1.0
    checkpoint_every: int = 200
    eval_every: int = 0  # steps between held-out tau evaluations (0: only at the end)
    eval_prompts: int = 8  # held-out sequences, never trained on
    eval_max_tokens: int = 96
    seed: int = 0

    def __post_init__(self):
        if self.block_size < 2:
            raise ValueError(f"block size must be >= 2, got {self.block_size}")
        if self.architecture not in ("dflash", "dflash2"):
            raise ValueError(f"architecture must be dflash or dflash2, got {self.architecture!r}")
        if self.num_layers < 1 or self.num_target_layers < 1:
            raise ValueError("the drafter needs at least one layer and one target layer")
        for name in ("lr", "gamma", "weight_decay", "grad_clip", "min_lr_ratio", "text_fraction", "distill"):
            value = getattr(self, name)
            if not math.isfinite(value) or value < 0 or (value == 0 and name in ("lr", "gamma", "grad_clip")):
                raise ValueError(f"{name} must be a finite number > 0 (>= 0 for decay and ratios), got {value}")
        for name in ("epochs", "sequences_per_step", "head_size", "checkpoint_every", "eval_prompts",
                     "eval_max_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name.replace('_', ' ')} must be >= 1, got {getattr(self, name)}")
        if self.steps is not None and self.steps < 1:
            raise ValueError(f"steps must be >= 1, got {self.steps}")
        if self.eval_every < 0 or self.warmup_steps < 0:
            raise ValueError("eval every and warmup steps must be >= 0")
        if not 0 <= self.text_fraction < 1:
            raise ValueError(f"text fraction must be in [0, 1), got {self.text_fraction}")
        if self.distill > 1:
            raise ValueError(f"distill is a weight in [0, 1], got {self.distill}")
        if self.block_positions < self.block_size:
            raise ValueError(f"block positions per sequence ({self.block_positions}) must be >= the block size")


# ---------------------------------------------------------------- the drafter


def choose_mask_token(tokenizer) -> int:
    """The tokenizer's mask token, else its last special token the chat never uses."""
    hf = getattr(tokenizer, "_tokenizer", tokenizer)
    if getattr(hf, "mask_token_id", None) is not None:
        return hf.mask_token_id
    used = set(tokenizer.eos_token_ids) | {getattr(hf, "bos_token_id", None), getattr(hf, "pad_token_id", None)}
    chat = hf.apply_chat_template([{"role": "user", "content": "x"}, {"role": "assistant", "content": "y"}],
                                  tokenize=False) if getattr(hf, "chat_template", None) else ""
    specials = [i for t, i in zip(hf.all_special_tokens, hf.all_special_ids) if i not in used and t not in chat]
    added = [i for i, t in getattr(hf, "added_tokens_decoder", {}).items()
             if getattr(t, "special", False) and i not in used and str(t) not in chat]
    candidates = sorted(set(specials) | set(added))
    if not candidates:
        raise ValueError("the tokenizer has no spare special token for MASK; pass --mask-token-id")
    return candidates[-1]


def output_embeddings(target: Target) -> mx.array:
    """The target's lm_head weight (its embedding when tied); frozen."""
    head = target.head_module
    if isinstance(head, (nn.QuantizedLinear, nn.QuantizedEmbedding)):
        raise ValueError("train against a float (fp32/bf16) target, not a quantized one")
    return head.weight


def new_drafter(target: Target, cfg: TrainConfig, mask_token_id: int) -> DFlashDraftModel:
    attn = target.layers[0].self_attn
    n_heads, n_kv = attn.n_heads, attn.n_kv_heads
    args = DraftArgs(
        hidden_size=target.hidden_size,
        num_hidden_layers=cfg.num_layers,
        num_attention_heads=n_heads,
        num_key_value_heads=n_kv,
        head_dim=target.hidden_size // n_heads,
        intermediate_size=target.layers[0].mlp.gate_proj.weight.shape[0],
        vocab_size=target.vocab_size,
        target_layer_ids=cfg.target_layer_ids or stratified_layer_ids(target.num_layers, cfg.num_target_layers),
        mask_token_id=mask_token_id,
        block_size=cfg.block_size,
        num_target_layers=target.num_layers,
        rms_norm_eps=target.norm.eps,
        rope_theta=getattr(attn.rope, "base", 10000.0),
        max_position_embeddings=getattr(getattr(target.model, "args", None), "max_position_embeddings", 8192),
    )
    draft = DFlashDraftModel(args)
    if cfg.architecture == "dflash2":
        draft = to_dflash2(draft, cfg)
    if cfg.init_from_target:
        # deepest target layers: they already map hidden states towards the output space
        for layer, source in zip(draft.layers, target.layers[-cfg.num_layers:]):
            weights = {k: v for k, v in tree_flatten(source.parameters())
                       if k.split(".")[-2] in ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
                       or k.endswith("layernorm.weight")}
            layer.load_weights(list(weights.items()), strict=False)
    mx.eval(draft.parameters())
    return draft.bind(target)


def to_dflash2(draft: DFlashDraftModel, cfg: TrainConfig) -> DFlashDraftModel:
    """The same drafter as a DFlash 2 one whose convolutions pass through and whose
    selector picks the best logit: it drafts exactly what it did, and trains on."""
    args = DraftArgs(**{**asdict(draft.args), "architecture": "DFlash2DraftModel",
                        "conv_kernel_size": cfg.conv_kernel_size, "conv_group_size": cfg.conv_group_size,
                        "selector_rank": cfg.selector_rank, "selector_top_k": cfg.selector_top_k})
    grown = DFlashDraftModel(args)
    grown.update({k: v for k, v in draft.parameters().items() if k != "layers"})
    for new, old in zip(grown.layers, draft.layers):
        new.update(old.parameters())
        new.attention_conv.make_identity()
        new.mlp_conv.make_identity()
    grown.candidate_selector.make_neutral()
    mx.eval(grown.parameters())
    if draft.vocab_ids is not None:
        grown.restrict_vocab(draft.vocab_ids.tolist())
    return grown.bind(draft._target) if draft._target is not None else grown


# ---------------------------------------------------------------- target pass and labels


def target_pass(target: Target, seqs: list, layer_ids: list[int],
                teacher_ids: Optional[mx.array] = None) -> tuple[mx.array, np.ndarray, Optional[mx.array]]:
    """The target over each of `seqs`: their features (S, L, n_layers * hidden), the
    target's greedy choice at every position (S, L), zero-padded to the longest, and
    with `teacher_ids` its logits over those ids (S, L, len(teacher_ids)), else None.
    One sequence per pass: padding a batch cost more here than it saved (measured)."""
    length = max(len(s.tokens) for s in seqs)
    features, teacher, greedy = [], [], np.zeros((len(seqs), length), dtype=np.int64)
    for row, s in zip(greedy, seqs):
        logits, f = target(mx.array(s.tokens, dtype=mx.int32)[None], target.make_cache(), layer_ids)
        choice = mx.argmax(logits[0], axis=-1)
        pad = [(0, 0), (0, length - f.shape[1]), (0, 0)]
        if teacher_ids is not None:
            teacher.append(mx.pad(logits[:, :, teacher_ids].astype(mx.float32), pad))
        mx.eval(f, choice, *teacher[-1:])
        row[: len(s.tokens)] = np.array(choice)
        features.append(mx.pad(f, pad))
    return mx.concatenate(features, axis=0), greedy, mx.concatenate(teacher, axis=0) if teacher else None


def label_counts(tokens: list[int], greedy: np.ndarray, block_size: int) -> np.ndarray:
    """For an anchor at each position a: how many block positions have an exact greedy label.

    Position k of the block after anchor a is labelled greedy[a+k-1] when the
    tokens a+1..a+k-1 are the target's own greedy choices (always for k = 1;
    always in a self-distilled response; where the text agreed, in other text)."""
    n = len(tokens)
    agree = np.asarray(tokens[1:]) == greedy[: n - 1]
    run = np.zeros(n + 1, dtype=np.int64)  # run[i]: consecutive agreements from i on
    for i in range(n - 2, -1, -1):
        run[i] = run[i + 1] + 1 if agree[i] else 0
    return np.minimum.reduce([np.full(n, block_size - 1), n - np.arange(n), 1 + run[:n]])


# ---------------------------------------------------------------- packed batches


@dataclass
class PackedBatch:
    """Blocks of S sequences for one drafter pass, grouped by sequence.

    Sequence s contributes Q (padded) block positions that attend to its own
    context positions 0..L-1 and to block positions; `visible[s, 0, q, k]` says
    which keys (L context, then Q block) query q of sequence s sees."""

    features: mx.array  # (S, L, n_layers * hidden)
    block_tokens: mx.array  # (1, S * Q)
    block_positions: mx.array  # (S * Q,)
    visible: mx.array  # (S, 1, Q, L + Q) bool
    label_index: mx.array  # (M,) which of the S * Q positions are predicted
    labels: mx.array  # (M,) target token ids
    weights: mx.array  # (M,) loss weights
    block_offsets: np.ndarray = field(repr=False, default=None)  # (M,) k-1, for per-position metrics
    teacher: Optional[mx.array] = None  # (M, V) the target's logits over the restricted head, for distill
    block_index: Optional[mx.array] = None  # (1, S * Q) each position's index inside its block
    predecessors: Optional[mx.array] = None  # (M,) the token before each label (anchor or previous label)

    @property
    def groups(self) -> int:
        return self.visible.shape[0]


class PackedContext:
    """The attention-context protocol of DraftAttention, for packed training blocks:
    each sequence's blocks attend to that sequence's context, in one batched call."""

    def __init__(self, batch: PackedBatch, context: mx.array):
        self.position = batch.block_positions
        self.block_index = batch.block_index  # DFlash 2's convolutions stay inside each block
        self._context = context  # (S, L, hidden)
        self._visible = batch.visible

    def attend(self, attn, queries, keys, values):
        groups = self._visible.shape[0]

        def grouped(x):  # (1, H, S * Q, D) -> (S, H, Q, D)
            _, H, SQ, D = x.shape
            return x.reshape(H, groups, SQ // groups, D).transpose(1, 0, 2, 3)

        ctx_keys, ctx_values = attn.keys_values(self._context, 0)
        keys = mx.concatenate([ctx_keys, grouped(keys)], axis=2)
        values = mx.concatenate([ctx_values, grouped(values)], axis=2)
        out = mx.fast.scaled_dot_product_attention(grouped(queries), keys, values, scale=attn.scale,
                                                   mask=self._visible)
        S, H, Q, D = out.shape
        return out.transpose(1, 0, 2, 3).reshape(1, H, S * Q, D)


def sample_blocks(seq, counts: np.ndarray, budget: int, rng: random.Random) -> list[tuple[int, int]]:
    """Random (anchor, labelled positions) pairs whose blocks fill at most `budget` positions."""
    anchors = list(range(seq.first_anchor, len(seq.tokens)))
    rng.shuffle(anchors)
    blocks, used = [], 0
    for a in anchors:
        size = 1 + int(counts[a])
        if used + size > budget:
            continue
        blocks.append((a, int(counts[a])))
        used += size
    return sorted(blocks)


def pack(seqs: list, features: mx.array, greedy: np.ndarray, blocks: list[list[tuple[int, int]]],
         mask_token_id: int, gamma: float, vocab: Optional[set] = None,
         teacher: Optional[mx.array] = None) -> PackedBatch:
    """Blocks [token at a, MASK x n] at positions a..a+n, labelled greedy[a+k-1]
    at block position k (labels outside `vocab` are not predicted); `teacher`
    (S, L, V): the target's logits, gathered at the same positions as the labels."""
    S, L = len(seqs), features.shape[1]
    Q = max(sum(1 + n for _, n in b) for b in blocks)
    visible = np.zeros((S, 1, Q, L + Q), dtype=bool)
    block_tokens = np.full((S, Q), mask_token_id, dtype=np.int32)
    block_positions = np.zeros((S, Q), dtype=np.int32)
    block_index = np.zeros((S, Q), dtype=np.int32)
    label_index, labels, weights, offsets, sources, predecessors = [], [], [], [], [], []
    for s, (seq, seq_blocks) in enumerate(zip(seqs, blocks)):
        q = 0
        for a, n in seq_blocks:
            rows = slice(q, q + n + 1)
            visible[s, 0, rows, :a] = True  # own sequence, strictly before the anchor
            visible[s, 0, rows, L + q : L + q + n + 1] = True  # own block, both directions
            block_tokens[s, q] = seq.tokens[a]
            block_positions[s, rows] = np.arange(a, a + n + 1)
            block_index[s, rows] = np.arange(n + 1)
            for k in range(1, n + 1):
                label = int(greedy[s, a + k - 1])
                if vocab is None or label in vocab:
                    label_index.append(s * Q + q + k)
                    labels.append(label)
                    weights.append(math.exp(-(k - 1) / gamma))
                    offsets.append(k - 1)
                    sources.append(s * L + a + k - 1)
                    predecessors.append(seq.tokens[a] if k == 1 else int(greedy[s, a + k - 2]))
            q += n + 1
        for pad in range(q, Q):  # padding sees only itself (a fully masked row would be NaN)
            visible[s, 0, pad, L + pad] = True
    return PackedBatch(
        features=features,
        block_tokens=mx.array(block_tokens.reshape(1, -1)),
        block_positions=mx.array(block_positions.reshape(-1)),
        visible=mx.array(visible),
        label_index=mx.array(label_index, dtype=mx.int32),
        labels=mx.array(labels, dtype=mx.int32),
        weights=mx.array(weights, dtype=mx.float32),
        block_offsets=np.array(offsets),
        teacher=None if teacher is None else teacher.reshape(S * L, -1)[mx.array(sources, dtype=mx.int32)],
        block_index=mx.array(block_index.reshape(1, -1)),
        predecessors=mx.array(predecessors, dtype=mx.int32),
    )


# ---------------------------------------------------------------- loss


class RestrictedHead:
    """Frozen output embeddings of the `size` token ids most frequent in the data."""

    def __init__(self, weight: mx.array, token_counts: Counter, size: int):
        self.token_ids = sorted(t for t, _ in token_counts.most_common(size))
        self.vocab = set(self.token_ids)
        self.weight = weight[mx.array(self.token_ids)]
        lookup = np.full(weight.shape[0], -1, dtype=np.int32)
        lookup[self.token_ids] = np.arange(len(self.token_ids))
        self.lookup = mx.array(lookup)


def block_hidden(draft: DFlashDraftModel, batch: PackedBatch) -> mx.array:
    """Final-normed hidden states (M, hidden) of the labelled block positions."""
    context = PackedContext(batch, draft.context(batch.features))
    return draft.run_layers(batch.block_tokens, [context] * len(draft.layers))[0][batch.label_index]


def block_logits(draft: DFlashDraftModel, batch: PackedBatch, head: RestrictedHead) -> mx.array:
    return block_hidden(draft, batch) @ head.weight.T


def selector_loss(draft: DFlashDraftModel, batch: PackedBatch, head: RestrictedHead, hidden: mx.array,
                  logits: mx.array) -> mx.array:
    """Per labelled position: cross-entropy of the selector's scores over the top-k
    candidates against the label, after the teacher-forced predecessor; zero where
    the label is not among the candidates (the token loss must first bring it there)."""
    selector = draft.candidate_selector
    candidates, unary = selector.candidates(logits, mx.array(head.token_ids))
    scores = selector.score(batch.predecessors, hidden, unary, candidates).astype(mx.float32)
    hit = candidates == batch.labels[:, None]
    per_position = nn.losses.cross_entropy(scores, hit.argmax(axis=-1), reduction="none")
    return per_position * hit.any(axis=-1)


def loss_fn(draft: DFlashDraftModel, batch: PackedBatch, head: RestrictedHead, distill: float = 0.0):
    hidden = block_hidden(draft, batch)
    logits = (hidden @ head.weight.T).astype(mx.float32)
    targets = head.lookup[batch.labels]
    per_position = nn.losses.cross_entropy(logits, targets, reduction="none")
    if distill > 0:
        teacher = mx.softmax(batch.teacher, axis=-1)
        kl = (teacher * (mx.log(teacher + 1e-30) - nn.log_softmax(logits, axis=-1))).sum(axis=-1)
        per_position = (1 - distill) * per_position + distill * kl
    if draft.args.dflash2:
        per_position = per_position + selector_loss(draft, batch, head, hidden, logits)
    loss = (per_position * batch.weights).sum() / batch.weights.sum()
    correct = (logits.argmax(axis=-1) == targets)
    return loss, correct


# ---------------------------------------------------------------- evaluation


def split_held_out(examples: list[Example], n: int) -> tuple[list[Example], list[Example]]:
    """(held out, training): the last `n` examples of a data dir are never trained on."""
    return examples[-n:], examples[:-n]


def committed_lengths(target: Target, draft: DFlashDraftModel, prompts: list[list[int]], max_tokens: int,
                      block_size: Optional[int] = None) -> list[int]:
    """Tokens committed per cycle in the real greedy decode loop, over all prompts."""
    lengths = []
    for prompt in prompts:
        stats = DecodeStats()
        for _ in decode(DFlashModel(target, draft), mx.array(prompt), SamplingParams(), max_tokens, block_size, stats):
            pass
        lengths += stats.accepted_lengths
    return lengths


def evaluate_tau(target: Target, draft: DFlashDraftModel, prompts: list[list[int]], max_tokens: int,
                 block_size: Optional[int] = None) -> float:
    """Mean tokens committed per cycle (tau) in the real greedy decode loop."""
    lengths = committed_lengths(target, draft, prompts, max_tokens, block_size)
    return sum(lengths) / max(len(lengths), 1)


def position_acceptance(lengths: list[int], width: int) -> list[float]:
    """Acceptance rate of block position k given positions 1..k-1 were accepted, k = 1..width-1
    (a cycle that committed n tokens accepted n - 1 drafts)."""
    rates = []
    for k in range(1, width):
        reached = sum(n - 1 >= k - 1 for n in lengths)
        rates.append(sum(n - 1 >= k for n in lengths) / reached if reached else 0.0)
    return rates


# ---------------------------------------------------------------- the loop


@dataclass
class TrainState:
    step: int = 0
    epoch: float = 0
    tokens_seen: int = 0  # target tokens passed over (features + labels)
    history: list = field(default_factory=list)  # one dict per logged step


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


def grow(draft: DFlashDraftModel, num_layers: int) -> DFlashDraftModel:
    """The same drafter with extra layers appended whose residual branches start
    at zero (o_proj, down_proj), so it computes exactly what it did before."""
    if num_layers <= len(draft.layers):
        return draft
    args = DraftArgs(**{**asdict(draft.args), "num_hidden_layers": num_layers,
                        "layer_types": list(draft.args.layer_types) + ["full_attention"] * (num_layers - len(draft.layers))})
    bigger = DFlashDraftModel(args)
    bigger.update({k: v for k, v in draft.parameters().items() if k != "layers"})
    old = len(draft.layers)
    for i, layer in enumerate(bigger.layers):
        if i < old:
            layer.update(draft.layers[i].parameters())
        else:
            layer.self_attn.o_proj.weight = mx.zeros_like(layer.self_attn.o_proj.weight)
            layer.mlp.down_proj.weight = mx.zeros_like(layer.mlp.down_proj.weight)
    mx.eval(bigger.parameters())
    if draft.vocab_ids is not None:
        bigger.restrict_vocab(draft.vocab_ids.tolist())
    return bigger.bind(draft._target)


def checkpoint_config(out_dir) -> Optional[dict]:
    """The training config a run in `out_dir` would resume with (None: no checkpoint)."""
    state = Path(out_dir) / "checkpoint" / "state.json"
    return json.loads(state.read_text())["config"] if state.is_file() else None


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
        cfg = TrainConfig(**{**{k: v for k, v in saved["config"].items() if k in known},
                             "epochs": cfg.epochs, "steps": cfg.steps})
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
    log(f"{len(train_set)} training sequences ({sum(len(e.response_ids) for e in train_set)} response tokens), "
        f"{len(text)} text windows; {chat_per_step} + {text_per_step} per step, {total_steps} steps; "
        f"restricted head {len(head.token_ids)} tokens, target layers {layer_ids}")

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
        blocks = [sample_blocks(s, label_counts(s.tokens, g, cfg.block_size), cfg.block_positions, rng)
                  for s, g in zip(seqs, greedy)]
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
                "step": state.step, "epoch": round(state.epoch, 3), "tokens_seen": state.tokens_seen,
                "loss": round(loss.item(), 4), "acc": round(float(correct.mean()), 4),
                "acc_pos1": round(float(first.mean()), 4) if first.size else None,
                "lr": float(optimizer.learning_rate), "grad_norm": round(grad_norm.item(), 3),
                "predictions": len(correct), "predictions_per_s": round(len(correct) / seconds, 1),
                "target_s": round(features_done - tic, 2), "step_s": round(seconds, 2),
            }
            state.history.append(record)
            bar.update(task, advance=1, info=f"loss {record['loss']:.3f} acc {record['acc']:.3f} "
                                             f"acc@1 {record['acc_pos1'] or 0:.3f} {record['predictions_per_s']:.0f} pred/s")
            if state.step % 25 == 0:
                log(" ".join(f"{k} {v}" for k, v in record.items()))
            if cfg.eval_every and state.step % cfg.eval_every == 0:
                record["tau"] = _eval(target, draft, held_out, cfg)
                log(f"step {state.step}: held-out tau {record['tau']:.2f}")
            if state.step % cfg.checkpoint_every == 0 or state.step == total_steps:
                save_checkpoint(checkpoint, draft, optimizer, cfg, state)
    tau = _eval(target, draft, held_out, cfg)
    state.history.append({"step": state.step, "tokens_seen": state.tokens_seen, "tau": tau})
    log(f"held-out tau {tau:.2f} (block {cfg.block_size}, {len(held_out)} prompts, greedy)")
    save_checkpoint(checkpoint, draft, optimizer, cfg, state)
    export(draft, out_dir)
    try:
        from .plots import training_curve

        training_curve(out_dir / "train_log.jsonl", out_dir / "train_curve.png")
    except ImportError as e:
        log(f"no training plot: {e}")
    return draft


def _eval(target, draft, held_out: list[Example], cfg: TrainConfig) -> float:
    draft.eval()
    tau = evaluate_tau(target, draft, [e.prompt_ids for e in held_out], cfg.eval_max_tokens)
    draft.train()
    return tau


def save_checkpoint(path: Path, draft, optimizer, cfg: TrainConfig, state: TrainState) -> None:
    path.mkdir(parents=True, exist_ok=True)
    save_draft(draft, path / "drafter")
    mx.save_safetensors(str(path / "optimizer.safetensors"), dict(tree_flatten(optimizer.state)))
    (path / "state.json").write_text(json.dumps({"config": asdict(cfg), "state": asdict(state)}))
    (path.parent / "train_log.jsonl").write_text("".join(json.dumps(r) + "\n" for r in state.history))


def export(draft: DFlashDraftModel, out_dir: Path, dtype: mx.Dtype = mx.bfloat16) -> Path:
    """The release: a z-lab format drafter in bf16, as z-lab ships them."""
    release = DFlashDraftModel(draft.args)
    release.update(tree_map(lambda p: p.astype(dtype), draft.parameters()))
    if draft.vocab_ids is not None:
        release.restrict_vocab(draft.vocab_ids.tolist())
    return save_draft(release, out_dir)
