"""Train a DFlash drafter against a frozen target (the paper's recipe, on MLX).

Per sequence (prompt + the target's own response):
    features  target outputs at `target_layer_ids`, computed once and cached
    anchors   random response positions, resampled every epoch; each starts a
              block [token at anchor, MASK x (B-1)] at positions anchor..anchor+B-1
    attention bidirectional inside a block; a block sees the context features
              of its own sequence before its anchor, never another block
    loss      cross-entropy at the masked positions only, weight exp(-(k-1)/gamma)
              at block position k, over the target's frozen output embeddings
              restricted to the token ids that occur in the data

All blocks of several sequences are packed into one forward pass with one sparse
mask.  The drafter's embedding and lm_head are the target's: frozen, not saved.
"""

import hashlib
import json
import math
import random
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Optional

import mlx.core as mx
import mlx.nn as nn
import mlx.optimizers as optim
import numpy as np
from mlx.utils import tree_flatten, tree_map

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
    num_target_layers: int = 5  # how many target layers feed the drafter
    target_layer_ids: Optional[list[int]] = None  # default: stratified_layer_ids
    mask_token_id: Optional[int] = None  # default: choose_mask_token
    gamma: float = 4.0  # loss weight decay along the block
    init_from_target: bool = True  # copy the deepest target layers into the drafter layers
    init_from: Optional[str] = None  # or start from an existing drafter dir (warm start; its shape wins)
    epochs: int = 10
    sequences_per_step: int = 8
    anchors_per_block_span: float = 1.0  # blocks per sequence = ratio * response_len / block_size
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
        if self.num_layers < 1 or self.num_target_layers < 1:
            raise ValueError("the drafter needs at least one layer and one target layer")


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
    owner = getattr(target.model, "language_model", target.model)
    head = owner.lm_head if "lm_head" in owner else target.embed_tokens
    if isinstance(head, (nn.QuantizedLinear, nn.QuantizedEmbedding)):
        raise ValueError("train against a float (fp32/bf16) target, not a quantized one")
    return head.weight


def new_drafter(target: Target, cfg: TrainConfig, mask_token_id: int) -> DFlashDraftModel:
    inner = target._inner
    attn = inner.layers[0].self_attn
    n_heads, n_kv = attn.n_heads, attn.n_kv_heads
    args = DraftArgs(
        hidden_size=target.hidden_size,
        num_hidden_layers=cfg.num_layers,
        num_attention_heads=n_heads,
        num_key_value_heads=n_kv,
        head_dim=target.hidden_size // n_heads,
        intermediate_size=inner.layers[0].mlp.gate_proj.weight.shape[0],
        vocab_size=target.vocab_size,
        target_layer_ids=cfg.target_layer_ids or stratified_layer_ids(target.num_layers, cfg.num_target_layers),
        mask_token_id=mask_token_id,
        block_size=cfg.block_size,
        num_target_layers=target.num_layers,
        rms_norm_eps=inner.norm.eps,
        rope_theta=getattr(attn.rope, "base", 10000.0),
        max_position_embeddings=getattr(getattr(target.model, "args", None), "max_position_embeddings", 8192),
    )
    draft = DFlashDraftModel(args)
    if cfg.init_from_target:
        # deepest target layers: they already map hidden states towards the output space
        for layer, source in zip(draft.layers, inner.layers[-cfg.num_layers:]):
            weights = {k: v for k, v in tree_flatten(source.parameters())
                       if k.split(".")[-2] in ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
                       or k.endswith("layernorm.weight")}
            layer.load_weights(list(weights.items()), strict=False)
    mx.eval(draft.parameters())
    return draft.bind(target)


# ---------------------------------------------------------------- features


