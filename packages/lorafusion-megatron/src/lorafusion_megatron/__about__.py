"""Version of the lorafusion-megatron distribution (read by hatchling)."""

__version__ = "0.1.0"
