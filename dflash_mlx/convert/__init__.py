"""Conversion: GGUF -> mlx-lm directories (`gguf.py`), drafters and targets prepared and
quantized for a Mac (`models.py`, `dflash-mlx convert`)."""
