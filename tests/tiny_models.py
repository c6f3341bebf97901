"""Tiny random-weight targets and drafters for tests (fp32, built in memory)."""

import mlx.core as mx
import pytest
from mlx.utils import tree_map

from dflash_mlx.decode.costs import CostModel
from dflash_mlx.drafters import DFlashDraftModel, DraftArgs
from dflash_mlx.drafters.dflash import ContextRows
from dflash_mlx.target.wrapper import Target

VOCAB = 97
HIDDEN = 32

# The families the fast subset (`-m "not slow"`) decodes, one per kind of cache state: full
# attention (llama), GatedDeltaNet beside attention (qwen3_5), sliding windows beside full
# attention (gpt_oss). The full suite runs every family.
FAST_FAMILIES = ("llama", "qwen3_5", "gpt_oss")


def by_family(cases: list, fast=lambda *case: True) -> list:
    """pytest params for `cases` (family names, or tuples that start with one), marked slow where
    the family is outside FAST_FAMILIES or `fast(*case)` says the case repeats, on that family,
    what another fast case shows."""
    params = []
    for case in cases:
        values = case if isinstance(case, tuple) else (case,)
        marks = () if values[0] in FAST_FAMILIES and fast(*values) else pytest.mark.slow
        params.append(pytest.param(*values, marks=marks))
    return params


def same_up_to_rounding(ours: mx.array, theirs: mx.array) -> bool:
    """Equal within float32 rounding (weights stored for another BLAS kernel, the compiled
    softmax: fused_ops.py) and choosing the same greedy tokens."""
    return (
        ours.shape == theirs.shape
        and mx.allclose(ours, theirs, rtol=1e-4, atol=1e-4).item()
        and (ours.ndim < 3 or mx.array_equal(ours.argmax(-1), theirs.argmax(-1)).item())
    )


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


GATED_DELTA = dict(
    linear_num_value_heads=4,
    linear_num_key_heads=2,
    linear_key_head_dim=16,
    linear_value_head_dim=8,
    linear_conv_kernel_dim=4,
    full_attention_interval=2,
)
MOE = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32)
DEEPSEEK = dict(
    kv_lora_rank=16,
    q_lora_rank=16,
    qk_rope_head_dim=4,
    qk_nope_head_dim=8,
    v_head_dim=8,
    n_routed_experts=4,
    n_shared_experts=1,
    num_experts_per_tok=2,
    moe_intermediate_size=32,
    first_k_dense_replace=1,
    n_group=1,
    topk_group=1,
)


