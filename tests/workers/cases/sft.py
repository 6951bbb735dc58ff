"""Case ``sft``: trains ``HFCausalLM`` (a save_pretrained folder) or ``LitGPTCausalLM`` (a litgpt checkpoint folder) on
``sft`` batches from a token cache built by the test (padded: attention masks, none for LitGPT; packed: position
ids) under one strategy for a list of cases; rank 0 saves the gathered parameters as <name>_params.pt
(tests/conftest.py's ``Batch``, ``worker="sft"``).

Case keys: name, path (the model folder), library ("hf" or "litgpt"), cache (the token cache folder), packing,
seq_len, steps, global_batch,
accumulate (micro-batches per optimizer step), lr, validate (after training, the validation loss of the first 2
unshuffled micro-batches: ``val_loss``).

Each step's loss is the global batch's token mean as this rank sees it: the mean of the window's micro-step losses
times the module's ``window_factor`` (``CausalLM.loss``); averaged over the dp ranks by the test.
"""

from __future__ import annotations

import lightning.pytorch as pl

from lightning_parallel.hf import HFCausalLM
from lightning_parallel.litgpt import LitGPTCausalLM
from lightning_parallel.text import open_token_cache, text_dataset

from .common import ShardedData, batch_ranks, build_strategy, make_trainer, save_full_params


class _Recording:
    """Keeps each micro-step's loss and each optimizer step's window factor."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.micro_losses: list[float] = []
        self.factors: list[float] = []

    def training_step(self, batch, batch_idx):
        loss = super().training_step(batch, batch_idx)
        self.micro_losses.append(loss.item())
        return loss

    def on_before_optimizer_step(self, optimizer) -> None:
        super().on_before_optimizer_step(optimizer)
        self.factors.append(self.window_factor)


class Recording(_Recording, HFCausalLM):
    pass


class LitRecording(_Recording, LitGPTCausalLM):
    pass


def run_case(case: dict, ctx) -> dict:
    strategy, world, out = ctx.strategy, ctx.world, ctx.out
    pl.seed_everything(0, verbose=False)
    steps, global_batch, accumulate = case["steps"], case["global_batch"], case.get("accumulate", 1)
    strategy_obj = build_strategy(strategy)
    micro = global_batch // (accumulate * batch_ranks(strategy_obj, world))
    litgpt = case.get("library") == "litgpt"
    model = (LitRecording if litgpt else Recording)(case["path"], lr=case["lr"], eps=1e-6)
    cache = open_token_cache(case["cache"])  # LitGPT's GPT takes no attention mask: padded rows without it
    data = text_dataset(cache, case["seq_len"], packing=case["packing"], attention_mask=not litgpt)
    trainer = make_trainer(world, strategy_obj, max_steps=steps, accumulate_grad_batches=accumulate)
    trainer.fit(model, datamodule=ShardedData(data, micro))
    validated = {}
    if case.get("validate"):
        trainer.limit_val_batches = 2
        metrics = trainer.validate(model, datamodule=ShardedData(data, micro), verbose=False)
        validated = {"val_loss": metrics[0]["val_loss"]}
    save_full_params(trainer, model, out / f"{case['name']}_params.pt")
    windows = [model.micro_losses[i : i + accumulate] for i in range(0, len(model.micro_losses), accumulate)]
    losses = [sum(w) / accumulate * f for w, f in zip(windows, model.factors)]
    return {"name": case["name"], "losses": losses, "factors": model.factors, **validated}
