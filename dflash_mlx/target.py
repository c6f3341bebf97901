"""The target model: an mlx-lm model run layer by layer so that the outputs of
chosen layers come back with the logits, and so that every layer cache can be
rolled back after verification.

Nothing is patched: the loop below calls the model's own layer modules with the
mask its cache asks for.  Only GatedDeltaNet layers go through
`gated_delta_forward`, which mirrors mlx-lm's module and records a replay tape.
"""

from typing import Sequence

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.base import create_attention_mask, create_ssm_mask
from mlx_lm.models.cache import make_prompt_cache

from .gated_delta import gated_delta_forward
from .rollback import GatedDeltaState, checkpointed

# Model types whose forward is exactly: embed -> layers(h, mask, cache) -> norm -> head.
# Others (embedding scales, logit soft-caps, other recurrent layers) would be
# silently wrong in the generic loop, so they are refused.
SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3", "qwen3_moe", "qwen3_5", "qwen3_5_moe")


class TargetCache:
    """The target's per-layer mlx-lm caches plus their rollback handlers."""

    def __init__(self, model: nn.Module):
        self.layers = make_prompt_cache(model)
        self.handlers = [checkpointed(c, layer) for c, layer in zip(self.layers, model.layers)]

    @property
    def offset(self) -> int:
        """Number of tokens the cache holds (GatedDeltaNet caches do not count)."""
        return next(h.cache.offset for h in self.handlers if hasattr(h.cache, "offset"))

    def checkpoint(self):
        for h in self.handlers:
            h.checkpoint()

    def rollback(self, keep: int):
        for h in self.handlers:
            h.rollback(keep)


class Target:
    """Wraps an mlx-lm model (never copies its weights)."""

    def __init__(self, model: nn.Module, model_type: str | None = None):
        model_type = model_type or getattr(model, "model_type", None)
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise ValueError(
                f"target model type {model_type!r} is not supported; "
                f"supported: {', '.join(SUPPORTED_MODEL_TYPES)}"
            )
        self.model = model
        self.model_type = model_type
        owner = getattr(model, "language_model", model)  # qwen3_5 wraps its text model
        self._inner = owner.model
        self.embed_tokens = self._inner.embed_tokens
        # what the model multiplies its embeddings by (z-lab's drafters multiply theirs alike)
        self.embed_scale = getattr(self.embed_tokens, "embed_scale", getattr(self._inner, "embed_scale", 1.0))
        self.lm_head = owner.lm_head if "lm_head" in owner else self.embed_tokens.as_linear
        self.layers = model.layers

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    @property
    def hidden_size(self) -> int:
        return self._inner.norm.weight.shape[0]

    @property
    def vocab_size(self) -> int:
        return self.embed_tokens.weight.shape[0]

    @property
    def dtype(self) -> mx.Dtype:
        return self._inner.norm.weight.dtype

    def head_rows(self, token_ids: mx.array):
        """The output head restricted to `token_ids`: hidden (.., D) -> logits (.., len(token_ids))."""
        head = self.lm_head.__self__ if hasattr(self.lm_head, "__self__") else self.lm_head  # tied: as_linear
        # gathered now, not lazily: a lazy array is tied to this thread's stream, and the
        # drafter may run in another thread (the server's engine thread)
        weight = head.weight[token_ids]
        if isinstance(head, (nn.QuantizedLinear, nn.QuantizedEmbedding)):
            scales = head.scales[token_ids]
            biases = head["biases"][token_ids] if "biases" in head else None
            mx.eval(weight, scales, biases)
            return lambda h: mx.quantized_matmul(h, weight, scales, biases, transpose=True,
                                                 group_size=head.group_size, bits=head.bits)
        bias = head.bias[token_ids] if "bias" in head else None
        mx.eval(weight, bias)
        return lambda h: h @ weight.T + bias if bias is not None else h @ weight.T

    def make_cache(self) -> TargetCache:
        return TargetCache(self.model)

    def __call__(
        self,
        tokens: mx.array,
        cache: TargetCache,
        feature_layers: Sequence[int] = (),
        logits_for_last_only: bool = False,
    ) -> tuple[mx.array, mx.array | None]:
        """Forward `tokens` (1, L) on top of `cache`.

        Returns logits (1, L, V) (or (1, 1, V) for the last position only) and
        the concatenated outputs of `feature_layers` (1, L, len * hidden), or
        None when none are asked for.
        """
        h = self.embed_tokens(tokens)
        captured = {}
        wanted = set(feature_layers)
        for i, (layer, c, handler) in enumerate(zip(self.layers, cache.layers, cache.handlers)):
            if isinstance(handler, GatedDeltaState):
                h = _gated_delta_layer(layer, h, create_ssm_mask(h, c), handler)
            else:
                h = layer(h, create_attention_mask(h, c), c)
            if i in wanted:
                captured[i] = h
        if logits_for_last_only:
            h = h[:, -1:]
        logits = self.lm_head(self._inner.norm(h))
        features = mx.concatenate([captured[i] for i in feature_layers], axis=-1) if feature_layers else None
        return logits, features


def _gated_delta_layer(layer, h, mask, state: GatedDeltaState):
    """qwen3_5 DecoderLayer.__call__ for a linear-attention layer, with the tape kept."""
    r, tape = gated_delta_forward(layer.linear_attn, layer.input_layernorm(h), mask, state.cache, state.recording)
    if tape is not None:
        state.record(tape)
    h = h + r
    return h + layer.mlp(layer.post_attention_layernorm(h))
