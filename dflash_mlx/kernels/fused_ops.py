"""A model's ops in faster forms on a CPU, with the same output up to float32 rounding.

Norms and RoPE, compiled per module instance: on a CPU, `mx.fast.rms_norm` and
`mx.fast.rope` fall back to compositions of small ops (11 and 29 primitives), and each
primitive costs several microseconds to schedule there whatever its size: for SmolLM2-135M
that is 60 norms and 60 RoPEs, 2,400 of a decode step's 4,067 primitives.  Compiled, each
becomes a few fused kernels.

Matmul weights, stored column-major: a float32 Linear (or tied Embedding head) computes
x @ W.T, which BLAS runs as its "NT" kernel on a row-major W; the same values stored
transposed make it the "NN" kernel, which OpenBLAS runs faster at decode shapes (a few rows
against weights streamed from memory: a SmolLM2 decode step ~1.2x).  Bitwise the same where
both kernels sum alike (an AVX2 machine here), within float32 rounding where they do not
(an AVX-512 one: ~1e-6).  An untied Embedding's lookups then read strided rows, a few per
decode step.

Attention's softmax, in C++ (kernels/cpu.py: max, exp, sum and scale in one pass per row, 16
lanes at a time) where that kernel is built, else in MLX ops with the exp in compiled
multiply-adds: on an x86 CPU, MLX evaluates exp one lane at a time with a library fma per
polynomial term (~12 ns an element), and its max and sum one element at a time, and a pass's
scores over a long context are most of its attention.  Either way a pass's attention is computed
in parts (rows of a batch, kv heads, spans of queries) one after another, each part's scores 8 MB
at most, so that they stay in cache from the product that writes them to the one that reads
them: one layer's attention of a 4-row verify of 16 tokens over 2,100, or of a 128-token prefill
chunk over 2,048, in a quarter of MLX's time with the kernel, half without
(bench/fused_ops.py --attention).  Within ~3e-7 of MLX's (tests/test_fused_ops.py), as passes
of different widths are of each other.

On a GPU the norms, RoPE and attention are single kernels already and the matmuls are not
BLAS, so nothing is done there (bench/fused_ops.py measures the step).

`fuse(model)` puts a FusedNorm / FusedRoPE in front of every module of the kinds below and a
FusedAttention in front of every module calling mlx-lm's `scaled_dot_product_attention`, and
re-stores the matmul weights, in that model instance only (never in a class or module);
`unfused(model)` undoes all of it for a while (a plain mlx-lm baseline runs mlx-lm's own ops
on row-major weights).
A compiled function is traced once per input shape; the module's parameters are passed in at
each call, so the live weights are used.
"""

import functools
import types
from contextlib import contextmanager
from contextvars import ContextVar
from typing import Optional

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models import base
from mlx_lm.models.rope_utils import Llama3RoPE, SuScaledRoPE

from .cpu import row_softmax_kernel

NORMS = (nn.RMSNorm, nn.LayerNorm)
ROPES = (nn.RoPE, Llama3RoPE, SuScaledRoPE)  # called as (x, offset): offset an int or an array
MATMULS = (nn.Linear, nn.Embedding)  # float weights multiplied as x @ W.T (an Embedding as a tied head)


def fusing() -> bool:
    """True where the fast norm / RoPE ops are compositions of small ops (a CPU)."""
    return mx.default_device() == mx.cpu


class Wrapper(nn.Module):
    """A module standing in for `inner` (its child, so its parameters stay reachable and
    quantizable); attributes it lacks are the inner module's."""

    def __init__(self, inner: nn.Module):
        super().__init__()
        self.inner = inner

    def __getattr__(self, name):
        if name in self:
            return self[name]
        inner = dict.get(self, "inner")  # absent while __init__ runs
        if inner is None:
            raise AttributeError(name)
        return getattr(inner, name)


class _Fused(Wrapper):
    def __init__(self, inner: nn.Module, forward):
        super().__init__(inner)
        self._forward = mx.compile(forward, inputs=inner)


class FusedNorm(_Fused):
    def __init__(self, inner: nn.Module):
        super().__init__(inner, lambda x: inner(x))

    def __call__(self, x: mx.array) -> mx.array:
        return self._forward(x)


