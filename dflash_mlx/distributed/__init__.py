"""Running one target over several machines with mlx.distributed (pipeline.py)."""


class DistributedError(RuntimeError):
    """A rank was lost or never answered."""
