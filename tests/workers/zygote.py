"""Start a worker script's ranks as forks of a process that has already imported what every rank imports.

Importing torch, Lightning and this package costs a fresh interpreter about 5 s of CPU here, once per rank and
per launch: on 2 cores that was most of a small test's time. This process pays it once per test session:

    python zygote.py serve        # reads one JSON request per line on stdin, answers each with a line

A request ``{"world", "log_dir", "script", "args", "env"}`` forks a *launcher* (a new session, so the harness
can kill the whole launch) that forks one child per rank. Each child gets torchrun's per-rank environment
(``RANK``, ``LOCAL_RANK`` on top of ``env``), writes its output to ``log_dir/rank<R>.log``, runs ``script`` as
``__main__`` and ends as any process does: normal interpreter finalization, its own exit status. The launcher
waits like torchrun's agent (when one rank fails, the others get 2 s to print their side, then are killed),
writes the exit statuses to ``log_dir/codes.json`` (``-N``: killed by signal N) and leaves. The answer to a
request is the launcher's pid. Nothing has run in parallel in this process before a fork (no OpenMP or gloo
threads exist yet), which is what makes forking it safe; end of stdin ends it.

``python zygote.py WORLD LOG_DIR SCRIPT [ARGS...]`` does one launch in the foreground.
"""

from __future__ import annotations

import ctypes
import json
import os
import runpy
import signal
import sys
import time
from pathlib import Path

import lightning.pytorch  # noqa: F401  (what every rank imports: paid once, before the forks)
import torch  # noqa: F401
import torchmetrics  # noqa: F401

import lightning_parallel  # noqa: F401


def die_with_parent() -> None:
    """Linux: this process gets SIGKILL when its parent ends (a killed test session leaves no rank behind)."""
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def run_rank(rank: int, log: Path, script: str, args: list[str]) -> None:
    """In a rank's child: become rank ``rank`` and run the script; never returns."""
    die_with_parent()
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank))
    fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    sys.argv = [script, *args]
    sys.path.insert(0, str(Path(script).parent))
    code: int | str | None = 0
    try:
        runpy.run_path(script, run_name="__main__")
    except SystemExit as stop:
        code = stop.code
    except BaseException as error:  # noqa: BLE001  (as the interpreter handles an uncaught exception)
        sys.last_type, sys.last_value, sys.last_traceback = type(error), error, error.__traceback__
        if sys.version_info >= (3, 12):
            sys.last_exc = error
        sys.excepthook(type(error), error, error.__traceback__)
        code = 1
    raise SystemExit(code)  # normal finalization, as a process torchrun started would end


def _status(wait_status: int) -> int:
    return -os.WTERMSIG(wait_status) if os.WIFSIGNALED(wait_status) else os.WEXITSTATUS(wait_status)


def launch(world: int, log_dir: Path, script: str, args: list[str]) -> list[int]:
    """Fork the ranks, wait for them; their exit statuses."""
    sys.stdout.flush()
    sys.stderr.flush()
    pids: dict[int, int] = {}
    for rank in range(world):
        pid = os.fork()
        if pid == 0:
            run_rank(rank, log_dir / f"rank{rank}.log", script, args)
        pids[pid] = rank
    codes: dict[int, int] = {}
    failed_at: float | None = None
    while len(codes) < len(pids):
        pid, wait_status = os.waitpid(-1, os.WNOHANG)
        if pid:
            codes[pids[pid]] = _status(wait_status)
            if codes[pids[pid]] != 0 and failed_at is None:
                failed_at = time.monotonic()
            continue
        if failed_at is not None and time.monotonic() - failed_at > 2:  # peers have printed their side
            for other, rank in pids.items():
                if rank not in codes:
                    os.kill(other, signal.SIGKILL)
        time.sleep(0.05)
    return [codes[r] for r in range(world)]


def _launcher(request: dict) -> None:
    """In the launcher's child: one launch, its codes.json, then leave (this copy of the server ran nothing of
    its own worth finalizing)."""
    me = os.getpid()
    codes: list[int] = [-1] * int(request["world"])
    log_dir = Path(request["log_dir"])
    try:
        die_with_parent()
        os.setsid()  # the harness kills the launch as one process group
        os.environ.update(request["env"])
        codes = launch(int(request["world"]), log_dir, request["script"], request["args"])
    finally:
        if os.getpid() == me:  # not a rank's child unwinding to its own exit
            tmp = log_dir / "codes.json.tmp"
            tmp.write_text(json.dumps(codes))
            tmp.rename(log_dir / "codes.json")
            os._exit(0)


def serve() -> None:
    die_with_parent()
    for line in sys.stdin:
        while True:  # reap launchers that have ended
            try:
                if os.waitpid(-1, os.WNOHANG)[0] == 0:
                    break
            except ChildProcessError:
                break
        request = json.loads(line)
        sys.stdout.flush()
        pid = os.fork()
        if pid == 0:
            _launcher(request)
        print(json.dumps({"pid": pid}), flush=True)


def main() -> None:
    if sys.argv[1:] == ["serve"]:
        serve()
        return
    world, log_dir, script, *args = sys.argv[1:]
    codes = launch(int(world), Path(log_dir), script, args)
    (Path(log_dir) / "codes.json").write_text(json.dumps(codes))


if __name__ == "__main__":
    main()