class FusedRoPE(_Fused):
    def __init__(self, inner: nn.Module):
        super().__init__(inner, lambda x, offset: inner(x, offset=offset))

    def __call__(self, x: mx.array, offset=0) -> mx.array:
        # an int offset would be a constant of the trace (a new trace per position): an array is an input
        return self._forward(x, offset if isinstance(offset, mx.array) else mx.array(offset, dtype=mx.int32))


# MLX's CPU exp (mlx/backend/cpu/simd/math.h): 2**(x log2 e) as a power of two times a
# polynomial of the fraction
EXP_POLYNOMIAL = (
    1.535336188319500e-4,
    1.339887440266574e-3,
    9.618437357674640e-3,
    5.550332471162809e-2,
    2.402264791363012e-1,
    6.931472028550421e-1,
    1.0,
)
LOG2_E = 1.4426950408889634
ROUNDING = 1.5 * 2**23  # x + ROUNDING - ROUNDING is x rounded to an integer, for |x| < 2**22
EXP2_FLOOR = -127.0  # 2**-127 built with a zero exponent field is exactly 0.0 (a softmax weight under 1e-38)
SCORES_IN_CACHE = 2_097_152  # score elements (8 MB) an attention part holds (this CPU: 1M-2M alike, 256k ~15% dearer)


@mx.compile
def exp_nonpositive(x: mx.array) -> mx.array:
    """exp(x) for x <= 0 (-inf and below -88: 0) in loops the C++ compiler vectorises: no select
    (a branch), no broadcast input (a strided loop); the fraction rounds the power again (the other
    way round, the same integer) rather than reusing the power of two's rounding (the compile then
    splits it into fewer kernels)."""
    powers = mx.maximum(x * LOG2_E, EXP2_FLOOR)
    two_to_whole = mx.left_shift(((powers + ROUNDING) - ROUNDING).astype(mx.int32) + 127, 23).view(mx.float32)
    fraction = powers - ((powers - ROUNDING) + ROUNDING)
    polynomial = mx.array(EXP_POLYNOMIAL[0], dtype=mx.float32)
    for coefficient in EXP_POLYNOMIAL[1:]:
        polynomial = polynomial * fraction + coefficient
    return two_to_whole * polynomial


def scaled_dot_product_attention(queries, keys, values, cache, scale: float, mask, sinks=None) -> mx.array:
    """mlx-lm's `scaled_dot_product_attention` (the computation of MLX's own CPU fallback), with
    our softmax where the scores are float32, in parts (`_part_sizes`) computed one
    after another so that each part's scores stay in cache; mlx-lm's otherwise.  A batch cache
    that tells each row's keys in use (`key_spans`: a row's left padding and what lies past its
    end are masked) has each row attend over its own keys alone."""
    B, H, L, _ = queries.shape
    kv_heads, T = keys.shape[1], keys.shape[2]
    group = H // kv_heads
    if sinks is not None or hasattr(cache, "bits") or queries.dtype != mx.float32 or group * T > SCORES_IN_CACHE:
        return base.scaled_dot_product_attention(queries, keys, values, cache, scale=scale, mask=mask, sinks=sinks)
    queries = (queries * scale).reshape(B, kv_heads, group, L, -1)
    if isinstance(mask, str):  # "causal": the queries are the last L positions
        mask = _causal_mask(L, T - L, kv_heads)
    elif mask is not None:
        mask = _by_kv_head(mask, kv_heads)
    last, by_rows = None, []
    for b, stop, first, end in _row_groups(cache, B, kv_heads, group, L, T):
        _, heads, spans = _part_sizes(stop - b, kv_heads, group, L, end - first)
        by_head = []
        for h in range(0, kv_heads, heads):
            by_span = []
            for q in range(0, L, spans):
                part = _within(queries, (b, stop), (h, h + heads), None, (q, q + spans))
                if last is not None:  # MLX would otherwise compute the parts side by side, all their scores at once
                    part = mx.depends(part, last)
                part_keys, part_values = (_within(x, (b, stop), (h, h + heads), (first, end)) for x in (keys, values))
                part_mask = (
                    None
                    if mask is None
                    else _within(mask, (b, stop), (h, h + heads), None, (q, q + spans), (first, end))
                )
                last = _attend(part, part_keys, part_values, part_mask)
                by_span.append(last)
            by_head.append(_concatenate(by_span, axis=3))
        by_rows.append(_concatenate(by_head, axis=1))
    return _concatenate(by_rows, axis=0).reshape(B, H, L, -1)


