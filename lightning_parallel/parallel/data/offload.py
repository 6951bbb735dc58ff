"""ZeRO-Offload's host side for the flat buffers: this rank's slice of parameters and of reduced gradients on the
host, where the optimizer steps. Pure torch.

Every collective runs on the device (on CUDA the groups are NCCL only, which has no backend for host tensors):
gradients leave for the host only once every reduction of them is done, and parameters come back to the device
before the all-gather. With an accelerator the host buffers are allocated once and pinned, and both copies run
``non_blocking`` on the current stream (what FSDP2's ``CPUOffloadPolicy(pin_memory=True)`` does):

- gradients, device -> host: queued behind the reduction on the stream; an event recorded after the copies is
  synchronised (:meth:`HostSlice.wait`) before anything on the host reads them: clipping's norm, the step;
- parameters, host -> device, after the step: the all-gather and the next forward read them on the device, after
  the copy in stream order (the process group's stream waits for the current one); the host must not write the
  host slice again (the next step, a checkpoint load) while the copy reads it, so that event is synchronised first.

On the CPU there is no accelerator, the "host copy" is a plain synchronous copy, and no buffer is pinned (pinning
needs the CUDA runtime).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor


def pinned_transfers(device: torch.device) -> bool:
    """Whether host copies of tensors on ``device`` are pinned and copied ``non_blocking``: only for a CUDA device
    with CUDA available (page-locked memory and asynchronous copies need the accelerator's runtime)."""
    return device.type == "cuda" and torch.cuda.is_available()


def host_buffer(like: Tensor, pinned: bool) -> Tensor:
    """An uninitialised host tensor of ``like``'s shape and dtype, page-locked when ``pinned``."""
    return torch.empty(like.shape, dtype=like.dtype, device="cpu", pin_memory=pinned)


class HostSlice:
    """This rank's slice of one flat group on the host: the parameter the optimizer steps (``param``) and the
    buffer its reduced gradient is copied into (``grad``), both allocated once.

    Args:
        device_slice: this rank's slice of the flat parameter buffer, on the device.
    """

    def __init__(self, device_slice: Tensor) -> None:
        self.pinned = pinned_transfers(device_slice.device)
        self.param = host_buffer(device_slice, self.pinned)
        self.param.copy_(device_slice)
        self.grad = host_buffer(device_slice, self.pinned)
        self._in_flight: list[Any] = []  # events recorded after copies still running (CUDA only)

    def grad_from(self, grad: Tensor) -> Tensor:
        """Queue the copy of a reduced gradient slice (on the device) into the host buffer; returns the buffer,
        readable once :meth:`wait` returned."""
        self.wait()  # the last copy into the buffer, if any, is done: never two in flight on one buffer
        self.grad.copy_(grad, non_blocking=self.pinned)
        self._record()
        return self.grad

    def param_to(self, device_slice: Tensor) -> None:
        """Queue the copy of the stepped host slice into ``device_slice`` (read on the device after it, in stream
        order); the host slice must not be written before :meth:`wait`."""
        device_slice.copy_(self.param, non_blocking=self.pinned)
        self._record()

    def param_from(self, device_slice: Tensor) -> None:
        """Refresh the host slice from the device (after a checkpoint was loaded into the flat buffers)."""
        self.wait()
        self.param.copy_(device_slice)

    def wait(self) -> None:
        """Block the host until every copy queued so far is done (a no-op without an accelerator)."""
        for event in self._in_flight:
            event.synchronize()
        self._in_flight.clear()

    def _record(self) -> None:
        if self.pinned:
            event = torch.cuda.Event()
            event.record()
            self._in_flight.append(event)
