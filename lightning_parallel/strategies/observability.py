"""Moved to :mod:`lightning_parallel.callbacks.monitor` (also ``from lightning_parallel import TrainingMonitor``);
this path keeps working for code written against earlier releases."""

from lightning_parallel.callbacks.monitor import TrainingMonitor

__all__ = ["TrainingMonitor"]
