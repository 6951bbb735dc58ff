"""Moved to :mod:`lightning_parallel.callbacks.preemption` (also ``from lightning_parallel import Preemption``);
this path keeps working for code written against earlier releases."""

from lightning_parallel.callbacks.preemption import PREEMPTED_FILE, Preemption

__all__ = ["PREEMPTED_FILE", "Preemption"]
