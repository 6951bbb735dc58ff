"""GPT-2, which describes neither plan (``Conv1D`` layers, a fused q/k/v projection, learned positions): its
tensor-parallel plan (Megatron's split, c_attn per q/k/v part) and pipeline layers (token embedding, position
embedding, blocks, final norm, head) written here."""

from __future__ import annotations

import torch
from torch import Tensor, nn
from torch.distributed.tensor import Placement, Replicate, Shard
from torch.distributed.tensor.parallel import ColwiseParallel, ParallelStyle, RowwiseParallel, SequenceParallel

from lightning_parallel.hf.families.registry import HFFamily, register_hf_family
from lightning_parallel.hf.layers import decoder_inputs, hook_once, positions_of, refuse_extra_inputs
from lightning_parallel.hf.styles import Conv1DColwise, Conv1DRowwise
from lightning_parallel.parallel.tensor.styles import HiddenStatesInput


def gpt2_plan(model: nn.Module, family: HFFamily, sequence_parallel: bool) -> dict[str, ParallelStyle]:
    """GPT-2's plan (HF ships none): Megatron's split of the ``Conv1D`` layers, c_attn per q/k/v part."""
    seq: Placement = Shard(1) if sequence_parallel else Replicate()
    block = "transformer.h.*"
    plan: dict[str, ParallelStyle] = {
        "transformer.wte": RowwiseParallel(input_layouts=Replicate(), output_layouts=Replicate()),
        f"{block}.attn.c_attn": Conv1DColwise(parts=3),
        f"{block}.attn.c_proj": Conv1DRowwise(output_layout=seq),
        f"{block}.mlp.c_fc": Conv1DColwise(),
        f"{block}.mlp.c_proj": Conv1DRowwise(output_layout=seq),
        # attention splits c_attn's output by split_size (the width of q): this rank's width after the split
        f"{block}.attn": HiddenStatesInput(seq, Replicate(), set_attrs=("split_size",)),
        f"{block}.mlp": HiddenStatesInput(seq, Replicate()),
        "lm_head": ColwiseParallel(input_layouts=seq, output_layouts=Shard(-1), use_local_output=False),
    }
    if sequence_parallel:
        plan.update(
            {
                "transformer.h.0": HiddenStatesInput(Replicate(), Shard(1), use_local_output=True),
                f"{block}.ln_1": SequenceParallel(),
                f"{block}.ln_2": SequenceParallel(),
                "transformer.ln_f": SequenceParallel(),
            }
        )
    return plan


class _AddPositions:
    """GPT-2's ``wpe`` as a pipeline layer: called on the token embeddings (floating point, not position ids),
    it returns ``drop(tokens + wpe(positions))``, what GPT2Model computes before its blocks."""

    def __init__(self, drop: nn.Module, model: nn.Module) -> None:
        self.drop, self.model = drop, model
        self.tokens: Tensor | None = None

    def before(self, wpe: nn.Module, args: tuple) -> tuple | None:
        if len(args) != 1 or not torch.is_floating_point(args[0]):
            return None  # position ids: HF's own forward
        self.tokens = args[0]  # (B, T, C)
        return (positions_of(args[0], self.model),)

    def after(self, wpe: nn.Module, args: tuple, output: Tensor) -> Tensor | None:
        if self.tokens is None:
            return None
        tokens, self.tokens = self.tokens, None
        return self.drop(tokens + output)


def gpt2_layers(model: nn.Module, family: HFFamily) -> list[nn.Module]:
    """GPT-2's pipeline layers: the token embedding, the position embedding (adding its rows to the tokens'), the
    blocks, the final norm and the head."""
    base = model.transformer

    def install() -> None:
        base.wte.register_forward_pre_hook(refuse_extra_inputs, with_kwargs=True)
        positions = _AddPositions(base.drop, model)
        base.wpe.register_forward_pre_hook(positions.before)
        base.wpe.register_forward_hook(positions.after)
        for index, block in enumerate(base.h):
            block.register_forward_pre_hook(decoder_inputs(model, None, index, family), with_kwargs=True)

    hook_once(model, install)
    return [base.wte, base.wpe, *base.h, base.ln_f, model.lm_head]


GPT2 = register_hf_family(HFFamily("gpt2", tp_plan=gpt2_plan, layers=gpt2_layers))
