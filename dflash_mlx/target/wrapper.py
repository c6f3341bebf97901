"""The target model: an mlx-lm model run through its own forward, with the
outputs of chosen layers captured on the way and every cache kept rollback-able.

Whatever a model does around its layers (embedding scales, per-layer inputs,
shared-KV layers, attention sinks, logit soft-capping) runs as mlx-lm wrote it.
Three kinds of stand-ins are installed in *this model instance* (never in a
class), each calling the module it replaces:

  LayerTap            every decoder layer in the model's own layer list: keeps its
                      output when the current pass asks for that layer's features
  RecordingGatedDelta every GatedDeltaNet mixer: during a verify pass, runs the
                      mirror in gated_delta.py that records the replay tape
  FinalNormTap        the final norm: for a prefill chunk, only each row's last
                      position goes on to the output head

Where MLX has no kernel for them (a CPU), its norms and RoPEs are compiled first
(fused_ops.py).

What the target supports is therefore decided by its caches: a model loads if
every cache its `make_cache` returns has a rollback handler (rollback.py).
"""

from typing import Sequence

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.cache import RotatingKVCache, make_prompt_cache

from ..kernels.fused_ops import Wrapper, column_major, fuse, fusing, one_mask_a_pass
from .gated_delta import MIXER_PROJECTIONS, gated_delta_forward
from .mlx_lm_compat import write_index
from .rollback import (
    BatchRotatingKV,
    BatchTrimmableKV,
    GatedDeltaState,
    RaggedBatchKVCache,
    RaggedRows,
    UnsupportedCache,
    checkpointed,
    checkpointed_batch,
    merged,
)


class TargetCache:
    """The target's per-layer mlx-lm caches plus their rollback handlers: one row, with the
    calls of a batch (BatchTargetCache) that one row needs."""

    splittable = False  # one row: a pass over some rows is a pass over all

    def __init__(self, model: nn.Module = None, layers: list = None):
        """A fresh cache for `model`, or one holding `layers` (a batch row's, extracted)."""
        self.layers = layers if layers is not None else make_prompt_cache(model)
        self.handlers = [checkpointed(c) for c in self.layers]

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

    def rollback_rows(self, keep: list[int]):
        self.rollback(keep[0])

    def pad_right(self, lengths: list[int]):
        """One row has nothing to pad."""

    def finalize(self):
        pass

    def extract(self, row: int) -> "TargetCache":
        return self

    def keep_rows(self, rows: list[int]):
        """Its one row is kept (dropping it drops the cache)."""


class BatchTargetCache:
    """Several requests' target caches as one batch (rollback.merged: full-attention rows each
    end where their own tokens end, other kinds share mlx-lm's one write index); each row keeps
    its own length and rolls back its own accepted prefix."""

    def __init__(self, rows: list[TargetCache]):
        if any(isinstance(c, RotatingKVCache) and c.keep for c in rows[0].layers):
            raise UnsupportedCache("a sliding window that keeps its first tokens cannot be batched")
        self.layers = [merged(list(row_caches)) for row_caches in zip(*(r.layers for r in rows))]
        self.handlers = [checkpointed_batch(c) for c in self.layers]

    @property
    def size(self) -> int:
        return len(self.offsets)

    @property
    def offsets(self) -> list[int]:
        """Tokens each row holds."""
        return self._kv[0].offset.tolist()

    @property
    def width(self) -> int:
        """Tokens the batch holds per row: the longest row's, the others left-padded to it."""
        return max(write_index(c) for c in self._kv)

    @property
    def _kv(self) -> list:
        return [h.cache for h in self.handlers if isinstance(h, (BatchTrimmableKV, BatchRotatingKV))]

    @property
    def splittable(self) -> bool:
        """Whether a pass may run over some of its rows alone (`rows`): full-attention layers
        only (a sliding window or a recurrent state shares one write index across the rows)."""
        return all(isinstance(c, RaggedBatchKVCache) for c in self.layers)

    def rows(self, start: int, stop: int) -> "BatchRows":
        """Rows start..stop-1 as the cache of a pass over them alone (`splittable` batches); the
        batch's checkpoint and rollback still cover every row."""
        return BatchRows([RaggedRows(c, slice(start, stop)) for c in self.layers])

    def extend(self, other: "BatchTargetCache"):
        """Append `other`'s rows (after this batch's)."""
        for cache, more in zip(self.layers, other.layers):
            cache.extend(more)

    def extract(self, row: int) -> TargetCache:
        """Row `row`'s caches alone, without the batch's padding."""
        return TargetCache(layers=[cache.extract(row) for cache in self.layers])

    def pad_right(self, lengths: list[int]):
        """The next pass's rows are right-padded to its longest; finalize() after it ends each
        row after its own tokens (a cache sharing one write index moves each row's padding to
        its left, as mlx-lm's batched prefill does)."""
        longest = max(lengths)
        for cache in self.layers:
            cache.prepare(lengths=lengths, right_padding=[longest - n for n in lengths])

    def finalize(self):
        for cache in self.layers:
            cache.finalize()

    def keep_rows(self, rows: list[int]):
        """The rows in `rows`, in that order; every other dropped (the common left padding goes with them)."""
        index = mx.array(rows, dtype=mx.int32)
        for cache in self.layers:
            cache.filter(index)

    def checkpoint(self):
        for h in self.handlers:
            h.checkpoint()

    def rollback(self, keep: list[int]):
        for h in self.handlers:
            h.rollback(keep)

    rollback_rows = rollback


