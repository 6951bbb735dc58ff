"""Worker: trains ``HFCausalLM`` (a save_pretrained folder) or ``LitGPTCausalLM`` (a litgpt checkpoint folder) on
``sft`` batches from a token cache built by the test (padded: attention masks, none for LitGPT; packed: position
ids) under one strategy for a list of cases; writes rank<N>.json (+ params), with the same ``--runs-file`` batching
as gpt_worker.py (tests/conftest.py's ``Batch`` launches it).

Case keys: name, path (the model folder), library ("hf" or "litgpt"), cache (the token cache folder), packing,
seq_len, steps, global_batch,
accumulate (micro-batches per optimizer step), lr, validate (after training, the validation loss of the first 2
unshuffled micro-batches: ``val_loss``).

Each step's loss is the global batch's token mean as this rank sees it: the mean of the window's micro-step losses
times the module's ``window_factor`` (``CausalLM.loss``); averaged over the dp ranks by the test.
"""

from __future__ import annotations

from pathlib import Path

import lightning.pytorch as pl
import torch
from gpt_worker import ShardedData, batch_ranks, build_strategy, run_batches

from lightning_parallel.hf import HFCausalLM
from lightning_parallel.litgpt import LitGPTCausalLM
from lightning_parallel.text import open_token_cache, text_dataset


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


def run_case(case: dict, strategy: str, world: int, out: Path) -> dict:
    pl.seed_everything(0, verbose=False)
    steps, global_batch, accumulate = case["steps"], case["global_batch"], case.get("accumulate", 1)
    strategy_obj = build_strategy(strategy)
    micro = global_batch // (accumulate * batch_ranks(strategy_obj, world))
    litgpt = case.get("library") == "litgpt"
    model = (LitRecording if litgpt else Recording)(case["path"], lr=case["lr"], eps=1e-6)
    cache = open_token_cache(case["cache"])  # LitGPT's GPT takes no attention mask: padded rows without it
    data = text_dataset(cache, case["seq_len"], packing=case["packing"], attention_mask=not litgpt)
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=world,
        strategy=strategy_obj,
        max_steps=steps,
        accumulate_grad_batches=accumulate,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        limit_val_batches=0,
        use_distributed_sampler=False,
    )
    trainer.fit(model, datamodule=ShardedData(data, micro))
    validated = {}
    if case.get("validate"):
        trainer.limit_val_batches = 2
        metrics = trainer.validate(model, datamodule=ShardedData(data, micro), verbose=False)
        validated = {"val_loss": metrics[0]["val_loss"]}
    state = trainer.strategy.full_state_dict() if hasattr(trainer.strategy, "full_state_dict") else model.state_dict()
    if trainer.global_rank == 0:
        torch.save({k: v.detach().cpu() for k, v in state.items()}, out / f"{case['name']}_params.pt")
    windows = [model.micro_losses[i : i + accumulate] for i in range(0, len(model.micro_losses), accumulate)]
    losses = [sum(w) / accumulate * f for w, f in zip(windows, model.factors)]
    return {"name": case["name"], "losses": losses, "factors": model.factors, **validated}


if __name__ == "__main__":
    run_batches(run_case)
