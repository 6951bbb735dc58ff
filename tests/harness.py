"""Run a standalone worker script on N CPU processes (gloo), the way torchrun would, and collect results.

Workers are subprocesses, never DDP inside pytest (Lightning's launcher would re-run pytest). Each gets
torchrun's environment, so Lightning sees an external launcher. A port taken between choosing and
binding is retried with a fresh one.
"""

from __future__ import annotations

import json
import os
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


def _env(rank: int, world_size: int, port: int) -> dict[str, str]:
    env = dict(os.environ)
    env.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        WORLD_SIZE=str(world_size),
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        LOCAL_WORLD_SIZE=str(world_size),
        GROUP_RANK="0",
        TORCHELASTIC_RUN_ID="lightning-parallel-tests",
        OMP_NUM_THREADS="1",  # 2 cores shared by up to 8 ranks
        PYTHONPATH=f"{REPO}{os.pathsep}{env.get('PYTHONPATH', '')}",
        PYTHONWARNINGS="ignore",
        PYTHONFAULTHANDLER="1",  # a C++ abort still prints the Python stack
    )
    return env


def _run_once(cmd: list[str], world_size: int, timeout: float, log_dir: Path) -> tuple[list[int], list[str], bool]:
    port = free_port()
    procs, logs = [], []
    for rank in range(world_size):
        log = open(log_dir / f"rank{rank}.log", "w+")
        logs.append(log)
        procs.append(subprocess.Popen(cmd, env=_env(rank, world_size, port), stdout=log, stderr=subprocess.STDOUT))
    deadline = time.monotonic() + timeout
    codes: list[int | None] = [None] * world_size
    timed_out = False
    while any(c is None for c in codes):
        for i, p in enumerate(procs):
            codes[i] = p.poll()
        timed_out = time.monotonic() > deadline
        if any(c not in (None, 0) for c in codes) or timed_out:
            time.sleep(2)  # let peers print their side before they are stopped
            for p in procs:
                if p.poll() is None:
                    p.kill()
            codes = [p.wait() for p in procs]
            break
        time.sleep(0.05)
    texts = []
    for log in logs:
        log.seek(0)
        texts.append(log.read())
        log.close()
    return [int(c) for c in codes], texts, timed_out


def run_distributed(
    script: str, world_size: int, args: list[str], out_dir: Path, timeout: float = 300
) -> list[dict[str, Any]]:
    """Run ``tests/workers/<script>`` on ``world_size`` processes; return each rank's ``rank<N>.json``.

    Raises:
        AssertionError: with the output of every rank that failed.
    """
    out_dir.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, str(WORKERS / script), *args, "--out", str(out_dir)]
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
