"""The step-time model's calibrated constants and its overlap rule, shared by the analytic planner
(:mod:`.analytic`, from formulas) and the simulator (:mod:`lightning_parallel.simulate.timing`, from the recorded
collectives and counted FLOPs), so both time a layout alike. Pure Python.

What hides behind compute and what does not:

- tensor, context (Ulysses) and expert parallelism's collectives sit between a layer's matmuls, which wait for
  them: on the critical path, all exposed;
- the pipeline's bubble is the schedule's (:mod:`lightning_parallel.parallel.pipeline.schedules`);
- data parallelism's collectives (ZeRO-3's per-layer parameter gathers, the gradient reductions) run beside the
  compute of other layers: at most ``overlap`` of the compute they run beside hides them, the rest is exposed.
  A group that crosses nodes gets its rank's own network card (the node's bandwidth over its GPUs) at
  ``inter_link`` of nominal: so ZeRO-3 across a thousand GPUs, a full gather of the model twice a step and a
  reduce-scatter through one card per GPU, is bound by the network, not by compute.

Three free parameters (and the simulator's fourth), fitted on part of the published runs (:mod:`.calibrate`) and
held against the rest.
"""

from __future__ import annotations

from dataclasses import dataclass

INTRA_LINK = 0.8  # of NVLink's nominal bandwidth inside a node (NCCL's bus bandwidth); not fitted


@dataclass(frozen=True)
class Calibration:
    """The time model's free parameters.

    Attributes:
        compute: achieved-FLOP scale: each device's large-GEMM and fused-attention efficiencies (the device
            table's) are multiplied by it.
        inter_link: the fraction of a GPU's share of its node's network bandwidth that collectives crossing nodes
            achieve.
        overlap: the fraction of the compute that data-parallel collectives (ZeRO-3's gathers, gradient
            reductions under overlap) can hide behind.
        achieved: the simulator's compute: the fraction of the calibrated large-GEMM rate a step's counted FLOPs
            run at end to end (attention, elementwise work and small GEMMs included, which the planner models one
            by one). Fitted after the other three, on the same rows.
    """

    compute: float
    inter_link: float
    overlap: float
    achieved: float = 1.0


# fitted by ``python -m lightning_parallel.planning.calibrate`` (tests/test_calibrate.py checks it is the fit)
CALIBRATION = Calibration(compute=1.0, inter_link=0.75, overlap=0.6, achieved=0.79)
# the planner's figures before calibration (the host model's fit, benchmarks/auto_sweep.py, keeps these)
NOMINAL = Calibration(compute=1.0, inter_link=INTRA_LINK, overlap=1.0)


def exposed_dp(reduce: float, gathers: float, compute: float, overlap: float, hide_reduce: bool, m: int = 1) -> float:
    """Exposed seconds of a step's data-parallel collectives.

    Args:
        reduce: seconds of the gradient reduction after the last microbatch (hidden behind its backward, two
            thirds of its compute, when ``hide_reduce``: ZeRO-3 or ``overlap_grad_reduce``), in what the
            parameter gathers leave of that window (one network for both).
        gathers: seconds of ZeRO-3's parameter all-gathers of one microbatch (prefetched behind its compute).
        compute: seconds of one microbatch's compute.
        overlap: :attr:`Calibration.overlap`.
        m: microbatches per step (the gathers are issued for each).
    """
    window = overlap * compute
    hidden = min(max(0.0, window - gathers), window * 2 / 3) if hide_reduce else 0.0
    return m * max(0.0, gathers - window) + max(0.0, reduce - hidden)