class BatchRows:
    """Some rows of a batch, as the cache a target pass over them alone is given."""

    def __init__(self, layers: list):
        self.layers = layers
        self.handlers = []  # no recurrent state to record: splittable batches are full attention


class _Pass:
    """What the current forward pass wants recorded (shared by the stand-ins of one model)."""

    def __init__(self):
        self.reset()

    def reset(self, wanted=(), logits_at=None, handlers=()):
        self.wanted = frozenset(wanted)
        self.logits_at = logits_at
        self.gated_delta = {id(h.cache): h for h in handlers if isinstance(h, GatedDeltaState)}
        self.outputs = {}


class StandIn(Wrapper):
    """A wrapper told what the current pass wants recorded."""

    def __init__(self, inner: nn.Module, current: _Pass):
        super().__init__(inner)
        self._pass = current  # a plain object: kept out of the parameter tree


class LayerTap(StandIn):
    def __init__(self, layer: nn.Module, index: int, current: _Pass):
        super().__init__(layer, current)
        self._index = index

    def __call__(self, *args, **kwargs):
        out = self.inner(*args, **kwargs)
        if self._index in self._pass.wanted:
            self._pass.outputs[self._index] = out[0] if isinstance(out, tuple) else out  # gemma4: (h, kv, offset)
        return out


class RecordingGatedDelta(StandIn):
    def __call__(self, x: mx.array, mask=None, cache=None):
        handler = self._pass.gated_delta.get(id(cache))
        if handler is None or not handler.recording:  # prefill, plain steps, other callers
            return self.inner(x, mask, cache)
        out, tape = gated_delta_forward(self.inner, x, mask, cache)
        handler.record(tape)
        return out


def at_positions(x: mx.array, positions) -> mx.array:
    """(B, 1, ...): row b's position positions[b] of `x` (B, L, ...)."""
    return x[mx.arange(x.shape[0]), mx.array(positions)][:, None]


class FinalNormTap(StandIn):
    def __call__(self, h: mx.array) -> mx.array:
        at = self._pass.logits_at  # the norm is per position: the others need not go on
        return self.inner(h if at is None else at_positions(h, at))


def model_parts(model: nn.Module):
    """(owner of the output head, inner model holding embed_tokens / layers / norm)."""
    owner = getattr(model, "language_model", model)  # multimodal wrappers hold a text model
    inner = getattr(owner, "model", None)
    if not isinstance(inner, nn.Module) or not isinstance(inner.get("layers"), list) or "embed_tokens" not in inner:
        raise ValueError(
            f"target {type(model).__module__}: no embed_tokens / layers list where mlx-lm "
            "models keep them (model.model or model.language_model.model); not supported"
        )
    return owner, inner


