"""Start a recipe's worker processes ourselves, one launch per Hydra job.

Lightning's own launcher re-runs ``sys.argv`` for ranks 1..N-1. Under a Hydra multirun that re-runs the
whole sweep in every child, and a job whose ``trainer.devices`` differs from the first job's ran as one
process while reporting N. Here each job starts exactly ``trainer.devices`` workers with torch's elastic
launch API (torchrun's engine); the workers see torchrun's environment, so Lightning uses it and launches
nothing. Under an outside ``torchrun`` (or SLURM's srun) the processes exist already and the job just runs.
"""

from __future__ import annotations

import os
import uuid
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf


def launched_externally() -> bool:
    """True inside processes that torchrun (or a cluster scheduler through it) started."""
    return "LOCAL_RANK" in os.environ and "WORLD_SIZE" in os.environ


def check_world(devices: int) -> None:
    world = int(os.environ.get("LOCAL_WORLD_SIZE", os.environ.get("WORLD_SIZE", "1")))
    if launched_externally() and devices != world:
        raise ValueError(
            f"trainer.devices={devices} but torchrun started {world} processes per node: set trainer.devices={world} "
            f"or run torchrun with --nproc-per-node {devices}."
        )


def _worker(config_yaml: str, run_dir: str, entry: str) -> Any:
    """What each spawned worker runs (importable, so the spawn start method can find it)."""
    import importlib

    module, _, name = entry.rpartition(".")
    train = getattr(importlib.import_module(module), name)
    cfg = OmegaConf.create(config_yaml)
    result = train(cfg, Path(run_dir))
    return result if os.environ.get("RANK") == "0" else None


def run(cfg: DictConfig, run_dir: Path, entry: str = "lightning_parallel.recipes.train.train") -> Any:
    """Run ``entry(cfg, run_dir)`` on ``cfg.trainer.devices`` processes of this machine; returns rank 0's result."""
    import importlib

    devices = int(cfg.trainer.devices)
    if devices == 1 or launched_externally():
        check_world(devices)
        module, _, name = entry.rpartition(".")
        return getattr(importlib.import_module(module), name)(cfg, run_dir)

    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    config = LaunchConfig(
        min_nodes=1,
        max_nodes=1,
        nproc_per_node=devices,
        run_id=f"lightning-parallel-{uuid.uuid4().hex[:8]}",
        rdzv_backend="c10d",
        rdzv_endpoint="localhost:0",  # a free port per job: sweeps never collide
        max_restarts=0,
        monitor_interval=0.5,
        start_method="spawn",
    )
    results = elastic_launch(config, _worker)(OmegaConf.to_yaml(cfg, resolve=True), str(run_dir), entry)
    return results.get(0)
