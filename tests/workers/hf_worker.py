"""Worker: trains a Hugging Face causal LM (``HFCausalLM`` loaded from a save_pretrained folder) or, with case key
``library: litgpt``, LitGPT's GPT (``LitGPTCausalLM`` from a litgpt checkpoint folder) under one strategy for a
list of cases; writes rank<N>.json (+ params), as gpt_worker.py does (same ``--runs-file`` batching,
so tests/conftest.py's ``Batch`` can launch it).

Case keys: name, path (the model folder), steps, global_batch, seq_len, lr, tuple_batch (batches as
(input_ids, labels) instead of dicts), accumulate (micro-batches per optimizer step), clip (gradient norm).
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

import lightning.pytorch as pl
import torch
from gpt_worker import ShardedData, batch_ranks, build_strategy
from torch.utils.data import Dataset

from lightning_parallel.hf import HFCausalLM


class RandomTokens(Dataset):
    """Fixed random token rows; dict samples (``input_ids``, ``labels``) or (input_ids, labels) tuples."""

    def __init__(self, num_samples: int, seq_len: int, vocab_size: int, as_tuple: bool = False) -> None:
        g = torch.Generator().manual_seed(0)
        self.tokens = torch.randint(0, vocab_size, (num_samples, seq_len), generator=g)
        self.as_tuple = as_tuple

    def __len__(self) -> int:
        return len(self.tokens)

    def __getitem__(self, i: int):
        row = self.tokens[i]
        return (row, row) if self.as_tuple else {"input_ids": row, "labels": row}


def recording(module_class: type) -> type:
    """``module_class`` that keeps each training step's loss (``self.losses``)."""

    class Recording(module_class):
        def __init__(self, *args, **kwargs) -> None:
            super().__init__(*args, **kwargs)
            self.losses: list[float] = []

        def training_step(self, batch, batch_idx):
            loss = super().training_step(batch, batch_idx)
            self.losses.append(loss.item())
            return loss

    return Recording


def module_class(library: str) -> type:
    if library == "litgpt":
        from lightning_parallel.litgpt import LitGPTCausalLM

        return LitGPTCausalLM
    return HFCausalLM


def run_case(case: dict, strategy: str, world: int, out: Path) -> dict:
    pl.seed_everything(0, verbose=False)
    steps, global_batch, accumulate = case.get("steps", 10), case.get("global_batch", 8), case.get("accumulate", 1)
    strategy_obj = build_strategy(strategy)
    micro = global_batch // (accumulate * batch_ranks(strategy_obj, world))
    model = recording(module_class(case.get("library", "hf")))(case["path"], lr=case.get("lr", 1e-3), eps=1e-6)
    data = RandomTokens(global_batch * steps, case.get("seq_len", 16), model.model.config.vocab_size)
    data.as_tuple = bool(case.get("tuple_batch"))
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=world,
        strategy=strategy_obj,
        max_steps=steps,
        accumulate_grad_batches=accumulate,
        gradient_clip_val=case.get("clip"),
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        limit_val_batches=0,
        use_distributed_sampler=False,
    )
    trainer.fit(model, datamodule=ShardedData(data, micro))
    state = trainer.strategy.full_state_dict() if hasattr(trainer.strategy, "full_state_dict") else model.state_dict()
    if trainer.global_rank == 0:
        torch.save({k: v.detach().cpu() for k, v in state.items()}, out / f"{case['name']}_params.pt")
    # one loss per optimizer step: the mean of its micro-batches' (equal token counts: the global batch's loss)
    losses = [sum(model.losses[i : i + accumulate]) / accumulate for i in range(0, len(model.losses), accumulate)]
    return {"name": case["name"], "losses": losses, "bytes_read": getattr(model, "weight_bytes_read", 0)}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--runs-file", required=True, help="JSON [{label, strategy, cases}], each into OUT/<label>/")
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    out = Path(args.out)
    world, rank = int(os.environ.get("WORLD_SIZE", "1")), int(os.environ.get("RANK", "0"))
    torch.set_num_threads(1)
    runs = json.loads(Path(args.runs_file).read_text())
    for run in runs:
        run_out = out / run["label"]
        run_out.mkdir(parents=True, exist_ok=True)
        results = [run_case(case, run["strategy"], world, run_out) for case in run["cases"]]
        (run_out / f"rank{rank}.json").write_text(json.dumps(results))
    (out / f"rank{rank}.json").write_text(json.dumps([run["label"] for run in runs]))


if __name__ == "__main__":
    main()
