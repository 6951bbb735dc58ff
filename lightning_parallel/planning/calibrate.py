"""The time model's three free parameters (:class:`.timemodel.Calibration`) fitted on part of the published runs
and held against the rest: ``python -m lightning_parallel.planning.calibrate`` prints the fit, each row's error and
the held-out error (the table of docs/planner.md, recomputed by tests/test_calibrate.py).

Fitted rows: every other row of Megatron-LM's Table 1 (the first, third, ...), the first of Llama 3's Table 4, and
the 384- and 768-GPU rows of ZeRO-3 and the 384-GPU row of PTD-P from Megatron-LM's Table 2. Held out: the others
(five of Table 1, two of Table 4, ZeRO-3 and PTD-P at 1,536 GPUs, PTD-P at 768). The fit minimizes the mean
squared log error of TFLOP/s per GPU over a grid; nothing of a held-out row enters it.
"""

from __future__ import annotations

import itertools
import math
import sys
from dataclasses import dataclass, replace

from lightning_parallel.planning.published import RUNS, ZERO3_RUNS, Run
from lightning_parallel.planning.search import complete
from lightning_parallel.planning.timemodel import CALIBRATION, Calibration

ALL_RUNS = [*RUNS, *ZERO3_RUNS]
FITTED = {
    *(run.label for run in RUNS[:10:2]),  # Megatron-LM Table 1: 1.7B, 7.5B, 39.1B, 145.6B, 529.6B
    RUNS[10].label,  # Llama 3 405B on 8,192 GPUs
    *(run.label for run in ZERO3_RUNS if run.cluster.gpus in (384, 768) and "ZeRO" in run.label),
    ZERO3_RUNS[3].label,  # PTD-P at 384
}
ACHIEVED = [round(0.5 + 0.01 * i, 2) for i in range(51)]
GRID = {
    "compute": [round(0.8 + 0.02 * i, 2) for i in range(21)],
    "inter_link": [round(0.3 + 0.05 * i, 2) for i in range(15)],
    "overlap": [round(0.1 * i, 1) for i in range(11)],
}


@dataclass(frozen=True)
class RowError:
    """One published run against the time model: predicted and published TFLOP/s per GPU, whether it was fitted."""

    label: str
    source: str
    gpus: int
    fitted: bool
    published: float
    predicted: float

    @property
    def error(self) -> float:
        return self.predicted / self.published - 1


def predict(run: Run, cal: Calibration, counted: bool = False) -> float:
    """TFLOP/s per GPU of ``run``'s published layout under calibration ``cal`` (the fields its paper leaves open
    chosen by the planner). ``counted``: the simulator's variant, the planner's compute (and the bubble, a share of
    it) replaced by the step's counted FLOPs at ``cal.achieved`` of the calibrated GEMM rate, its communication
    and overlap kept."""
    cluster = replace(run.cluster, calibration=cal)
    est = complete(run.shape, cluster, run.layout, run.workload, run.free)
    assert est is not None, run.label
    if not counted:
        return est.tflops_per_gpu
    flops = est.tflops_per_gpu * 1e12 * est.step_time  # per GPU and step, as the run's source counts them
    compute = flops / (cluster.device.peak_flops * cluster.efficiency("gemm") * cal.achieved)
    scale = compute / est.times["compute"]
    step = est.step_time + (scale - 1) * (est.times["compute"] + est.times["bubble"])
    return flops / step / 1e12


def loss(cal: Calibration, runs: list[Run], counted: bool = False) -> float:
    """Mean squared log error of TFLOP/s per GPU over ``runs``."""
    return sum(math.log(predict(run, cal, counted) / run.tflops) ** 2 for run in runs) / len(runs)


def fit() -> Calibration:
    """The grid point of least :func:`loss` on the fitted rows (ties: the first in grid order)."""
    runs = [run for run in ALL_RUNS if run.label in FITTED]
    best, best_loss = None, math.inf
    for values in itertools.product(*GRID.values()):
        cal = Calibration(**dict(zip(GRID, values)))
        value = loss(cal, runs)
        if value < best_loss - 1e-12:
            best, best_loss = cal, value
    assert best is not None
    achieved = min(ACHIEVED, key=lambda a: loss(replace(best, achieved=a), runs, counted=True))
    return replace(best, achieved=achieved)


def rows(cal: Calibration = CALIBRATION, counted: bool = False) -> list[RowError]:
    return [
        RowError(run.label, run.source, run.cluster.gpus, run.label in FITTED, run.tflops, predict(run, cal, counted))
        for run in ALL_RUNS
    ]


def summary(errors: list[RowError]) -> dict[str, float]:
    """Mean and largest absolute error, fitted and held out."""
    out = {}
    for name, part in (("fitted", True), ("held_out", False)):
        errs = [abs(r.error) for r in errors if r.fitted == part]
        out[f"{name}_mean"], out[f"{name}_max"] = sum(errs) / len(errs), max(errs)
    return out


def table(cal: Calibration = CALIBRATION) -> str:
    """The Markdown table of docs/planner.md: every row, the planner's prediction and the simulator's variant (the
    counted FLOPs), their errors, then the errors summed up."""
    errors, counted = rows(cal), rows(cal, counted=True)
    lines = [
        "| run | source | GPUs | fitted or held out | published TFLOP/s per GPU | planner (error) | counted-FLOP "
        "model (error) |",
        "|---|---|---|---|---|---|---|",
    ]
    for r, c in zip(errors, counted):
        part = "fitted" if r.fitted else "**held out**"
        lines.append(
            f"| {r.label} | {r.source} | {r.gpus:,} | {part} | {r.published:.0f} | {r.predicted:.1f} ({r.error:+.1%}) "
            f"| {c.predicted:.1f} ({c.error:+.1%}) |"
        )
    s, k = summary(errors), summary(counted)
    lines.append("")
    lines.append(
        f"Calibration `compute={cal.compute}, inter_link={cal.inter_link}, overlap={cal.overlap}, "
        f"achieved={cal.achieved}`. Planner: fitted rows {s['fitted_mean']:.1%} mean, {s['fitted_max']:.1%} largest "
        f"absolute error; held-out rows {s['held_out_mean']:.1%} mean, {s['held_out_max']:.1%} largest. "
        f"Counted-FLOP model (the simulator's): fitted {k['fitted_mean']:.1%} mean, {k['fitted_max']:.1%} largest; "
        f"held out {k['held_out_mean']:.1%} mean, {k['held_out_max']:.1%} largest."
    )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    cal = fit() if "--fit" in argv else CALIBRATION
    if "--fit" in argv:
        print(f"fitted: {cal}" + ("" if cal == CALIBRATION else f" (timemodel.CALIBRATION is {CALIBRATION})"))
    print(table(cal))
    return 0


if __name__ == "__main__":
    sys.exit(main())