def compute_features(target: Target, examples: list[Example], layer_ids: list[int], cache_file: Optional[Path],
                     show_progress: bool = True) -> list[mx.array]:
    """Target features (T, n_layers * hidden) per example, fp32; cached in `cache_file`."""
    if cache_file is not None and cache_file.is_file():
        stored = mx.load(str(cache_file))
        if len(stored) == len(examples):
            return [stored[str(i)] for i in range(len(examples))]
    out = []
    total = sum(len(e.tokens) for e in examples)
    with progress(show_progress) as bar:
        task = add_task(bar, "target features (tokens)", total=total, info=f"layers {layer_ids}")
        for e in examples:
            _, features = target(mx.array(e.tokens)[None], target.make_cache(), layer_ids, logits_for_last_only=True)
            features = features[0].astype(mx.float32)
            mx.eval(features)
            out.append(features)
            bar.advance(task, len(e.tokens))
    if cache_file is not None:
        cache_file.parent.mkdir(parents=True, exist_ok=True)
        mx.save_safetensors(str(cache_file), {str(i): f for i, f in enumerate(out)})
    return out


# ---------------------------------------------------------------- packed batches


@dataclass
class PackedBatch:
    """Blocks of several sequences, packed for one drafter pass.

    context positions 0..N-1 (features of all sequences, back to back), then the
    Q = n_blocks * B block positions; `visible[q, k]` says which keys query q sees."""

    features: mx.array  # (1, N, n_layers * hidden)
    context_positions: mx.array  # (N,) position of each context entry in its sequence
    block_tokens: mx.array  # (1, Q)
    block_positions: mx.array  # (Q,)
    visible: mx.array  # (Q, N + Q) bool
    label_index: mx.array  # (M,) which of the Q positions are predicted
    labels: mx.array  # (M,) target token ids
    weights: mx.array  # (M,) loss weights
    block_offsets: np.ndarray = field(repr=False, default=None)  # (M,) k-1, for per-position metrics


class PackedContext:
    """The attention-context protocol of DraftAttention, for packed training blocks."""

    def __init__(self, batch: PackedBatch, context: mx.array):
        self.position = batch.block_positions
        self._context = context
        self._context_positions = batch.context_positions
        self._visible = batch.visible

    def attend(self, attn, queries, keys, values):
        ctx_keys, ctx_values = attn.keys_values(self._context, self._context_positions)
        keys = mx.concatenate([ctx_keys, keys], axis=2)
        values = mx.concatenate([ctx_values, values], axis=2)
        return mx.fast.scaled_dot_product_attention(queries, keys, values, scale=attn.scale, mask=self._visible)


def sample_anchors(example: Example, cfg: TrainConfig, rng: random.Random) -> list[int]:
    """Random anchor positions inside the response, each with at least one token to predict."""
    first, last = len(example.prompt_ids), len(example.tokens) - 2
    if last < first:
        return []
    n = max(1, round(cfg.anchors_per_block_span * len(example.response_ids) / cfg.block_size))
    return sorted(rng.sample(range(first, last + 1), min(n, last - first + 1)))


def pack(examples: list[Example], features: list[mx.array], anchors: list[list[int]], block_size: int,
         mask_token_id: int, gamma: float) -> PackedBatch:
    context_lengths = [max(a) if a else 0 for a in anchors]  # nothing at/after the last anchor is needed
    N = sum(context_lengths)
    Q = sum(len(a) for a in anchors) * block_size
    visible = np.zeros((Q, N + Q), dtype=bool)
    context_positions, block_tokens, block_positions = [], [], []
    label_index, labels, weights, offsets = [], [], [], []
    c0 = q0 = 0
    for example, seq_anchors, length in zip(examples, anchors, context_lengths):
        tokens = example.tokens
        context_positions.extend(range(length))
        for a in seq_anchors:
            rows = slice(q0, q0 + block_size)
            visible[rows, c0 : c0 + a] = True  # own sequence, strictly before the anchor
            visible[rows, N + q0 : N + q0 + block_size] = True  # own block, both directions
            block_tokens += [tokens[a]] + [mask_token_id] * (block_size - 1)
            block_positions.extend(range(a, a + block_size))
            for k in range(1, block_size):
                if a + k < len(tokens):
                    label_index.append(q0 + k)
                    labels.append(tokens[a + k])
                    weights.append(math.exp(-(k - 1) / gamma))
                    offsets.append(k - 1)
            q0 += block_size
        c0 += length
    feats = mx.concatenate([f[:n] for f, n in zip(features, context_lengths)], axis=0)[None]
    return PackedBatch(
        features=feats,
        context_positions=mx.array(context_positions, dtype=mx.int32),
        block_tokens=mx.array(block_tokens, dtype=mx.int32)[None],
        block_positions=mx.array(block_positions, dtype=mx.int32),
        visible=mx.array(visible),
        label_index=mx.array(label_index, dtype=mx.int32),
        labels=mx.array(labels, dtype=mx.int32),
        weights=mx.array(weights, dtype=mx.float32),
        block_offsets=np.array(offsets),
    )


