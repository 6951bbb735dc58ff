"""``python -m benchmarks.fp8_convergence [--steps 200] [--seeds 0,1] [--recipes tensorwise]``: the GPT recipe
(gpt_tiny, one process, ``strategy=hybrid3d``) trained for ``--steps`` under ``precision=bf16-mixed`` and under
``precision=fp8`` (emulated on a CPU) for each seed, and the final validation losses side by side (BENCHMARKS.md,
"FP8 against bf16"). Each run is the recipe as a user starts it, in a scratch folder."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def run(folder: Path, precision: str, seed: int, steps: int, recipe: str | None) -> dict:
    out = folder / f"{precision}-{recipe or 'bf16'}-seed{seed}"
    cmd = [sys.executable, str(ROOT / "recipes" / "train_gpt.py"), "strategy=hybrid3d", "trainer.devices=1",
           f"precision={precision}", f"seed={seed}", f"trainer.max_steps={steps}",
           f"trainer.val_check_interval={steps}", "trainer.limit_val_batches=8", f"hydra.run.dir={out}"]  # fmt: skip
    cmd += [f"precision.recipe={recipe}"] if recipe else []
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    subprocess.run(cmd, cwd=folder, env=env, check=True, capture_output=True)
    return json.loads((out / "metrics.json").read_text())


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.fp8_convergence", description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--seeds", default="0,1")
    p.add_argument("--recipes", default="tensorwise", help="comma-separated fp8 recipes (tensorwise, rowwise)")
    args = p.parse_args(argv)
    folder = Path(tempfile.mkdtemp(prefix="fp8_convergence_"))
    print("| seed | bf16-mixed val loss | fp8 recipe | fp8 val loss | fp8 / bf16 - 1 |")
    print("|---|---|---|---|---|")
    for seed in (int(s) for s in args.seeds.split(",")):
        bf16 = run(folder, "bf16-mixed", seed, args.steps, None)["final_val_loss"]
        for recipe in args.recipes.split(","):
            fp8 = run(folder, "fp8", seed, args.steps, recipe)["final_val_loss"]
            print(f"| {seed} | {bf16:.4f} | {recipe} | {fp8:.4f} | {fp8 / bf16 - 1:+.1%} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
