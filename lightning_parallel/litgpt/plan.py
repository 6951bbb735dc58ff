"""The tensor-parallel plan of LitGPT's ``GPT``, as this package's plans: module path -> torch ParallelStyle.

Megatron's split: each attention keeps whole heads, each MLP whole columns of its first projections and rows of
its last; the embedding is split over the vocabulary and the head's logits stay split over it for the
vocabulary-parallel loss. LitGPT fuses q, k and v into one ``attn.qkv`` Linear whose rows are laid out
``[q (n_head * head_size) | k (n_query_groups * head_size) | v (same)]`` (litgpt 0.5.13). With grouped-query
attention the three parts differ in size, so no one (strided) shard of the rows gives a rank its heads' q, k and v:
:class:`GroupedQKVColwise` shards the rows evenly (memory and matmul split) and all-gathers the q/k/v output, of
which each rank keeps its heads' columns. The attention module's ``config`` is swapped for a copy with this rank's
head counts (LitGPT views q/k/v with them); the class, the parameters and their names stay LitGPT's.

A ``litgpt.lora.GPT`` (LoRA) gets the same plan: each ``LoRALinear`` follows its base ``linear``'s style
(:class:`LitLoRAParallel`, torch's ``ColwiseParallel`` / ``RowwiseParallel`` through
:class:`~lightning_parallel.parallel.tensor.styles.LoraParallel`), and the fused ``LoRAQKVLinear`` keeps its adapter
whole on every rank (see :class:`GroupedQKVColwise`). Pure functions of the model: no process group.
"""

from __future__ import annotations

import copy
from typing import Any

import torch
from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Placement, Replicate, Shard, distribute_module, distribute_tensor
from torch.distributed.tensor.parallel import ColwiseParallel, ParallelStyle, RowwiseParallel, SequenceParallel

from lightning_parallel.parallel.pipeline.split import ElsewhereLayer
from lightning_parallel.parallel.tensor.plan import sp_with_pp
from lightning_parallel.parallel.tensor.styles import HiddenStatesInput, LoraParallel, ReplicatedWithPartialGrad

SP_WITH_PP = sp_with_pp("LitGPT")  # a stage rebuilds positions from the hidden state it receives

# the MLP classes of litgpt.model this plan knows: (column-split projections, row-split projection)
MLP_SPLITS = {
    "GptNeoxMLP": (("fc",), "proj"),
    "LLaMAMLP": (("fc_1", "fc_2"), "proj"),
    "GemmaMLP": (("fc_1", "fc_2"), "proj"),
}


def qkv_columns(n_head: int, n_query_groups: int, head_size: int, tp: int, rank: int) -> torch.Tensor:
    """Indices of rank ``rank``'s columns of the fused q/k/v output: its q heads, then its k and v groups.

    LitGPT repeats key/value group ``j`` for query heads ``j * q_per_kv ...``: splitting heads and groups into
    ``tp`` contiguous blocks keeps each rank's query heads with their own group.
    """
    q_heads, groups = n_head // tp, n_query_groups // tp
    q = torch.arange(rank * q_heads * head_size, (rank + 1) * q_heads * head_size)
    k = n_head * head_size + torch.arange(rank * groups * head_size, (rank + 1) * groups * head_size)
    v = k + n_query_groups * head_size
    return torch.cat([q, k, v])


