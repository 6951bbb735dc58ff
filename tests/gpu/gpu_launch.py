"""Ranks as fresh interpreters, one per rank, the way torchrun starts them: what CUDA needs.

tests/harness.py forks every rank from a zygote that imported torch once; a fork cannot use CUDA once the parent
initialized it, so the GPU tier starts each rank with ``subprocess`` (a new interpreter: nothing inherited but the
environment). Launches start at once and are waited for separately, so independent runs overlap on one GPU and a
failed or hung one fails only its own tests.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from harness import REPO, WORKERS, _env, free_port

DEVICE_ENV = "LP_GPU_TIER_DEVICE"  # "cpu": the tier's logic on CPU/gloo (slow; for changing the tier without a GPU)


def accelerator() -> str:
    """What the tier's workers run on: ``gpu`` unless ``LP_GPU_TIER_DEVICE=cpu``."""
    return "cpu" if os.environ.get(DEVICE_ENV) == "cpu" else "gpu"


def cuda_devices() -> int:
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def needs_gpus(n: int) -> pytest.MarkDecorator:
    """Skip unless ``n`` CUDA devices are there (or the tier runs on CPU: ``LP_GPU_TIER_DEVICE=cpu``)."""
    found = cuda_devices()
    return pytest.mark.skipif(
        accelerator() == "gpu" and found < n, reason=f"needs {n} CUDA device{'s' * (n > 1)}, found {found}"
    )


@dataclass
class Launch:
    """One worker script on ``world`` processes; :meth:`results` waits for it."""

    label: str
    world: int
    out: Path
    procs: list[subprocess.Popen] = field(default_factory=list)
    started: float = field(default_factory=time.monotonic)

    @classmethod
    def start(cls, label: str, script: str, world: int, args: list[str], out: Path) -> Launch:
        """Start ``tests/workers/<script> ARGS --out OUT --accelerator ...`` on ``world`` fresh processes."""
        out.mkdir(parents=True, exist_ok=True)
        cmd = [sys.executable, str(WORKERS / script), *args, "--out", str(out), "--accelerator", accelerator()]
        return cls.start_command(label, cmd, world, out)

    @classmethod
    def start_command(cls, label: str, cmd: list[str], world: int, out: Path, torchrun_env: bool = True) -> Launch:
        """Start ``cmd`` on ``world`` processes: with torchrun's environment, or (a recipe, which launches its own
        workers) as a user would type it."""
        launch = cls(label, world, out)
        port = free_port()
        threads = "4" if accelerator() == "gpu" else "1"  # the GPU machines have 16 cores, this one 2
        for rank in range(world):
            # the repository, then what was on the path (gpu-check's packages installed from .whl/ among them)
            path = os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))
            env = _env(world, port) if torchrun_env else {**os.environ, "PYTHONPATH": path}
            env |= {"RANK": str(rank), "LOCAL_RANK": str(rank)} if torchrun_env else {}
            env["OMP_NUM_THREADS"] = threads
            log = (out / f"rank{rank}.log").open("w")
            # a session of its own: a hung rank's whole tree can be killed
            proc = subprocess.Popen(cmd, env=env, cwd=out, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
            launch.procs.append(proc)
        return launch

    def wait(self, timeout: float) -> None:
        """Wait for every rank; a rank that fails or outlives ``timeout`` raises with every rank's log tail."""
        deadline = self.started + timeout
        while any(p.poll() is None for p in self.procs) and time.monotonic() < deadline:
            if any(p.poll() not in (None, 0) for p in self.procs):  # one rank failed: its peers would hang
                break
            time.sleep(0.1)
        hung = any(p.poll() is None for p in self.procs)
        for p in self.procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()
        codes = [p.returncode for p in self.procs]
        if hung or any(codes):
            why = f"stopped after {timeout:.0f} s (hung)" if hung else "failed"
            tails = "\n".join(f"--- rank {r} exited {c} ---\n{self._log(r)[-6000:]}" for r, c in enumerate(codes))
            raise AssertionError(f"{self.label} at world {self.world} {why}:\n{tails}")

    def results(self, timeout: float = 300) -> list[Any]:
        """Each rank's ``rank<N>.json`` (for run.py, the list of its cases' results)."""
        self.wait(timeout)
        return [json.loads((self.out / f"rank{r}.json").read_text()) for r in range(self.world)]

    def _log(self, rank: int) -> str:
        log = self.out / f"rank{rank}.log"
        return log.read_text(errors="replace") if log.is_file() else ""
