"""Running the recipes as a user does: a subprocess in its own working directory, the repository on the
path, one thread per process (the machine has two cores and a run has up to eight processes)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
GPT = ROOT / "recipes" / "train_gpt.py"
VGG = ROOT / "recipes" / "train_vgg.py"


def env() -> dict[str, str]:
    return {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}


def run(cwd: Path, *cmd: str | Path, timeout: int = 300, ok: bool = True) -> subprocess.CompletedProcess:
    """``python *cmd`` in ``cwd``; with ``ok`` it must succeed (the failure shows the output's tail)."""
    args = [sys.executable, *map(str, cmd)]
    result = subprocess.run(args, cwd=cwd, env=env(), capture_output=True, text=True, timeout=timeout)
    if ok:
        assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
    return result


def run_recipe(script: Path, cwd: Path, *overrides: str, timeout: int = 300) -> dict:
    """One recipe run into ``cwd/run``; returns its metrics.json."""
    run(cwd, script, *overrides, f"hydra.run.dir={cwd / 'run'}", timeout=timeout)
    return json.loads((cwd / "run" / "metrics.json").read_text())


def assert_fails_before_workers(script: Path, cwd: Path, *overrides: str, message: str) -> None:
    """The recipe refuses the overrides with ``message``, in the parent, before any worker starts."""
    result = run(cwd, script, *overrides, timeout=120, ok=False)
    output = result.stdout + result.stderr
    assert result.returncode != 0 and message in output, output[-4000:]
    assert "Initializing distributed" not in output  # no worker ever started


def default_run_metrics(cwd: Path) -> dict:
    """metrics.json of a run left in Hydra's default ``outputs/DATE/TIME`` directory."""
    (metrics_file,) = (cwd / "outputs").glob("*/*/metrics.json")
    return json.loads(metrics_file.read_text())
