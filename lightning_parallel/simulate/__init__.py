"""The simulator: a layout checked at its real world size, in one machine, from the code that will run it
(``python -m lightning_parallel.simulate``; docs/simulate.md).

For each chosen rank, a fresh process joins torch's fake process group as that rank of the full world, builds the
package's model on the meta device, splits it with the strategies' own ``parallelize()`` and sharding, and runs a
few real training steps on fake tensors (:mod:`.rank`; pipeline stages under their schedule, given static shapes:
:mod:`.pipeline`); what each rank holds (model states, torch's memory tracker's
peak), sends (every collective, by mesh axis) and computes (counted FLOPs) is measured, the ranks of each group are
checked to issue the same collectives (:mod:`.trace`), and the step is timed on the planner's cluster model
(:mod:`.timing`).

May import: ``parallel``, ``planning``, the model packages (``models``, ``hf``, ``litgpt``) and ``plan`` (the recipe
models' configs). A command-line package: nothing below imports it.
"""

from lightning_parallel.simulate.api import Simulation, default_ranks, simulate

__all__ = ["Simulation", "default_ranks", "simulate"]
