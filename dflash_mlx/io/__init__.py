"""Where bytes come from and go to: the cache folder, Hugging Face fetches and staged
writes (`storage.py`), OpenBLAS for MLX's CPU backend (`blas.py`), progress bars and the
console (`progress.py`).  Imports nothing else of the package."""
