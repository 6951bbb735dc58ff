"""Dynamic loss scaling for fp16 whose overflow verdict is agreed by every rank. Pure torch.

Hand-written because torch's ``GradScaler`` cannot unscale a mix of DTensor and plain gradients ("got
mixed torch.Tensor and DTensor") and decides on overflow per rank, while under sharding each rank sees
only part of the gradients: an inf in one tensor-parallel shard or one pipeline stage must make every rank
of the mesh skip the same step, or the replicas drift apart. Here each rank checks its local gradients
(DTensor shards included), the verdict is all-reduced with MAX over the whole process group, and the
scale is a Python number that every rank updates the same way.

The interface is ``GradScaler``'s (``scale``, ``unscale_``, ``step``, ``update``, ``get_scale``,
``state_dict``), so Lightning's mixed-precision plugin drives it unchanged; the defaults are its defaults.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from lightning_parallel.parallel.dtensor import local as _local


def unscale_and_check_(grads: Iterable[Tensor], inv_scale: float) -> Tensor:
    """Multiply ``grads`` (this rank's data of each; DTensor shards included) by ``inv_scale`` in place.

    Returns:
        A float32 scalar on the gradients' device (CPU when there are none): 1.0 if any local element is
        inf or NaN, else 0.0. Local only: no communication.
    """
    by_device_dtype: dict[tuple[torch.device, torch.dtype], list[Tensor]] = defaultdict(list)
    for g in grads:
        local = _local(g)
        by_device_dtype[(local.device, local.dtype)].append(local)
    device = next(iter(by_device_dtype))[0] if by_device_dtype else torch.device("cpu")
    found = torch.zeros(1, dtype=torch.float32, device=device)
    for (dev, _), tensors in by_device_dtype.items():
        found_here = torch.zeros(1, dtype=torch.float32, device=dev)
        inv = torch.full((1,), inv_scale, dtype=torch.float32, device=dev)
        # the kernel GradScaler uses: one pass that multiplies and flags inf/NaN (CPU and CUDA)
        torch._amp_foreach_non_finite_check_and_unscale_(tensors, found_here, inv)
        found = torch.maximum(found, found_here.to(device))
    return found.reshape(())


class LossScaler:
    """fp16 dynamic loss scaling with one overflow verdict for all ranks of ``group``.

    Args:
        init_scale: the first scale (GradScaler's default 2**16).
        growth_factor: multiplies the scale after ``growth_interval`` steps in a row without overflow.
        backoff_factor: multiplies the scale after a step with inf/NaN gradients (which is skipped).
        growth_interval: overflow-free steps before the scale grows.
        group: process group that agrees on overflow (all-reduce MAX); ``None`` is the default (world)
            group when one is initialized, and no communication otherwise.
        device: where the verdict is all-reduced (``cuda`` under NCCL, even when gradients sit on the host).
    """

    def __init__(
        self,
        init_scale: float = 2.0**16,
        growth_factor: float = 2.0,
        backoff_factor: float = 0.5,
        growth_interval: int = 2000,
        group: dist.ProcessGroup | None = None,
        device: str | torch.device = "cpu",
    ) -> None:
        if not growth_factor > 1.0 or not 0.0 < backoff_factor < 1.0 or growth_interval < 1 or init_scale <= 0:
            raise ValueError(
                f"LossScaler(init_scale={init_scale}, growth_factor={growth_factor}, backoff_factor={backoff_factor},"
                f" growth_interval={growth_interval}): needs init_scale > 0, growth_factor > 1, "
                "0 < backoff_factor < 1 and growth_interval >= 1."
            )
        self._scale = float(init_scale)
        self._growth_factor = float(growth_factor)
        self._backoff_factor = float(backoff_factor)
        self._growth_interval = int(growth_interval)
        self._growth_tracker = 0
        self.group = group
        self.device = torch.device(device)
        self._found_inf: dict[int, bool] = {}  # id(optimizer) -> verdict of this step's unscale_
        self.skipped_steps = 0  # optimizer steps skipped for overflow so far (not saved in checkpoints)

    # ----- GradScaler's interface -----

    def get_scale(self) -> float:
        return self._scale

    def is_enabled(self) -> bool:
        return True

    def scale(self, outputs: Tensor) -> Tensor:
        """``outputs`` times the current scale (backpropagate that instead of the loss)."""
        return outputs * torch.full((), self._scale, dtype=torch.float32, device=outputs.device)

    def unscale_(self, optimizer: torch.optim.Optimizer) -> None:
        """Divide the gradients of ``optimizer``'s parameters by the scale, in place, and agree on overflow.

        Collective over ``group``: every rank calls it once per optimizer step.
        """
        if id(optimizer) in self._found_inf:
            raise RuntimeError("unscale_() was already called on this optimizer since the last update().")
        grads = [p.grad for group in optimizer.param_groups for p in group["params"] if p.grad is not None]
        self._found_inf[id(optimizer)] = self.unscale_grads_(grads)

    def unscale_grads_(self, grads: Iterable[Tensor]) -> bool:
        """Unscale ``grads`` in place; True when any rank of the group found inf or NaN (collective)."""
        found = unscale_and_check_(grads, 1.0 / self._scale)
        if dist.is_available() and dist.is_initialized():
            found = found.to(self.device)
            # one verdict for the whole mesh: a shard's overflow on one rank skips the step everywhere
            dist.all_reduce(found, op=dist.ReduceOp.MAX, group=self.group)
        return bool(found.item())

    def step(self, optimizer: torch.optim.Optimizer, *args: Any, **kwargs: Any) -> Any:
        """``optimizer.step()`` unless the gradients overflowed on any rank (then nothing, on every rank)."""
        if "closure" in kwargs:
            raise RuntimeError("LossScaler.step() takes no closure: run forward and backward before it.")
        if id(optimizer) not in self._found_inf:
            self.unscale_(optimizer)
        if self._found_inf[id(optimizer)]:
            self.skipped_steps += 1
            return None
        return optimizer.step(*args, **kwargs)

    def update(self) -> None:
        """Back off after an overflow, grow after ``growth_interval`` clean steps (same on every rank)."""
        if not self._found_inf:
            raise RuntimeError("update() needs an unscale_() or step() since the last update().")
        if any(self._found_inf.values()):
            self._scale *= self._backoff_factor
            self._growth_tracker = 0
        else:
            self._growth_tracker += 1
            if self._growth_tracker == self._growth_interval:
                self._scale *= self._growth_factor
                self._growth_tracker = 0
        self._found_inf.clear()

    # ----- checkpoints: GradScaler's keys, so either loads the other's state -----

    def state_dict(self) -> dict[str, Any]:
        return {
            "scale": self._scale,
            "growth_factor": self._growth_factor,
            "backoff_factor": self._backoff_factor,
            "growth_interval": self._growth_interval,
            "_growth_tracker": self._growth_tracker,
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Take a state saved by this class or by torch's GradScaler; an empty one (a run without loss
        scaling, such as bf16) keeps the current settings."""
        if not state_dict:
            return
        self._scale = float(state_dict["scale"])
        self._growth_factor = float(state_dict["growth_factor"])
        self._backoff_factor = float(state_dict["backoff_factor"])
        self._growth_interval = int(state_dict["growth_interval"])
        self._growth_tracker = int(state_dict["_growth_tracker"])
