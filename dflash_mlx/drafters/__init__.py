"""Drafter models: DFlash 1 (`dflash.py`) and DFlash 2 (`dflash2.py`) layers, the model
that assembles either (`model.py`), its z-lab config (`config.py`), its drafting
vocabulary (`vocab.py`), and reading / writing drafter directories (`loading.py`)."""

from .config import DraftArgs, DraftLoadError
from .loading import load_draft, save_draft
from .model import DFlashDraftModel

__all__ = ["DraftArgs", "DraftLoadError", "DFlashDraftModel", "load_draft", "save_draft"]