def _row_groups(
    cache, rows: int, kv_heads: int, group: int, queries: int, keys: int
) -> list[tuple[int, int, int, int]]:
    """(first row, last row + 1, first key, last key + 1) of each group of rows attending together:
    all rows over the keys any of them uses where one part holds them, else rows of one key span
    as many as a part holds, else (rows of different spans) one by one."""
    spans = cache.key_spans() if hasattr(cache, "key_spans") else [(0, keys)] * rows
    first, end = min(f for f, _ in spans), max(e for _, e in spans)
    together = _part_sizes(rows, kv_heads, group, queries, end - first)[0]
    if together < rows and len(set(spans)) > 1:
        return [(b, b + 1, f, e) for b, (f, e) in enumerate(spans)]
    return [(b, min(b + together, rows), first, end) for b in range(0, rows, together)]


def _attend(queries, keys, values, mask) -> mx.array:
    """One part's attention: (rows, kv heads, group, L, D) queries, each kv head's group and
    queries against its keys in one product."""
    rows, heads, group, L, _ = queries.shape
    scores = (queries.reshape(rows, heads, group * L, -1) @ keys.swapaxes(-1, -2)).reshape(rows, heads, group, L, -1)
    softmax = row_softmax_kernel()
    if softmax is not None:
        out = softmax(scores, mask).reshape(rows, heads, group * L, -1) @ values
        return out.reshape(rows, heads, group, L, -1)
    if mask is not None:
        scores = mx.where(mask, scores, -mx.inf) if mask.dtype == mx.bool_ else scores + mask
    weights = exp_nonpositive(scores - scores.max(axis=-1, keepdims=True))
    # normalised after the product: a pass over (L, Dv) instead of one more over the scores
    out = weights.reshape(rows, heads, group * L, -1) @ values
    return out.reshape(rows, heads, group, L, -1) / weights.sum(axis=-1, keepdims=True)