def _config(model_type: str) -> tuple[str, dict]:
    """(mlx-lm module name, config) of a tiny `model_type` model."""
    config = _common(model_type)
    if model_type == "qwen3_moe":
        config.update(MOE, decoder_sparse_step=1, mlp_only_layers=[], norm_topk_prob=True)
    elif model_type in ("qwen3_5", "qwen3_5_moe"):
        if model_type == "qwen3_5_moe":
            config.update(MOE, shared_expert_intermediate_size=32)
        config.update(
            GATED_DELTA, rope_parameters={"type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5}
        )
    elif model_type == "qwen3_next":
        config.update(
            {**MOE, **GATED_DELTA},
            decoder_sparse_step=1,
            mlp_only_layers=[],
            norm_topk_prob=True,
            shared_expert_intermediate_size=32,
            partial_rotary_factor=0.5,
        )
    elif model_type == "gpt_oss":  # attention sinks, alternating sliding layers, MoE
        config.update(num_local_experts=4, num_experts_per_tok=2, sliding_window=8)
    elif model_type in ("gemma4_text", "gemma4"):
        # sliding + full layers, a shared-KV layer, per-layer inputs, soft-capped logits
        config.update(
            global_head_dim=16,
            num_kv_shared_layers=1,
            hidden_size_per_layer_input=8,
            vocab_size_per_layer_input=VOCAB,
            sliding_window=8,
            sliding_window_pattern=2,
        )
        if model_type == "gemma4":  # the multimodal wrapper around gemma4_text
            config = dict(model_type="gemma4", vocab_size=VOCAB, text_config={**config, "model_type": "gemma4_text"})
    elif model_type == "gemma3_text":  # sliding + global layers (rotating caches), sandwich norms
        config.update(sliding_window=8, sliding_window_pattern=2, query_pre_attn_scalar=8, rope_local_base_freq=10000.0)
    elif model_type in ("deepseek_v3", "kimi_k25"):  # MLA attention, routed + shared experts
        config.update(DEEPSEEK)
        if model_type == "kimi_k25":
            config = dict(model_type="kimi_k25", text_config={**config, "model_type": "deepseek_v3"})
    elif model_type not in ("llama", "qwen2", "qwen3"):
        raise ValueError(model_type)
    return model_type, config


def tiny_model(model_type: str, seed: int = 0, **overrides):
    """A random mlx-lm `model_type` model with peaky logits (so greedy ties are rare)."""
    import importlib

    mx.random.seed(seed)
    name, config = _config(model_type)
    module = importlib.import_module(f"mlx_lm.models.{name}")
    config.update(overrides)
    model = module.Model(module.ModelArgs.from_dict(config))
    # Larger weights than the default init make the random model's predictions
    # confident and varied, like a trained model's.
    model.update(tree_map(lambda p: p * 3.0 if p.ndim >= 2 else p, model.parameters()))
    mx.eval(model.parameters())
    return model


def tiny_target(model_type: str, seed: int = 0, **overrides) -> Target:
    return Target(tiny_model(model_type, seed, **overrides))


def draft_args(target: Target, layer_ids=(0, 2), block_size=8, **overrides) -> DraftArgs:
    return DraftArgs(
        **{
            **dict(
                hidden_size=target.hidden_size,
                num_hidden_layers=2,
                num_attention_heads=4,
                num_key_value_heads=2,
                head_dim=8,
                intermediate_size=64,
                vocab_size=target.vocab_size,
                target_layer_ids=list(layer_ids),
                mask_token_id=target.vocab_size - 1,
                block_size=block_size,
                num_target_layers=target.num_layers,
                rms_norm_eps=1e-5,
                rope_theta=10000.0,
            ),
            **overrides,
        }
    )


def random_draft(target: Target, seed: int = 1, **kwargs) -> DFlashDraftModel:
    mx.random.seed(seed)
    model = DFlashDraftModel(draft_args(target, **kwargs))
    mx.eval(model.parameters())
    return model.bind(target)


DFLASH2 = dict(
    architecture="DFlash2DraftModel", conv_kernel_size=3, conv_group_size=8, selector_rank=8, selector_top_k=4
)


def random_dflash2(target: Target, seed: int = 1, **kwargs) -> DFlashDraftModel:
    """A random DFlash 2 drafter whose convolutions and selector both matter: random base
    kernels (zeros at init) and codebooks large enough that the edge term can overrule
    the logits' order among the candidates."""
    draft = random_draft(target, seed, **{**DFLASH2, **kwargs})
    for layer in draft.layers:
        for conv in (layer.attention_conv, layer.mlp_conv):
            conv.base_kernel = 0.3 * mx.random.normal(conv.base_kernel.shape)
    selector = draft.candidate_selector
    for codebook in (selector.predecessor_codebook, selector.successor_codebook):
        codebook.weight = 3.0 * mx.random.normal(codebook.weight.shape)
    mx.eval(draft.parameters())
    return draft


class OracleDraft(DFlashDraftModel):
    """Proposes the reference continuation (the target's own greedy tokens),
    except at positions listed in `wrong`, so tests choose which drafts fail."""

    def __init__(self, args: DraftArgs, reference: list[int], wrong: set[int] = frozenset()):
        super().__init__(args)
        self.reference = reference
        self.wrong = set(wrong)

    def __call__(self, block, cache):
        if isinstance(cache[0], ContextRows):  # several rows' blocks: each as alone
            return mx.concatenate(
                [self(block[i : i + 1], [layer.rows[i] for layer in cache]) for i in range(block.shape[0])]
            )
        start = cache[0].position  # position of block[0]
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


class RowsOracleDraft(OracleDraft):
    """An OracleDraft for a batch: several references, the one a block continues picked by
    its position and last token (the first that fits: a rare mix-up only costs acceptance)."""

    def __init__(self, args: DraftArgs, references: list[list[int]], wrong: list[set[int]]):
        super().__init__(args, references[0])
        self.references, self.wrongs = references, wrong

    def __call__(self, block, cache):
        if isinstance(cache[0], ContextRows):
            return super().__call__(block, cache)  # row by row, each back here
        start, last = cache[0].position, block[0, 0].item()
        pick = next((i for i, r in enumerate(self.references) if start < len(r) and r[start] == last), 0)
        self.reference, self.wrong = self.references[pick], self.wrongs[pick]
        return super().__call__(block, cache)


def rows_oracle_draft(target: Target, references: list[list[int]], wrong: list[set[int]], **kwargs) -> RowsOracleDraft:
    model = RowsOracleDraft(draft_args(target, **kwargs), references, wrong)
    mx.eval(model.parameters())
    return model.bind(target)


class Clock:
    """An injected clock: each target pass advances it by what the cost curve says it costs."""

    def __init__(self, cost: CostModel):
        self.cost, self.now = cost, 0.0

    def __call__(self) -> float:
        return self.now


class Timed:
    """A target whose passes take what `clock`'s curve says (for the decoder's clock)."""

    def __init__(self, target, clock: Clock):
        self.target, self.clock = target, clock

    def __getattr__(self, name):
        return getattr(self.target, name)

    def __call__(self, tokens, *args, **kwargs):
        self.clock.now += self.clock.cost.verify(tokens.shape[0] * tokens.shape[1])
        return self.target(tokens, *args, **kwargs)


class Recording:
    """A target that notes the shape of every pass, and of the prefill passes apart (those asking
    for the logits of one position per row)."""

    def __init__(self, target):
        self.target, self.passes, self.prefills = target, [], []

    def __getattr__(self, name):
        return getattr(self.target, name)

    def __call__(self, tokens, *args, **kwargs):
        self.passes.append(tuple(tokens.shape))
        if kwargs.get("logits_at") is not None:
            self.prefills.append(tuple(tokens.shape))
        return self.target(tokens, *args, **kwargs)
