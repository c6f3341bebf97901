"""Shared fixtures.  Importing dflash_mlx first lets it load OpenBLAS before mlx."""

import json
import shutil
import sys
from pathlib import Path

import dflash_mlx  # noqa: F401  (must precede any mlx import)
import mlx.core as mx
import pytest

sys.path.insert(0, str(Path(__file__).parent))


@pytest.fixture(autouse=True)
def cpu_unless_marked_metal(request):
    """On a Mac, tests not marked `metal` run on the CPU, as they do everywhere else: their fp32
    exactness checks compare target passes of different shapes, which MLX's CPU backend computes
    bit-reproducibly and a GPU's shape-specialised matmul kernels need not.  Tests marked `metal`
    keep the GPU."""
    if request.node.get_closest_marker("metal") or not mx.metal.is_available():
        yield
        return
    previous = mx.default_device()
    mx.set_default_device(mx.cpu)
    try:
        yield
    finally:
        mx.set_default_device(previous)


@pytest.fixture(scope="session")
def smollm2_dir() -> Path:
    """The real offline default model, converted into the user's cache on first use."""
    from dflash_mlx.convert.smollm2 import smollm2_path

    return smollm2_path(show_progress=False)


@pytest.fixture(scope="session")
def smollm2(smollm2_dir):
    import mlx_lm

    return mlx_lm.load(str(smollm2_dir))


@pytest.fixture(scope="session")
def gemma3_dir() -> Path:
    """Gemma 3 270M (base), float32, converted into the user's cache on first use."""
    from dflash_mlx.convert.gemma3 import gemma3_path

    return gemma3_path("float32", show_progress=False)


@pytest.fixture(scope="session")
def tiny_dirs(tmp_path_factory):
    """A tiny llama model dir (tokenizer and chat template included) and a drafter for it."""
    from dflash_mlx import load
    from dflash_mlx.convert.models import convert_target
    from dflash_mlx.drafters import save_draft
    from gguf_fixtures import write_gguf
    from tiny_models import random_draft

    root = tmp_path_factory.mktemp("tiny")
    write_gguf(root / "m.gguf", "llama", "F32")
    model_dir = convert_target(str(root / "m.gguf"), root / "model", show_progress=False)
    model, _ = load(str(model_dir), use_draft=False, adaptive=False)
    save_draft(random_draft(model.target, layer_ids=(0, 1), block_size=4), root / "draft")
    return model_dir, root / "draft"


WIDE = 65_536  # a window that holds every agent's first request, in the tiny tokenizer's many tokens


@pytest.fixture(scope="session")
def wide_dirs(tiny_dirs, tmp_path_factory):
    """The tiny model with a window of WIDE tokens (its config says so; the weights are the same)."""
    model_dir, draft_dir = tiny_dirs
    wide = tmp_path_factory.mktemp("wide") / "model"
    shutil.copytree(model_dir, wide)
    config = json.loads((wide / "config.json").read_text())
    (wide / "config.json").write_text(json.dumps({**config, "max_position_embeddings": WIDE}))
    return wide, draft_dir
