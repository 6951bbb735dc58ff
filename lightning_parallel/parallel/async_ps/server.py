"""A parameter server: one contiguous shard of the flat parameters, the user's optimizer on it, and the rules
for when a push is applied and when a pull is answered. Pure torch.

Clocks: a worker's clock is the number of steps it has pushed (it pushes its steps in order, one after
another, starting at the step it said HELLO with). The *active* workers are the live ones that have not said
FINISH.

- ``staleness == 0`` (synchronous): the pushes of step ``t`` wait until every active worker has pushed ``t``;
  then their mean is one optimizer step (one *update*). A pull for step ``k`` is answered once every active
  worker has pushed ``k`` steps, i.e. after update ``k``: the same training as one process on the global batch.
- ``staleness == s > 0`` (stale-synchronous / asynchronous): every push is one update as it comes (the
  gradient of one worker's share of a global batch). A pull for step ``k`` is answered once every active
  worker has pushed at least ``k - s`` steps: no worker runs more than ``s`` steps ahead of the slowest.

A worker whose connection ends without BYE is dead: it leaves the active set at once (nobody waits for it any
more). A push of it that arrived whole counts (in a synchronous step, in the mean of that step); a push cut off
mid-message is dropped, as is the step it was computing. Server 0 also runs the workers' collectives
(Lightning's barrier, broadcast, reduce) over the workers still there.
"""

from __future__ import annotations

import math
import socket
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor
from torch.optim import Optimizer

from lightning_parallel.parallel.async_ps import protocol as p
from lightning_parallel.parallel.async_ps.layout import FlatLayout, shard_optimizer
from lightning_parallel.parallel.devices import host_all_reduce


@dataclass
class _Worker:
    clock: int | None = None  # None: not registered yet
    finished: bool = False
    gone: bool = False
    dead: bool = False
    pushes: int = 0
    loss: float | None = None  # the training loss of its last push (on its share of the batch)


@dataclass
class Clip:
    """Gradient clipping of each update's gradient (Lightning's ``gradient_clip_val`` / ``_algorithm``)."""

    value: float
    algorithm: str = "norm"  # "norm" (by the whole gradient's 2-norm) or "value" (element-wise)


@dataclass
class _Collective:
    parts: dict[int, tuple[str, int, bytearray]] = field(default_factory=dict)
    result: bytes | None = None


