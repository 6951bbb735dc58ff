"""When one rank fails, the others end within the collective timeout and say which rank failed first.

Gloo and NCCL report a dead peer as "Connection closed by peer", "Connection reset by peer" or a timeout,
naming an address, not a rank, and never the peer's error. So a rank that fails with an exception leaves
word of it (its rank and the error) on a board that every rank can read, and a rank whose collective then
fails reads the board and says ``rank 1 failed first: ValueError: ...``. A rank killed outright
(SIGKILL, the out-of-memory killer) leaves no word: the board also holds every rank's host and pid, so a
survivor on the same host can name the rank that is gone.

The board is the default process group's store (a TCPStore: hosted by rank 0 under Lightning's launcher, by
the agent under torchrun) and, when ``LIGHTNING_PARALLEL_FAILURE_DIR`` is set (the recipes set it to their
run directory), a file in that folder, which the launching parent reads after the workers are gone.
Pure torch: no Lightning here.
"""

from __future__ import annotations

import json
import os
import socket
import sys
import threading
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch.distributed as dist

from lightning_parallel._compat import default_store

FAILURE_DIR_ENV = "LIGHTNING_PARALLEL_FAILURE_DIR"
FIRST_FAILURE_FILE = "first_failure.json"
_KEY = "lightning_parallel/failure/"
# how gloo and NCCL word a collective that failed because of a peer (the exception type is a plain RuntimeError)
_PEER_SIGNS = (
    "Connection closed by peer",
    "Connection reset by peer",
    "Timed out waiting",
    "Broken pipe",
    "Connection refused",
    "NCCL communicator was aborted",
    "Watchdog caught collective operation timeout",
)


def to_timeout(value: timedelta | float | int, setting: str = "timeout") -> timedelta:
    """``value`` (a ``timedelta`` or a number of seconds) as a positive ``timedelta``.

    Raises:
        TypeError: for anything else; ValueError: for zero or a negative time.
    """
    if isinstance(value, bool) or not isinstance(value, (timedelta, int, float)):
        raise TypeError(f"{setting}={value!r}: give a datetime.timedelta or a number of seconds.")
    seconds = value.total_seconds() if isinstance(value, timedelta) else float(value)
    if not seconds > 0:
        raise ValueError(f"{setting}={value!r}: the collective timeout must be positive; give e.g. 600 (seconds).")
    return timedelta(seconds=seconds)


def is_collective_failure(exc: BaseException) -> bool:
    """True for an error a collective raised because a peer failed or did not answer in time."""
    if isinstance(exc, dist.DistError):
        return True
    return isinstance(exc, RuntimeError) and any(sign in str(exc) for sign in _PEER_SIGNS)


def describe(exc: BaseException) -> str:
    """``Type: first line of the message``, short enough for one log line."""
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0][:300] if text else ''}".rstrip(": ")


