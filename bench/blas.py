"""fp32 matmul throughput of MLX's CPU backend, with or without OpenBLAS.

python bench/blas.py                              # OpenBLAS (when installed)
DFLASH_MLX_NO_OPENBLAS=1 python bench/blas.py     # the wheel's reference BLAS
"""

import time

import dflash_mlx  # noqa: F401  (loads OpenBLAS before mlx)
import mlx.core as mx
from dflash_mlx.io import blas


def gflops(n: int = 1024, repeats: int = 10) -> float:
    a, b = mx.random.normal((n, n)), mx.random.normal((n, n))
    mx.eval(a @ b)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        mx.eval(a @ b)
        times.append(time.perf_counter() - start)
    return 2 * n**3 / sorted(times)[len(times) // 2] / 1e9


if __name__ == "__main__":
    print(f"BLAS: {blas.status()}")
    print(f"1024x1024 fp32 matmul: {gflops():.1f} GFLOP/s (median of 10)")
