"""Version of the lorafusion-sched distribution (read by hatchling)."""

__version__ = "0.1.0"
