"""``python -m benchmarks.fp8_convergence [--steps 200] [--seeds 0,1] [--recipes tensorwise] [--model gpt_tiny]
[--control 32-true]``: the GPT recipe (one process, ``strategy=hybrid3d``) trained for ``--steps`` under
``precision=bf16-mixed`` and under ``precision=fp8`` (emulated on a CPU) for each seed, and the final validation
losses side by side (BENCHMARKS.md, "FP8 against bf16"). ``--control``: also a run at another precision (fp32), for
how far a change that is not fp8 moves the same seed's loss. Each run logs its training loss every step; the table's
last column is the first step at which a run's training loss parts from bf16's by more than 1% (same seed: the same
initial weights and the same batches, ``DistributedSampler(seed=cfg.seed)``). Each run is the recipe as a user starts
it, in a scratch folder."""

from __future__ import annotations

import argparse
import csv
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def run(folder: Path, precision: str, seed: int, steps: int, recipe: str | None, model: str) -> dict:
    """Train once; returns metrics.json with ``train_losses`` (step -> training loss) added."""
    out = folder / f"{model}-{precision}-{recipe or 'plain'}-seed{seed}"
    cmd = [sys.executable, str(ROOT / "recipes" / "train_gpt.py"), "strategy=hybrid3d", "trainer.devices=1",
           f"precision={precision}", f"seed={seed}", f"trainer.max_steps={steps}", f"model={model}",
           f"trainer.val_check_interval={steps}", "trainer.limit_val_batches=8", "trainer.log_every_n_steps=1",
           f"hydra.run.dir={out}"]  # fmt: skip
    cmd += [f"precision.recipe={recipe}"] if recipe else []
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    subprocess.run(cmd, cwd=folder, env=env, check=True, capture_output=True)
    metrics = json.loads((out / "metrics.json").read_text())
    with next(out.glob("logs/version_*/metrics.csv")).open() as f:
        rows = [r for r in csv.DictReader(f) if r.get("train_loss")]
    metrics["train_losses"] = {int(r["step"]): float(r["train_loss"]) for r in rows}
    return metrics


def parting_step(got: dict[int, float], want: dict[int, float], rel: float = 0.01) -> int | None:
    """The first step at which ``got``'s training loss is more than ``rel`` away from ``want``'s (None: never)."""
    return next((s for s in sorted(want) if s in got and abs(got[s] / want[s] - 1) > rel), None)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.fp8_convergence", description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--seeds", default="0,1")
    p.add_argument("--recipes", default="tensorwise", help="comma-separated fp8 recipes (tensorwise, rowwise)")
    p.add_argument("--model", default="gpt_tiny", help="the recipe's model group (gpt_tiny, gpt_bench, gpt_small)")
    p.add_argument("--control", default="", help="comma-separated other precisions to run beside (32-true)")
    args = p.parse_args(argv)
    folder = Path(tempfile.mkdtemp(prefix="fp8_convergence_"))
    print(f"model={args.model}, {args.steps} steps")
    print("| seed | bf16-mixed val loss | run | val loss | / bf16 - 1 | train loss parts by >1% at step |")
    print("|---|---|---|---|---|---|")
    for seed in (int(s) for s in args.seeds.split(",")):
        bf16 = run(folder, "bf16-mixed", seed, args.steps, None, args.model)
        others = [("fp8", r, f"fp8 {r}") for r in args.recipes.split(",")]
        others += [(c, None, c) for c in args.control.split(",") if c]
        for precision, recipe, label in others:
            got = run(folder, precision, seed, args.steps, recipe, args.model)
            ratio = got["final_val_loss"] / bf16["final_val_loss"] - 1
            part = parting_step(got["train_losses"], bf16["train_losses"])
            print(
                f"| {seed} | {bf16['final_val_loss']:.4f} | {label} | {got['final_val_loss']:.4f} | {ratio:+.1%} "
                f"| {part if part is not None else 'never'} |",
                flush=True,
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
