"""Fault tolerance across replica groups with torchft (PyPI ``torchft``): a lost replica does not stop the job.

The world is launched as ``ft_replicas`` independent replica groups, each its own ``torchrun`` (its own store and
process group) with the same layout inside. Inside a group the strategy reduces gradients as usual (dp, ZeRO,
cp); across groups, each rank averages its gradient pieces with the rank of the same group rank in every
other group through torchft's :class:`~torchft.manager.Manager` and its reconfigurable process group. Each step:

1. ``start_step``: the lighthouse forms a quorum of the groups alive now (at least ``ft_min_replicas``); a group
   that is behind (a restarted one) receives model and optimizer state from a peer over torchft's checkpoint
   transport (HTTP) before its forward: no checkpoint is read.
2. ``reduce``: after the in-group reduction, the cross-group average over the quorum.
3. ``should_commit``: every rank of every group in the quorum agrees the step went through; otherwise (a peer
   died mid-step) the update is dropped and the step runs again with the next quorum.

So the final state equals a one-process run in which step ``s`` averaged the batches of the groups in step
``s``'s quorum (:attr:`FaultTolerantReplicas.participants`). Pure torch and torchft; torchft is imported lazily.

May import: nothing of this package (torch, and torchft lazily). Never Lightning.
"""

from __future__ import annotations

import importlib.util
import os
from collections.abc import Callable, Iterable
from datetime import timedelta
from typing import Any

import torch
from torch import Tensor

FAULT_TOLERANCE = ("none", "torchft")
FT_SETTINGS = ("ft_replicas", "ft_replica_id", "ft_min_replicas", "ft_lighthouse", "ft_timeout")
_DTENSOR_STATE = (
    "its parameters and optimizer states are DTensors, and the live state transfer carries plain tensors "
    "(a rejoining group would get optimizer states it cannot rebuild)"
)
# settings torchft cannot run with, and why (checked before launch)
_REFUSED = {
    "pp": "a pipeline's stages hold different parameters and its schedule runs the forward before the quorum "
    "(and a live state transfer) could land",
    "dp_shard": "HSDP's replicas are torchft's replica groups here: launch ft_replicas groups of dp_shard ranks "
    "each, with dp_shard unset",
    "grad_compression": "the compressed reduction keeps per-rank error state that a rejoining replica would not get",
    "overlap_grad_reduce": "the overlapped parameter gathers of a step may still write the parameters that a live "
    "state transfer loads",
    "tp": _DTENSOR_STATE,
    "ep": _DTENSOR_STATE,
}


def check_fault_tolerance(config: Any, warn: Callable[[str], Any]) -> None:
    """Check the fault-tolerance settings of a :class:`~lightning_parallel.parallel.config.ParallelConfig`.

    Args:
        config: the parallel settings (``fault_tolerance`` and the ``ft_*`` fields are read).
        warn: how to warn about ``ft_*`` settings that do not apply.

    Raises:
        ValueError: an unknown mode, a setting out of range, torchft missing, or a layout torchft cannot run.
    """
    mode = config.fault_tolerance
    if mode not in FAULT_TOLERANCE:
        raise ValueError(f"fault_tolerance={mode!r} is unknown: set it to one of {', '.join(FAULT_TOLERANCE)}.")
    if mode == "none":
        if any(getattr(config, n) != getattr(type(config), n) for n in FT_SETTINGS):
            warn("the ft_* settings only apply with fault_tolerance='torchft': ignored.")
        return
    if importlib.util.find_spec("torchft") is None:
        raise ValueError(
            "fault_tolerance='torchft' needs torchft: pip install --no-deps torchft==0.2.0 (and its opentelemetry "
            "packages; see docs/fault-tolerance.md), or set fault_tolerance='none'."
        )
    replicas, replica_id, minimum = config.ft_replicas, config.ft_replica_id, config.ft_min_replicas
    for name, value in (("ft_replicas", replicas), ("ft_min_replicas", minimum)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name}={value!r} is not a count of replica groups: set it to a positive integer.")
    if minimum > replicas:
        raise ValueError(f"ft_min_replicas={minimum} exceeds ft_replicas={replicas}: set it to at most {replicas}.")
    if isinstance(replica_id, bool) or not isinstance(replica_id, int) or not 0 <= replica_id < replicas:
        raise ValueError(
            f"ft_replica_id={replica_id!r} names no replica group of {replicas}: give each group's launch its "
            f"index, 0 to {replicas - 1}."
        )
    timeout = config.ft_timeout
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or timeout <= 0:
        raise ValueError(f"ft_timeout={timeout!r} is not a duration: set it to a positive number of seconds.")
    for name, why in _REFUSED.items():
        value = getattr(config, name)
        if value != getattr(type(config), name):  # set away from its default
            raise ValueError(f"fault_tolerance='torchft' with {name}={value!r}: not supported ({why}). Unset {name}.")
    if config.zero_stage == 3:
        raise ValueError(
            f"fault_tolerance='torchft' with zero_stage=3: not supported ({_DTENSOR_STATE}). Use zero_stage 0-2."
        )