def process_alive(pid: int) -> bool:
    """Whether ``pid`` runs on this host (a zombie, dead but not yet reaped by its parent, counts as gone)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
        return stat.rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except FileNotFoundError:
        return False
    except OSError:  # no /proc (macOS): ask the kernel
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        return True


class FailureBoard:
    """Where ranks leave word of a failure, and where a rank whose collective failed looks it up.

    Args:
        store: the process group's store (``None``: the folder only).
        rank: this process's global rank.
        world_size: the number of ranks.
        folder: a folder every rank and the launching parent can read (``None``: the store only).
    """

    def __init__(self, store: Any, rank: int, world_size: int, folder: Path | None = None) -> None:
        self.store, self.rank, self.world_size, self.folder = store, rank, world_size, folder

    @classmethod
    def for_process_group(cls) -> FailureBoard:
        """The board of the default process group; registers this rank's host and pid on it."""
        try:
            store = default_store()
        except (RuntimeError, ValueError):
            store = None
        folder = os.environ.get(FAILURE_DIR_ENV)
        board = cls(store, dist.get_rank(), dist.get_world_size(), Path(folder) if folder else None)
        board._store_op(lambda s: s.set(f"{_KEY}pid/{board.rank}", f"{socket.gethostname()}:{os.getpid()}"))
        board._store_op(lambda s: s.delete_key(f"{_KEY}done/{board.rank}"))
        return board

    def mark_done(self) -> None:
        """Leave word that this rank ended its work normally: once its process is gone, it is not a failure."""
        self._store_op(lambda s: s.set(f"{_KEY}done/{self.rank}", "1"))

    def _store_op(self, op: Any) -> Any:
        """``op(store)``, or ``None`` when there is no store or it cannot be reached (its host is gone)."""
        if self.store is None:
            return None
        try:
            return op(self.store)
        except Exception:  # the store's host died with the failure: the folder, or the pids, must do
            return None

    def record(self, exc: BaseException, rank: int | None = None) -> None:
        """Leave word that this rank (or ``rank``: one the heartbeat found hung) failed with ``exc``; only the first
        rank to fail is kept."""
        text, rank = describe(exc), self.rank if rank is None else rank
        self._store_op(lambda s: s.compare_set(f"{_KEY}first", "", f"{rank}\n{text}"))
        if self.folder is not None:
            record = {"rank": rank, "error": text, "time": time.time(), "pid": os.getpid()}
            try:  # O_EXCL: the first rank to create the file wins, as with compare_set
                fd = os.open(self.folder / FIRST_FAILURE_FILE, os.O_CREAT | os.O_EXCL | os.O_WRONLY)
            except OSError:
                return
            with os.fdopen(fd, "w") as f:
                json.dump(record, f)

    def first_failure(self) -> tuple[int, str] | None:
        """``(rank, "Type: message")`` of the first rank that recorded a failure, if any did."""
        if self.folder is not None:
            found = read_first_failure(self.folder)
            if found is not None:
                return found

        def get(s: Any) -> tuple[int, str] | None:
            if not s.check([f"{_KEY}first"]):
                return None
            rank, _, text = s.get(f"{_KEY}first").decode().partition("\n")
            return int(rank), text

        return self._store_op(get)

    def gone(self) -> list[tuple[int, int]]:
        """``(rank, pid)`` of the ranks on this host whose process has ended."""

        def location(s: Any, rank: int) -> str | None:  # get() would block on a key never set
            key = f"{_KEY}pid/{rank}"
            return s.get(key).decode() if s.check([key]) else None

        host, found = socket.gethostname(), []
        known = self.__dict__.setdefault("_locations", {})  # a rank's host and pid never change: read each once
        for rank in range(self.world_size):
            where = known.get(rank) or self._store_op(lambda s, r=rank: location(s, r))
            if where is None:
                continue
            known[rank] = where
            their_host, _, pid = where.rpartition(":")
            if their_host == host and int(pid) != os.getpid() and not process_alive(int(pid)):
                if not self._store_op(lambda s, r=rank: s.check([f"{_KEY}done/{r}"])):  # ended its work normally
                    found.append((rank, int(pid)))
        return found

    def explain(self, wait_s: float = 2.0) -> str:
        """What a rank whose collective failed should say about the cause. Waits up to ``wait_s`` for a
        failing peer's word (it writes before it exits, but a timeout can come first)."""
        deadline = time.monotonic() + wait_s
        while True:
            first = self.first_failure()
            if first is not None:
                return f"rank {first[0]} failed first: {first[1]}"
            gone = self.gone()
            if gone or time.monotonic() > deadline:
                break
            time.sleep(0.2)
        if gone:
            ranks = ", ".join(f"rank {r} (pid {p})" for r, p in gone)
            return f"{ranks} ended without reporting an error (killed by a signal: SIGKILL, the out-of-memory killer?)"
        if self.store is not None and self._store_op(lambda s: s.check([f"{_KEY}pid/{self.rank}"])) is None:
            return "the rendezvous store cannot be reached: its host (rank 0, or the launcher agent) is gone"
        return "no rank reported an error and none on this host has ended: a rank is stuck or in another collective"


def needs_watch(backend: str) -> bool:
    """Whether a backend needs :class:`FailureWatch`: NCCL does (a collective with a dead peer waits, on the
    device, until the watchdog's timeout); gloo does not (its collectives fail as soon as the peer's connection
    closes, and the failing rank's word is read then)."""
    return "gloo" not in str(backend)


