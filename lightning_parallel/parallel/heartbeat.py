"""A hang explained: every rank beats through the rendezvous store, every rank's failure watch reads the beats, and
the rank that stopped or fell behind is named, its peers' last collectives dumped, and the run ended within its
collective timeout, on every backend.

Each rank's :class:`~lightning_parallel.parallel.failure.FailureWatch` thread publishes, every ``interval_s``, one
record under ``lightning_parallel/beat/<rank>`` of the default group's store: a beat counter, its step, and per process
group the collectives it has *issued* (torch's own sequence counter, advanced by the main thread's calls, so a rank
stuck before a collective shows a number below its peers' while a beating thread alone would look healthy). Each
reader notes, on its own clock (no clocks compared across hosts), when every rank's beat and issued count last moved:

- a rank whose beat has not moved for ``stale_s`` while this rank has issued nothing for as long has *stopped*
  (SIGSTOP, a debugger, a frozen host, a call that holds the GIL);
- when no rank has issued anything for ``behind_s``, a rank whose count on a group is below another member's is
  *behind*: it has not reached the collective the others wait in.

The watch then writes this rank's flight recorder and Python stacks into the dump folder, says on stderr (and on the
failure board, which the launchers read) which rank, its host and pid, last step and counts, and what the waiting
ranks are blocked in, aborts this rank's communicators and ends the process with exit code 1 (gloo's abort does not
interrupt a pending collective, torch 2.13; on NCCL the aborted collective raises first and the Trainer says why).
Pure torch: no Lightning here.
"""

from __future__ import annotations

import faulthandler
import json
import os
import pickle
import socket
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

from torch.optim.optimizer import register_optimizer_step_post_hook

import lightning_parallel._compat as _compat
from lightning_parallel.parallel.failure import FAILURE_DIR_ENV, FailureBoard, FailureWatch, needs_watch

HEARTBEAT_ENV = "LIGHTNING_PARALLEL_HEARTBEAT_S"  # seconds between beats; 0 turns the heartbeat off
STALE_ENV = "LIGHTNING_PARALLEL_HEARTBEAT_STALE_S"  # seconds without a beat before a rank counts as stopped
DUMP_DIR_ENV = "LIGHTNING_PARALLEL_DUMP_DIR"  # where the flight recorder and stacks go (default: beside the run)
FR_BUFFER_ENV = "TORCH_FR_BUFFER_SIZE"
FR_BUFFER_DEFAULT = "2000"  # entries per process, NCCL's own default; gloo records nothing unless it is set
HANG_EXIT_CODE = 1
_KEY = "lightning_parallel/beat/"
_HANG = "lightning_parallel/hang"  # the first hang a rank found: [blamed ranks, explanation]


@dataclass(frozen=True)
class Timing:
    """How often a rank beats, and how long a silence takes to count as a stop or a fall behind (seconds)."""

    interval_s: float
    stale_s: float
    behind_s: float


def timing_for(timeout: timedelta | float) -> Timing:
    """The heartbeat's timing from the run's collective timeout, so a hang is named well within it: a beat every
    timeout/30 (0.5 to 5 s), stopped after timeout/3 (at least 3 beats, at most 120 s), behind after 0.75 x timeout.
    ``LIGHTNING_PARALLEL_HEARTBEAT_S`` and ``LIGHTNING_PARALLEL_HEARTBEAT_STALE_S`` set the first two."""
    seconds = timeout.total_seconds() if isinstance(timeout, timedelta) else float(timeout)
    interval = float(os.environ.get(HEARTBEAT_ENV) or min(5.0, max(0.5, seconds / 30)))
    stale = float(os.environ.get(STALE_ENV) or min(120.0, max(3 * interval, seconds / 3)))
    return Timing(interval, stale, max(0.75 * seconds, stale))


@dataclass(frozen=True)
class Hang:
    """The ranks a hang is blamed on and what to say about it."""

    ranks: tuple[int, ...]
    text: str