class GroupedQKVColwise(ParallelStyle):
    """LitGPT's fused ``attn.qkv`` Linear split for tensor parallelism with grouped-query attention.

    The weight and bias are sharded evenly by rows (``Shard(0)``: any layout loads any other); the output
    (B, T, (n_head + 2 * n_query_groups) * head_size) is all-gathered and each rank keeps its heads' columns
    (:func:`qkv_columns`), a plain tensor. Backward: the kept columns' gradient is a partial sum over the tensor
    ranks, reduce-scattered back onto the row shards.

    LitGPT's ``LoRAQKVLinear`` (LoRA): the base ``linear`` is split as above; ``lora_A`` (r * parts, in) and
    ``lora_B`` (q/k/v rows it adapts, r) stay whole on every rank, as drawn from one seed. ``lora_B``'s q, k and v
    parts differ in size under grouped-query attention, so no even row split lines them up with the base's rows:
    each rank computes the whole adapter output (B, T, out) (r is small), adds it to its row shard of the base's
    output, and the sum is gathered by the one all-gather. Backward: the adapter output's gradient is gathered
    whole, so every rank computes the same gradients for the replicated factors.

    Args:
        n_head, n_query_groups, head_size: the model's (``config``), before the split.
    """

    def __init__(self, n_head: int, n_query_groups: int, head_size: int) -> None:
        super().__init__()
        self.sizes = (n_head, n_query_groups, head_size)

    @staticmethod
    def _partition(name: str, module: nn.Module, mesh: DeviceMesh) -> None:
        for pname, param in list(module.named_parameters(recurse=False)):
            placement = Replicate() if pname.startswith("lora_") else Shard(0)
            dist = distribute_tensor(param, mesh, [placement])
            module.register_parameter(pname, nn.Parameter(dist, requires_grad=param.requires_grad))

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        columns = qkv_columns(*self.sizes, device_mesh.size(), device_mesh.get_local_rank())
        on_device: dict[torch.device, Tensor] = {}  # copied once per device, not in every forward (a blocking copy)

        def prepare_input(mod: nn.Module, inputs: tuple, mesh: DeviceMesh) -> tuple:
            _replicate_lora_index(mod, mesh)
            x = inputs[0]
            if not isinstance(x, DTensor):
                x = DTensor.from_local(x, mesh, (Replicate(),), run_check=False)
            return (x.redistribute(placements=(Replicate(),)), *inputs[1:])

        def prepare_output(mod: nn.Module, output: DTensor, mesh: DeviceMesh) -> Any:
            whole = output.redistribute(placements=(Replicate(),)).to_local(grad_placements=(Partial(),))
            if whole.device not in on_device:
                on_device[whole.device] = columns.to(whole.device)
            return whole.index_select(-1, on_device[whole.device])  # (B, T, local q + k + v)

        return distribute_module(module, device_mesh, self._partition, prepare_input, prepare_output)


def _replicate_lora_index(module: nn.Module, mesh: DeviceMesh) -> None:
    """A ``LoRAQKVLinear`` adapting some of q, k, v pads the adapter output into their columns with an index it
    builds on first use and caches (``_lora_ind``, a plain tensor): give it a replicated DTensor instead, at the first
    forward (the model may be built on meta and materialized after the split)."""
    if all(getattr(module, "enable_lora", (True,))) or isinstance(getattr(module, "_lora_ind", None), DTensor):
        return
    index = DTensor.from_local(module.lora_ind, mesh, [Replicate()], run_check=False)
    module.register_buffer("_lora_ind", index, persistent=False)


class LocalHeadsAttention(HiddenStatesInput):
    """An attention module's input re-laid (as :class:`HiddenStatesInput`) and its ``config`` replaced by a copy
    with this rank's ``n_head`` and ``n_query_groups`` (the model's shared config is left as it is)."""

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        local = copy.copy(module.config)
        local.n_head //= device_mesh.size()
        local.n_query_groups //= device_mesh.size()
        module.config = local
        return super()._apply(module, device_mesh)


class LitLoRAParallel(LoraParallel):
    """LitGPT's ``LoRALinear`` (base ``linear``; ``lora_A`` (r, in) and ``lora_B`` (out, r), the module's own
    parameters) split as :class:`~lightning_parallel.parallel.tensor.styles.LoraParallel` splits a peft LoRA layer with
    the base style ``base_style``: the same placements, one collective for base and adapter. A ``LoRALinear`` with
    ``r=0`` (not adapted) holds the base alone, split as ``base_style`` splits it.

    Args:
        base_style: the style the plan gives the base layer (``ColwiseParallel`` or ``RowwiseParallel``).
    """

    def _placement(self, name: str, pname: str, module: nn.Module) -> Placement:
        if name == "linear":
            return super()._placement("base_layer", pname, module)
        return super()._placement(pname, "weight", module)  # lora_A / lora_B sit on the LoRALinear itself


