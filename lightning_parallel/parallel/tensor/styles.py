"""Tensor-parallel styles beyond torch's own, for any model: a module's hidden states re-laid whether passed first or
as the ``hidden_states`` keyword (Hugging Face calls attention with the keyword), a module replicated over tp that
sees this rank's heads only (per-head q/k norms), and a LoRA layer split the way its base layer is, with one
collective for both. All math stays in DTensor: the styles place the parameters and the inputs/outputs, as torch's
``ColwiseParallel``/``RowwiseParallel`` do. Hugging Face's and LitGPT's plans use them (model-specific styles, GPT-2's
``Conv1D``, sit beside those models: :mod:`lightning_parallel.hf.styles`).
"""

from __future__ import annotations

from typing import Any, NamedTuple

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import (
    DTensor,
    Partial,
    Placement,
    Replicate,
    Shard,
    distribute_module,
    distribute_tensor,
)
from torch.distributed.tensor.parallel import ColwiseParallel, ParallelStyle, RowwiseParallel

from lightning_parallel._compat import StridedShard


def to_dtensor(x: Any, mesh: DeviceMesh, layout: Placement, desired: Placement) -> Any:
    """``x`` (a plain tensor laid out as ``layout``, or a DTensor) as a DTensor placed ``desired``."""
    if not isinstance(x, DTensor):
        x = DTensor.from_local(x, mesh, (layout,), run_check=False)
    return x.redistribute(placements=(desired,)) if x.placements != (desired,) else x