class Heartbeat:
    """This rank's beat and its reading of everyone's (one :meth:`tick` per watch interval).

    Args:
        store: the default process group's store (any object with ``set``, ``check``, ``multi_get``).
        rank, world_size: this process's global rank and the number of ranks.
        timing: see :func:`timing_for`.
        counters: ``{group name: (issued, global ranks)}`` now (default: torch's counters of every group).
        step: this rank's training step now (default: the optimizer steps this process has taken).
        pending: what this rank is blocked in, read from its flight recorder (default), or None.
        clock: seconds, monotonic.
    """

    def __init__(
        self,
        store: Any,
        rank: int,
        world_size: int,
        timing: Timing,
        counters: Callable[[], dict[str, tuple[int, tuple[int, ...]]]] = _compat.group_sequence_numbers,
        step: Callable[[], int | None] | None = None,
        pending: Callable[[], str | None] | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.store, self.rank, self.world_size, self.timing = store, rank, world_size, timing
        self.counters, self.clock = counters, clock
        self.pending = pending_collective if pending is None else pending
        self._steps, self._hook = 0, None
        if step is None:  # Fabric: count optimizer steps (a Python int, no sync)
            self._hook = register_optimizer_step_post_hook(self._count_step)
            step = lambda: self._steps  # noqa: E731
        self.step = step
        self._beats, self._seen, self._waiting = 0, {}, None
        self._beat_since: dict[int, float] = {}
        self._issue_since: dict[int, float] = {}
        self._store_down_since: float | None = None
        self.host, self.pid = socket.gethostname(), os.getpid()

    def _count_step(self, *_: Any) -> None:
        self._steps += 1

    def beat(self, done: bool = False) -> None:
        """Publish this rank's record (a store write)."""
        self._beats += 1
        counts = self.counters()
        issued = sum(n for n, _ in counts.values())
        since = self._issue_since.get(self.rank)
        stuck = since is not None and self._seen.get(self.rank, {}).get("issued") == issued
        if not stuck:
            self._waiting = None
        elif self._waiting is None and self.clock() - since >= 2 * self.timing.interval_s:
            self._waiting = self.pending() or "?"  # once per stall: what this rank waits in
        record = {"n": self._beats, "step": self.step(), "issued": issued, "host": self.host, "pid": self.pid}
        record |= {"seq": {g: [n, list(r)] for g, n, r in ((g, *v) for g, v in counts.items())}}
        record |= {"waiting": self._waiting, "done": done}
        self.store.set(f"{_KEY}{self.rank}", json.dumps(record))
        self._note(self.rank, record)

    def finish(self) -> None:
        """This rank's work ended: say so, so that its silence is no stop."""
        if self._hook is not None:
            self._hook.remove()
            self._hook = None
        self.beat(done=True)

    def observe(self) -> None:
        """Read every rank's record (one round trip when all have beaten)."""
        keys = [f"{_KEY}{r}" for r in range(self.world_size) if r != self.rank]
        if not keys:
            return
        if self.store.check(keys):
            values = self.store.multi_get(keys)
        else:  # start-up: a rank that has not beaten yet is not judged
            values = [self.store.get(k) if self.store.check([k]) else None for k in keys]
        for key, value in zip(keys, values):
            if value is not None:
                self._note(int(key.rsplit("/", 1)[1]), json.loads(value))

    def _note(self, rank: int, record: dict) -> None:
        now, old = self.clock(), self._seen.get(rank)
        if old is None or old["n"] != record["n"]:
            self._beat_since[rank] = now
        if old is None or old["issued"] != record["issued"]:
            self._issue_since[rank] = now
        self._seen[rank] = record

    def tick(self) -> Hang | None:
        """Beat, read, judge. A hang found here is announced on the store, and one announced by another rank is
        taken up: every rank then ends with the same explanation, the one blamed too (its stacks show where it is),
        before the first to end can take the store with it (torchrun's agent on its node hosts it)."""
        self.beat()
        self._store_down_since = None
        if self.store.check([_HANG]):
            ranks, text = json.loads(self.store.get(_HANG))
            return Hang(tuple(ranks), text)
        self.observe()
        hang = self.verdict()
        if hang is not None:
            found = f"{hang.text} (found by rank {self.rank})"
            self.store.compare_set(_HANG, "", json.dumps([list(hang.ranks), found]))
            return Hang(*json.loads(self.store.get(_HANG)))  # the first announcement, ours or another's
        return None

    def store_failed(self, exc: str) -> Hang | None:
        """A tick's store call failed: after ``stale_s`` of failures the store's host is gone, and the run with it."""
        now = self.clock()
        self._store_down_since = since = self._store_down_since or now
        if now - since < self.timing.stale_s:
            return None
        return Hang(
            (),
            f"the rendezvous store has not answered for {now - since:.1f} s ({exc}): its host (torchrun's agent "
            "on the first node, or rank 0 under Lightning's launcher) is gone or stopped",
        )

    def verdict(self) -> Hang | None:
        """The ranks a hang is blamed on, if there is a hang (see the module's docstring)."""
        now, live = self.clock(), {r: rec for r, rec in self._seen.items() if not rec["done"]}
        if self.rank not in live:
            return None
        idle = {r: now - self._issue_since[r] for r in live}
        stopped = [r for r in live if r != self.rank and now - self._beat_since[r] >= self.timing.stale_s]
        if stopped and idle[self.rank] >= self.timing.stale_s:
            named = [f"{self._who(r)} stopped beating {now - self._beat_since[r]:.1f} s ago" for r in stopped]
            return Hang(tuple(stopped), self._say(named, stopped))
        if len(live) < self.world_size or min(idle.values()) < self.timing.behind_s:
            return None
        behind = self._behind(live)
        if not behind:
            return None
        named = [f"{self._who(r)} is behind: {why}" for r, why in behind.items()]
        quiet = f"no rank has issued a collective for {min(idle.values()):.1f} s"
        return Hang(tuple(behind), self._say([*named, quiet], list(behind)))

    def _behind(self, live: dict[int, dict]) -> dict[int, str]:
        """Ranks whose issued count on a group is below another member's (the first such group each)."""
        found: dict[int, str] = {}
        groups = {(g, tuple(ranks)) for rec in live.values() for g, (_, ranks) in rec["seq"].items()}
        for name, ranks in sorted(groups):
            counts = {r: live[r]["seq"][name][0] for r in ranks if r in live and name in live[r]["seq"]}
            if len(counts) < 2:
                continue
            top = max(counts, key=counts.get)
            for r, n in counts.items():
                if n < counts[top] and r not in found:
                    found[r] = f"{n} collectives issued on group {name} (ranks {list(ranks)}), rank {top} {counts[top]}"
        return found

    def _who(self, rank: int) -> str:
        rec = self._seen[rank]
        groups = sorted(rec["seq"].items(), key=lambda item: (len(item[0]), item[0]))  # 2 before 10
        counts = ", ".join(f"{g}: {n}" for g, (n, _) in groups)
        return f"rank {rank} (host {rec['host']}, pid {rec['pid']}, step {rec['step']}, collectives issued {counts})"

    def _say(self, named: list[str], blamed: list[int]) -> str:
        seen = sorted(self._seen.items())
        waiting = [f"rank {r} in {rec['waiting']}" for r, rec in seen if r not in blamed and rec["waiting"]]
        return "; ".join(named) + (f"; waiting: {', '.join(waiting)}" if waiting else "")


def pending_collective() -> str | None:
    """The oldest collective this rank issued that has not ended, from its flight recorder (None if it is off)."""
    try:
        entries = json.loads(_compat.flight_recorder_dump(as_json=True)).get("entries", [])
    except Exception:  # a torch without the recorder: the counts must do
        return None
    open_ = [e for e in entries if not e.get("retired") and e.get("state") != "completed"]
    if not open_:
        return None
    e = open_[0]
    group = "/".join(str(p) for p in e.get("process_group", []))
    seq = e.get("p2p_seq_id") if e.get("is_p2p") else e.get("collective_seq_id")
    return f"{e.get('profiling_name')} (group {group}, #{seq}, sizes {e.get('input_sizes')})"


def enable_flight_recorder() -> None:
    """Turn torch's flight recorder on (``TORCH_FR_BUFFER_SIZE``, unless set) before the first process group: gloo
    records nothing otherwise."""
    os.environ.setdefault(FR_BUFFER_ENV, FR_BUFFER_DEFAULT)


def dump_folder(default_root: str | os.PathLike | None = None) -> Path:
    """Where a hang's dumps go: ``LIGHTNING_PARALLEL_DUMP_DIR``, else ``flight_recorder/`` in the run directory the
    recipes name (``LIGHTNING_PARALLEL_FAILURE_DIR``), else in ``default_root`` (the Trainer's), else here."""
    if os.environ.get(DUMP_DIR_ENV):
        return Path(os.environ[DUMP_DIR_ENV])
    return Path(os.environ.get(FAILURE_DIR_ENV) or default_root or os.getcwd()) / "flight_recorder"


def dump(folder: Path, rank: int) -> list[Path]:
    """This rank's flight recorder (``fr_rank_<rank>``: torch's pickle, read by its ``fr_trace`` analyzer, and
    ``fr_<rank>.json``) and the Python stacks of its threads (``stacks_<rank>.txt``) in ``folder``."""
    folder.mkdir(parents=True, exist_ok=True)
    written = []
    for name, as_json in ((f"fr_rank_{rank}", False), (f"fr_{rank}.json", True)):
        try:
            load, save = (json.loads, lambda d: json.dumps(d).encode()) if as_json else (pickle.loads, pickle.dumps)
            (folder / name).write_bytes(save(_with_groups(load(_compat.flight_recorder_dump(as_json=as_json)))))
            written.append(folder / name)
        except Exception as exc:  # noqa: BLE001  (the stacks and the message must still come)
            print(f"[rank {rank}] flight recorder dump failed: {exc}", file=sys.stderr, flush=True)
    with open(folder / f"stacks_{rank}.txt", "w") as f:
        faulthandler.dump_traceback(file=f, all_threads=True)
    return [*written, folder / f"stacks_{rank}.txt"]


def _with_groups(trace: dict) -> dict:
    """The recorder's trace with every group of this process in its ``pg_config`` (name, description, ranks): gloo's
    leaves it empty in torch 2.13, and torch's ``fr_trace`` analyzer needs it to read the entries."""
    config = trace.setdefault("pg_config", {})
    desc = {e["process_group"][0]: e["process_group"][1] for e in trace.get("entries", []) if e.get("process_group")}
    for name, (_, ranks) in _compat.group_sequence_numbers().items():
        if not config.get(name, {}).get("name"):
            config[name] = {"name": name, "desc": desc.get(name, ""), "ranks": str(list(ranks))}
    if "" in config and not config[""].get("name"):
        del config[""]
    return trace


@dataclass
class HangResponse:
    """What a rank does once its watch found a hang: dump, say, leave word, abort, and end the process.

    Args:
        board: the failure board (the launchers read the first failure from it).
        folder: where to dump (called at the hang: the run directory may be known only then).
        abort: aborts this rank's communicators.
        grace_s: seconds between the abort and the end of the process: on NCCL for the aborted collective to raise
            in the main thread (which then ends the run itself); on gloo, whose abort leaves a pending collective
            waiting (torch 2.13), for the other ranks to take up the announced hang while the store is there.
        before_exit: ends what this process launched (Lightning's launcher's children).
    """

    board: FailureBoard
    folder: Callable[[], Path]
    abort: Callable[[], None]
    grace_s: float = 5.0
    before_exit: Callable[[], None] = lambda: None

    def __call__(self, hang: Hang) -> None:
        rank = self.board.rank
        paths = dump(self.folder(), rank)
        text = f"hang: {hang.text}. This rank's flight recorder and stacks: {', '.join(map(str, paths))}"
        print(f"[rank {rank}] {text}. Ending this rank (exit code {HANG_EXIT_CODE}).", file=sys.stderr, flush=True)
        if hang.ranks:
            self.board.record(RuntimeError(text), rank=hang.ranks[0])
        try:
            self.abort()
        except Exception:  # noqa: BLE001  (the process group may be half gone: the exit below still comes)
            pass
        time.sleep(self.grace_s)
        self.before_exit()
        os._exit(HANG_EXIT_CODE)


def start_watch(
    board: FailureBoard,
    backend: str,
    timeout: timedelta,
    step: Callable[[], int | None] | None,
    folder: Callable[[], Path],
    before_exit: Callable[[], None],
) -> FailureWatch | None:
    """This rank's failure watch with the heartbeat (unless ``LIGHTNING_PARALLEL_HEARTBEAT_S=0``): on every backend,
    reading the board's failures too on NCCL (gloo's collectives fail by themselves when a peer's process ends)."""
    timing = timing_for(timeout)
    beating = timing.interval_s > 0 and board.store is not None and board.world_size > 1
    if not beating and not needs_watch(backend):
        return None
    heartbeat = Heartbeat(board.store, board.rank, board.world_size, timing, step=step) if beating else None
    grace_s = 2 * timing.interval_s + 0.5  # two beats: every rank has read the announced hang
    if needs_watch(backend):  # NCCL: the aborted collective raises in the main thread, which ends the run
        grace_s = max(grace_s, min(10.0, 0.1 * timeout.total_seconds()))
    respond = HangResponse(board, folder, _compat.abort_process_group, grace_s, before_exit)
    interval = timing.interval_s if beating else 2.0
    watch = FailureWatch(board, _compat.abort_process_group, interval, heartbeat, respond, needs_watch(backend))
    return watch.start()