def _with_lora(model: nn.Module, plan: dict[str, ParallelStyle]) -> dict[str, ParallelStyle]:
    """``plan`` for a ``litgpt.lora.GPT``: every linear layer is a ``LoRALinear`` there (``r=0`` where not adapted),
    so each torch style is given as :class:`LitLoRAParallel` of it."""
    from litgpt.lora import GPT

    if not isinstance(model, GPT):
        return plan
    linear = (ColwiseParallel, RowwiseParallel)
    embedding = "transformer.wte"  # an nn.Embedding in both models
    return {path: LitLoRAParallel(style) if isinstance(style, linear) and path != embedding else style
            for path, style in plan.items()}  # fmt: skip


def _mlp_split(config: Any) -> tuple[tuple[str, ...], str]:
    # from the config, not a module: under pp a stage holds placeholders for the blocks of other stages
    name = config.mlp_class_name
    if name not in MLP_SPLITS:
        raise ValueError(
            f"litgpt_tensor_parallel_plan does not know the MLP {name} (it splits {', '.join(MLP_SPLITS)}): give "
            "your module its own tensor_parallel_plan(), or use tp=1."
        )
    return MLP_SPLITS[name]


def _norm_names(config: Any) -> list[str]:
    """The norms of every block (``Block.__init__``: those the config turns on; a shared norm_2 is None)."""
    norm_2 = config.norm_2 and not config.shared_attention_norm
    flags = {"norm_1": config.norm_1, "norm_2": norm_2, "post_attention_norm": config.post_attention_norm}
    flags["post_mlp_norm"] = config.post_mlp_norm
    return [name for name, on in flags.items() if on]


def litgpt_tensor_parallel_plan(model: nn.Module, sequence_parallel: bool = False) -> dict[str, ParallelStyle]:
    """The tensor-parallel plan of a LitGPT ``GPT``, paths relative to it.

    Prefix the paths with where the model sits in your LightningModule (``{"model." + k: v ...}``).

    Args:
        model: a ``litgpt.model.GPT`` (``CausalSelfAttention``; MLP ``GptNeoxMLP``, ``LLaMAMLP`` or ``GemmaMLP``).
        sequence_parallel: norms and the residual stream split along the sequence as well.

    Raises:
        ValueError: an MLP class the plan does not know, or sequence parallelism with a pipeline split.
    """
    if sequence_parallel and any(isinstance(m, ElsewhereLayer) for m in model.modules()):
        raise ValueError(SP_WITH_PP)
    config = model.config
    seq: Placement = Shard(1) if sequence_parallel else Replicate()
    block = "transformer.h.*"
    columns, rows = _mlp_split(config)
    plan: dict[str, ParallelStyle] = {
        # the embedding split over the vocabulary, its output whole (the first block slices it under SP)
        "transformer.wte": RowwiseParallel(input_layouts=Replicate(), output_layouts=Replicate()),
        # one input all-reduce (or all-gather) per attention and MLP, not one per projection
        f"{block}.attn": LocalHeadsAttention(seq, Replicate()),
        f"{block}.attn.qkv": GroupedQKVColwise(config.n_head, config.n_query_groups, config.head_size),
        f"{block}.attn.proj": RowwiseParallel(output_layouts=seq),
        f"{block}.mlp": HiddenStatesInput(seq, Replicate()),
        **{f"{block}.mlp.{name}": ColwiseParallel() for name in columns},
        f"{block}.mlp.{rows}": RowwiseParallel(output_layouts=seq),
        # logits stay split over the vocabulary for the vocabulary-parallel loss
        "lm_head": ColwiseParallel(input_layouts=seq, output_layouts=Shard(-1), use_local_output=False),
    }
    if config.norm_qk:  # per-head q/k norms (Qwen3): whole on every rank, gradients summed over its heads' ranks
        plan.update({f"{block}.attn.{name}": ReplicatedWithPartialGrad() for name in ("norm_q", "norm_k")})
    if sequence_parallel:
        plan["transformer.h.0"] = HiddenStatesInput(Replicate(), Shard(1), use_local_output=True)
        plan.update({f"{block}.{name}": SequenceParallel() for name in _norm_names(config)})
        plan["transformer.ln_f"] = SequenceParallel()
    return _with_lora(model, plan)
