"""A worker's side of the parameter servers: pull the parameters into the model, push a step's gradient, and
the workers' collectives (through server 0, so that they go on without a worker that died). Pure torch."""

from __future__ import annotations

import socket
import time
from typing import Any

import torch
from torch import Tensor

from lightning_parallel.parallel.async_ps import protocol as p
from lightning_parallel.parallel.async_ps.layout import FlatLayout


class ServerClient:
    """One connection to each server.

    Args:
        addresses: ``(host, port)`` of each server, in server order.
        worker: this worker's global rank.
        layout: the flat layout of the model's parameters.
        connect_timeout_s: how long to keep trying to reach a server that is not listening yet.
    """

    def __init__(
        self, addresses: list[tuple[str, int]], worker: int, layout: FlatLayout, connect_timeout_s: float = 300.0
    ) -> None:
        self.worker, self.layout = worker, layout
        self.socks = [_connect(address, connect_timeout_s) for address in addresses]
        self.ranges = [layout.server_range(i) for i in range(len(addresses))]
        self.seq = 0  # collectives so far: every worker calls the same ones in the same order
        self.pulled = 0  # the servers' update count of the parameters last pulled (server 0's)
        self.pulls = 0
        self.finished = False

    def hello(self, step: int) -> None:
        for sock in self.socks:
            p.send(sock, p.HELLO, {"worker": self.worker, "step": step})

    def pull(self, step: int) -> int:
        """Load into the model the parameters for computing step ``step`` (waits while the staleness bound says
        so); returns the servers' update count they carry."""
        for sock in self.socks:
            p.send(sock, p.PULL, {"step": step})
        updates = []
        for sock, (start, _) in zip(self.socks, self.ranges):
            meta, payload = p.expect(sock, p.PARAMS)
            self.layout.load(p.as_tensor(payload), start)
            updates.append(int(meta["updates"]))
        self.pulled, self.pulls = updates[0], self.pulls + 1
        return self.pulled

    def push(self, step: int, grad: Tensor, lrs: list[float], norm: float | None, loss: float | None = None) -> None:
        """Send step ``step``'s gradient (flat, fp32), each server its slice, and the step's training loss on this
        worker's share (server 0 averages them: the global loss); does not wait for an answer."""
        for sock, (start, end) in zip(self.socks, self.ranges):
            meta = {"step": step, "lrs": lrs, "norm": norm, "pulled": self.pulled, "loss": loss}
            p.send(sock, p.PUSH, meta, grad[start:end])

    def collective(self, op: str, value: Any = None, src: int = 0) -> Any:
        """``op`` among the live workers: ``barrier``, ``broadcast`` (``value`` of worker ``src``) or ``sum``,
        ``mean``, ``max``, ``min`` of a tensor."""
        if self.finished:  # no longer a member: the live workers' collectives go on without this one
            return None if op == "barrier" else value
        self.seq += 1
        payload = b"" if op == "barrier" else p.to_blob(value.detach().cpu() if isinstance(value, Tensor) else value)
        p.send(self.socks[0], p.REDUCE, {"seq": self.seq, "op": op, "src": src}, payload)
        _, result = p.expect(self.socks[0], p.REDUCED)
        return None if op == "barrier" else p.from_blob(result)

    def snapshot(self, step: int) -> list[dict[str, Any]]:
        """Every server's state once the updates a pull of ``step`` would see are applied."""
        for sock in self.socks:
            p.send(sock, p.SNAPSHOT, {"step": step})
        return [p.from_blob(p.expect(sock, p.STATE)[1], map_location="cpu") for sock in self.socks]

    def finish(self) -> None:
        """No more pushes, and no more collectives with the other workers."""
        for sock in self.socks:
            p.send(sock, p.FINISH)
        self.finished = True

    def counters(self) -> list[dict[str, Any]]:
        """Each server's counters, once every live worker has finished."""
        for sock in self.socks:
            p.send(sock, p.STATS)
        return [p.expect(sock, p.COUNTS)[0] for sock in self.socks]

    def close(self) -> None:
        for sock in self.socks:
            try:
                p.send(sock, p.BYE)
                sock.close()
            except OSError:
                pass
        self.socks = []


def _connect(address: tuple[str, int], timeout_s: float) -> socket.socket:
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            sock = socket.create_connection(address, timeout=timeout_s)
            sock.settimeout(None)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            return sock
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.1)


def grad_norm(flat: Tensor) -> float:
    return float(torch.linalg.vector_norm(flat.double()))
