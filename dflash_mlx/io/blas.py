"""Make MLX's CPU backend use OpenBLAS on Linux.

The mlx-cpu wheel links a single-threaded reference BLAS that is ~10x slower for
fp32 matmuls.  Loading OpenBLAS's ``libblas.so.3`` into the global symbol scope
*before* ``mlx.core`` is first imported makes MLX resolve its BLAS calls to it.
Importing mlx first makes this a no-op (the binding is fixed when mlx loads), which
``status()`` reports and a RuntimeWarning says once, with the fix.
"""

import ctypes
import os
import platform
import sys
import warnings

OPENBLAS_DIRS = (
    "/usr/lib/x86_64-linux-gnu/openblas-pthread",
    "/usr/lib/aarch64-linux-gnu/openblas-pthread",
    "/usr/lib64/openblas-pthread",
)
DISABLE_ENV = "DFLASH_MLX_NO_OPENBLAS"

_status = "not attempted"


def load_openblas() -> str:
    global _status
    if platform.system() != "Linux":
        _status = "not needed (not Linux)"
    elif os.environ.get(DISABLE_ENV):
        _status = f"disabled by {DISABLE_ENV}"
    elif "mlx.core" in sys.modules:
        _status = "not loaded: mlx was imported before dflash_mlx"
        if _find() is not None:
            warnings.warn(
                "mlx was imported before dflash_mlx, so MLX keeps its bundled single-threaded "
                "reference BLAS (fp32 matmuls ~10x slower on this CPU); import dflash_mlx before "
                "mlx or mlx_lm",
                RuntimeWarning,
                stacklevel=3,
            )
    else:
        _status = "not found (apt install libopenblas0-pthread for ~10x faster fp32)"
        path = _find()
        if path is not None:
            try:
                ctypes.CDLL(path, mode=ctypes.RTLD_GLOBAL)
                _status = f"OpenBLAS ({path})"
            except OSError as e:
                _status = f"failed to load {path}: {e}"
    return _status


def _find():
    for folder in OPENBLAS_DIRS:
        path = os.path.join(folder, "libblas.so.3")
        if os.path.exists(path):
            return path
    return None


def status() -> str:
    return _status


def slow_notice() -> str | None:
    """One line for a Linux user whose fp32 runs on the reference BLAS for want of OpenBLAS
    (None when OpenBLAS is in use, not applicable, or turned off on purpose)."""
    if not _status.startswith("not found"):
        return None
    return (
        "note: MLX is using its bundled single-threaded reference BLAS, ~10x slower for float32 on "
        "this CPU; install OpenBLAS (Debian/Ubuntu: sudo apt install libopenblas0-pthread) and rerun"
    )
