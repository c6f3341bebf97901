"""Kernels of our own for a CPU, in C++ (cpu/ in the repo, shipped as dflash_mlx/cpu).

    row_softmax   softmax over the last axis of float32 scores: each row read once for its
                  max, once for its exponentials and their sum, and scaled while in cache,
                  16 lanes at a time (MLX's CPU softmax and the max / exp / sum it is otherwise
                  composed of run one element at a time on x86); attention's weights
                  (fused_ops.py)

A kernel is an MLX primitive (lazy, on MLX's streams, as any op; with its gradient), bound with
nanobind into MLX's own nanobind domain so that it takes and returns mx.arrays.  It is built
once per machine (g++ -O3 -march=native, against the installed MLX, nanobind and Python: ~10 s;
$CXX and $CXXFLAGS as make takes them, the flags after ours) into the cache, and loaded from
there: at the first model load, or ahead (scripts/setup.sh).
Where it cannot be built or loaded, one warning says why and how to fix it, and attention keeps
its MLX form.
"""

import hashlib
import importlib.util
import os
import platform
import shlex
import subprocess
import sys
import sysconfig
import warnings
from functools import cache
from pathlib import Path
from typing import Callable, Optional

import mlx.core as mx

from ..io.storage import cache_dir, file_lock, shipped

MODULE = "_row_softmax"
NANOBIND_DOMAIN = "mlx"  # MLX's Python module binds mx.array in this nanobind domain


class BuildError(RuntimeError):
    """A kernel that could not be built or loaded, with the reason in one line."""


def source() -> Path:
    try:
        path = shipped("cpu") / "row_softmax.cpp"
    except FileNotFoundError as e:
        raise BuildError(str(e)) from None
    if not path.is_file():
        raise BuildError(f"its source ({path}) is missing; reinstall the package")
    return path


def _machine() -> str:
    """What -march=native builds for: the CPU's model and feature flags where Linux tells them."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        lines = []
    wanted = ("model name", "flags", "Features", "CPU part")
    return "\n".join(sorted({line for line in lines if line.startswith(wanted)})) or platform.processor()


def _toolchain():
    """nanobind, or a BuildError naming the fix."""
    try:
        import nanobind
    except ImportError:
        raise BuildError("nanobind is not installed (pip install 'nanobind>=3')") from None
    return nanobind


def library_path() -> Path:
    """Where the kernels built for this machine, MLX, nanobind and Python are kept."""
    nanobind = _toolchain()
    flags = extra_flags()
    key = hashlib.sha256()
    for part in (
        source().read_bytes(),
        mx.__version__.encode(),
        nanobind.__version__.encode(),
        sys.version.encode(),
        platform.machine().encode(),
        _machine().encode(),
        *([flags.encode()] if flags else []),  # the default build keeps its key
    ):
        key.update(part + b"\0")
    return cache_dir() / "cpu-kernels" / key.hexdigest()[:16] / f"{MODULE}{sysconfig.get_config_var('EXT_SUFFIX')}"


def extra_flags() -> str:
    """$CXXFLAGS: flags after ours, so that they win (-march=x86-64-v3 for code valgrind runs)."""
    return os.environ.get("CXXFLAGS", "").strip()


def build_command(output: Path) -> list[str]:
    nanobind = _toolchain()
    mlx_root = Path(mx.__file__).parent
    nanobind_root = Path(nanobind.include_dir()).parent
    command = [
        *shlex.split(os.environ.get("CXX", "g++")),
        "-std=c++20",
        "-O3",
        "-mcpu=native" if platform.machine() in ("arm64", "aarch64") else "-march=native",
        "-fPIC",
        "-shared",
        "-fvisibility=hidden",
        "-DNDEBUG",
        *shlex.split(extra_flags()),
        f"-DNB_DOMAIN={NANOBIND_DOMAIN}",
        f"-I{nanobind.include_dir()}",
        f"-I{nanobind_root / 'ext' / 'robin_map' / 'include'}",
        f"-I{sysconfig.get_paths()['include']}",
        f"-I{mlx_root / 'include'}",
        str(source()),
        str(Path(nanobind.source_dir()) / "nb_combined.cpp"),
        f"-L{mlx_root / 'lib'}",
        "-lmlx",
        f"-Wl,-rpath,{mlx_root / 'lib'}",
        "-o",
        str(output),
    ]
    if sys.platform == "darwin":
        command[-2:-2] = ["-undefined", "dynamic_lookup"]  # Python's symbols come from the interpreter
    return command


def build() -> Path:
    """The kernels' library, built if this machine has none yet (two processes: one builds,
    the other waits and loads it)."""
    output = library_path()
    with file_lock(output.parent.with_suffix(".lock")):
        if output.exists():
            return output
        output.parent.mkdir(parents=True, exist_ok=True)
        partial = output.with_name(f".{output.name}.{os.getpid()}")
        print("dflash-mlx: building the CPU softmax kernel for this machine (once, ~10 s)", file=sys.stderr)
        try:
            done = subprocess.run(build_command(partial), capture_output=True, text=True)
        except OSError as e:
            raise BuildError(f"no C++ compiler ({e.strerror}: {e.filename}); install g++ or set CXX") from None
        if done.returncode != 0:
            partial.unlink(missing_ok=True)
            errors = [line for line in done.stderr.splitlines() if "error" in line] or done.stderr.splitlines()
            raise BuildError(f"the C++ build failed ({(errors or ['no output'])[0].strip()})")
        os.replace(partial, output)  # whole or absent: a reader never loads half a library
    return output


def load(path: Path):
    spec = importlib.util.spec_from_file_location(MODULE, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@cache
def row_softmax_kernel() -> Optional[Callable[..., mx.array]]:
    """The row softmax kernel, built and loaded (checked on a small input), or None with one
    warning saying why (attention then keeps its MLX form)."""
    try:
        module = load(build())
        probe = mx.array([[0.0, -mx.inf, 1.0]])
        if not mx.allclose(module.row_softmax(probe), mx.softmax(probe, axis=-1)).item():
            raise BuildError("its output differs from MLX's softmax")
        return module.row_softmax
    except BuildError as e:
        reason = str(e)
    except (ImportError, TypeError) as e:  # an MLX built against another nanobind
        reason = f"it does not load into this MLX ({str(e).splitlines()[0]})"
    except OSError as e:
        reason = f"it cannot be kept in {cache_dir()} ({e.strerror}); set DFLASH_MLX_CACHE to a writable folder"
    warnings.warn(f"dflash-mlx: no CPU softmax kernel: {reason}; attention runs at MLX's speed", stacklevel=2)
    return None
