"""Checkpoints a stopped run resumes from, and the exported release."""

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Optional

import mlx.core as mx
from mlx.utils import tree_flatten, tree_map

from ..drafters import DFlashDraftModel, save_draft
from .config import TrainConfig


@dataclass
class TrainState:
    step: int = 0
    epoch: float = 0
    tokens_seen: int = 0  # target tokens passed over (features + labels)
    history: list = field(default_factory=list)  # one dict per logged step


def checkpoint_config(out_dir) -> Optional[dict]:
    """The training config a run in `out_dir` would resume with (None: no checkpoint)."""
    state = Path(out_dir) / "checkpoint" / "state.json"
    return json.loads(state.read_text())["config"] if state.is_file() else None


def save_checkpoint(path: Path, draft, optimizer, cfg: TrainConfig, state: TrainState) -> None:
    path.mkdir(parents=True, exist_ok=True)
    save_draft(draft, path / "drafter")
    mx.save_safetensors(str(path / "optimizer.safetensors"), dict(tree_flatten(optimizer.state)))
    (path / "state.json").write_text(json.dumps({"config": asdict(cfg), "state": asdict(state)}))
    (path.parent / "train_log.jsonl").write_text("".join(json.dumps(r) + "\n" for r in state.history))


def export(draft: DFlashDraftModel, out_dir: Path, dtype: mx.Dtype = mx.bfloat16) -> Path:
    """The release: a z-lab format drafter in bf16, as z-lab ships them."""
    release = DFlashDraftModel(draft.args)
    release.update(tree_map(lambda p: p.astype(dtype), draft.parameters()))
    if draft.vocab_ids is not None:
        release.restrict_vocab(draft.vocab_ids.tolist())
    return save_draft(release, out_dir)
