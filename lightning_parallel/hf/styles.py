"""Tensor-parallel styles of Hugging Face's GPT-2: its ``Conv1D`` (weight laid out (in, out), the transpose of
``nn.Linear``, which torch's ``ColwiseParallel``/``RowwiseParallel`` reject) split by columns or rows, its fused q/k/v
projection split per part. The generic styles (hidden states as a keyword, per-head norms, LoRA layers) are in
:mod:`lightning_parallel.parallel.tensor.styles`.
"""

from __future__ import annotations

from typing import Any

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Placement, Replicate, Shard, distribute_module, distribute_tensor
from torch.distributed.tensor.parallel import ParallelStyle

from lightning_parallel._compat import StridedShard
from lightning_parallel.parallel.tensor.styles import LoraLayout, to_dtensor


class Conv1DColwise(ParallelStyle):
    """A ``Conv1D`` split by output columns: weight (in, out) on dim 1, bias on dim 0; the output is this rank's
    columns (a plain tensor). ``parts > 1``: the output is ``parts`` projections side by side (GPT-2's c_attn:
    q, k, v) and each rank keeps its slice of every part of the weight (``_StridedShard``), so q, k and v stay
    whole heads; the bias of a fused projection is replicated.

    Args:
        parts: fused projections in the output (3 for c_attn).
        input_layout: how the input arrives (``Shard(1)`` under sequence parallelism); it is gathered whole.
    """

    def __init__(self, parts: int = 1, input_layout: Placement | None = None) -> None:
        super().__init__()
        self.parts, self.input_layout = parts, input_layout or Replicate()

    def _placement(self, dim: int) -> Placement:
        return StridedShard(dim, split_factor=self.parts) if self.parts > 1 else Shard(dim)

    def _partition(self, name: str, module: nn.Module, mesh: DeviceMesh) -> None:
        for pname, param in list(module.named_parameters(recurse=False)):
            placement = self._placement(1 if pname == "weight" else 0)
            if pname != "weight" and self.parts > 1:
                # a fused bias stays whole (it is tiny; DTensor slices it for the add): ZeRO-3 sharding dim 0
                # again on top of a strided split of dim 0 gathers it wrong (measured: 8e-3 off after 10 steps)
                placement = Replicate()
            module.register_parameter(pname, nn.Parameter(distribute_tensor(param, mesh, [placement])))

    def lora_layout(self) -> LoraLayout:
        """A LoRA layer on this base: columns split (per part), the output as the base's, a plain tensor."""
        return LoraLayout("col", self.parts, self.input_layout, None, True, out_dim=1)

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        layout = self.input_layout

        def prepare_input(mod: nn.Module, inputs: tuple, mesh: DeviceMesh) -> tuple:
            return (to_dtensor(inputs[0], mesh, layout, Replicate()), *inputs[1:])

        def prepare_output(mod: nn.Module, output: DTensor, mesh: DeviceMesh) -> Any:
            return output.to_local()

        return distribute_module(module, device_mesh, self._partition, prepare_input, prepare_output)


class Conv1DRowwise(ParallelStyle):
    """A ``Conv1D`` split by input rows: weight (in, out) on dim 0, bias replicated; the partial sums are
    all-reduced (``output_layout=Replicate()``) or reduce-scattered along the sequence (``Shard(1)``)."""

    def __init__(self, output_layout: Placement | None = None) -> None:
        super().__init__()
        self.output_layout = output_layout or Replicate()

    def lora_layout(self) -> LoraLayout:
        """A LoRA layer on this base: input rows split, the partial sums reduced to ``output_layout``."""
        return LoraLayout("row", 1, Shard(-1), self.output_layout, True, out_dim=1)

    @staticmethod
    def _partition(name: str, module: nn.Module, mesh: DeviceMesh) -> None:
        for pname, param in list(module.named_parameters(recurse=False)):
            placement = Shard(0) if pname == "weight" else Replicate()
            module.register_parameter(pname, nn.Parameter(distribute_tensor(param, mesh, [placement])))

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        out_layout = self.output_layout

        def prepare_input(mod: nn.Module, inputs: tuple, mesh: DeviceMesh) -> tuple:
            return (to_dtensor(inputs[0], mesh, Shard(-1), Shard(-1)), *inputs[1:])

        def prepare_output(mod: nn.Module, output: DTensor, mesh: DeviceMesh) -> Any:
            return output.redistribute(placements=(out_layout,)).to_local()

        return distribute_module(module, device_mesh, self._partition, prepare_input, prepare_output)
