"""Start a recipe's worker processes ourselves, one launch per Hydra job.

Lightning's own launcher re-runs ``sys.argv`` for ranks 1..N-1. Under a Hydra multirun that re-runs the
whole sweep in every child, and a job whose ``trainer.devices`` differs from the first job's ran as one
process while reporting N. Here each job starts exactly ``trainer.devices`` workers with torch's elastic
launch API (torchrun's engine); the workers see torchrun's environment, so Lightning uses it and launches
nothing. Under an outside ``torchrun``, or in the tasks SLURM starts (``hydra/launcher=slurm`` submits each
job with ``trainer.devices`` tasks per node), the processes exist already and the job just runs.

When a worker fails, torch elastic stops the others and raises ``ChildFailedError``; its "first observed
failure" is the first the agent happened to see, often a rank whose collective failed because of the real
one. The workers write the first failure into the run directory (``FailureBoard`` in
lightning_parallel/parallel/failure.py), and the error raised here names that rank.

With ``max_restarts=N`` (a recipe key, N > 0) the failed job starts its workers again, at most N times, from the
newest checkpoint in ``checkpoint.dir`` (``ckpt_path=last``): a fresh launch each time (new rendezvous, new store),
so restarted gloo workers never read the dead ones' addresses. A SIGTERM (preemption) makes the workers save
``last`` and stop (``lightning_parallel.callbacks.preemption``); the job then ends with status 0 and a line that
says what to resume; it is never restarted.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import sys
import uuid
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

from lightning_parallel.callbacks.preemption import PREEMPTED_FILE
from lightning_parallel.parallel.failure import FAILURE_DIR_ENV, FIRST_FAILURE_FILE, read_first_failure

log = logging.getLogger(__name__)
# a worker that stopped for a SIGTERM exits with 128 + 15, the shell's code for it: returning normally would
# leave it waiting for an agent that is itself shutting down, and exiting with 0 without a return value
# would leave the agent waiting for one
PREEMPTED_EXIT = 128 + signal.SIGTERM


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
    from lightning.pytorch.utilities.exceptions import SIGTERMException

    try:
        result = _call(entry, OmegaConf.create(config_yaml), Path(run_dir))
    except SIGTERMException:  # preempted: the checkpoint is saved, every rank stopped after the same step
        sys.exit(PREEMPTED_EXIT)  # an ordinary exit: atexit releases the process groups (parallel/shutdown.py)
    return result if os.environ.get("RANK") == "0" else None


def _first_failure(error: Any, run_dir: Path) -> str:
    """Which rank failed first and how: the workers' own record, else a rank a signal killed, else the
    agent's first observation."""
    recorded = read_first_failure(run_dir)
    if recorded is not None:
        return f"rank {recorded[0]} failed first: {recorded[1]}"
    killed = sorted((f.timestamp, r, f) for r, f in error.failures.items() if f.exitcode < 0)
    if killed:
        _, rank, failure = killed[0]
        return f"rank {rank} failed first: killed by {signal.Signals(-failure.exitcode).name} (pid {failure.pid})"
    rank, failure = error.get_first_failure()
    return f"rank {rank} failed first (first seen by torch elastic): exit code {failure.exitcode}, {failure.message}"


def _preempted(run_dir: Path) -> dict[str, Any] | None:
    """What the workers saved when a SIGTERM stopped them (see ``Preemption``), if one did."""
    try:
        return json.loads((run_dir / PREEMPTED_FILE).read_text())
    except (OSError, ValueError):
        return None


def restart_path(cfg: DictConfig) -> str | None:
    """Where a restarted job resumes: the newest checkpoint in ``checkpoint.dir`` (``last``), or the run's own
    ``ckpt_path`` while no save has been written since it started (a local ``checkpoint.dir`` without last.ckpt)."""
    from lightning_parallel.parallel.checkpoint import storage

    given, folder = cfg.get("ckpt_path"), cfg.checkpoint.dir
    if given in (None, "last") or storage.has_scheme(folder) or (Path(folder) / "last.ckpt").exists():
        return "last"
    return given


def run(cfg: DictConfig, run_dir: Path, entry: str) -> Any:
    """Run ``entry(cfg, run_dir)`` on ``cfg.trainer.devices`` processes of this machine; returns rank 0's result.
    A worker failure starts the workers again from the newest checkpoint, ``cfg.max_restarts`` times at most."""
    devices, restarts = int(cfg.trainer.devices), int(cfg.get("max_restarts") or 0)
    if launched_externally():
        check_world(devices)
        if restarts:
            log.warning(
                f"max_restarts={restarts} is ignored: torchrun or SLURM started these processes, and restarts them "
                "(torchrun --max-restarts, SLURM's requeue)."
            )
        return _call(entry, cfg, run_dir)
    if cfg.trainer.num_nodes > 1:
        raise ValueError(
            f"trainer.num_nodes={cfg.trainer.num_nodes} needs processes started on every node: submit with "
            "-m hydra/launcher=slurm, or run torchrun --nnodes on each node."
        )
    if devices == 1 and not restarts:  # one process, nothing to watch: the job runs here
        return _call(entry, cfg, run_dir)
    for attempt in range(restarts + 1):
        try:
            return _launch(cfg, run_dir, entry, devices)
        except _WorkerFailed as failed:
            if attempt == restarts:
                raise RuntimeError(failed.reason) from failed.__cause__
            cfg.ckpt_path = restart_path(cfg)
            log.warning(
                f"{failed.reason}. Restart {attempt + 1} of max_restarts={restarts}: starting the workers again "
                f"with ckpt_path={cfg.ckpt_path}."
            )
    raise AssertionError("unreachable")


class _WorkerFailed(Exception):
    """A worker of one launch failed (``reason`` names the rank that failed first); the launch may be retried."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


def _launch(cfg: DictConfig, run_dir: Path, entry: str, devices: int) -> Any:
    """One launch of ``devices`` workers (torch elastic, no restarts of its own); rank 0's result.

    Raises:
        _WorkerFailed: a worker failed (not a preemption: that returns None after its message).
    """
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
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
    run_dir.mkdir(parents=True, exist_ok=True)
    for stale in (run_dir / PREEMPTED_FILE, run_dir / FIRST_FAILURE_FILE):  # from an earlier run in this folder
        stale.unlink(missing_ok=True)
    os.environ[FAILURE_DIR_ENV] = str(run_dir)  # the spawned workers inherit it
    # the host's cores shared among the workers, as torchrun does: torch's default (every core per worker)
    # oversubscribes them (a 200-step GPT run at world 2 on 2 cores: 125-150 s instead of 24 s)
    threads_set = "OMP_NUM_THREADS" not in os.environ
    if threads_set:
        os.environ["OMP_NUM_THREADS"] = str(max(1, (os.cpu_count() or 1) // devices))
    try:
        results = elastic_launch(config, _worker)(OmegaConf.to_yaml(cfg, resolve=True), str(run_dir), entry)
    except (ChildFailedError, SignalException) as error:
        preempted = _preempted(run_dir)
        if preempted is not None:
            saved = preempted["checkpoint"] or "nothing (no checkpoint.dir)"
            log.warning(
                f"Preempted: every worker stopped after step {preempted['step']} and saved {saved}; "
                "run again with ckpt_path=last to continue."
            )
            return None
        if isinstance(error, ChildFailedError):
            raise _WorkerFailed(_first_failure(error, run_dir)) from error
        raise
    finally:
        os.environ.pop(FAILURE_DIR_ENV, None)
        if threads_set:
            os.environ.pop("OMP_NUM_THREADS", None)
    return results.get(0)
