"""Moved to :mod:`lightning_parallel.callbacks.resume` (also ``from lightning_parallel import ExactResume``); this
path keeps working for code written against earlier releases."""

from lightning_parallel.callbacks.resume import ExactResume, ResumableDataLoader, ResumableSampler

__all__ = ["ExactResume", "ResumableDataLoader", "ResumableSampler"]
