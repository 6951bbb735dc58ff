"""Case ``strict`` (world 2, tests/test_strict.py): strict mode's executor and trace on plain torch.distributed.

Scenarios in order (``--opts '{"scenarios": [...]}'``), each returning what it saw: ``exchange`` (rank 0 sends
then receives, rank 1 receives then sends), ``batch`` (both ranks one batch_isend_irecv of a send and a receive),
``blocking`` (dist.send / dist.recv), ``sizes`` (a send meets a receive of another size), ``trace`` (the same
all_reduce with transposed shapes: strict.check names it), ``crossed`` (both send first: NCCL's deadlock; last, as
strict mode stays failed after it).
"""

from __future__ import annotations

import time

import torch
import torch.distributed as dist

from lightning_parallel.parallel import strict

PROCESS_GROUP = True


def _exchange(rank: int) -> dict:
    mine, theirs = torch.full((4,), float(rank)), torch.empty(4)
    if rank == 0:
        works = [dist.isend(mine, 1), dist.irecv(theirs, 1)]
    else:
        works = [dist.irecv(theirs, 0), dist.isend(mine, 0)]
    for work in works:
        work.wait()
    return {"got": theirs.tolist()}


def _batch(rank: int) -> dict:
    peer = 1 - rank
    mine, theirs = torch.full((3,), float(rank) + 10), torch.empty(3)
    ops = [dist.P2POp(dist.isend, mine, peer), dist.P2POp(dist.irecv, theirs, peer)]
    for work in dist.batch_isend_irecv(ops):
        work.wait()
    return {"got": theirs.tolist()}


def _blocking(rank: int) -> dict:
    x = torch.full((2,), 7.0) if rank == 0 else torch.empty(2)
    if rank == 0:
        dist.send(x, 1)
    else:
        dist.recv(x, 0)
    return {"got": x.tolist()}


def _crossed(rank: int) -> dict:
    peer, started = 1 - rank, time.monotonic()
    mine, theirs = torch.ones(5), torch.empty(5)
    try:
        send = dist.isend(mine, peer)  # both ranks send first: NCCL blocks both sends forever
        recv = dist.irecv(theirs, peer)
        send.wait()
        recv.wait()
    except strict.StrictCollectiveError as error:
        return {"error": str(error), "seconds": time.monotonic() - started}
    return {"error": None}


def _trace(rank: int) -> dict:
    dist.all_reduce(torch.ones(2, 3) if rank == 0 else torch.ones(3, 2))  # same bytes: gloo runs it
    try:
        strict.check("the trace scenario")
    except strict.StrictCollectiveError as error:
        return {"error": str(error)}
    return {"error": None}


def _sizes(rank: int) -> dict:
    try:
        if rank == 0:
            dist.isend(torch.ones(4), 1).wait()
        else:
            dist.irecv(torch.empty(6), 0).wait()
    except strict.StrictCollectiveError as error:
        return {"error": str(error)}
    return {"error": None}


SCENARIOS = {"exchange": _exchange, "batch": _batch, "blocking": _blocking, "crossed": _crossed}
SCENARIOS |= {"trace": _trace, "sizes": _sizes}


def run_case(case: dict, ctx) -> dict:
    on_from_env = strict.enabled()  # run.py called enable_from_env: the harness's LP_STRICT_COLLECTIVES
    strict.enable(timeout_s=float(case.get("timeout_s", 20)))
    return {"on_from_env": on_from_env, **{name: SCENARIOS[name](ctx.rank) for name in case["scenarios"]}}
