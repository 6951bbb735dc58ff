"""Case ``preemption_flag``: the Preemption callback's flag reduction on its own, as on an NCCL world (whose groups
take no host tensors): ``dist.get_backend`` reports "nccl", so the callback makes its gloo group of every rank; rank
``rank`` has the signal before step ``step``'s end. Returns, per step, whether this rank stops after it, the ranks
of the callback's group and whether it is the world's."""

from __future__ import annotations

from unittest import mock

import torch.distributed as dist

from lightning_parallel.callbacks.preemption import Preemption

PROCESS_GROUP = True


def run_case(case: dict, ctx) -> dict:
    callback = Preemption()
    with mock.patch.object(dist, "get_backend", return_value="nccl"):
        callback.on_train_start(None, None)  # type: ignore[arg-type]  (the trainer is not read there)
    stops = []
    for step in range(case["steps"]):
        if step == case["step"] and ctx.rank == case["rank"]:
            callback.received = True  # what the signal handler does
        stops.append(callback._anyone_received(None))  # type: ignore[arg-type]
    callback.on_train_end(None, None)  # type: ignore[arg-type]
    group = callback._group
    return {"stops": stops, "own_group": group is not None, "group_size": dist.get_world_size(group)}
