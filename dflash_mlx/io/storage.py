"""Where dflash-mlx reads and writes: the cache, Hugging Face downloads, and
writes that are all-or-nothing.

    staged(out)     a staging dir that becomes `out` only when the work finishes;
                    removed on errors, Ctrl-C and SIGTERM, and swept by the next
                    writer if its process died some other way (its name holds the pid)
    file_lock(path) one process at a time (two first uses of the default model)
    writable(dir)   checked before long work, so it never fails at its end
    shipped(folder) a folder of kernel sources shipped with the package (metal/, cpu/)
"""

import errno
import fcntl
import os
import shutil
import signal
import tempfile
import threading
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator, Sequence

CACHE_ENV = "DFLASH_MLX_CACHE"


def cache_dir() -> Path:
    """$DFLASH_MLX_CACHE (when set and not empty), else ~/.cache/dflash-mlx."""
    return Path(os.environ.get(CACHE_ENV) or Path.home() / ".cache" / "dflash-mlx").expanduser()


def shipped(folder: str) -> Path:
    """A folder of kernel sources shipped with the package: dflash_mlx/<folder> when installed,
    <folder> at the top of the repo in a source checkout."""
    package = Path(__file__).parent.parent
    for candidate in (package / folder, package.parent / folder):  # installed wheel, source checkout
        if candidate.is_dir():
            return candidate
    raise FileNotFoundError(f"kernel sources ({folder}/) not found next to {package}; reinstall the package")


def looks_like_path(name: str) -> bool:
    return name.startswith((".", "/", "~")) or name.count("/") > 1 or os.sep + os.sep in name


def fetch(repo_or_path: str, patterns: Sequence[str]) -> Path:
    """A local directory as is, else a Hugging Face snapshot of `repo_or_path`."""
    path = Path(repo_or_path).expanduser()
    if path.exists():
        return path
    if looks_like_path(repo_or_path):
        raise FileNotFoundError(f"no directory at {repo_or_path}")
    from huggingface_hub import snapshot_download

    try:
        return Path(snapshot_download(repo_or_path, allow_patterns=list(patterns)))
    except Exception as e:
        reason = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise FileNotFoundError(
            f"could not get {repo_or_path} from Hugging Face ({reason}); "
            "check the name and your connection, or pass a local directory"
        ) from None


def writable(folder: Path, what: str = "output") -> Path:
    """Prove a file can be written in `folder` (or where it would be created), without
    leaving anything behind; a clear error if not."""
    folder = Path(folder)
    probe = folder
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent
    hint = f" (set {CACHE_ENV} to a writable folder)" if what == "cache" else ""
    if not probe.is_dir():
        raise PermissionError(f"cannot write the {what} folder {folder}: {probe} is not a folder{hint}")
    try:
        with tempfile.NamedTemporaryFile(dir=probe, prefix=".write-test-"):
            pass
    except OSError as e:
        reason = os.strerror(e.errno) if e.errno else str(e)
        raise PermissionError(f"cannot write the {what} folder {folder}: {reason}{hint}") from None
    return folder


@contextmanager
def file_lock(path: Path) -> Iterator[None]:
    """An exclusive lock held while the block runs (other processes wait)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except OSError as e:
        return e.errno == errno.EPERM
    return True


def sweep_stale(parent: Path, name: str) -> None:
    """Remove staging dirs for `name` left by writers that no longer run
    (a staging dir is named .NAME.PID.RANDOM)."""
    for stale in parent.glob(f".{name}.*"):
        pid = stale.name[len(name) + 2 :].split(".")[0]
        if stale.is_dir() and pid.isdigit() and not _alive(int(pid)):
            shutil.rmtree(stale, ignore_errors=True)


@contextmanager
def _sigterm_unwinds() -> Iterator[None]:
    """Turn SIGTERM into SystemExit while the block runs, so `finally` clauses clean up."""
    if (
        threading.current_thread() is not threading.main_thread()
        or signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL
    ):
        yield
        return

    def stop(signum, frame):
        raise SystemExit(128 + signum)

    signal.signal(signal.SIGTERM, stop)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)


@contextmanager
def staged(out: Path, force: bool) -> Iterator[Path]:
    """A temp dir that becomes `out` only if the block finishes."""
    out = Path(out)
    if out.exists() and not force:
        raise FileExistsError(f"{out} already exists; pass --force to overwrite it")
    writable(out.parent)
    out.parent.mkdir(parents=True, exist_ok=True)
    sweep_stale(out.parent, out.name)
    with _sigterm_unwinds():
        staging = Path(tempfile.mkdtemp(prefix=f".{out.name}.{os.getpid()}.", dir=out.parent))
        try:
            staging.chmod(0o755)
            yield staging
            if out.exists():
                # move the old output aside first: the rename below is then atomic
                old = Path(tempfile.mkdtemp(prefix=f".{out.name}.{os.getpid()}.", dir=out.parent))
                os.replace(out, old / "old")
                shutil.rmtree(old, ignore_errors=True)
            os.replace(staging, out)
        finally:
            shutil.rmtree(staging, ignore_errors=True)


def atomic_write(path: Path, data: bytes | str) -> None:
    """Write `path` through a temp file and a rename: readers see the old or the new file."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    handle, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        with os.fdopen(handle, "wb") as f:
            f.write(data.encode() if isinstance(data, str) else data)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
