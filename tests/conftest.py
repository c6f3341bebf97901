"""Shared fixtures.  Importing dflash_mlx first lets it load OpenBLAS before mlx."""

import sys
from pathlib import Path

import dflash_mlx  # noqa: F401  (must precede any mlx import)
import pytest

sys.path.insert(0, str(Path(__file__).parent))


@pytest.fixture(scope="session")
def smollm2_dir() -> Path:
    """The real offline default model, converted into the user's cache on first use."""
    from dflash_mlx.registry import smollm2_path

    return smollm2_path(show_progress=False)


@pytest.fixture(scope="session")
def smollm2(smollm2_dir):
    import mlx_lm

    return mlx_lm.load(str(smollm2_dir))
