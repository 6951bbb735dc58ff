"""One recipe job, run alone or as one job of a Hydra multirun (``-m``): its checks, then its workers.

Alone, a refused setting ends the run with its message (exit status 1), and a failed worker with the error naming
the rank that failed first. Inside a sweep a job does not end the sweep: it writes why it failed into its folder
(:data:`JOB_FAILED_FILE`, with the layout it asked for) and returns, the next job starts, and the summary lists it
as failed with that reason (:mod:`.summary`, which also makes the multirun exit with status 1 once the summary is
written). A worker failure is recorded so only when this job started its workers itself: under torchrun or in SLURM's
tasks every process of the job would have to agree to go on, and the error is raised as in a single run.
"""

from __future__ import annotations

import json
import logging
import os
import pickle
from collections.abc import Callable
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

log = logging.getLogger(__name__)

# what the recipes' checks raise for settings they refuse (each message names the setting and the fix)
REFUSALS = (ValueError, TypeError, OSError, pickle.UnpicklingError)
JOB_FAILED_FILE = "job_failed.json"
# the settings a failed job's row shows (the layout it asked for; a finished job's come from its metrics.json)
REQUESTED = ("dp", "pp", "tp", "cp", "ep", "dp_shard", "zero_stage")


def in_sweep() -> bool:
    """True inside a job of a Hydra multirun (``-m``)."""
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode

    return HydraConfig.initialized() and HydraConfig.get().mode == RunMode.MULTIRUN


def run_job(cfg: DictConfig, check: Callable[[DictConfig], Any], entry: str) -> Any:
    """What a recipe script's ``main`` runs: ``check(cfg)`` (the checks that refuse bad settings before any worker
    starts), then ``entry`` on the job's workers (:func:`~.launch.run`); returns rank 0's result, or None for a
    sweep's job that failed (recorded in its folder)."""
    from hydra.core.hydra_config import HydraConfig

    return checked_run(cfg, check, entry, Path(HydraConfig.get().runtime.output_dir), sweep=in_sweep())


def run_recipe(cfg: DictConfig, module: str, check: str) -> Any:
    """A recipe script's ``main`` (recipes/finetune.py, recipes/dpo.py): :func:`run_job` with ``module``'s function
    ``check`` before launch and its ``train`` on the workers (``module`` imported here, in the job)."""
    import importlib

    import lightning_parallel  # noqa: F401  (registers the strategy names)

    return run_job(cfg, getattr(importlib.import_module(module), check), entry=f"{module}.train")


def checked_run(cfg: DictConfig, check: Callable[[DictConfig], Any], entry: str, run_dir: Path, sweep: bool) -> Any:
    """:func:`run_job` in ``run_dir``, as one job of a sweep or as a run of its own."""
    from lightning_parallel.recipes.launch import launched_externally, run

    (run_dir / JOB_FAILED_FILE).unlink(missing_ok=True)  # from an earlier run in this folder
    try:
        check(cfg)
    except REFUSALS as err:
        # the message names the setting and the fix: a traceback through the checks would only bury it
        message = f"Error in the config ({type(err).__name__}): {err}"
        if not sweep:
            raise SystemExit(message) from None
        return record_failure(cfg, run_dir, message)
    except Exception as err:  # not a refusal: a fault of the checks themselves, recorded with its traceback
        if not sweep:
            raise
        return record_failure(cfg, run_dir, f"{type(err).__name__}: {err}", error=err)
    if not sweep or launched_externally():  # alone, or under torchrun or SLURM: failures raise as in a single run
        return run(cfg, run_dir, entry=entry)
    try:
        return run(cfg, run_dir, entry=entry)
    except Exception as err:  # a worker failed (the error names the rank) or the launch did: the sweep goes on
        return record_failure(cfg, run_dir, f"{type(err).__name__}: {err}", error=err)


def record_failure(cfg: DictConfig, run_dir: Path, reason: str, error: BaseException | None = None) -> None:
    """Log ``reason`` (with ``error``'s traceback when given) and write it, with the layout the job asked for, to
    ``run_dir/job_failed.json`` (rank 0)."""
    log.error(f"This job failed, the sweep goes on: {reason}", exc_info=error)
    if int(os.environ.get("RANK", os.environ.get("SLURM_PROCID", "0"))) != 0:
        return None
    run_dir.mkdir(parents=True, exist_ok=True)
    record = {"status": "failed", "reason": reason, "requested": requested_layout(cfg)}
    (run_dir / JOB_FAILED_FILE).write_text(json.dumps(record, indent=2))
    return None


def read_failure(job_dir: Path) -> dict[str, Any] | None:
    """What :func:`record_failure` wrote into a job's folder, if it did."""
    try:
        return json.loads((job_dir / JOB_FAILED_FILE).read_text())
    except (OSError, ValueError):
        return None


def requested_layout(cfg: DictConfig) -> dict[str, Any]:
    """The degrees, schedule and precision as the job's config sets them (metrics.json's ``layout`` names; what a
    summary row of a job that never ran shows). A setting the config lacks is None."""

    def get(key: str) -> Any:
        return OmegaConf.select(cfg, key, default=None)

    devices, nodes = get("trainer.devices"), get("trainer.num_nodes") or 1
    layout: dict[str, Any] = {"world_size": devices * nodes if isinstance(devices, int) else devices}
    layout |= {key: get(f"strategy.{key}") for key in REQUESTED}
    pipelined = isinstance(layout["pp"], int) and layout["pp"] > 1
    layout["pp_schedule"] = get("strategy.pp_schedule") if pipelined else None
    layout["microbatches"] = get("strategy.microbatches") if pipelined else None
    layout["precision"] = get("precision.value")
    return layout
