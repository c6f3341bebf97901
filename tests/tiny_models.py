"""Tiny random-weight targets and drafters for tests (fp32, built in memory)."""

import mlx.core as mx
from mlx.utils import tree_map

from dflash_mlx.draft import DFlashDraftModel, DraftArgs
from dflash_mlx.target import Target

VOCAB = 97
HIDDEN = 32


def _common(model_type: str) -> dict:
    return dict(
        model_type=model_type,
        hidden_size=HIDDEN,
        num_hidden_layers=4,
        intermediate_size=64,
        num_attention_heads=4,
        num_key_value_heads=2,
        rms_norm_eps=1e-5,
        vocab_size=VOCAB,
        head_dim=8,
        rope_theta=10000.0,
        tie_word_embeddings=True,
        max_position_embeddings=4096,
    )


def tiny_target(model_type: str, seed: int = 0, **overrides) -> Target:
    """A random `model_type` target with peaky logits (so greedy ties are rare)."""
    mx.random.seed(seed)
    config = _common(model_type)
    if model_type == "llama":
        from mlx_lm.models import llama as module
    elif model_type == "qwen3":
        from mlx_lm.models import qwen3 as module
    elif model_type == "qwen3_moe":
        from mlx_lm.models import qwen3_moe as module

        config.update(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                      decoder_sparse_step=1, mlp_only_layers=[], norm_topk_prob=True)
    elif model_type == "qwen2":
        from mlx_lm.models import qwen2 as module
    elif model_type in ("qwen3_5", "qwen3_5_moe"):
        from mlx_lm.models import qwen3_5, qwen3_5_moe

        module = qwen3_5 if model_type == "qwen3_5" else qwen3_5_moe
        if model_type == "qwen3_5_moe":
            config.update(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                          shared_expert_intermediate_size=32)
        config.update(linear_num_value_heads=4, linear_num_key_heads=2, linear_key_head_dim=16,
                      linear_value_head_dim=8, linear_conv_kernel_dim=4, full_attention_interval=2,
                      rope_parameters={"type": "default", "rope_theta": 10000.0,
                                       "partial_rotary_factor": 0.5})
    else:
        raise ValueError(model_type)
    config.update(overrides)
    model = module.Model(module.ModelArgs.from_dict(config))
    # Larger weights than the default init make the random model's predictions
    # confident and varied, like a trained model's.
    model.update(tree_map(lambda p: p * 3.0 if p.ndim >= 2 else p, model.parameters()))
    mx.eval(model.parameters())
    return Target(model)


def draft_args(target: Target, layer_ids=(0, 2), block_size=8, **overrides) -> DraftArgs:
    return DraftArgs(**{
        **dict(
            hidden_size=target.hidden_size, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=8, intermediate_size=64, vocab_size=target.vocab_size,
            target_layer_ids=list(layer_ids), mask_token_id=target.vocab_size - 1,
            block_size=block_size, num_target_layers=target.num_layers, rms_norm_eps=1e-5,
            rope_theta=10000.0,
        ),
        **overrides,
    })


def random_draft(target: Target, seed: int = 1, **kwargs) -> DFlashDraftModel:
    mx.random.seed(seed)
    model = DFlashDraftModel(draft_args(target, **kwargs))
    mx.eval(model.parameters())
    return model.bind(target)


class OracleDraft(DFlashDraftModel):
    """Proposes the reference continuation (the target's own greedy tokens),
    except at positions listed in `wrong`, so tests choose which drafts fail."""

    def __init__(self, args: DraftArgs, reference: list[int], wrong: set[int] = frozenset()):
        super().__init__(args)
        self.reference = reference
        self.wrong = set(wrong)

    def __call__(self, block, cache):
        start = cache[0].offset  # position of block[0]
        L = block.shape[1]
        tokens = []
        for pos in range(start + 1, start + L):
            t = self.reference[pos] if pos < len(self.reference) else 0
            tokens.append((t + 1) % self.args.vocab_size if pos in self.wrong else t)
        # the real pass still runs, so the drafter's cache path is exercised
        mx.eval(super().__call__(block, cache))
        one_hot = mx.arange(self.args.vocab_size)[None] == mx.array(tokens)[:, None]
        return (one_hot * 10.0)[None]


def oracle_draft(target: Target, reference: list[int], wrong=frozenset(), **kwargs) -> OracleDraft:
    model = OracleDraft(draft_args(target, **kwargs), reference, wrong)
    mx.eval(model.parameters())
    return model.bind(target)