# ---------------------------------------------------------------- loss


class RestrictedHead:
    """Frozen output embeddings of the token ids that occur in the data."""

    def __init__(self, weight: mx.array, token_ids: list[int]):
        self.token_ids = sorted(set(token_ids))
        self.weight = weight[mx.array(self.token_ids)]
        lookup = np.full(weight.shape[0], -1, dtype=np.int32)
        lookup[self.token_ids] = np.arange(len(self.token_ids))
        self.lookup = mx.array(lookup)


def block_logits(draft: DFlashDraftModel, batch: PackedBatch, head: RestrictedHead) -> mx.array:
    context = PackedContext(batch, draft.context(batch.features))
    h = draft.run_layers(batch.block_tokens, [context] * len(draft.layers))[0]
    return h[batch.label_index] @ head.weight.T


def loss_fn(draft: DFlashDraftModel, batch: PackedBatch, head: RestrictedHead):
    logits = block_logits(draft, batch, head).astype(mx.float32)
    targets = head.lookup[batch.labels]
    ce = nn.losses.cross_entropy(logits, targets, reduction="none")
    loss = (ce * batch.weights).sum() / batch.weights.sum()
    correct = (logits.argmax(axis=-1) == targets)
    return loss, correct


# ---------------------------------------------------------------- evaluation


def split_held_out(examples: list[Example], n: int) -> tuple[list[Example], list[Example]]:
    """(held out, training): the last `n` examples of a data dir are never trained on."""
    return examples[-n:], examples[:-n]


def evaluate_tau(target: Target, draft: DFlashDraftModel, prompts: list[list[int]], max_tokens: int,
                 block_size: Optional[int] = None) -> float:
    """Mean accepted tokens per cycle in the real greedy decode loop."""
    lengths = []
    for prompt in prompts:
        stats = DecodeStats()
        for _ in decode(DFlashModel(target, draft), mx.array(prompt), SamplingParams(), max_tokens, block_size, stats):
            pass
        lengths += stats.accepted_lengths
    return sum(lengths) / max(len(lengths), 1)


# ---------------------------------------------------------------- the loop


@dataclass
class TrainState:
    step: int = 0
    epoch: int = 0
    history: list = field(default_factory=list)  # one dict per logged step


def _schedule(cfg: TrainConfig, total_steps: int):
    warmup = optim.linear_schedule(cfg.lr * 0.01, cfg.lr, max(cfg.warmup_steps, 1))
    decay = optim.cosine_decay(cfg.lr, max(total_steps - cfg.warmup_steps, 1), cfg.lr * cfg.min_lr_ratio)
    return optim.join_schedules([warmup, decay], [max(cfg.warmup_steps, 1)])


def _data_key(examples: list[Example], layer_ids: list[int]) -> str:
    digest = hashlib.sha1(json.dumps([e.tokens for e in examples]).encode())
    digest.update(json.dumps(layer_ids).encode())
    return digest.hexdigest()[:16]


