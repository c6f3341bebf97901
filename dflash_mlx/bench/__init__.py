"""Benchmarking: the interleaved plain-vs-DFlash harness (`harness.py`, `dflash-mlx bench`),
the offline benchmark prompt sets (`prompt_sets.py`), plots (`plots.py`) and decodings
timed in turns (`turns.py`)."""
