"""Megatron-style tensor parallelism for conv nets: channels split the way Linear splits features. Pure torch.

Hand-written because torch has no such style: ``ColwiseParallel``/``RowwiseParallel`` take only ``nn.Linear``
and ``nn.Embedding``, and DTensor's convolution splits only the batch or the width, never channels.

A pair of convolutions is split like an MLP (activations are NCHW: the channel dim is 1):

- :class:`ChannelOutParallel` on the first conv: weight and bias ``Shard(0)`` (output channels); its input is
  replicated and its output holds this rank's channels (``Shard(1)``). Its input gradient is a partial sum
  (each rank back-propagates through its own output channels only) and is all-reduced in backward.
- :class:`ChannelNormParallel` on the BatchNorm after it: weight, bias and running statistics ``Shard(0)``.
  Exact, because BatchNorm normalizes each channel on its own (statistics over batch and space).
- Anything per-channel between them (ReLU, max-pool) runs on the local channels as it is.
- :class:`ChannelInParallel` on the second conv: weight ``Shard(1)`` (input channels), bias replicated; each
  rank's output is a partial sum over its input channels, all-reduced in forward (output ``Replicate``).

One all-reduce forward and one backward per pair, as for Megatron's MLP.
"""

from __future__ import annotations

import fnmatch
from collections.abc import Mapping
from types import MethodType
from typing import Any

from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Placement, Replicate, Shard, distribute_module, distribute_tensor
from torch.distributed.tensor.parallel import ParallelStyle

_CONV_TYPES = (nn.Conv1d, nn.Conv2d, nn.Conv3d)
_NORM_TYPES = (nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d, nn.SyncBatchNorm)


def _to_layout(x: Any, mesh: DeviceMesh, given: Placement, desired: Placement) -> DTensor:
    """Annotate a local input with its layout ``given``, then move it to ``desired``."""
    if not isinstance(x, DTensor):
        x = DTensor.from_local(x, mesh, (given,), run_check=False)
    if x.placements != (desired,):
        x = x.redistribute(placements=(desired,), async_op=True)
    return x


def _from_layout(y: DTensor, desired: Placement, use_local_output: bool) -> Tensor:
    if y.placements != (desired,):
        y = y.redistribute(placements=(desired,), async_op=True)
    return y.to_local() if use_local_output else y


def _shard_params(module: nn.Module, mesh: DeviceMesh, placements: Mapping[str, Placement], src: int | None) -> None:
    """Replace each named parameter or buffer by a DTensor with the given placement (others are left to
    ``distribute_module``, which replicates them)."""
    for name, placement in placements.items():
        tensor = getattr(module, name, None)
        if tensor is None:
            continue
        dist = distribute_tensor(tensor.detach(), mesh, [placement], src_data_rank=src)
        if isinstance(tensor, nn.Parameter):
            module.register_parameter(name, nn.Parameter(dist, requires_grad=tensor.requires_grad))
        else:
            module.register_buffer(name, dist)


def _local(t: Tensor | None) -> Tensor | None:
    return t.to_local() if isinstance(t, DTensor) else t


def _channel_out_forward(self: nn.Module, x: DTensor) -> DTensor:
    # every rank sees all input channels; its input gradient covers only its output channels: a partial sum
    x_local = x.to_local(grad_placements=(Partial(),))
    y = self._conv_forward(x_local, _local(self.weight), _local(self.bias))  # (B, C_out / tp, H, W)
    return DTensor.from_local(y, x.device_mesh, (Shard(1),), run_check=False)


def _channel_in_forward(self: nn.Module, x: DTensor) -> DTensor:
    y = self._conv_forward(x.to_local(), _local(self.weight), None)  # (B, C_out, H, W), a sum over my channels
    y = DTensor.from_local(y, x.device_mesh, (Partial(),), run_check=False).redistribute(placements=(Replicate(),))
    if self.bias is not None:  # added once, after the sum
        y = y + self.bias.view(1, -1, *([1] * (y.dim() - 2)))
    return y