def fit(
    target: Target,
    tokenizer,
    examples: list[Example],
    out_dir,
    cfg: TrainConfig,
    resume: bool = True,
    feature_cache_dir: Optional[Path] = None,
    show_progress: bool = True,
    log=print,
) -> DFlashDraftModel:
    """Train (or resume) a drafter into `out_dir`; returns the trained drafter."""
    out_dir = Path(out_dir)
    checkpoint = out_dir / "checkpoint"
    if len(examples) <= cfg.eval_prompts:
        raise ValueError(f"need more than {cfg.eval_prompts} examples (the held-out set), got {len(examples)}")
    if cfg.mask_token_id is None:
        cfg.mask_token_id = choose_mask_token(tokenizer)

    if resume and (checkpoint / "state.json").is_file():
        saved = json.loads((checkpoint / "state.json").read_text())
        # the architecture and recipe are the checkpoint's; only the length can change
        cfg = TrainConfig(**{**saved["config"], "epochs": cfg.epochs})
        draft = load_draft(checkpoint / "drafter", dtype=mx.float32).bind(target)
        state = TrainState(**saved["state"])
        log(f"resuming at step {state.step} (epoch {state.epoch})")
    elif cfg.init_from:
        draft = load_draft(cfg.init_from, dtype=mx.float32).bind(target)
        cfg.block_size, cfg.num_layers = draft.block_size, len(draft.layers)
        cfg.target_layer_ids, cfg.mask_token_id = draft.target_layer_ids, draft.mask_token_id
        state = TrainState()
        log(f"starting from the drafter in {cfg.init_from}")
    else:
        draft = new_drafter(target, cfg, cfg.mask_token_id)
        state = TrainState()
    draft.train()

    held_out, train_set = split_held_out(examples, cfg.eval_prompts)
    layer_ids = draft.target_layer_ids
    cache_file = feature_cache_dir / f"features-{_data_key(train_set, layer_ids)}.safetensors" if feature_cache_dir else None
    features = compute_features(target, train_set, layer_ids, cache_file, show_progress)
    head = RestrictedHead(output_embeddings(target), [t for e in train_set for t in e.response_ids])
    log(f"{len(train_set)} training sequences, {sum(len(e.response_ids) for e in train_set)} response tokens, "
        f"restricted head {len(head.token_ids)} tokens, target layers {layer_ids}")

    steps_per_epoch = math.ceil(len(train_set) / cfg.sequences_per_step)
    total_steps = steps_per_epoch * cfg.epochs
    optimizer = optim.AdamW(learning_rate=_schedule(cfg, total_steps), weight_decay=cfg.weight_decay)
    optimizer.init(draft.trainable_parameters())
    if resume and (checkpoint / "optimizer.safetensors").is_file() and state.step:
        from mlx.utils import tree_unflatten

        optimizer.state = tree_unflatten(list(mx.load(str(checkpoint / "optimizer.safetensors")).items()))
    value_and_grad = nn.value_and_grad(draft, lambda m, b: loss_fn(m, b, head))

    def train_step(batch):
        (loss, correct), grads = value_and_grad(draft, batch)
        grads, grad_norm = optim.clip_grad_norm(grads, cfg.grad_clip)
        optimizer.update(draft, grads)
        return loss, correct, grad_norm

    with progress(show_progress) as bar:
        task = add_task(bar, "train (steps)", total=total_steps, info="")
        bar.update(task, completed=state.step)
        while state.step < total_steps:
            epoch = state.step // steps_per_epoch
            rng = random.Random(cfg.seed * 100003 + epoch)  # anchors and order resampled every epoch
            order = list(range(len(train_set)))
            rng.shuffle(order)
            for i in range(state.step % steps_per_epoch, steps_per_epoch):
                ids = order[i * cfg.sequences_per_step : (i + 1) * cfg.sequences_per_step]
                tic = time.perf_counter()
                group = [train_set[j] for j in ids]
                anchors = [sample_anchors(e, cfg, rng) for e in group]
                batch = pack(group, [features[j] for j in ids], anchors, cfg.block_size, cfg.mask_token_id, cfg.gamma)
                loss, correct, grad_norm = train_step(batch)
                mx.eval(loss, correct, draft.parameters(), optimizer.state)
                seconds = time.perf_counter() - tic
                correct = np.array(correct)
                first = correct[batch.block_offsets == 0]
                state.step += 1
                state.epoch = state.step / steps_per_epoch
                record = {
                    "step": state.step, "epoch": round(state.epoch, 3), "loss": round(loss.item(), 4),
                    "acc": round(float(correct.mean()), 4), "acc_pos1": round(float(first.mean()), 4) if first.size else None,
                    "lr": float(optimizer.learning_rate), "grad_norm": round(grad_norm.item(), 3),
                    "predictions_per_s": round(len(correct) / seconds, 1),
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
                if state.step >= total_steps:
                    break
    tau = _eval(target, draft, held_out, cfg)
    state.history.append({"step": state.step, "tau": tau})
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
    return save_draft(release, out_dir)
