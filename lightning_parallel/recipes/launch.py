"""Start a recipe's worker processes ourselves, one launch per Hydra job.

Lightning's own launcher re-runs ``sys.argv`` for ranks 1..N-1. Under a Hydra multirun that re-runs the
whole sweep in every child, and a job whose ``trainer.devices`` differs from the first job's ran as one
process while reporting N. Here each job starts exactly ``trainer.devices`` workers with torch's elastic
launch API (torchrun's engine); the workers see torchrun's environment, so Lightning uses it and launches
nothing. Under an outside ``torchrun``, or in the tasks SLURM starts (``hydra/launcher=slurm`` submits each
job with ``trainer.devices`` tasks per node), the processes exist already and the job just runs.
"""

from __future__ import annotations

import os
import uuid
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf


def launched_externally() -> bool:
    """True inside processes that torchrun or SLURM (a batch job's tasks, not an interactive shell) started."""
    from lightning.fabric.plugins.environments import SLURMEnvironment

    return ("LOCAL_RANK" in os.environ and "WORLD_SIZE" in os.environ) or SLURMEnvironment.detect()


def check_world(devices: int) -> None:
    if "LOCAL_RANK" not in os.environ:  # SLURM: Lightning checks devices against --ntasks-per-node itself
        return
    world = int(os.environ.get("LOCAL_WORLD_SIZE", os.environ.get("WORLD_SIZE", "1")))
    if devices != world:
        raise ValueError(
            f"trainer.devices={devices} but torchrun started {world} processes per node: set trainer.devices={world} "
            f"or run torchrun with --nproc-per-node {devices}."
        )


def _call(entry: str, cfg: DictConfig, run_dir: Path) -> Any:
    """``entry(cfg, run_dir)`` with ``entry`` a dotted path such as ``lightning_parallel.recipes.gpt.train``."""
    import importlib

    module, _, name = entry.rpartition(".")
    return getattr(importlib.import_module(module), name)(cfg, run_dir)


def _worker(config_yaml: str, run_dir: str, entry: str) -> Any:
    """What each spawned worker runs (importable, so the spawn start method can find it)."""
    result = _call(entry, OmegaConf.create(config_yaml), Path(run_dir))
    return result if os.environ.get("RANK") == "0" else None


def run(cfg: DictConfig, run_dir: Path, entry: str) -> Any:
    """Run ``entry(cfg, run_dir)`` on ``cfg.trainer.devices`` processes of this machine; returns rank 0's result."""
    devices = int(cfg.trainer.devices)
    if launched_externally():
        check_world(devices)
        return _call(entry, cfg, run_dir)
    if cfg.trainer.num_nodes > 1:
        raise ValueError(
            f"trainer.num_nodes={cfg.trainer.num_nodes} needs processes started on every node: submit with "
            "-m hydra/launcher=slurm, or run torchrun --nnodes on each node."
        )
    if devices == 1:
        return _call(entry, cfg, run_dir)

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
