"""Rich progress bars for the long jobs (downloads, conversion, training, benchmarks)."""

from contextlib import contextmanager
from typing import Iterator, Optional

from rich.console import Console
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
)

console = Console(stderr=True)


class _Silent:
    def add_task(self, *args, **kwargs):
        return 0

    def update(self, *args, **kwargs):
        pass

    def advance(self, *args, **kwargs):
        pass


@contextmanager
def progress(enabled: bool = True, transient: bool = False) -> Iterator[Progress]:
    """A Progress on stderr, or a silent stand-in when `enabled` is False."""
    if not enabled:
        yield _Silent()
        return
    with Progress(
        TextColumn("[bold]{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("{task.fields[info]}"),
        TimeElapsedColumn(),
        TimeRemainingColumn(),
        console=console,
        transient=transient,
    ) as bar:
        yield bar


def add_task(bar, description: str, total: Optional[float], info: str = "") -> int:
    return bar.add_task(description, total=total, info=info)
