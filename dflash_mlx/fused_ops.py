"""A model's ops in faster forms on a CPU, with bitwise the same output.

Norms and RoPE, compiled per module instance: on a CPU, `mx.fast.rms_norm` and
`mx.fast.rope` fall back to compositions of small ops (11 and 29 primitives), and each
primitive costs several microseconds to schedule there whatever its size: for SmolLM2-135M
that is 60 norms and 60 RoPEs, 2,400 of a decode step's 4,067 primitives.  Compiled, each
becomes a few fused kernels.

Matmul weights, stored column-major: a float32 Linear (or tied Embedding head) computes
x @ W.T, which BLAS runs as its "NT" kernel on a row-major W; the same values stored
transposed make it the "NN" kernel, which OpenBLAS runs faster at decode shapes (a few rows
against weights streamed from memory: a SmolLM2 decode step ~1.2x), bitwise the same.  An
untied Embedding's lookups then read strided rows, a few per decode step.

On a GPU the norms and RoPE are single kernels already and the matmuls are not BLAS, so
nothing is done there (bench/fused_ops.py measures the step).

`fuse(model)` puts a FusedNorm / FusedRoPE in front of every module of the kinds below and
re-stores the matmul weights, in that model instance only (never in a class); `unfused(model)`
undoes both for a while (a plain mlx-lm baseline runs mlx-lm's own ops on row-major weights).
A compiled function is traced once per input shape; the module's parameters are passed in at
each call, so the live weights are used.
"""

from contextlib import contextmanager

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.rope_utils import Llama3RoPE, SuScaledRoPE

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


def _place(model: nn.Module, path: str, module: nn.Module) -> None:
    *parents, name = path.split(".")
    owner = model
    for part in parents:
        owner = owner[int(part)] if isinstance(owner, list) else owner[part]
    if isinstance(owner, list):
        owner[int(name)] = module
    else:
        setattr(owner, name, module)


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
    """`model` with its norms and RoPEs compiled and its matmul weights column-major, where
    fusing(); returns the model."""
    if fusing():
        modules = model.named_modules()
        inside = {path for path, m in modules if isinstance(m, _Fused)}  # fused already
        for path, m in modules:
            if path and type(m) in NORMS + ROPES and path.rpartition(".")[0] not in inside:
                _place(model, path, (FusedNorm if type(m) in NORMS else FusedRoPE)(m))
        _restore_weights(model, column_major)
    return model


@contextmanager
def unfused(model: nn.Module):
    """`model` running its own (uncompiled) norms and RoPEs on row-major weights inside the block."""
    fused = [(path, m) for path, m in model.named_modules() if isinstance(m, _Fused)]
    for path, m in fused:
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
