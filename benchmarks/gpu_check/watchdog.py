"""Each section in a fresh interpreter with a time limit: a hung kernel or collective is killed with its whole
process tree, its output kept, and the check goes on."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

_START = time.monotonic()
GRACE_S = 5.0  # after the limit the section gets to stop its own children and write its result


@dataclass(frozen=True)
class Section:
    name: str
    gpu_cap_s: float
    dry_cap_s: float

    def cap(self, dry_run: bool) -> float:
        return self.dry_cap_s if dry_run else self.gpu_cap_s


def progress(message: str) -> None:
    """A timestamped line on stdout, flushed: the tail of the output says how far the check got."""
    print(f"[{time.strftime('%H:%M:%S')} +{time.monotonic() - _START:6.1f}s] {message}", flush=True)


def run_section(section: Section, index: int, total: int, limit: float, config: Path, log: Path) -> dict[str, Any]:
    """Run ``python -m benchmarks.gpu_check.section NAME`` under ``limit`` seconds; its result, or why there is none.

    Returns:
        ``status`` (``ok``, ``failed``, ``timeout``), ``seconds``, ``limit_s`` and ``result`` (the section's dict) or
        ``error`` with the tail of its output.
    """
    result_file = config.parent / f"{section.name}.json"
    result_file.unlink(missing_ok=True)
    cmd = [sys.executable, "-m", "benchmarks.gpu_check.section", section.name, str(config), str(result_file)]
    cmd.append(str(limit))
    progress(f"section {index}/{total} {section.name}: start (limit {limit:.0f} s)")
    started = time.monotonic()
    with log.open("a") as out:
        out.write(f"\n===== {section.name} (limit {limit:.0f} s) =====\n")
        out.flush()
        env = {**os.environ, "PYTHONUNBUFFERED": "1", "PYTHONPATH": _pythonpath(config)}
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        timed_out = _wait(proc, limit + GRACE_S)
    seconds = time.monotonic() - started
    entry: dict[str, Any] = {"seconds": round(seconds, 1), "limit_s": round(limit)}
    if result_file.is_file():
        entry |= {"status": "ok", "result": json.loads(result_file.read_text())}
    else:
        why = f"killed after {limit + GRACE_S:.0f} s" if timed_out else f"exited {proc.returncode}"
        entry |= {"status": "timeout" if timed_out else "failed", "error": f"{why}: {_tail(log, 25)}"}
    progress(f"section {index}/{total} {section.name}: {entry['status']} in {seconds:.1f} s")
    if entry["status"] != "ok":
        print(_tail(log, 12), flush=True)
    return entry


def _wait(proc: subprocess.Popen, timeout: float) -> bool:
    """Wait; past ``timeout`` kill the process's whole session (it may have started ranks). True if killed."""
    try:
        proc.wait(timeout=timeout)
        return False
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        return True


def _pythonpath(config: Path) -> str:
    """The repository, then the packages installed from .whl (deps.py's ``site``), then what was there."""
    settings = json.loads(config.read_text())
    return os.pathsep.join(p for p in (settings["root"], settings.get("site"), os.environ.get("PYTHONPATH")) if p)


def _tail(log: Path, lines: int) -> str:
    text = log.read_text(errors="replace").splitlines() if log.is_file() else []
    return "\n".join(text[-lines:])
