"""Case ``dpo``: trains ``HFCausalLM`` (a save_pretrained folder; with ``lora`` peft's LoRA) made a DPO module
(:func:`lightning_parallel.preference.module.as_dpo`) on preference pairs from a cache built by the test, under one
strategy; rank 0 saves the gathered parameters (the reference copy's left out) as <name>_params.pt (tests/conftest.py's
``Batch``, ``worker="dpo"``).

Case keys: name, path (the model folder), cache (the preference cache folder), seq_len, steps, global_batch, lr,
lora, reference (adapters, copy or precomputed), loss, beta.

The result: the losses, and ``copy_bytes``, what this rank holds of the reference copy's parameters.

Each step's loss is the mean DPO loss of this rank's pairs (one micro-batch per step); the test averages the dp
ranks' (every rank holds the same number of pairs: their mean is the global batch's).
"""

from __future__ import annotations

import lightning.pytorch as pl

from lightning_parallel.hf import HFCausalLM
from lightning_parallel.preference.data import PreferencePairs
from lightning_parallel.preference.module import DPOSettings, as_dpo
from lightning_parallel.preference.reference import COPY_NAME, parameter_bytes
from lightning_parallel.recipes.dpo_data import batch_group

from .common import ShardedData, batch_ranks, build_strategy, make_trainer, save_full_params


def lora_config():
    from peft import LoraConfig

    return LoraConfig(r=4, lora_alpha=8, target_modules="all-linear", lora_dropout=0.0)


class Precompute(pl.Callback):
    def __init__(self, data: PreferencePairs, micro: int) -> None:
        self.data, self.micro = data, micro

    def on_fit_start(self, trainer, pl_module) -> None:
        group = batch_group(trainer.strategy)
        self.data.with_reference(pl_module.precompute_reference(self.data, self.micro, group))


def run_case(case: dict, ctx) -> dict:
    strategy, world, out = ctx.strategy, ctx.world, ctx.out
    pl.seed_everything(0, verbose=False)
    strategy_obj = build_strategy(strategy)
    micro = case["global_batch"] // batch_ranks(strategy_obj, world)
    peft = lora_config() if case["lora"] else None
    module = HFCausalLM(case["path"], lr=case["lr"], eps=1e-6, peft_config=peft)
    settings = DPOSettings(beta=case["beta"], loss=case["loss"], reference=case["reference"])
    model = as_dpo(module, settings)
    losses: list[float] = []
    step = model.training_step

    def recorded(batch, batch_idx):
        loss = step(batch, batch_idx)
        losses.append(loss.item())
        return loss

    model.training_step = recorded
    data = PreferencePairs(case["cache"], case["seq_len"])
    callbacks = [Precompute(data, micro)] if case["reference"] == "precomputed" else []
    trainer = make_trainer(world, strategy_obj, max_steps=case["steps"], callbacks=callbacks)
    trainer.fit(model, datamodule=ShardedData(data, micro))
    path = out / f"{case['name']}_params.pt"
    save_full_params(trainer, model, path)
    if trainer.global_rank == 0:
        import torch

        state = torch.load(path, weights_only=True)
        torch.save({k: v for k, v in state.items() if not k.startswith(COPY_NAME + ".")}, path)
    # what this rank holds of the reference copy (its stages' layers under pp, its shards under tp / ZeRO-3)
    copy_bytes = parameter_bytes(getattr(model, COPY_NAME, None))
    return {"name": case["name"], "losses": losses, "copy_bytes": copy_bytes}
