"""Worker: LitGPT's own LoRA fine-tuning script (``litgpt.finetune.lora.main``, unchanged) on the tiny LitGPT
checkpoint folder, under one Fabric strategy; writes rank<N>.json with the loss the script logs at each optimizer
step (its running mean over the step's micro-batches, on this rank), its final validation loss, and where its LoRA
file and merged checkpoint lie.

Strategy specs: those of :mod:`.litgpt_script` ("ddp" at world 1 is the one-process reference; "zero2", "zero3",
"hybrid3d:tp=2" this package's), and "modelparallel": Lightning's ``ModelParallelStrategy`` with the script's own
``parallelize_fn`` (FSDP2 over dp, what the script's ``setup`` builds); "modelparallel:same_init" fills the model
with one process's values first. Case keys: name, assets (the folder
``make_default_assets`` wrote), steps, global_batch, dp (the script's ``devices``), eval_interval (optimizer steps
between the script's validations; each is followed by its rank-0 generation, which runs only where every rank
holds the whole model). The script's ``save_hyperparameters`` is CLI-only (it parses ``sys.argv`` with LitGPT's
jsonargparse CLI): :func:`~lightning_parallel.litgpt.fabric.hyperparameters_writer` writes the file in its place.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import lightning as L
import torch
from lightning.fabric.strategies import ModelParallelStrategy
from litgpt.args import EvalArgs, TrainArgs
from litgpt.data import JSON
from litgpt.finetune import lora
from litgpt.lora import Config

from lightning_parallel.litgpt.fabric import hyperparameters_writer, replay_discarded_draws
from lightning_parallel.parallel.materialize import fill_meta_tensors
from lightning_parallel.recipes.finetune_assets import LITGPT_DIR, instruction_pairs

from .litgpt_script import Recorder, build_strategy

SEED = 1337  # the script's seed argument
# every adapter LitGPT has (q, k, v, projection, MLP, head); no dropout: its draws differ by rank
LORA = {
    "lora_r": 4,
    "lora_alpha": 8,
    "lora_dropout": 0.0,
    "lora_query": True,
    "lora_key": True,
    "lora_value": True,
    "lora_projection": True,
    "lora_mlp": True,
    "lora_head": True,
}


class ValRecorder(Recorder):
    """:class:`Recorder` that also keeps the script's validation losses."""

    def __init__(self) -> None:
        super().__init__()
        self.val: list[float] = []

    def log_metrics(self, metrics: dict[str, Any], step: int | None = None) -> None:
        if "val_loss" in metrics:
            self.val.append(float(metrics["val_loss"]))
        else:
            super().log_metrics(metrics, step)


def _one_process_values(model: torch.nn.Module, mesh: Any) -> torch.nn.Module:
    """The script's ``parallelize_fn`` after filling the meta-built model with the values one process draws (this
    package's replay, from the generator as the script's ``seed_everything(1337)`` left it): Lightning's own
    materialization then has nothing left to draw."""
    if any(p.is_meta for p in model.parameters()):
        replay_discarded_draws(model)
        state = torch.Generator().manual_seed(SEED).get_state()
        fill_meta_tensors(model, model, torch.device("cpu"), rng_state=state)
    return lora.parallelize_fn(model, mesh)


def _strategy(spec: str, dp: int) -> Any:
    if spec.startswith("modelparallel"):  # the script's own choice in its setup
        fn = _one_process_values if spec.endswith(":same_init") else lora.parallelize_fn
        return ModelParallelStrategy(parallelize_fn=fn, data_parallel_size=dp, tensor_parallel_size=1)
    return build_strategy(spec)


def run_case(case: dict, ctx) -> dict:
    spec, world, out = ctx.strategy, ctx.world, ctx.out
    os.environ.pop("PL_GLOBAL_SEED", None)  # see litgpt_script: a previous run's seed would reach the sampler
    folder = Path(case["assets"]) / LITGPT_DIR
    dp = case.get("dp", 1)
    recorder = ValRecorder()
    fabric = L.Fabric(accelerator="cpu", devices=world, strategy=_strategy(spec, dp), precision="32-true")
    fabric._loggers = [recorder]
    data_file = out / "instructions.json"
    data_file.write_text(json.dumps([{"instruction": p, "input": "", "output": a} for p, a in instruction_pairs()]))
    data = JSON(json_path=data_file, val_split_fraction=0.1, num_workers=0, prompt_style="alpaca")
    train = TrainArgs(
        save_interval=None,
        log_interval=1,
        global_batch_size=case.get("global_batch", 4),
        micro_batch_size=1,
        lr_warmup_steps=1,
        epochs=1,
        max_steps=case.get("steps", 5),
    )
    evals = EvalArgs(interval=case.get("eval_interval", 10**6), max_new_tokens=2, max_iters=2, final_validation=True)
    config = Config.from_file(folder / "model_config.yaml", **LORA)
    optimizer = {"class_path": "torch.optim.AdamW", "init_args": {"lr": 1e-3, "eps": 1e-6}}  # as litgpt_script's
    run = out / "run"
    lora.save_hyperparameters = hyperparameters_writer(checkpoint_dir=folder, precision="32-true", **LORA)
    fabric.launch(lora.main, dp, SEED, config, data, folder, run, train, evals, optimizer, 1, "32-true")
    steps, last = [], 0
    for row in recorder.rows:
        if row.get("step", 0) > last:  # the iteration that stepped: the window is the step's micro-batches
            steps.append(row["loss"])
            last = row["step"]
    final = run / "final"
    return {
        "name": case["name"],
        "losses": steps,
        "val": recorder.val,
        "lora_file": str(final / "lit_model.pth.lora"),
        "merged_file": str(final / "lit_model.pth"),
    }