class Target:
    """Wraps an mlx-lm model (never copies its weights)."""

    def __init__(self, model: nn.Module):
        self.model = fuse(model)
        self.model_type = getattr(model, "model_type", type(model).__module__.rsplit(".", 1)[-1])
        owner, inner = model_parts(model)
        self._pass = _Pass()
        self.layers = list(inner.layers)  # the real layers, before their taps go in
        for i, layer in enumerate(self.layers):
            if layer is None:  # a pipeline stage's layers live on other ranks
                continue
            mixer = layer.get("linear_attn")
            if mixer is not None and type(mixer) in MIXER_PROJECTIONS:
                layer.linear_attn = RecordingGatedDelta(mixer, self._pass)
            inner.layers[i] = LayerTap(layer, i, self._pass)
        self.norm = inner.get("norm")  # the final norm, where the model has one
        if self.norm is not None:
            inner.norm = FinalNormTap(self.norm, self._pass)
        self.embed_tokens = inner.embed_tokens
        # what the model multiplies its embeddings by (z-lab's drafters multiply theirs alike)
        self.embed_scale = getattr(self.embed_tokens, "embed_scale", getattr(inner, "embed_scale", 1.0))
        self.lm_head = owner.lm_head if "lm_head" in owner else self.embed_tokens.as_linear
        self._check_caches()

    def _check_caches(self):
        try:
            cache = self.make_cache()
        except UnsupportedCache as e:
            raise ValueError(f"target model type {self.model_type!r} is not supported: {e}") from None
        recorded = sum(isinstance(layer.get("linear_attn"), RecordingGatedDelta) for layer in self.layers if layer)
        states = sum(isinstance(h, GatedDeltaState) for h in cache.handlers)
        if states != recorded:  # an ArraysCache of another recurrent kind (Mamba, ...)
            raise ValueError(
                f"target model type {self.model_type!r} is not supported: {states - recorded} "
                "recurrent layer caches are not GatedDeltaNet states, which cannot be rolled back"
            )

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    @property
    def hidden_size(self) -> int:
        return self.norm.weight.shape[0] if self.norm is not None else self.model.args.hidden_size

    @property
    def vocab_size(self) -> int:
        return self.embed_tokens.weight.shape[0]

    @property
    def dtype(self) -> mx.Dtype:
        """The activation dtype (a norm's: never a quantized weight's storage type)."""
        if self.norm is not None:
            return self.norm.weight.dtype
        return (self.embed_tokens.scales if "scales" in self.embed_tokens else self.embed_tokens.weight).dtype

    @property
    def head_module(self) -> nn.Module:
        """The module holding the output head's weight (the embedding when tied)."""
        return self.lm_head.__self__ if hasattr(self.lm_head, "__self__") else self.lm_head  # tied: as_linear

    def head_rows(self, token_ids: mx.array):
        """The output head restricted to `token_ids`: hidden (.., D) -> logits (.., len(token_ids))."""
        head = self.head_module
        # gathered now, not lazily: a lazy array is tied to this thread's stream, and the
        # drafter may run in another thread (the server's engine thread)
        weight = head.weight[token_ids]
        if isinstance(head, (nn.QuantizedLinear, nn.QuantizedEmbedding)):
            scales = head.scales[token_ids]
            biases = head["biases"][token_ids] if "biases" in head else None
            mx.eval(weight, scales, biases)
            return lambda h: mx.quantized_matmul(
                h, weight, scales, biases, transpose=True, group_size=head.group_size, bits=head.bits
            )
        bias = head.bias[token_ids] if "bias" in head else None
        if fusing() and weight.dtype == mx.float32:
            weight = column_major(weight)  # as the whole head is (fused_ops.py)
        mx.eval(weight, bias)
        return lambda h: h @ weight.T + bias if bias is not None else h @ weight.T

    def make_cache(self) -> TargetCache:
        return TargetCache(self.model)

    def batch_refusal(self) -> str | None:
        """Why requests to this target cannot be decoded in batches (None: they can)."""
        try:
            BatchTargetCache([self.make_cache()])
        except UnsupportedCache as e:
            return str(e)
        return None

    def __call__(
        self,
        tokens: mx.array,
        cache: TargetCache,
        feature_layers: Sequence[int] = (),
        logits_at: Sequence[int] | None = None,
    ) -> tuple[mx.array, mx.array | None]:
        """Forward `tokens` (B, L) on top of `cache` through the model's own forward.

        Returns logits (B, L, V) (or (B, 1, V) at one position per row, `logits_at`) and
        the concatenated outputs of `feature_layers` (B, L, len * hidden), or
        None when none are asked for.
        """
        self._pass.reset(feature_layers, logits_at, cache.handlers)
        try:
            with one_mask_a_pass():  # every layer's causal mask is the same (fused_ops.py)
                logits = self.model(tokens, cache=cache.layers)
            captured = self._pass.outputs
            if logits_at is not None and self.norm is None:
                logits = at_positions(logits, logits_at)
        finally:
            self._pass.reset()
        return logits, self._features(captured, feature_layers, tokens.shape[1]) if feature_layers else None

    def _features(self, captured: dict, feature_layers: Sequence[int], length: int) -> mx.array:
        return mx.concatenate([captured[i] for i in feature_layers], axis=-1)