class ParameterServer:
    """Serves shard ``server`` of ``layout`` to the workers ``worker_ranks``.

    Args:
        layout: the flat layout (every rank computes the same one from the user's optimizer).
        optimizer: the user's optimizer (its class and group settings are used on the shard).
        server: this server's index among the servers (0 runs the workers' collectives).
        worker_ranks: the global ranks of the workers.
        staleness: see the module docstring.
        clip: clipping of each update's gradient, or None.
        server_group: a process group of the servers (for the norm of a synchronous update's gradient when there
            are several servers), or None.
        register_timeout_s: a worker that has not said HELLO this long after serving began counts as dead.
    """

    def __init__(
        self,
        layout: FlatLayout,
        optimizer: Optimizer,
        server: int,
        worker_ranks: list[int],
        staleness: int,
        clip: Clip | None = None,
        server_group: Any = None,
        register_timeout_s: float = 600.0,
    ) -> None:
        self.layout, self.server, self.staleness, self.clip = layout, server, staleness, clip
        self.server_group = server_group
        self.optimizer, self.pieces = shard_optimizer(optimizer, layout, server)
        self.device = self.pieces[0].device  # where the shard and its optimizer live (pushes arrive on the host)
        self.start, self.end = layout.server_range(server)
        self.bounds = [(lo - self.start, hi - self.start) for _, lo, hi in layout.pieces(server)]
        self.workers = {rank: _Worker() for rank in worker_ranks}
        self.cond = threading.Condition()
        self.ready = threading.Event()
        self.register_timeout_s = register_timeout_s
        self.updates = 0  # optimizer steps applied (restored from a checkpoint)
        self.next_step: int | None = None  # synchronous: the step whose update comes next
        self.pending: dict[int, list[tuple[Tensor, list[float]]]] = {}
        self.pending_losses: dict[int, list[float | None]] = {}  # synchronous: each pending push's training loss
        self.train_loss: float | None = None  # the global training loss of the last update (see _push, _try_apply)
        self.collectives: dict[int, _Collective] = {}
        self.stats: dict[str, Any] = {"max_staleness": 0, "sum_staleness": 0, "max_clock_gap": 0, "dropped": 0}
        self.first_push: float | None = None
        self.last_update: float | None = None
        self.listener: socket.socket | None = None

    # ----- start, serve, end -----

    def listen(self, host: str = "127.0.0.1") -> int:
        """Open the listening socket on ``host`` ("" for every interface; workers may connect from now on) and
        accept in a background thread; returns the port."""
        self.listener = socket.create_server((host, 0), backlog=256)
        threading.Thread(target=self._accept, daemon=True, name="async-ps-accept").start()
        return self.listener.getsockname()[1]

    def serve(self) -> dict[str, Any]:
        """Answer the workers until every one has said BYE or died; returns the counters."""
        self.serve_started = time.monotonic()
        self.ready.set()
        with self.cond:
            while not all(w.gone for w in self.workers.values()):
                self._expire_unregistered()
                self.cond.wait(0.5)
        if self.listener is not None:
            self.listener.close()
        return self.counters()

    def _accept(self) -> None:
        assert self.listener is not None
        while True:
            try:
                conn, _ = self.listener.accept()
            except OSError:  # closed by serve()
                return
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            threading.Thread(target=self._handle, args=(conn,), daemon=True, name="async-ps-conn").start()

    def _expire_unregistered(self) -> None:
        if time.monotonic() - self.serve_started > self.register_timeout_s:
            for w in self.workers.values():
                if w.clock is None and not w.gone:
                    w.gone = w.dead = True
            self._try_apply()

    # ----- one worker's connection -----

    def _handle(self, conn: socket.socket) -> None:
        self.ready.wait()
        worker: int | None = None
        with conn:
            while True:
                message = p.recv(conn)
                if message is None:
                    self._leave(worker, dead=True)
                    return
                kind, meta, payload = message
                if kind == p.HELLO:
                    worker = int(meta["worker"])
                    self._hello(worker, int(meta["step"]))
                elif kind == p.PUSH:
                    self._push(worker, meta, p.as_tensor(payload).to(self.device, copy=True))
                elif kind == p.PULL:
                    updates, flat = self._pull(int(meta["step"]))
                    p.send(conn, p.PARAMS, {"updates": updates}, flat)
                elif kind == p.REDUCE:
                    p.send(conn, p.REDUCED, payload=self._collective(worker, meta, payload))
                elif kind == p.SNAPSHOT:
                    self._pull(int(meta["step"]))  # the same wait as a pull of that step
                    p.send(conn, p.STATE, payload=p.to_blob(self.state_dict()))
                elif kind == p.FINISH:
                    with self.cond:
                        self.workers[worker].finished = True
                        self._try_apply()
                        self.cond.notify_all()
                elif kind == p.STATS:
                    p.send(conn, p.COUNTS, self._final_counters())
                elif kind == p.BYE:
                    self._leave(worker, dead=False)
                    return

    def _active(self) -> list[_Worker]:
        return [w for w in self.workers.values() if not w.gone and not w.finished]

    def _registered(self) -> bool:
        return all(w.clock is not None for w in self.workers.values() if not w.gone)

    def _hello(self, worker: int, step: int) -> None:
        with self.cond:
            self.workers[worker].clock = step
            if self.next_step is None or step < self.next_step:
                self.next_step = step
            self._try_apply()
            self.cond.notify_all()

    def _leave(self, worker: int | None, dead: bool) -> None:
        if worker is None:
            return
        with self.cond:
            w = self.workers[worker]
            if not w.gone:
                w.gone, w.dead = True, dead
                self._try_apply()  # a synchronous step waiting for it goes ahead without it
                self.cond.notify_all()

    # ----- updates -----

    def _push(self, worker: int, meta: dict[str, Any], grad: Tensor) -> None:
        step, lrs = int(meta["step"]), list(meta["lrs"])
        with self.cond:
            w = self.workers[worker]
            w.clock, w.pushes = step + 1, w.pushes + 1
            w.loss = meta.get("loss")
            self.first_push = self.first_push or time.monotonic()
            if self.staleness == 0:
                if self.next_step is not None and step < self.next_step:
                    self.stats["dropped"] += 1  # a step already applied without it
                else:
                    self.pending.setdefault(step, []).append((grad, lrs))
                    self.pending_losses.setdefault(step, []).append(w.loss)
                self._try_apply()
            else:
                self.train_loss = _mean([x.loss for x in self.workers.values()])  # each worker's latest
                staleness = self.updates - int(meta["pulled"])
                self.stats["max_staleness"] = max(self.stats["max_staleness"], staleness)
                self.stats["sum_staleness"] += staleness
                self._apply(grad, lrs, meta.get("norm"))
            self.cond.notify_all()

    def _try_apply(self) -> None:
        """Synchronous: apply every step whose pushes are all in (caller holds the lock)."""
        if self.staleness != 0 or self.next_step is None or not self._registered():
            return
        while True:
            active = self._active()
            if any(w.clock <= self.next_step for w in active):
                return
            parts = self.pending.pop(self.next_step, [])
            losses = self.pending_losses.pop(self.next_step, [])
            if not parts and not active:
                return  # nobody will push this step
            if parts:
                grad = torch.stack([g for g, _ in parts]).mean(0) if len(parts) > 1 else parts[0][0]
                self._apply(grad, parts[0][1], None)
                self.train_loss = _mean(losses)  # the step's workers' shares are equal: the global batch's loss
            self.next_step += 1

    def _apply(self, grad: Tensor, lrs: list[float], norm: float | None) -> None:
        """One optimizer step with ``grad`` (this server's slice of the update's gradient)."""
        if self.clip is not None:
            if self.clip.algorithm == "value":
                grad.clamp_(-self.clip.value, self.clip.value)
            else:
                norm = self._norm(grad) if norm is None else norm
                grad.mul_(min(1.0, self.clip.value / (norm + 1e-6)))  # torch.nn.utils.clip_grad_norm_'s factor
        for piece, group, (lo, hi) in zip(self.pieces, self.optimizer.param_groups, self.bounds):
            piece.grad = grad[lo:hi]
            group["lr"] = lrs[group["user_group"]]
        self.optimizer.step()
        self.updates += 1
        self.last_update = time.monotonic()

    def _norm(self, grad: Tensor) -> float:
        """The 2-norm of the whole update's gradient (every server holds a slice of it)."""
        squares = grad.double().pow(2).sum()
        if self.server_group is not None:
            squares = host_all_reduce(squares, group=self.server_group)
        return math.sqrt(float(squares))

    # ----- pulls, snapshots -----

    def _pull(self, step: int) -> tuple[int, Tensor]:
        """The shard once every active worker has pushed at least ``step - staleness`` steps."""
        with self.cond:
            while True:
                active = self._active()
                if self._registered() and all(w.clock >= step - self.staleness for w in active):
                    break
                self._expire_unregistered()
                self.cond.wait(0.5)
            if active:
                self.stats["max_clock_gap"] = max(self.stats["max_clock_gap"], step - min(w.clock for w in active))
            flat = torch.cat([piece.detach().reshape(-1) for piece in self.pieces])
            return self.updates, flat

    def state_dict(self) -> dict[str, Any]:
        return {
            "server": self.server,
            "range": (self.start, self.end),
            "pieces": [piece.detach().clone() for piece in self.pieces],
            "optimizer": self.optimizer.state_dict(),
            "updates": self.updates,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if tuple(state["range"]) != (self.start, self.end):
            raise ValueError(
                f"async_ps: the checkpoint's server {state['server']} held elements {tuple(state['range'])} of the "
                f"flat parameters, this server holds {(self.start, self.end)}: resume with the num_servers (and "
                "model) the checkpoint was saved with."
            )
        with torch.no_grad():
            for piece, saved in zip(self.pieces, state["pieces"]):
                piece.copy_(saved)
        self.optimizer.load_state_dict(state["optimizer"])
        self.updates = int(state["updates"])

    # ----- the workers' collectives (server 0) -----

    def _collective(self, worker: int, meta: dict[str, Any], payload: bytearray) -> bytes:
        with self.cond:
            c = self.collectives.setdefault(int(meta["seq"]), _Collective())
            c.parts[worker] = (meta["op"], int(meta.get("src", 0)), payload)
            self.cond.notify_all()
            while c.result is None:
                # a finished worker runs no more collectives (its client answers them itself): a worker that
                # stopped at another step (max_steps against a time budget) must not hold the others' validation
                members = [r for r, w in self.workers.items() if not w.gone and not w.finished]
                if all(r in c.parts for r in members):
                    c.result = _combine(c.parts)
                    self.cond.notify_all()
                else:
                    self.cond.wait(0.5)
            return c.result

    # ----- counters -----

    def counters(self) -> dict[str, Any]:
        span = (self.last_update - self.first_push) if self.first_push and self.last_update else 0.0
        applied_pushes = sum(w.pushes for w in self.workers.values())
        return {
            "server": self.server,
            "updates": self.updates,
            "update_seconds": span,  # from the first push to the last update
            "updates_per_second": self.updates / span if span > 0 else None,
            "pushes": {str(r): w.pushes for r, w in self.workers.items()},
            "train_loss": self.train_loss,  # the last update's (server 0: the workers' mean; see _push)
            "dead_workers": sorted(r for r, w in self.workers.items() if w.dead),
            "mean_staleness": self.stats["sum_staleness"] / applied_pushes if self.staleness and applied_pushes else 0,
            **{k: v for k, v in self.stats.items() if k != "sum_staleness"},
        }

    def _final_counters(self) -> dict[str, Any]:
        """The counters once no active worker is left (every live worker has finished)."""
        with self.cond:
            while self._active():
                self.cond.wait(0.5)
            return self.counters()


def _mean(values: list[float | None]) -> float | None:
    known = [v for v in values if v is not None]
    return sum(known) / len(known) if known else None


def _combine(parts: dict[int, tuple[str, int, bytearray]]) -> bytes:
    op, src, _ = next(iter(parts.values()))
    if op == "barrier":
        return b""
    if op == "broadcast":
        return bytes(parts[src][2]) if src in parts else p.to_blob(None)
    tensors = [p.from_blob(payload) for _, _, payload in parts.values()]
    stacked = torch.stack([t.double() for t in tensors])
    combined = {"sum": stacked.sum(0), "mean": stacked.mean(0), "max": stacked.amax(0), "min": stacked.amin(0)}[op]
    return p.to_blob(combined.to(tensors[0].dtype))
