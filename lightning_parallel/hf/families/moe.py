"""Mixture-of-Experts families (``config.base_model_ep_plan``): the dense part's plan translated as Llama's is, the
experts left out of it (replicated over tp, split over ep only: :mod:`lightning_parallel.hf.experts`), the MoE blocks'
entries resolved to the layers that hold them."""

from __future__ import annotations

from torch import nn
from torch.distributed.tensor.parallel import ParallelStyle

from lightning_parallel.hf.experts import resolve_moe_block_entries, tp_plan_without_experts
from lightning_parallel.hf.families.described import described_family
from lightning_parallel.hf.families.registry import HFFamily, register_hf_family
from lightning_parallel.hf.plan import described_plan, described_tp_plan


def moe_plan(model: nn.Module, family: HFFamily, sequence_parallel: bool) -> dict[str, ParallelStyle]:
    """The tensor-parallel plan of a MoE model: :func:`~lightning_parallel.hf.plan.described_plan` of its
    ``base_model_tp_plan`` without the experts, MoE blocks resolved (dense layers' MLPs split as any MLP)."""
    described = described_tp_plan(model.config, family)  # None: described_plan names what is missing
    base_plan = tp_plan_without_experts(described, model.config) if described else None
    plan = described_plan(model, family, sequence_parallel, base_plan=base_plan)
    return resolve_moe_block_entries(model, plan, model.base_model_prefix + ".", sequence_parallel)


# tried (transformers 5.24): parity under ZeRO 1-3, DDP, pp (with HF's load-balancing loss), ep=2, tp
# (tests/test_hf_moe_parity.py, tests/test_hf_moe_loading.py)
MOE = ("mixtral", "qwen2_moe", "qwen3_moe", "deepseek_v3")
for _model_type in MOE:
    register_hf_family(described_family(_model_type, tp_plan=moe_plan, experts=True))
