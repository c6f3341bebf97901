"""The drafter being trained: a new one (layers initialised from the target's), one grown
from an existing drafter, or a DFlash 1 drafter turned into DFlash 2."""

from dataclasses import asdict

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten

from ..drafters import DFlashDraftModel, DraftArgs
from ..target.wrapper import Target
from .config import TrainConfig, stratified_layer_ids


def choose_mask_token(tokenizer) -> int:
    """The tokenizer's mask token, else its last special token the chat never uses."""
    hf = getattr(tokenizer, "_tokenizer", tokenizer)
    if getattr(hf, "mask_token_id", None) is not None:
        return hf.mask_token_id
    used = set(tokenizer.eos_token_ids) | {getattr(hf, "bos_token_id", None), getattr(hf, "pad_token_id", None)}
    chat = (
        hf.apply_chat_template(
            [{"role": "user", "content": "x"}, {"role": "assistant", "content": "y"}], tokenize=False
        )
        if getattr(hf, "chat_template", None)
        else ""
    )
    specials = [i for t, i in zip(hf.all_special_tokens, hf.all_special_ids) if i not in used and t not in chat]
    added = [
        i
        for i, t in getattr(hf, "added_tokens_decoder", {}).items()
        if getattr(t, "special", False) and i not in used and str(t) not in chat
    ]
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
        head_dim=getattr(attn, "head_dim", target.hidden_size // n_heads),
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
        for layer, source in zip(draft.layers, target.layers[-cfg.num_layers :]):
            # names as mlx-lm's (the target wrapper's fused modules hold them as `.inner`); a norm
            # only when it computes what the drafter's does (Gemma's scales by 1 + w)
            plain_norms = {_unwrapped(n) for n, m in source.named_modules() if isinstance(m, nn.RMSNorm)}
            weights = {
                k: v
                for k, v in ((_unwrapped(k), v) for k, v in tree_flatten(source.parameters()))
                if k.split(".")[-2] in ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
                or (k.endswith("layernorm.weight") and k[: -len(".weight")] in plain_norms)
            }
            layer.load_weights(list(weights.items()), strict=False)
    mx.eval(draft.parameters())
    return draft.bind(target)


def _unwrapped(name: str) -> str:
    return name.replace(".inner", "")


def to_dflash2(draft: DFlashDraftModel, cfg: TrainConfig) -> DFlashDraftModel:
    """The same drafter as a DFlash 2 one whose convolutions pass through and whose
    selector picks the best logit: it drafts exactly what it did, and trains on."""
    args = DraftArgs(
        **{
            **asdict(draft.args),
            "architecture": "DFlash2DraftModel",
            "conv_kernel_size": cfg.conv_kernel_size,
            "conv_group_size": cfg.conv_group_size,
            "selector_rank": cfg.selector_rank,
            "selector_top_k": cfg.selector_top_k,
        }
    )
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


def grow(draft: DFlashDraftModel, num_layers: int) -> DFlashDraftModel:
    """The same drafter with extra layers appended whose residual branches start
    at zero (o_proj, down_proj), so it computes exactly what it did before."""
    if num_layers <= len(draft.layers):
        return draft
    args = DraftArgs(
        **{
            **asdict(draft.args),
            "num_hidden_layers": num_layers,
            "layer_types": list(draft.args.layer_types) + ["full_attention"] * (num_layers - len(draft.layers)),
        }
    )
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
