"""Tensor-parallel plans of Hugging Face causal LMs that describe themselves (Llama and its relatives), as this
package's plans: module path -> torch ParallelStyle, translated from ``config.base_model_tp_plan`` and the head class's
``_tp_plan``. Added: what HF's plans leave to the runtime: the vocabulary-parallel embedding, the head's logits left
split over the vocabulary for the vocabulary-parallel loss, one input all-reduce per attention and MLP, and with
``sequence_parallel`` the norms and the residual stream split along the sequence. Which model gets which plan is
its family's entry (:mod:`lightning_parallel.hf.families`). Pure functions of the model's classes and config: no
process group.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from torch import nn
from torch.distributed.tensor import Placement, Replicate, Shard
from torch.distributed.tensor.parallel import ColwiseParallel, ParallelStyle, RowwiseParallel, SequenceParallel

from lightning_parallel.parallel.tensor.plan import sp_with_pp
from lightning_parallel.parallel.tensor.styles import HiddenStatesInput, ReplicatedWithPartialGrad

if TYPE_CHECKING:
    from lightning_parallel.hf.families.registry import HFFamily

SP_WITH_PP = sp_with_pp("Hugging Face")  # a stage rebuilds positions from the hidden state it receives

# HF's names for a head whose output columns are gathered (v5.0 "colwise_rep", v5.1+ "colwise_gather_output")
GATHERED_COLWISE = ("colwise_rep", "colwise_gather_output")
# "rowwise_split_input" (Phi-3, OLMo 2): a row split whose input arrives whole (after a gathered colwise) and is
# sliced locally, no communication; "replicated_with_grad_allreduce" (Qwen3, Gemma 3: per-head q/k norms): whole
# on every rank, fed this rank's heads, its gradient summed over tp
TRANSLATED = ("colwise", "rowwise", "rowwise_split_input", "replicated_with_grad_allreduce", *GATHERED_COLWISE)


def translate_tp_plan(
    base_plan: Mapping[str, str], head_plan: Mapping[str, str], base_prefix: str, sequence_parallel: bool
) -> dict[str, ParallelStyle]:
    """HF's style names as torch ParallelStyles, paths relative to the ``*ForCausalLM`` model.

    Args:
        base_plan: ``config.base_model_tp_plan`` (paths inside the base model).
        head_plan: the head class's ``_tp_plan`` (paths inside the head model: ``lm_head``).
        base_prefix: where the base model sits in the head model (``base_model_prefix`` + ".").
        sequence_parallel: row-parallel outputs reduce-scattered along the sequence (dim 1), not all-reduced.
    """
    seq: Placement = Shard(1) if sequence_parallel else Replicate()
    plan: dict[str, ParallelStyle] = {}
    entries = [(base_prefix + path, style, False) for path, style in base_plan.items()]
    entries += [(path, style, True) for path, style in head_plan.items()]
    for path, style, is_head in entries:
        if style not in TRANSLATED:
            raise ValueError(
                f"tensor-parallel style {style!r} for {path!r} is not supported by hf_tensor_parallel_plan (it "
                f"translates {', '.join(TRANSLATED)}): pass your own plan via tensor_parallel_plan(), or use tp=1."
            )
        if style == "colwise":
            plan[path] = ColwiseParallel()
        elif style == "rowwise":
            plan[path] = RowwiseParallel(output_layouts=seq)
        elif style == "rowwise_split_input":
            plan[path] = RowwiseParallel(input_layouts=Replicate(), output_layouts=seq)
        elif style == "replicated_with_grad_allreduce":
            plan[path] = ReplicatedWithPartialGrad()
        elif is_head:  # the head: logits stay split over the vocabulary for the vocabulary-parallel loss
            plan[path] = ColwiseParallel(input_layouts=seq, output_layouts=Shard(-1), use_local_output=False)
        else:
            plan[path] = ColwiseParallel(output_layouts=Replicate())
    return plan


def _parents(plan: Mapping[str, ParallelStyle], style: type) -> list[str]:
    return list(dict.fromkeys(path.rpartition(".")[0] for path, s in plan.items() if isinstance(s, style)))


def described_plan(
    model: nn.Module, family: HFFamily, sequence_parallel: bool, base_plan: Mapping[str, str] | None = None
) -> dict[str, ParallelStyle]:
    """The plan of a model that carries ``config.base_model_tp_plan`` (Llama, Mistral, Qwen2 ...), or whose family
    gives it (``family.base_tp_plan``, ``family.base_pp_plan``: in HF's own style names).

    Args:
        model: the ``*ForCausalLM`` model.
        family: its entry.
        sequence_parallel: split norms and the residual stream along the sequence as well.
        base_plan: the base model's plan to translate (default: the family's or ``config.base_model_tp_plan``; a
            MoE family passes it without its experts).
    """
    config = model.config
    base_plan = described_tp_plan(config, family) if base_plan is None else base_plan
    if not base_plan:
        raise ValueError(
            f"{type(model).__name__} has no config.base_model_tp_plan (its family's plan is translated from it): give "
            "your module a tensor_parallel_plan(), or use tp=1."
        )
    prefix = model.base_model_prefix + "."
    head_plan = dict(getattr(type(model), "_tp_plan", None) or {})  # the class: the head's own entries
    plan = translate_tp_plan(base_plan, head_plan, prefix, sequence_parallel)
    seq: Placement = Shard(1) if sequence_parallel else Replicate()
    embed, layers, norm = pp_names(config, family)
    # the embedding split over the vocabulary; its output whole: HF derives positions and the mask from it
    plan[prefix + embed] = RowwiseParallel(input_layouts=Replicate(), output_layouts=Replicate())
    # no local head counts to fix (transformers 5.24): attention views its projections with -1 heads and repeats
    # key/value heads by num_key_value_groups, a ratio tp keeps when it splits both head counts
    # one input all-reduce (or all-gather) per attention and MLP, not one per projection
    for parent in _parents(plan, ColwiseParallel):
        if parent.startswith(prefix + layers + "."):
            plan[parent] = HiddenStatesInput(seq, Replicate())
    if sequence_parallel:
        plan.update(_sequence_parallel_entries(model, prefix + layers, prefix + norm))
    return plan


def _sequence_parallel_entries(model: nn.Module, layers: str, final_norm: str) -> dict[str, ParallelStyle]:
    """Norms split along the sequence; the first layer keeps its slice of the whole embeddings. A norm's output
    is this rank's plain slice, like the residual stream it may be added to (OLMo 2 norms the sublayers' outputs)."""
    first = model.get_submodule(f"{layers}.0")
    norms = [name for name, m in first.named_children() if "norm" in type(m).__name__.lower() or "ln" in name]
    entries: dict[str, ParallelStyle] = {
        f"{layers}.0": HiddenStatesInput(Replicate(), Shard(1), use_local_output=True),
        final_norm: SequenceParallel(use_local_output=True),
    }
    entries.update({f"{layers}.*.{name}": SequenceParallel(use_local_output=True) for name in norms})
    return entries


def described_tp_plan(config: Any, family: HFFamily) -> Mapping[str, str] | None:
    """The base model's plan in HF's style names: the family's ``base_tp_plan``, else ``config.base_model_tp_plan``."""
    return family.base_tp_plan if family.base_tp_plan is not None else getattr(config, "base_model_tp_plan", None)


def pp_names(config: Any, family: HFFamily) -> tuple[str, str, str]:
    """(embedding, decoder layers, final norm) from the family's ``base_pp_plan``, else ``config.base_model_pp_plan``,
    in its order."""
    pp_plan = family.base_pp_plan if family.base_pp_plan is not None else getattr(config, "base_model_pp_plan", None)
    names = list(pp_plan or {})
    if len(names) != 3:
        raise ValueError(
            f"config.base_model_pp_plan of {type(config).__name__} lists {names}, not (embedding, layers, norm): "
            "give your module its own pipeline_layers() and tensor_parallel_plan(), or use pp=1 and tp=1."
        )
    return names[0], names[1], names[2]
