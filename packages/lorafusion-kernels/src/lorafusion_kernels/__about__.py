"""Version of the lorafusion-kernels distribution (read by hatchling)."""

__version__ = "0.1.0"
