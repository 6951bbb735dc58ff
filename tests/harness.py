"""Run a standalone worker script on N CPU processes (gloo), the way torchrun would, and collect results.

Workers are subprocesses, never DDP inside pytest (Lightning's launcher would re-run pytest). Each gets
torchrun's environment, so Lightning sees an external launcher. The ranks are forked from one process that
imported torch and Lightning once (``workers/zygote.py``: on 2 cores that import cost each fresh rank seconds).
A port taken between choosing and binding is retried with a fresh one.
"""

from __future__ import annotations

import atexit
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
WORKERS = Path(__file__).resolve().parent / "workers"
_PORT_TAKEN = ("Address already in use", "EADDRINUSE", "address already in use")


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _env(world_size: int, port: int) -> dict[str, str]:
    """torchrun's environment for every rank (the zygote adds each rank's RANK and LOCAL_RANK)."""
    env = dict(os.environ)
    env.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        WORLD_SIZE=str(world_size),
        LOCAL_WORLD_SIZE=str(world_size),
        GROUP_RANK="0",
        TORCHELASTIC_RUN_ID="lightning-parallel-tests",
        OMP_NUM_THREADS="1",  # 2 cores shared by up to 8 ranks
        PYTHONPATH=f"{REPO}{os.pathsep}{env.get('PYTHONPATH', '')}",
        PYTHONWARNINGS="ignore",
        PYTHONFAULTHANDLER="1",  # a C++ abort still prints the Python stack
    )
    # strict mode (lightning_parallel/parallel/strict/): gloo keeps NCCL's point-to-point order and every group's
    # collectives are compared across its ranks; on unless the session says 0 (pytest --no-strict-collectives)
    env.setdefault("LP_STRICT_COLLECTIVES", "1")
    return env


class _Zygote:
    """The test session's zygote server (workers/zygote.py): forks the ranks of every launch."""

    proc: subprocess.Popen | None = None

    @classmethod
    def launch(cls, world_size: int, log_dir: Path, script: list[str], port: int) -> int:
        """Start a launch; returns the launcher's pid (its process group holds every rank)."""
        if cls.proc is None or cls.proc.poll() is not None:
            env = _env(world_size, port)
            cmd = [sys.executable, str(WORKERS / "zygote.py"), "serve"]
            cls.proc = subprocess.Popen(cmd, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
            atexit.register(cls.stop)
        assert cls.proc.stdin is not None and cls.proc.stdout is not None
        env = {
            k: v for k, v in _env(world_size, port).items() if k in ("MASTER_PORT", "WORLD_SIZE", "LOCAL_WORLD_SIZE")
        }
        request = {"world": world_size, "log_dir": str(log_dir), "script": script[0], "args": script[1:], "env": env}
        cls.proc.stdin.write(json.dumps(request) + "\n")
        cls.proc.stdin.flush()
        return int(json.loads(cls.proc.stdout.readline())["pid"])

    @classmethod
    def stop(cls) -> None:
        if cls.proc is not None and cls.proc.poll() is None:
            assert cls.proc.stdin is not None
            cls.proc.stdin.close()
            try:
                cls.proc.wait(timeout=120)  # a loaded machine: it ends after its last fork's bookkeeping
            except subprocess.TimeoutExpired:
                cls.proc.kill()


def _run_once(script: list[str], world_size: int, timeout: float, log_dir: Path) -> tuple[list[int], list[str], bool]:
    """The ranks are forks of a process that imported torch and Lightning once (workers/zygote.py)."""
    codes_file = log_dir / "codes.json"
    codes_file.unlink(missing_ok=True)
    launcher = _Zygote.launch(world_size, log_dir, script, free_port())
    deadline = time.monotonic() + timeout
    timed_out = False
    while not codes_file.is_file():
        if time.monotonic() > deadline:
            timed_out = True
            os.killpg(launcher, signal.SIGKILL)  # the launcher and every rank it forked
            break
        time.sleep(0.05)
    codes = json.loads(codes_file.read_text()) if codes_file.is_file() else [-9] * world_size
    texts = []
    for rank in range(world_size):
        log = log_dir / f"rank{rank}.log"
        texts.append(log.read_text() if log.is_file() else "")
    return [int(c) for c in codes], texts, timed_out


def run_distributed(
    script: str, world_size: int, args: list[str], out_dir: Path, timeout: float = 300
) -> list[dict[str, Any]]:
    """Run ``tests/workers/<script>`` on ``world_size`` processes; return each rank's ``rank<N>.json``.

    Raises:
        AssertionError: with the output of every rank that failed.
    """
    out_dir.mkdir(parents=True, exist_ok=True)
    cmd = [str(WORKERS / script), *args, "--out", str(out_dir)]
    for _ in range(3):
        codes, texts, timed_out = _run_once(cmd, world_size, timeout, out_dir)
        if not (any(codes) and any(m in t for t in texts for m in _PORT_TAKEN)):
            break
    if any(codes):
        failed = "\n".join(
            f"--- rank {r} exited {c} ---\n{t[-6000:]}" for r, (c, t) in enumerate(zip(codes, texts)) if c
        )
        why = f"hung: stopped after {timeout:.0f} s" if timed_out else "failed"
        raise AssertionError(f"{script} at world {world_size} {why}:\n{failed}")
    return [json.loads((out_dir / f"rank{r}.json").read_text()) for r in range(world_size)]


def run_worker(
    name: str, world_size: int, args: list[str], out_dir: Path, timeout: float = 300
) -> list[dict[str, Any]]:
    """Run the case module ``tests/workers/cases/<name>.py`` through ``tests/workers/run.py`` (its ``ARGS``:
    ``--cases``, ``--runs-file``, ``--opts``, ``--strategy``), as :func:`run_distributed` runs a script."""
    return run_distributed("run.py", world_size, [name, *args], out_dir, timeout)