class FailureWatch:
    """A daemon thread that reads the board every ``interval_s`` and, once another rank has reported a failure
    (or a rank on this host has ended), says so on stderr and aborts this rank's communicators: its pending NCCL
    collectives then fail at once, naming the cause, instead of hanging until the collective timeout. With a
    heartbeat (``parallel/heartbeat.py``) it also beats, and hands a hang it finds to ``on_hang``.

    Args:
        board: the failure board.
        abort: what aborts this rank's communicators (``_compat.abort_process_group``).
        interval_s: seconds between two reads of the board.
        heartbeat: beats and finds hangs (its ``tick()`` returns one or None; ``finish()`` at the end), or None.
        on_hang: what to do with a hang the heartbeat found.
        watch_board: act on the board's failures (NCCL; gloo's collectives fail by themselves).
    """

    def __init__(
        self,
        board: FailureBoard,
        abort: Any,
        interval_s: float = 2.0,
        heartbeat: Any = None,
        on_hang: Any = None,
        watch_board: bool = True,
    ) -> None:
        self.board, self.abort, self.interval_s = board, abort, interval_s
        self.heartbeat, self.on_hang, self.watch_board = heartbeat, on_hang, watch_board
        self.cause: str | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True, name="lightning-parallel-failure-watch")

    def start(self) -> FailureWatch:
        if self.heartbeat is not None:
            self.board._store_op(lambda s: self.heartbeat.beat())  # seen by the others from now on
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(timeout=self.interval_s + 1.0)
        if self.heartbeat is not None:  # this rank's silence from now on is no hang
            self.board._store_op(lambda s: self.heartbeat.finish())

    def check(self) -> str | None:
        """The cause to abort for, if another rank failed (one read of the board)."""
        first = self.board.first_failure()
        if first is not None and first[0] != self.board.rank:
            return f"rank {first[0]} failed first: {first[1]}"
        gone = self.board.gone()
        if gone:
            ranks = ", ".join(f"rank {r} (pid {p})" for r, p in gone)
            return f"{ranks} ended without reporting an error (killed by a signal: SIGKILL, the out-of-memory killer?)"
        return None

    def _tick(self) -> Any:
        """The heartbeat's beat and verdict; a failure (the store's host gone) is said once, and the watch goes on."""
        if self.heartbeat is None:
            return None
        try:
            return self.heartbeat.tick()
        except Exception as exc:
            if not getattr(self, "_said", False):
                self._said = True
                print(f"[rank {self.board.rank}] heartbeat: {describe(exc)}", file=sys.stderr, flush=True)
            return self.heartbeat.store_failed(describe(exc))

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            hang = self._tick()
            cause = self.check() if self.watch_board else None
            if cause is None and hang is not None and not self._stop.is_set():
                self.cause = hang.text
                self.on_hang(hang)
                return
            if cause is None:
                continue
            self.cause = cause
            print(
                f"[rank {self.board.rank}] {cause}: aborting this rank's communicators, so that its pending "
                "collectives fail instead of waiting for the collective timeout",
                file=sys.stderr,
                flush=True,
            )
            try:
                self.abort()
            except Exception as exc:  # the process group may be gone already (a normal shutdown raced the check)
                print(f"[rank {self.board.rank}] abort failed: {describe(exc)}", file=sys.stderr, flush=True)
            return


def read_first_failure(folder: Path) -> tuple[int, str] | None:
    """The first failure a worker wrote into ``folder`` (see :class:`FailureBoard`), if any."""
    try:
        record = json.loads((Path(folder) / FIRST_FAILURE_FILE).read_text())
    except (OSError, ValueError):
        return None
    return int(record["rank"]), str(record["error"])


def annotate(exc: BaseException, cause: str, rank: int) -> None:
    """Put ``cause`` in front of ``exc``'s message, in place (Lightning re-raises the same exception)."""
    original = exc.args[0] if exc.args else ""
    exc.args = (f"{cause} (rank {rank} saw: {original})", *exc.args[1:])


def end_children(procs: list[Any], grace_s: float) -> None:
    """Give the worker processes this one launched ``grace_s`` seconds to end by themselves (a collective
    with a rank that is gone fails at once, and the rank says why), then kill what is left, as Lightning's
    launcher does on Ctrl-C: no worker outlives its launcher. Not longer: while this process lives, a worker
    waiting for it in a collective would wait for the whole timeout."""
    deadline = time.monotonic() + grace_s
    for proc in procs:
        try:
            proc.wait(timeout=max(0.0, deadline - time.monotonic()))
        except Exception:  # still running at the deadline (subprocess.TimeoutExpired)
            proc.kill()
            proc.wait()


_REPORTED = "_lightning_parallel_reported"


def report_now(exc: BaseException) -> None:
    """Print ``exc`` with its traceback now, through ``sys.excepthook`` (torch's adds the ``[rankN]:`` prefix),
    and keep the interpreter from printing it a second time if it ends the process.

    A failing rank's launcher often stops it with a signal before Python prints the uncaught exception at exit
    (torchrun sends SIGTERM to every worker once one has failed): said here, the cause is never lost.
    """
    if getattr(exc, _REPORTED, False):
        return
    sys.excepthook(type(exc), exc, exc.__traceback__)
    sys.stderr.flush()
    try:
        setattr(exc, _REPORTED, True)
    except AttributeError:  # an exception type without a __dict__: printed twice rather than not at all
        return
    hook = sys.excepthook
    if not getattr(hook, _REPORTED, False):

        def skip_reported(kind: type, value: BaseException, tb: Any) -> None:
            if not getattr(value, _REPORTED, False):
                hook(kind, value, tb)

        setattr(skip_reported, _REPORTED, True)
        sys.excepthook = skip_reported
