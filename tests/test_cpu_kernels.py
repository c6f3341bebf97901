"""The C++ row softmax (cpu/row_softmax.cpp): built here, equal to a float64 softmax within float32
rounding, masks applied, lazy and in place only where its input is not needed, with MLX's
gradient; a build that fails says why once and leaves attention its MLX form."""

import re
import sys
import warnings

import mlx.core as mx
import numpy as np
import pytest

from dflash_mlx.kernels import cpu as cpu_kernels
from dflash_mlx.kernels import fused_ops
from dflash_mlx.kernels.fused_ops import scaled_dot_product_attention

# nanobind is a dependency on Linux only (pyproject.toml): on macOS attention runs on the GPU, and
# the C++ kernel is neither built nor wanted there
pytest.importorskip("nanobind", reason="the C++ CPU kernels need nanobind, which dflash-mlx installs on Linux only")


@pytest.fixture
def softmax():
    kernel = cpu_kernels.row_softmax_kernel()
    assert kernel is not None, "the CPU softmax kernel did not build here (see the warning)"
    return kernel


def float64_softmax(x: mx.array) -> np.ndarray:
    x = np.array(x).astype(np.float64)
    with np.errstate(invalid="ignore"):
        e = np.exp(x - x.max(axis=-1, keepdims=True))
    return e / e.sum(axis=-1, keepdims=True)


@pytest.mark.parametrize("shape", [(1, 1), (3, 5), (2, 3, 17), (4, 2100), (2, 2, 48, 33)])
def test_row_softmax_is_a_softmax_within_float32_rounding(softmax, shape):
    x = mx.random.normal(shape) * 6
    x = mx.where(mx.random.uniform(shape=shape) < 0.1, -mx.inf, x)
    x = mx.concatenate([x, mx.zeros(shape[:-1] + (1,))], axis=-1)  # never a row wholly masked
    got, want = np.array(softmax(x)), float64_softmax(x)
    assert got.shape == want.shape
    assert np.allclose(got, want, rtol=1e-5, atol=1e-9), np.abs(got - want).max()
    assert np.allclose(got.sum(axis=-1), 1.0, atol=1e-5)


@pytest.mark.parametrize("mask_shape", [(2, 1, 1, 33), (1, 3, 5, 33), (2, 3, 5, 1), (2, 3, 5, 33), (33,)])
@pytest.mark.parametrize("kind", ["boolean", "additive"])
def test_a_mask_broadcast_to_the_scores_is_applied_first(softmax, mask_shape, kind):
    x = mx.random.normal((2, 3, 5, 33)) * 4
    keep = mx.random.uniform(shape=mask_shape) < 0.7
    # never a row wholly masked
    keep = keep | (mx.arange(33) == 0) if mask_shape[-1] > 1 else mx.ones(mask_shape, dtype=mx.bool_)
    mask = keep if kind == "boolean" else mx.where(keep, mx.random.normal(mask_shape), -mx.inf)
    masked = mx.where(mask, x, -mx.inf) if kind == "boolean" else x + mask
    got, want = np.array(softmax(x, mask)), float64_softmax(masked)
    assert np.allclose(got, want, rtol=1e-5, atol=1e-9), np.abs(got - want).max()


def test_masked_and_negligible_scores_weigh_exactly_nothing(softmax):
    weights = softmax(mx.array([[0.0, -mx.inf, -200.0, -88.5, -87.0, -1.0, -mx.inf] * 3]))
    assert all(weights[0, i].item() == 0.0 for i in (1, 2, 3)) and weights[0, 4].item() > 0.0


def test_an_input_still_needed_is_left_as_it_was(softmax):
    x = mx.random.normal((3, 40))
    before = np.array(x)
    first = softmax(x)
    second = softmax(x)
    mx.eval(first, second)
    assert np.array_equal(np.array(x), before)
    assert mx.array_equal(first, second).item()


def test_it_computes_lazily_on_the_current_stream(softmax):
    x = mx.random.normal((2, 7, 19))
    with mx.stream(mx.new_stream(mx.cpu)):
        y = softmax(x * 2.0 + 1.0)  # inside a graph, on another stream
        total = (y * 3.0).sum(axis=-1)
    assert mx.allclose(total, mx.full((2, 7), 3.0), atol=1e-5).item()


def test_its_gradient_is_the_softmax_gradient(softmax):
    x, w = mx.random.normal((3, 21)), mx.random.normal((3, 21))
    ours = mx.grad(lambda x: (softmax(x) * w).sum())(x)
    mlx = mx.grad(lambda x: (mx.softmax(x, axis=-1) * w).sum())(x)
    assert mx.allclose(ours, mlx, rtol=1e-5, atol=1e-6).item()


