"""The wire between workers and parameter servers: framed messages over plain TCP sockets, the settings'
checks, and which rank does what. Pure torch and the standard library.

Why sockets and not torch.distributed: a gloo collective or point-to-point op with a peer that died fails on
every rank that talks to it ("Connection closed by peer"), and torch.distributed.rpc ends with a graceful
barrier over all ranks. A socket per (worker, server) pair tells the server at once that a worker is gone (its
socket reads end-of-file) and touches no one else. The default process group's store only carries the servers'
addresses at start-up.

A message: a 9-byte header (kind, length of a JSON meta part, length of a binary payload), the meta, the
payload (raw tensor bytes, or a ``torch.save`` blob for snapshots and objects).
"""

from __future__ import annotations

import io
import json
import socket
import struct
from typing import Any

import torch

# worker -> server
HELLO = 1  # {"worker", "step"}: this worker starts at step (resume: the checkpoint's global step)
PUSH = 2  # {"step", "lrs", "norm"} + gradient slice (fp32): this worker's gradient of its step `step`
PULL = 3  # {"step"}: parameters for computing step `step` (answered once the staleness bound allows)
REDUCE = 4  # {"seq", "op", "src"} + payload: a collective among the live workers (server 0 only)
SNAPSHOT = 5  # {"step"}: this server's shard, optimizer state and counters (for a checkpoint)
FINISH = 6  # this worker pushes no more
STATS = 7  # the server's counters, once every live worker has finished
BYE = 8  # this worker is done with the server (it may end)
# server -> worker
PARAMS = 10  # {"updates"} + parameter slice
REDUCED = 11  # payload: the collective's result
STATE = 12  # payload: torch.save blob
COUNTS = 13  # {...}: the counters

_HEADER = struct.Struct("!BII")
_ADDRESS_KEY = "lightning_parallel/async_ps/server/"


def check_settings(num_servers: object, staleness: object, slow_worker_sleep: object = 0.0) -> None:
    """Refuse settings that cannot run, naming the setting and the fix (no process group needed)."""
    if isinstance(num_servers, bool) or not isinstance(num_servers, int) or num_servers < 1:
        raise ValueError(
            f"num_servers={num_servers!r} must be a positive integer: the last num_servers ranks hold the "
            "parameters; set num_servers=1 (or more, leaving at least one worker)."
        )
    if isinstance(staleness, bool) or not isinstance(staleness, int) or staleness < 0:
        raise ValueError(
            f"staleness={staleness!r} must be an integer >= 0: 0 is synchronous training, s > 0 lets a worker run "
            "up to s steps ahead of the slowest (set e.g. staleness=4; a value above max_steps is fully async)."
        )
    if isinstance(slow_worker_sleep, bool) or not isinstance(slow_worker_sleep, (int, float)) or slow_worker_sleep < 0:
        raise ValueError(
            f"slow_worker_sleep={slow_worker_sleep!r} must be a number of seconds >= 0: e.g. slow_worker_sleep=0.5."
        )


def check_world(num_servers: int, world_size: int, setting: str = "num_servers") -> int:
    """The number of workers; refuses a world with no worker left."""
    if num_servers >= world_size:
        raise ValueError(
            f"{setting}={num_servers} leaves no worker in a world of {world_size} processes: the last "
            f"{setting} ranks serve parameters and the others train; set {setting} to at most {world_size - 1} "
            f"or start more processes (devices)."
        )
    return world_size - num_servers


def is_server(rank: int, world_size: int, num_servers: int) -> bool:
    return rank >= world_size - num_servers


def send(sock: socket.socket, kind: int, meta: dict[str, Any] | None = None, payload: Any = b"") -> None:
    """Send one message; ``payload`` is bytes or a tensor on any device (its raw bytes, copied to the host)."""
    if isinstance(payload, torch.Tensor):
        payload = payload.detach().cpu().contiguous().view(torch.uint8).numpy()
    data = json.dumps(meta or {}).encode()
    view = memoryview(payload).cast("B")
    sock.sendall(_HEADER.pack(kind, len(data), view.nbytes) + data)
    if view.nbytes:
        sock.sendall(view)


def _read(sock: socket.socket, n: int) -> bytearray | None:
    buf = bytearray(n)
    view, got = memoryview(buf), 0
    while got < n:
        k = sock.recv_into(view[got:], n - got)
        if k == 0:
            return None
        got += k
    return buf


def recv(sock: socket.socket) -> tuple[int, dict[str, Any], bytearray] | None:
    """One message, or ``None`` when the peer has gone (end of file or a reset connection)."""
    try:
        header = _read(sock, _HEADER.size)
        if header is None:
            return None
        kind, meta_len, payload_len = _HEADER.unpack(header)
        meta = _read(sock, meta_len) if meta_len else bytearray()
        payload = _read(sock, payload_len) if payload_len else bytearray()
    except (ConnectionResetError, BrokenPipeError, OSError):
        return None
    if meta is None or payload is None:
        return None
    return kind, json.loads(meta) if meta else {}, payload


def expect(sock: socket.socket, kind: int) -> tuple[dict[str, Any], bytearray]:
    message = recv(sock)
    if message is None:
        raise ConnectionError("async_ps: a parameter server closed its connection (did a server rank fail?)")
    got, meta, payload = message
    if got != kind:
        raise ConnectionError(f"async_ps: expected message kind {kind} from a server, got {got}")
    return meta, payload


def as_tensor(payload: bytearray, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return torch.frombuffer(payload, dtype=dtype) if payload else torch.empty(0, dtype=dtype)


def to_blob(obj: Any) -> bytes:
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    return buffer.getvalue()


def from_blob(payload: bytearray, map_location: Any = None) -> Any:
    return torch.load(io.BytesIO(bytes(payload)), map_location=map_location, weights_only=False)


def publish_address(store: Any, server: int, host: str, port: int) -> None:
    store.set(f"{_ADDRESS_KEY}{server}", f"{host}:{port}")


def server_address(store: Any, server: int) -> tuple[str, int]:
    host, _, port = store.get(f"{_ADDRESS_KEY}{server}").decode().rpartition(":")
    return host, int(port)
