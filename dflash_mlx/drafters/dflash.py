"""DFlash 1 drafter layers: Qwen3-style layers whose queries are the block and whose
keys/values are the injected target context followed by the block itself.

    AttentionContext  what DraftAttention and DFlash 2's convolutions ask of a context
    ContextKV       the context's keys/values, appended as positions are committed
    FreshContext    a ContextKV and the context vectors it takes in the pass that drafts next
    ContextRows     several rows' contexts, for one pass over all their blocks
    DraftAttention  attention over [context, block], bidirectional inside the block
    DraftLayer      attention + MLP, pre-norm residual
"""

from typing import Optional

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.qwen3 import MLP
from mlx_lm.models.rope_utils import initialize_rope

from ..kernels.metal import ContextSpan, block_attention
from .config import DraftArgs, DraftLoadError


class AttentionContext:
    """What a drafter layer asks of its attention context: the block's position(s) (`position`:
    an int for consecutive tokens, or an array, one per token), each position's index inside its
    block (`block_index`, for DFlash 2's convolutions; None: one block a row), the block's keys and
    values, and attend(attn, queries, keys, values)."""

    block_index = None

    def keys_values(self, attn: "DraftAttention", x: mx.array) -> tuple[mx.array, mx.array]:
        return attn.keys_values(x, self.position)


