"""Tensor-parallel styles Hugging Face models need beyond torch's own: GPT-2's ``Conv1D`` (weight laid out
(in, out), the transpose of ``nn.Linear``) split by columns or rows, its fused q/k/v projection split per part,
and a module input given as the first argument or as the ``hidden_states`` keyword (HF calls attention with the
keyword). All math stays in DTensor: the styles only place the parameters and the inputs/outputs, as torch's
``ColwiseParallel``/``RowwiseParallel`` do for ``nn.Linear`` (which reject a ``Conv1D``).
"""

from __future__ import annotations

from typing import Any

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Placement, Replicate, Shard, distribute_module, distribute_tensor
from torch.distributed.tensor.parallel import ParallelStyle

from lightning_parallel._compat import StridedShard


def _to_dtensor(x: Any, mesh: DeviceMesh, layout: Placement, desired: Placement) -> Any:
    if not isinstance(x, DTensor):
        x = DTensor.from_local(x, mesh, (layout,), run_check=False)
    return x.redistribute(placements=(desired,)) if x.placements != (desired,) else x


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

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        layout = self.input_layout

        def prepare_input(mod: nn.Module, inputs: tuple, mesh: DeviceMesh) -> tuple:
            return (_to_dtensor(inputs[0], mesh, layout, Replicate()), *inputs[1:])

        def prepare_output(mod: nn.Module, output: DTensor, mesh: DeviceMesh) -> Any:
            return output.to_local()

        return distribute_module(module, device_mesh, self._partition, prepare_input, prepare_output)


class Conv1DRowwise(ParallelStyle):
    """A ``Conv1D`` split by input rows: weight (in, out) on dim 0, bias replicated; the partial sums are
    all-reduced (``output_layout=Replicate()``) or reduce-scattered along the sequence (``Shard(1)``)."""

    def __init__(self, output_layout: Placement | None = None) -> None:
        super().__init__()
        self.output_layout = output_layout or Replicate()

    @staticmethod
    def _partition(name: str, module: nn.Module, mesh: DeviceMesh) -> None:
        for pname, param in list(module.named_parameters(recurse=False)):
            placement = Shard(0) if pname == "weight" else Replicate()
            module.register_parameter(pname, nn.Parameter(distribute_tensor(param, mesh, [placement])))

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        out_layout = self.output_layout

        def prepare_input(mod: nn.Module, inputs: tuple, mesh: DeviceMesh) -> tuple:
            return (_to_dtensor(inputs[0], mesh, Shard(-1), Shard(-1)), *inputs[1:])

        def prepare_output(mod: nn.Module, output: DTensor, mesh: DeviceMesh) -> Any:
            return output.redistribute(placements=(out_layout,)).to_local()

        return distribute_module(module, device_mesh, self._partition, prepare_input, prepare_output)


class HiddenStatesInput(ParallelStyle):
    """Re-lay the module's hidden states, passed first or as ``hidden_states=``: e.g. sequence-split (Shard(1))
    to whole (Replicate) before attention, so its projections' input gradients are reduced once.

    Args:
        input_layout: how the hidden states arrive.
        desired_layout: what the module gets.
        use_local_output: hand the module a plain tensor instead of a DTensor.
        set_attrs: attributes of the module to set, each to ``value // tp`` (a split module's local sizes:
            GPT-2 attention's ``split_size``, the width of each of q, k, v on this rank).
    """

    def __init__(
        self,
        input_layout: Placement,
        desired_layout: Placement,
        use_local_output: bool = False,
        set_attrs: tuple[str, ...] = (),
    ) -> None:
        super().__init__()
        self.input_layout, self.desired_layout = input_layout, desired_layout
        self.use_local_output, self.set_attrs = use_local_output, set_attrs

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        for attr in self.set_attrs:
            setattr(module, attr, getattr(module, attr) // device_mesh.size())

        def convert(x: Any) -> Any:
            x = _to_dtensor(x, device_mesh, self.input_layout, self.desired_layout)
            return x.to_local() if self.use_local_output else x

        def hook(mod: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
            if args:
                return (convert(args[0]), *args[1:]), kwargs
            return args, {**kwargs, "hidden_states": convert(kwargs["hidden_states"])}

        module.register_forward_pre_hook(hook, with_kwargs=True)
        return module
