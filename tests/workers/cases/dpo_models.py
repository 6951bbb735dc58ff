"""Case ``dpo_models``: DPO (:func:`lightning_parallel.preference.module.as_dpo`) on the model kinds beyond the dense
HF Llama of case ``dpo``: ``LitGPTCausalLM`` (a litgpt checkpoint folder; ``lora``: LitGPT's LoRA settings) and
``HFCausalLM`` of a MoE transformers config (``config``: its fields, fresh weights from seed 0; ``lora``: peft's
LoraConfig fields), trained on preference pairs from a cache built by the test under one strategy; rank 0 saves the
gathered parameters (the reference copy's left out) as <name>_params.pt (tests/conftest.py's ``Batch``,
``worker="dpo_models"``).

Case keys: name, model ("litgpt" or "hf"), path (litgpt's folder) or config (the MoE's fields), lora (a dict or
None), cache, seq_len, steps, global_batch, lr, reference (adapters, copy or precomputed), loss, beta.

Each step's loss is the mean DPO loss of this rank's pairs (plus the global batch's load-balancing loss for a MoE);
the test averages the dp ranks'.
"""

from __future__ import annotations

import lightning.pytorch as pl
import torch

from lightning_parallel.parallel.expert.apply import is_expert_param
from lightning_parallel.preference.data import PreferencePairs
from lightning_parallel.preference.module import DPOSettings, as_dpo
from lightning_parallel.preference.reference import COPY_NAME

from .common import ShardedData, batch_ranks, build_strategy, make_trainer, save_full_params
from .dpo import Precompute


def build_module(case: dict):
    """The LightningModule of the case (the same in the test's one-process reference)."""
    if case["model"] == "litgpt":
        from lightning_parallel.litgpt import LitGPTCausalLM

        return LitGPTCausalLM(case["path"], lr=case["lr"], eps=1e-6, lora=case["lora"])
    import transformers
    from peft import LoraConfig

    from lightning_parallel.hf import HFCausalLM

    config = transformers.AutoConfig.for_model(**case["config"])
    peft = LoraConfig(**case["lora"]) if case["lora"] else None
    return HFCausalLM(config, lr=case["lr"], eps=1e-6, peft_config=peft)


def run_case(case: dict, ctx) -> dict:
    strategy, world, out = ctx.strategy, ctx.world, ctx.out
    pl.seed_everything(0, verbose=False)
    strategy_obj = build_strategy(strategy)
    micro = case["global_batch"] // batch_ranks(strategy_obj, world)
    settings = DPOSettings(beta=case["beta"], loss=case["loss"], reference=case["reference"])
    model = as_dpo(build_module(case), settings)
    losses: list[float] = []
    step = model.training_step

    def recorded(batch, batch_idx):
        loss = step(batch, batch_idx)
        losses.append(loss.item())
        return loss

    model.training_step = recorded
    data = PreferencePairs(case["cache"], case["seq_len"], attention_mask=case["model"] != "litgpt")
    callbacks = [Precompute(data, micro)] if case["reference"] == "precomputed" else []
    trainer = make_trainer(world, strategy_obj, max_steps=case["steps"], callbacks=callbacks)
    trainer.fit(model, datamodule=ShardedData(data, micro))
    copy = getattr(model, COPY_NAME, None)  # its experts split over ep as the policy's (a MoE's)
    split = sum(is_expert_param(p) for p in copy.parameters()) if copy is not None else 0
    path = out / f"{case['name']}_params.pt"
    save_full_params(trainer, model, path)
    if trainer.global_rank == 0:
        state = torch.load(path, weights_only=True)
        torch.save({k: v for k, v in state.items() if not k.startswith(COPY_NAME + ".")}, path)
    return {"name": case["name"], "losses": losses, "copy_expert_params": split}
