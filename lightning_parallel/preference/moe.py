"""DPO on Hugging Face MoE models (Mixtral, Qwen3-MoE: ``HFCausalLM`` with ``config.base_model_ep_plan``, experts
split over ep): the routers' load-balancing loss added to the DPO loss as TRL 1.16's ``DPOTrainer`` adds it.

TRL (``trl/trainer/dpo_trainer.py``, trl 1.16.0):

- lines 895-905: the auxiliary loss is on when the model's config has ``output_router_logits`` (whatever its value)
  and the coefficient is not 0; the coefficient is the config's ``router_aux_loss_coef`` (``DPOConfig`` may override
  it, 0 turning it off: here set the config's ``router_aux_loss_coef`` to 0 for that, since
  ``output_router_logits=False`` alone is overridden as TRL overrides it);
- lines 1292-1295: the policy's forward asks for the router logits (``output_router_logits=True``);
- lines 1321-1323: the reference's forward does not (its auxiliary loss would be thrown away);
- lines 1530-1532: ``loss = loss + router_aux_loss_coef * outputs.aux_loss``, the DPO loss (the mean over the
  batch's pairs) plus HF's load-balancing loss of the policy's forward over the batch's rows, chosen and rejected
  alike, padding masked out by the attention mask.

Here the same, with one difference in what "the batch" is: TRL adds each rank's own batch's auxiliary loss; this
package's :func:`~lightning_parallel.hf.experts.router_aux_loss` gives the global batch's (its sums all-reduced over
the ranks reading different pairs), what one process computes on the whole batch, so every layout gives the
one-process values (under pp each pipeline microbatch is its own batch, as each accumulated micro-batch is:
:mod:`lightning_parallel.hf.moe_pipeline`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

from torch import Tensor, nn

from lightning_parallel.hf.experts import as_loss_like


def enable_router_aux(module: Any) -> bool:
    """TRL's rule (see the module docstring): an HF model whose config has ``output_router_logits`` and a nonzero
    ``router_aux_loss_coef`` gets ``output_router_logits=True``, so the policy's forward returns its router logits
    (HFCausalLM's forward then computes the load-balancing loss, and under pp the stages exchange its sums). Returns
    whether it is on."""
    hf = getattr(module, "hf_model", None)
    config = getattr(hf, "config", None)
    if config is None or not hasattr(config, "output_router_logits"):
        return False
    if not getattr(config, "router_aux_loss_coef", 0.0):
        return False
    config.output_router_logits = True
    return True


@contextlib.contextmanager
def router_logits_off(module: nn.Module) -> Iterator[None]:
    """Every HF config under ``module`` (the policy's, the frozen copy's) with ``output_router_logits`` off for the
    block: the reference's forwards compute no load-balancing loss (TRL's lines 1321-1323); restored after."""
    configs: dict[int, Any] = {}
    for m in module.modules():
        config = getattr(m, "config", None)
        if getattr(config, "output_router_logits", False) is True:
            configs[id(config)] = config
    for config in configs.values():
        config.output_router_logits = False
    try:
        yield
    finally:
        for config in configs.values():
            config.output_router_logits = True


def with_router_aux(module: Any, loss: Tensor) -> Tensor:
    """``loss`` plus ``router_aux_loss_coef`` times HF's load-balancing loss of the policy's last forward (under pp:
    of this microbatch over every stage, on the last stage), when there is one (TRL's lines 1530-1532); consumed."""
    aux, module._router_aux = getattr(module, "_router_aux", None), None
    pipeline = getattr(module, "_pipeline_aux", None)
    if aux is None and pipeline is not None:
        aux = pipeline.finish()
    if aux is None:
        return loss
    return loss + as_loss_like(loss, module.hf_model.router_aux_loss_coef * aux.to(loss.device))
