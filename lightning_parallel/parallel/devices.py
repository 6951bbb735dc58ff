"""Which device a collective takes its tensors on, and host values reduced over any backend. Pure torch.

On CUDA the world and every mesh group are NCCL only (Lightning's default world, bound to this rank's device, the
mesh's groups split from it by ``ncclCommSplit``): such a group has no backend for host tensors, and a collective on
one raises "No backend type associated with device type cpu". On CPU the groups are gloo, which takes host tensors.
Values that live on the host (FLOP counts, a check before training, the norm of gradients offloaded to the host) are
reduced through :func:`host_all_reduce`, which moves them to the device the group's backend serves and back: one
small copy each way, at measuring steps, setup, or per clipped step under offload. Everything else is on the
device already. ARCHITECTURE.md ("On GPUs") says why the groups are not ``cuda:nccl,cpu:gloo``.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor

import lightning_parallel._compat as _compat


def collective_device(group: dist.ProcessGroup | None = None) -> torch.device:
    """The device a collective over ``group`` (default: the world) takes its tensors on: the host when the group has
    a backend for host tensors (gloo), else this rank's accelerator (NCCL serves its device only)."""
    types = _compat.group_device_types(group)
    if "cpu" in types:
        return torch.device("cpu")
    bound = getattr(group if group is not None else dist.group.WORLD, "bound_device_id", None)
    if bound is not None:  # the device NCCL's communicator was made for (right in any thread)
        return bound
    device_type = types[0]
    module = getattr(torch, device_type, None)
    index = module.current_device() if module is not None and hasattr(module, "current_device") else 0
    return torch.device(device_type, index)


def host_all_reduce(
    tensor: Tensor, group: dist.ProcessGroup | None = None, op: dist.ReduceOp.RedOpType = dist.ReduceOp.SUM
) -> Tensor:
    """``tensor`` all-reduced over ``group`` on whatever backend the group has, returned on ``tensor``'s device
    (a new tensor; ``tensor`` is not changed).

    Args:
        tensor: values on any device (host scalars and counts are the usual case).
        group: the process group (default: the world).
        op: the reduction.
    """
    device = collective_device(group)
    out = tensor.to(device, copy=True)
    dist.all_reduce(out, op=op, group=group)
    return out.to(tensor.device)