def _part_sizes(rows: int, kv_heads: int, group: int, queries: int, keys: int) -> tuple[int, int, int]:
    """Rows, kv heads (with their groups of query heads) and queries of a part whose scores are
    about SCORES_IN_CACHE at most: whole rows where one fits, else kv heads, else spans of queries."""
    per_head = group * queries * keys
    if per_head * kv_heads <= SCORES_IN_CACHE:
        return min(rows, SCORES_IN_CACHE // (per_head * kv_heads)), kv_heads, queries
    if per_head <= SCORES_IN_CACHE:
        return 1, min(kv_heads, SCORES_IN_CACHE // per_head), queries
    spans = -(-per_head // SCORES_IN_CACHE)
    return 1, 1, -(-queries // spans)


# the causal masks of the current pass, by (queries, offset, kv heads): every layer asks for the
# same one, and building it is ~10 small ops, each costing its scheduling on a CPU
_pass_masks: ContextVar[Optional[dict]] = ContextVar("pass_masks", default=None)


@contextmanager
def one_mask_a_pass():
    """Inside, a causal mask the attention builds is built once per shape and shared by the
    layers that ask for it again (the layers of one model pass)."""
    token = _pass_masks.set({})
    try:
        yield
    finally:
        _pass_masks.reset(token)


def _causal_mask(queries: int, offset: int, kv_heads: int) -> mx.array:
    masks = _pass_masks.get()
    key = (queries, offset, kv_heads)
    if masks is None or key not in masks:
        mask = _by_kv_head(base.create_causal_mask(queries, offset), kv_heads)
        if masks is None:
            return mask
        masks[key] = mask
    return masks[key]


def _by_kv_head(mask: mx.array, kv_heads: int) -> mx.array:
    """A mask broadcastable to (B, H, L, T) as one broadcastable to (B, kv heads, group, L, T)."""
    mask = mask.reshape((1,) * (4 - mask.ndim) + mask.shape)
    b, h = mask.shape[:2]
    return (
        mask.reshape(b, 1, 1, *mask.shape[2:]) if h == 1 else mask.reshape(b, kv_heads, h // kv_heads, *mask.shape[2:])
    )


def _within(x: mx.array, *ranges) -> mx.array:
    """`x` over [start, stop) of each of its leading axes (None, or an axis of 1, which
    broadcasts: all of it); `x` itself where that is all of it (a slice is one more op to
    schedule, which on a CPU costs as much as a small op's work)."""
    index = tuple(slice(None) if r is None or n == 1 else slice(*r) for n, r in zip(x.shape, ranges))
    if all(i == slice(None) or (i.start, i.stop) == (0, n) for i, n in zip(index, x.shape)):
        return x
    return x[index]


def _concatenate(parts: list, axis: int) -> mx.array:
    return parts[0] if len(parts) == 1 else mx.concatenate(parts, axis=axis)


@functools.cache
def _with_our_attention(call: types.FunctionType) -> types.FunctionType:
    """A copy of `call` whose global `scaled_dot_product_attention` is ours (one per class)."""
    names = {**call.__globals__, "scaled_dot_product_attention": scaled_dot_product_attention}
    copy = types.FunctionType(call.__code__, names, call.__name__, call.__defaults__, call.__closure__)
    copy.__kwdefaults__ = call.__kwdefaults__
    return copy


class FusedAttention(Wrapper):
    """An attention module run by a copy of its class's `__call__` that calls the
    `scaled_dot_product_attention` above where mlx-lm's would be called."""

    def __init__(self, inner: nn.Module):
        super().__init__(inner)
        self._call = _with_our_attention(type(inner).__call__)

    def __call__(self, *args, **kwargs):
        return self._call(self.inner, *args, **kwargs)


def _calls_mlx_attention(module: nn.Module) -> bool:
    call = getattr(type(module), "__call__", None)
    return (
        isinstance(call, types.FunctionType)
        and "scaled_dot_product_attention" in call.__code__.co_names
        and call.__globals__.get("scaled_dot_product_attention") is base.scaled_dot_product_attention
    )


def _place(model: nn.Module, path: str, module: nn.Module) -> None:
    *parents, name = path.split(".")
    owner = model
    for part in parents:
        owner = owner[int(part)] if isinstance(owner, list) else owner[part]
    if isinstance(owner, list):
        owner[int(name)] = module
    else:
        setattr(owner, name, module)


STAND_INS = (_Fused, FusedAttention)


def column_major(weight: mx.array) -> mx.array:
    """`weight` with the same values stored transposed (no copy if it is so already)."""
    return mx.contiguous(weight.T).T


def _restore_weights(model: nn.Module, layout) -> None:
    """Each float32 matmul weight re-stored by `layout`, one at a time (the old one is freed
    before the next is copied, so a model never needs twice its memory)."""
    for m in model.modules():
        if type(m) in MATMULS and m.weight.dtype == mx.float32:
            m.weight = layout(m.weight)
            mx.eval(m.weight)


def fuse(model: nn.Module) -> nn.Module:
    """`model` with its norms and RoPEs compiled, its attention's softmax ours (the C++ kernel,
    built here when it is not yet) and its matmul weights column-major, where fusing(); returns
    the model."""
    if fusing():
        row_softmax_kernel()  # built now (once per machine), not in the middle of a first request
        modules = model.named_modules()
        inside = {path for path, m in modules if isinstance(m, STAND_INS)}  # fused already
        fresh = [(path, m) for path, m in modules if path and path.rpartition(".")[0] not in inside]
        for path, m in fresh:
            if type(m) in NORMS + ROPES:
                _place(model, path, (FusedNorm if type(m) in NORMS else FusedRoPE)(m))
        for path, m in fresh:  # after the norms and RoPEs inside them, placed by the paths they had
            if _calls_mlx_attention(m):
                _place(model, path, FusedAttention(m))
        _restore_weights(model, column_major)
    return model


@contextmanager
def unfused(model: nn.Module):
    """`model` running its own norms, RoPEs and attention on row-major weights inside the block."""
    fused = sorted(
        ((path, m) for path, m in model.named_modules() if isinstance(m, STAND_INS)), key=lambda pm: pm[0].count(".")
    )
    for path, m in reversed(fused):  # the innermost first: the outer ones' paths go through them
        _place(model, path, m.inner)
    if fused:
        _restore_weights(model, mx.contiguous)
    try:
        yield model
    finally:
        for path, m in fused:
            _place(model, path, m)
        if fused:
            _restore_weights(model, column_major)