class ContextKV(AttentionContext):
    """Keys/values of the injected context, in temporal order, preallocated in
    steps so appending a few positions per cycle does not copy the whole
    context.  With a window, entries older than the window are dropped when
    the buffer is regrown."""

    step = 256

    def __init__(self, window: Optional[int] = None):
        self.window = window
        self.keys = self.values = None
        self.offset = 0  # positions appended so far
        self._end = 0  # buffer index after the newest entry

    def append(self, keys: mx.array, values: mx.array):
        n = keys.shape[2]
        if self.keys is None or self._end + n > self.keys.shape[2]:
            self._regrow(keys, values, n)
        self.keys[..., self._end : self._end + n, :] = keys
        self.values[..., self._end : self._end + n, :] = values
        self._end += n
        self.offset += n

    def _regrow(self, keys, values, n):
        kept = self.span()
        length = kept.length if kept else 0
        capacity = ((length + n + self.step - 1) // self.step + 1) * self.step
        B, H, _, D = keys.shape
        new_k = mx.zeros((B, H, capacity, D), keys.dtype)
        new_v = mx.zeros((B, H, capacity, values.shape[3]), values.dtype)
        if length:
            live = slice(kept.start, kept.start + length)
            new_k[..., :length, :] = kept.keys[..., live, :]
            new_v[..., :length, :] = kept.values[..., live, :]
        self.keys, self.values, self._end = new_k, new_v, length

    def trim(self, n: int) -> None:
        """Forget the newest `n` entries (a context without a window only)."""
        if self.window is not None:
            raise ValueError("a windowed drafter context cannot be cut back")
        self._end -= n
        self.offset -= n

    def span(self) -> Optional[ContextSpan]:
        """The live entries (the last `window` with a window), read in place by attention."""
        if self.keys is None:
            return None
        start = 0 if self.window is None else max(0, self._end - self.window)
        return ContextSpan(self.keys, self.values, start, self._end - start)

    @property
    def state(self):
        """The live entries (what a snapshot of it holds)."""
        span = self.span()
        if span is None:
            return None, None
        live = slice(span.start, span.start + span.length)
        return span.keys[..., live, :], span.values[..., live, :]

    @property
    def position(self) -> int:
        return self.offset  # the block starts right after the context

    def attend(self, attn: "DraftAttention", queries, keys, values) -> mx.array:
        return block_attention(
            queries, keys, values, self.span(), scale=attn.scale, causal=attn.causal, window=attn.window
        )


class FreshContext(AttentionContext):
    """A layer's ContextKV with the context vectors of the positions committed since its last
    draft, appended by the pass that drafts next: their keys and values are projected with the
    block's, in one projection, norm and RoPE a layer instead of two (the positions follow on:
    the block starts right after them)."""

    def __init__(self, cache: ContextKV, vectors: mx.array):
        self.cache, self.vectors = cache, vectors

    @property
    def position(self) -> int:
        return self.cache.offset + self.vectors.shape[1]

    def keys_values(self, attn: "DraftAttention", x: mx.array) -> tuple[mx.array, mx.array]:
        """The block's keys and values, the context vectors' appended to the cache on the way."""
        n = self.vectors.shape[1]
        keys, values = attn.keys_values(mx.concatenate([self.vectors, x], axis=1), self.cache.offset)
        self.cache.append(keys[..., :n, :], values[..., :n, :])
        return keys[..., n:, :], values[..., n:, :]

    def attend(self, attn: "DraftAttention", queries, keys, values) -> mx.array:
        return self.cache.attend(attn, queries, keys, values)


class ContextRows(AttentionContext):
    """One layer's contexts of several rows (a ContextKV each), for one drafter pass over
    all their blocks: the projections and MLPs read the weights once for every row, and
    each row's block attends to its own context at its own positions."""

    def __init__(self, rows: list[ContextKV], width: int, position: Optional[mx.array] = None):
        """`position` (rows, width): the blocks' positions, when built already (every layer's
        contexts of a row hold as many entries: one array serves them all)."""
        self.rows = rows
        self.position = position if position is not None else block_positions(rows, width)

    def attend(self, attn: "DraftAttention", queries, keys, values) -> mx.array:
        return mx.concatenate(
            [c.attend(attn, queries[i : i + 1], keys[i : i + 1], values[i : i + 1]) for i, c in enumerate(self.rows)]
        )


def block_positions(rows: list[ContextKV], width: int) -> mx.array:
    """(rows, width): each row's block positions, right after its context."""
    return mx.array([[c.offset + i for i in range(width)] for c in rows])


def per_position(layer, x: mx.array) -> mx.array:
    """`layer` (an MLP, a Linear: position by position) over x (..., D) as one 2D array: a matmul
    of a 3D input by a 2D weight flattens it and unflattens its output, two ops more per Linear,
    each built and scheduled (an MLP's three Linears: two reshapes here instead of six)."""
    return layer(x.reshape(-1, x.shape[-1])).reshape(*x.shape[:-1], -1)


class DraftAttention(nn.Module):
    def __init__(self, args: DraftArgs, layer_type: str):
        super().__init__()
        self.n_heads = args.num_attention_heads
        self.n_kv_heads = args.num_key_value_heads
        self.head_dim = args.head_dim
        self.scale = args.head_dim**-0.5
        sliding = layer_type == "sliding_attention"
        self.window = args.sliding_window if sliding else None
        # z-lab's reference: sliding layers are causal inside the block unless the config says otherwise
        self.causal = sliding if args.is_causal is None else bool(args.is_causal)
        dim, bias = args.hidden_size, args.attention_bias
        self.q_proj = nn.Linear(dim, self.n_heads * self.head_dim, bias=bias)
        self.k_proj = nn.Linear(dim, self.n_kv_heads * self.head_dim, bias=bias)
        self.v_proj = nn.Linear(dim, self.n_kv_heads * self.head_dim, bias=bias)
        self.o_proj = nn.Linear(self.n_heads * self.head_dim, dim, bias=bias)
        self.q_norm = nn.RMSNorm(self.head_dim, eps=args.rms_norm_eps)
        self.k_norm = nn.RMSNorm(self.head_dim, eps=args.rms_norm_eps)
        try:
            self.rope = initialize_rope(
                self.head_dim, args.rope_theta, False, args.rope_scaling, args.max_position_embeddings
            )
        except (ValueError, KeyError, TypeError) as e:
            raise DraftLoadError(f"drafter config: RoPE {args.rope_scaling} is not supported ({e})") from None

    def _rope(self, x: mx.array, position) -> mx.array:
        """RoPE at `position`: an int offset for consecutive tokens, or an array with
        one position per token, row by row (packed training blocks, several rows' blocks)."""
        if isinstance(position, int):
            return self.rope(x, offset=position)
        B, H, L, D = x.shape  # each token its own "row" of one, rotated at its own offset
        flat = x.transpose(0, 2, 1, 3).reshape(B * L, H, 1, D)
        return self.rope(flat, offset=position.reshape(-1)).reshape(B, L, H, D).transpose(0, 2, 1, 3)

    def keys_values(self, x: mx.array, position) -> tuple[mx.array, mx.array]:
        B, L, _ = x.shape
        flat = x.reshape(B * L, -1)  # 2D, and one reshape for both projections (see `per_position`)
        keys = self.k_norm(self.k_proj(flat).reshape(B, L, self.n_kv_heads, -1)).transpose(0, 2, 1, 3)
        values = self.v_proj(flat).reshape(B, L, self.n_kv_heads, -1).transpose(0, 2, 1, 3)
        return self._rope(keys, position), values

    def add_context(self, context: mx.array, cache: "ContextKV"):
        cache.append(*self.keys_values(context, cache.offset))

    def __call__(self, x: mx.array, context) -> mx.array:
        """Block queries attend to the injected context and to the whole block.

        `context` is an AttentionContext: a ContextKV, FreshContext or ContextRows (decoding)
        or a packed training context (a FreshContext projects its new context vectors with the
        block's keys and values)."""
        B, L, _ = x.shape
        position = context.position
        queries = self.q_norm(self.q_proj(x.reshape(B * L, -1)).reshape(B, L, self.n_heads, -1)).transpose(0, 2, 1, 3)
        queries = self._rope(queries, position)
        keys, values = context.keys_values(self, x)
        out = context.attend(self, queries, keys, values)
        return self.o_proj(out.transpose(0, 2, 1, 3).reshape(B * L, -1)).reshape(B, L, -1)


class DraftLayer(nn.Module):
    def __init__(self, args: DraftArgs, layer_type: str):
        super().__init__()
        self.self_attn = DraftAttention(args, layer_type)
        self.mlp = MLP(args.hidden_size, args.intermediate_size)
        self.input_layernorm = nn.RMSNorm(args.hidden_size, eps=args.rms_norm_eps)
        self.post_attention_layernorm = nn.RMSNorm(args.hidden_size, eps=args.rms_norm_eps)

    def __call__(self, x: mx.array, context) -> mx.array:
        h = x + self.self_attn(self.input_layernorm(x), context)
        return h + per_position(self.mlp, self.post_attention_layernorm(h))
