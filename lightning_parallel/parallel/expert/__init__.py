"""Mixture-of-Experts and expert parallelism (the ``ep`` axis). Pure torch.

``moe.py`` the layer (router, auxiliary losses, capacity, statistics), ``experts.py`` the experts' kernels (grouped
GEMM on CUDA, its padded twin elsewhere) and initial values, ``dispatch.py`` tokens to their experts by all-to-all,
``aux.py`` how auxiliary losses reach the gradients, ``apply.py`` the experts split over ep ranks.
"""

from lightning_parallel.parallel.expert.apply import EXPERT_AXIS, ExpertStyle, apply_expert_parallel, is_expert_param
from lightning_parallel.parallel.expert.aux import aux_loss_scale, backward_scale, set_aux_loss_scale
from lightning_parallel.parallel.expert.moe import GroupedExperts, MoE, check_moe_settings, expert_forward, moe_layers

__all__ = [
    "EXPERT_AXIS",
    "ExpertStyle",
    "GroupedExperts",
    "MoE",
    "apply_expert_parallel",
    "aux_loss_scale",
    "backward_scale",
    "check_moe_settings",
    "expert_forward",
    "is_expert_param",
    "moe_layers",
    "set_aux_loss_scale",
]