def lighthouse_address(setting: str | None) -> str:
    """The lighthouse's address: the setting, else ``TORCHFT_LIGHTHOUSE`` (torchft's own variable).

    Raises:
        ValueError: neither is set.
    """
    address = setting or os.environ.get("TORCHFT_LIGHTHOUSE")
    if not address:
        raise ValueError(
            "fault_tolerance='torchft' needs a lighthouse: start `torchft_lighthouse --min_replicas 1 --bind "
            "[::]:29510` and set ft_lighthouse='http://HOST:29510' (or TORCHFT_LIGHTHOUSE)."
        )
    return address


def check_backend(device: torch.device) -> None:
    """torchft reduces over gloo on CPU and NCCL on CUDA; other devices are refused (before any group exists).

    Raises:
        ValueError: a device type torchft has no process group for here.
    """
    if device.type not in ("cpu", "cuda"):
        raise ValueError(
            f"fault_tolerance='torchft' runs on cpu (gloo) or cuda (NCCL), not {device.type}: set "
            "fault_tolerance='none' or train on cpu or cuda."
        )


def sampler_kwargs(config: Any, kwargs: dict[str, Any]) -> dict[str, Any]:
    """The samples of ``ft_replicas`` groups: group ``i`` takes the i-th of every ``ft_replicas`` batch ranks'
    shards (torchft's own ``DistributedSampler`` splits the same way)."""
    if config.fault_tolerance != "torchft":
        return kwargs
    size = kwargs["num_replicas"]
    return {"num_replicas": size * config.ft_replicas, "rank": config.ft_replica_id * size + kwargs["rank"]}


class FaultTolerantReplicas:
    """One rank's handle on torchft: the quorum, the cross-group gradient average, the commit, the state transfer.

    Args:
        config: the validated parallel settings (``ft_*``).
        device: this rank's device (picks gloo or NCCL for the cross-group reduction).
        state_dict: returns what a rejoining group must receive (model and optimizer state of this rank).
        load_state_dict: loads what :paramref:`state_dict` returned, on a rejoining group.
        group_rank, group_size: this rank in its replica group, and the group's size.
        store: ``(host, port)`` of the group's TCP store (the one its process group was made with).
    """

    def __init__(
        self,
        config: Any,
        device: torch.device,
        state_dict: Callable[[], dict[str, Any]],
        load_state_dict: Callable[[dict[str, Any]], None],
        group_rank: int,
        group_size: int,
        store: tuple[str, int],
    ) -> None:
        from torchft import Manager, ProcessGroupGloo, ProcessGroupNCCL

        check_backend(device)
        timeout = timedelta(seconds=config.ft_timeout)
        group = ProcessGroupGloo(timeout=timeout) if device.type == "cpu" else ProcessGroupNCCL(timeout=timeout)
        self.manager = Manager(
            pg=group,
            load_state_dict=load_state_dict,
            state_dict=state_dict,
            min_replica_size=config.ft_min_replicas,
            use_async_quorum=False,  # the quorum (and a transfer) completes before the forward: every step counts
            timeout=timeout,
            quorum_timeout=timeout,
            connect_timeout=timeout,
            rank=group_rank,
            world_size=group_size,
            store_addr=store[0],
            store_port=store[1],
            lighthouse_addr=lighthouse_address(config.ft_lighthouse),
            replica_id=f"replica_{config.ft_replica_id}",  # trailing digits: torchft numbers ranks by them
        )

    def start_step(self) -> None:
        """Join this step's quorum; a group that is behind loads a peer's state here, before its forward."""
        self.manager.start_quorum()

    def reduce(self, grads: Iterable[Tensor]) -> None:
        """Average ``grads`` in place with the same pieces of the other groups in the quorum (a failure is
        recorded by torchft and turns :meth:`should_commit` false)."""
        works = [self.manager.allreduce(g) for g in grads]
        for work in works:
            work.wait()

    def should_commit(self) -> bool:
        """Whether every rank of the quorum got through the step: apply the update only then."""
        return self.manager.should_commit()

    @property
    def step(self) -> int:
        """The number of committed steps (a rejoined group takes its peers' count)."""
        return self.manager.current_step()

    @property
    def participants(self) -> int:
        """How many replica groups this step's quorum holds."""
        return self.manager.num_participants()

    def shutdown(self) -> None:
        self.manager.shutdown(wait=False)