def test_its_gradient_through_a_mask_is_mlxs(softmax):
    x, w = mx.random.normal((2, 3, 21)), mx.random.normal((2, 3, 21))
    keep = (mx.random.uniform(shape=(2, 1, 21)) < 0.7) | (mx.arange(21) == 0)
    ours = mx.grad(lambda x: (softmax(x, keep) * w).sum())(x)
    mlx = mx.grad(lambda x: (mx.softmax(mx.where(keep, x, -mx.inf), axis=-1) * w).sum())(x)
    assert mx.allclose(ours, mlx, rtol=1e-5, atol=1e-6).item()
    add = mx.random.normal((1, 3, 21))
    ours = mx.grad(lambda x, add: (softmax(x, add) * w).sum(), argnums=(0, 1))(x, add)
    mlx = mx.grad(lambda x, add: (mx.softmax(x + add, axis=-1) * w).sum(), argnums=(0, 1))(x, add)
    assert all(mx.allclose(a, b, rtol=1e-5, atol=1e-6).item() for a, b in zip(ours, mlx))


def test_non_float32_scores_are_refused(softmax):
    with pytest.raises(ValueError, match="float32"):
        softmax(mx.zeros((2, 3), dtype=mx.float16))


@pytest.mark.parametrize(
    "compiler,reason", [("false", "the C++ build failed"), ("/nonexistent/g++", "no C++ compiler")]
)
def test_a_failed_build_warns_once_and_attention_keeps_its_mlx_form(compiler, reason, tmp_path, monkeypatch):
    monkeypatch.setenv("DFLASH_MLX_CACHE", str(tmp_path))
    monkeypatch.setenv("CXX", compiler)
    cpu_kernels.row_softmax_kernel.cache_clear()
    try:
        with pytest.warns(UserWarning, match=re.escape(f"no CPU softmax kernel: {reason}")) as caught:
            assert cpu_kernels.row_softmax_kernel() is None
            with warnings.catch_warnings():
                warnings.simplefilter("error")
                assert cpu_kernels.row_softmax_kernel() is None  # said once
        assert len(caught) == 1 and "\n" not in str(caught[0].message)
        assert not list(tmp_path.rglob("*.so")) and not list(tmp_path.rglob(".*"))  # nothing half-written
        q, k, v = (mx.random.normal((1, 4, 3, 8)), mx.random.normal((1, 2, 9, 8)), mx.random.normal((1, 2, 9, 8)))
        want = mx.fast.scaled_dot_product_attention(q, k, v, scale=0.3, mask="causal")
        assert mx.allclose(scaled_dot_product_attention(q, k, v, None, 0.3, "causal"), want, atol=1e-6).item()
    finally:
        cpu_kernels.row_softmax_kernel.cache_clear()  # the next test loads the machine's build again


def test_a_cache_that_cannot_be_written_warns_once(tmp_path, monkeypatch):
    blocked = tmp_path / "a-file"
    blocked.write_text("")
    monkeypatch.setenv("DFLASH_MLX_CACHE", str(blocked))  # a folder cannot be made under a file
    cpu_kernels.row_softmax_kernel.cache_clear()
    try:
        with pytest.warns(UserWarning, match="set DFLASH_MLX_CACHE to a writable folder"):
            assert cpu_kernels.row_softmax_kernel() is None
    finally:
        cpu_kernels.row_softmax_kernel.cache_clear()


def test_the_library_is_kept_per_machine_mlx_nanobind_and_python(tmp_path, monkeypatch):
    monkeypatch.setenv("DFLASH_MLX_CACHE", str(tmp_path))
    path = cpu_kernels.library_path()
    assert path.is_relative_to(tmp_path / "cpu-kernels")
    monkeypatch.setattr(mx, "__version__", mx.__version__ + ".other")
    assert cpu_kernels.library_path() != path
    assert "-march=native" in cpu_kernels.build_command(path) or sys.platform == "darwin"


def test_cxxflags_come_after_ours_and_keep_a_build_of_their_own(tmp_path, monkeypatch):
    monkeypatch.setenv("DFLASH_MLX_CACHE", str(tmp_path))
    monkeypatch.delenv("CXXFLAGS", raising=False)
    native = cpu_kernels.library_path()
    monkeypatch.setenv("CXXFLAGS", "-march=x86-64-v3 -g")
    command = cpu_kernels.build_command(cpu_kernels.library_path())
    assert cpu_kernels.library_path() != native
    assert command.index("-march=x86-64-v3") > command.index("-O3") and "-g" in command


def test_attention_uses_the_kernel_where_it_is_built(softmax, monkeypatch):
    calls = []
    monkeypatch.setattr(
        fused_ops, "row_softmax_kernel", lambda: lambda x, mask: calls.append(x.shape) or softmax(x, mask)
    )
    q, k, v = (mx.random.normal((2, 4, 3, 8)), mx.random.normal((2, 2, 9, 8)), mx.random.normal((2, 2, 9, 8)))
    got = scaled_dot_product_attention(q, k, v, None, 0.3, "causal")
    assert (
        calls
        and mx.allclose(got, mx.fast.scaled_dot_product_attention(q, k, v, scale=0.3, mask="causal"), atol=1e-6).item()
    )
