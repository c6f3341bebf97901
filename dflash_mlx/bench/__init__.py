"""Benchmarking: the interleaved plain-vs-DFlash harness (`harness.py`, `dflash-mlx bench`),
the offline benchmark prompt sets (`prompt_sets.py`) and plots (`plots.py`)."""