class _ChannelStyle(ParallelStyle):
    """Shared plumbing: shard the named tensors, move the input to the layout the math needs, move the
    output to the layout the next module expects."""

    desired_input_layout: Placement
    natural_output_layout: Placement
    forward_fn: Any = None
    module_types: tuple[type[nn.Module], ...] = _CONV_TYPES

    def __init__(
        self,
        *,
        input_layouts: Placement | None = None,
        output_layouts: Placement | None = None,
        use_local_output: bool = True,
    ) -> None:
        super().__init__()
        self.input_layout = input_layouts or self.desired_input_layout
        self.output_layout = output_layouts or self.natural_output_layout
        self.use_local_output = use_local_output

    def placements(self, module: nn.Module) -> dict[str, Placement]:
        raise NotImplementedError

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        if not isinstance(module, self.module_types):
            names = ", ".join(t.__name__ for t in self.module_types)
            raise TypeError(f"{type(self).__name__} applies to {names}, not {type(module).__name__}.")
        if isinstance(module, _CONV_TYPES) and module.groups != 1:
            raise ValueError(
                f"{type(self).__name__} needs groups=1, got a {type(module).__name__} with groups={module.groups}."
            )
        if self.forward_fn is not None:
            # a plain conv's forward would hand DTensor weights to DTensor's convolution, which cannot split
            # channels: run the local math instead, between the layout hooks below
            module.forward = MethodType(type(self).forward_fn, module)
        return distribute_module(
            module,
            device_mesh,
            # a conv or norm has no submodules: this partitions ``module`` itself
            lambda _name, mod, mesh: _shard_params(mod, mesh, self.placements(mod), self.src_data_rank),
            lambda mod, inputs, mesh: _to_layout(inputs[0], mesh, self.input_layout, self.desired_input_layout),
            self._output_fn,
        )

    def _output_fn(self, mod: nn.Module, outputs: DTensor, mesh: DeviceMesh) -> Tensor:
        return _from_layout(outputs, self.output_layout, self.use_local_output)

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}(input_layouts={self.input_layout}, output_layouts={self.output_layout}, "
            f"use_local_output={self.use_local_output})"
        )


class ChannelOutParallel(_ChannelStyle):
    """Split a convolution by its output channels (``ColwiseParallel`` for convs).

    Keyword Args:
        input_layouts: the layout of the incoming activation; default ``Replicate()``.
        output_layouts: the layout to hand on; default ``Shard(1)``, this rank's output channels.
        use_local_output: return a local tensor (default) instead of a DTensor.
    """

    desired_input_layout = Replicate()
    natural_output_layout = Shard(1)
    forward_fn = _channel_out_forward

    def placements(self, module: nn.Module) -> dict[str, Placement]:
        return {"weight": Shard(0), "bias": Shard(0)}  # weight (C_out, C_in, k, k)


class ChannelInParallel(_ChannelStyle):
    """Split a convolution by its input channels (``RowwiseParallel`` for convs); partial outputs are summed.

    Keyword Args:
        input_layouts: the layout of the incoming activation; default ``Shard(1)``, this rank's channels.
        output_layouts: the layout to hand on; default ``Replicate()`` (an all-reduce).
        use_local_output: return a local tensor (default) instead of a DTensor.
    """

    desired_input_layout = Shard(1)
    natural_output_layout = Replicate()
    forward_fn = _channel_in_forward

    def placements(self, module: nn.Module) -> dict[str, Placement]:
        return {"weight": Shard(1)}  # the bias stays replicated: added once, after the sum


class ChannelNormParallel(_ChannelStyle):
    """BatchNorm on this rank's channels: affine parameters and running statistics ``Shard(0)``.

    DTensor's batch-norm rules keep the channel split (statistics reduce over batch and space only).

    Keyword Args:
        input_layouts: the layout of the incoming activation; default ``Shard(1)``.
        output_layouts: the layout to hand on; default ``Shard(1)``.
        use_local_output: return a local tensor (default) instead of a DTensor.
    """

    desired_input_layout = Shard(1)
    natural_output_layout = Shard(1)
    module_types = _NORM_TYPES

    def placements(self, module: nn.Module) -> dict[str, Placement]:
        return {name: Shard(0) for name in ("weight", "bias", "running_mean", "running_var")}


def _split_size(style: ParallelStyle, module: nn.Module) -> tuple[str, int] | None:
    """The size a channel style splits across tp ranks, named for the error message."""
    if isinstance(style, ChannelOutParallel) and isinstance(module, _CONV_TYPES):
        return "out_channels", module.out_channels
    if isinstance(style, ChannelInParallel) and isinstance(module, _CONV_TYPES):
        return "in_channels", module.in_channels
    if isinstance(style, ChannelNormParallel) and isinstance(module, _NORM_TYPES):
        return "num_features", module.num_features
    return None


def check_conv_tp_plan(root: nn.Module, plan: Mapping[str, ParallelStyle], tp: int, fix: str = "") -> None:
    """Every channel count the plan splits must divide by ``tp``; no process group needed.

    Args:
        root: the module the plan's paths are relative to.
        plan: module path (``*`` matches one name) -> style.
        tp: the tensor-parallel degree.
        fix: how to change the model's size, appended to the message (e.g. "or change VGGConfig.width").

    Raises:
        ValueError: naming the first module, its channel count and the divisors to choose from.
    """
    for path, module in root.named_modules():
        for pattern, style in plan.items():
            if not (fnmatch.fnmatchcase(path, pattern) and path.count(".") == pattern.count(".")):
                continue
            split = _split_size(style, module)
            if split and split[1] % tp:
                divisors = [d for d in range(1, split[1] + 1) if split[1] % d == 0]
                raise ValueError(
                    f"tp={tp} does not divide {path}.{split[0]}={split[1]}: {type(style).__name__} splits those "
                    f"channels across the tp ranks. Choose tp among {divisors}{', ' + fix if fix else ''}."
                )