class LoraLayout(NamedTuple):
    """How a base layer's style splits it, as :class:`LoraParallel` follows it.

    Attributes:
        kind: "col" (output features split) or "row" (input features split).
        parts: fused projections side by side in the output (each split on its own: ``_StridedShard``).
        input_layout: how the input arrives.
        output_layout: what the output is brought to (None: as the split leaves it).
        local_output: hand on a plain tensor instead of a DTensor.
        out_dim: the weight's output-features dim (0 for ``nn.Linear``'s (out, in); 1 for a (in, out) weight).
    """

    kind: str
    parts: int
    input_layout: Placement
    output_layout: Placement | None
    local_output: bool
    out_dim: int = 0


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
            x = to_dtensor(x, device_mesh, self.input_layout, self.desired_layout)
            return x.to_local() if self.use_local_output else x

        def hook(mod: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
            if args:
                return (convert(args[0]), *args[1:]), kwargs
            return args, {**kwargs, "hidden_states": convert(kwargs["hidden_states"])}

        module.register_forward_pre_hook(hook, with_kwargs=True)
        return module


class ReplicatedWithPartialGrad(ParallelStyle):
    """transformers' ``replicated_with_grad_allreduce``: the module's parameters replicated over tp, its input
    and output this rank's plain tensors, its parameter gradients summed over tp.

    For a module between a column split and a row split that sees this rank's heads only: Qwen3's and Gemma 3's
    q/k norms (weight (head_dim,)) normalize each head of the q/k projection's output, of which a rank holds its
    own heads (with or without sequence parallelism: attention gets the whole sequence). The forward is HF's own on
    plain tensors (no collective); each parameter enters it as its local value whose gradient is declared
    ``Partial`` (this rank's heads' share), so the parameter's gradient arrives a Partial DTensor and is all-reduced
    where every DTensor gradient is brought to its parameter's placement
    (:func:`~lightning_parallel.parallel.dtensor.placed_like`, FSDP2's own reduction under ZeRO-3).
    """

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        def partition(name: str, mod: nn.Module, mesh: DeviceMesh) -> None:
            for pname, param in list(mod.named_parameters(recurse=False)):
                dist = distribute_tensor(param, mesh, [Replicate()])
                mod.register_parameter(pname, nn.Parameter(dist, requires_grad=param.requires_grad))

        distribute_module(module, device_mesh, partition)
        # the DTensor parameters as they are before the forward (ZeRO-3 swaps its gathered ones in before it)
        held: dict[str, DTensor] = {}

        def to_local(mod: nn.Module, args: tuple) -> None:
            for pname, param in list(mod._parameters.items()):
                if isinstance(param, DTensor):
                    held[pname] = param
                    mod._parameters[pname] = param.to_local(grad_placements=(Partial(),))

        def restore(mod: nn.Module, args: tuple, output: Any) -> None:
            mod._parameters.update(held)
            held.clear()

        module.register_forward_pre_hook(to_local)
        module.register_forward_hook(restore, always_call=True)
        return module


class LoraParallel(ParallelStyle):
    """A peft LoRA layer (``base_layer``, ``lora_A[name]``, ``lora_B[name]``) split the way ``base_style`` splits its
    base layer, with one collective for base and adapter together.

    Column-parallel base (torch's ``ColwiseParallel``, GPT-2's ``Conv1DColwise``): the base's output columns are split,
    ``lora_A`` (r, in) is replicated and ``lora_B`` (out, r) split by rows like the base's output (per fused part
    for GPT-2's c_attn), so ``B A x`` is this rank's columns of the adapter's output and adds to the base's locally;
    the input gradients of both (partial sums) meet in the one reduction of the input's layout change. Row-parallel
    base (``RowwiseParallel``, ``Conv1DRowwise``): the input features are split, ``lora_A`` split on its input
    and ``lora_B`` replicated, so ``B A x`` is a partial sum like the base's and the two are reduced once (all-reduce,
    or reduce-scatter along the sequence). Replicated factors come from the tensor as every rank built it (peft's
    initialization, drawn from one seed: :func:`lightning_parallel.hf.lora.apply_peft`). The math runs in DTensor.
    A base style of another kind says how it splits by a ``lora_layout()`` method returning a :class:`LoraLayout`.

    Args:
        base_style: the style the plan gives the base layer.
    """

    def __init__(self, base_style: ParallelStyle) -> None:
        super().__init__()
        self.base_style = base_style
        layout = lora_layout(base_style)
        self.kind, self.parts, self.input_layout, self.output_layout, self.local_output, self.out_dim = layout

    def _base_placement(self, pname: str, module: nn.Module) -> Placement:
        if pname != "weight":  # the bias: split with the output columns (whole when fused), else added whole
            return Shard(0) if self.kind == "col" and self.parts == 1 else Replicate()
        out_dim = self.out_dim
        if self.kind == "row":
            return Shard(1 - out_dim)
        return StridedShard(out_dim, split_factor=self.parts) if self.parts > 1 else Shard(out_dim)

    def _placement(self, name: str, pname: str, module: nn.Module) -> Placement:
        owner = name.split(".")[0]
        if owner == "base_layer":
            return self._base_placement(pname, module)
        if owner == "lora_A":  # (r, in): the input features split under a row-parallel base
            return Shard(1) if self.kind == "row" and pname == "weight" else Replicate()
        if owner == "lora_B" and self.kind == "col":  # (out, r): the output rows, as the base's columns
            if pname != "weight":
                return Shard(0) if self.parts == 1 else Replicate()
            return StridedShard(0, split_factor=self.parts) if self.parts > 1 else Shard(0)
        if owner == "lora_B":
            return Replicate()
        raise ValueError(
            f"LoRA parameter {name}.{pname} has no tensor-parallel placement here (plain LoRA's base_layer, lora_A "
            "and lora_B do): use plain LoRA, or tp=1."
        )

    def _partition(self, name: str, module: nn.Module, mesh: DeviceMesh) -> None:
        for pname, param in list(module.named_parameters(recurse=False)):
            placement = self._placement(name, pname, module)
            dist = distribute_tensor(param, mesh, [placement])
            module.register_parameter(pname, nn.Parameter(dist, requires_grad=param.requires_grad))

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        desired = Replicate() if self.kind == "col" else Shard(-1)
        layout, out_layout, local_output = self.input_layout, self.output_layout, self.local_output

        def prepare_input(mod: nn.Module, inputs: tuple, mesh: DeviceMesh) -> tuple:
            return (to_dtensor(inputs[0], mesh, layout, desired), *inputs[1:])

        def prepare_output(mod: nn.Module, output: DTensor, mesh: DeviceMesh) -> Any:
            # column-parallel: the columns as the base style hands them (a fused Conv1D's strided columns as they
            # are); row-parallel: base and adapter partial sums reduced here, once
            if out_layout is not None and output.placements != (out_layout,):
                output = output.redistribute(placements=(out_layout,))
            return output.to_local() if local_output else output

        return distribute_module(module, device_mesh, self._partition, prepare_input, prepare_output)


def lora_layout(style: ParallelStyle) -> LoraLayout:
    """How ``style`` splits a base layer: its own ``lora_layout()`` when it has one, else torch's linear styles'.

    Raises:
        ValueError: a style LoRA does not follow.
    """
    own = getattr(style, "lora_layout", None)
    if callable(own):
        return own()
    if isinstance(style, ColwiseParallel):
        return LoraLayout("col", 1, style.input_layouts[0], style.output_layouts[0], style.use_local_output)
    if isinstance(style, RowwiseParallel):
        return LoraLayout("row", 1, style.input_layouts[0], style.output_layouts[0], style.use_local_output)
    raise ValueError(
        f"a LoRA layer whose base layer's tensor-parallel style is {type(style).__name__} is not supported (LoRA "
        "follows ColwiseParallel, RowwiseParallel and GPT-2's Conv1D styles): drop it from target_modules, or use tp=1."
    )
