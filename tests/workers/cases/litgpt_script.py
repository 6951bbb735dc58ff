"""Worker: LitGPT's own full fine-tuning script (``litgpt.finetune.full.main``, unchanged) on the tiny LitGPT
checkpoint folder, under one Fabric strategy; writes rank<N>.json with the loss the script logs at each optimizer
step (its running mean over the step's micro-batches, on this rank).

Strategy specs: "ddp" (Lightning's own, the one-process reference: Lightning's FSDPStrategy, the script's choice,
needs an accelerator under torch 2.13, even with gloo), "fsdp" (that FSDPStrategy, as the script builds it: on a GPU,
benchmarks/gpu_check), "fsdp2" (Lightning's ModelParallelStrategy with the ``parallelize_fn`` of LitGPT's LoRA
script, no activation checkpointing: its wrapper renames the keys ``fabric.load_raw`` fills), "zero3" or
"hybrid3d:tp=2" (this package's, with ``prepare_model=litgpt_protocol``). Case keys: name, assets (the folder
``make_default_assets`` wrote), steps (optimizer steps), global_batch (samples per step), dp (the script's
``devices``: what it divides the global batch by). The script's last call, ``save_hyperparameters`` on rank 0, needs
LitGPT's CLI dependency jsonargparse, which this environment lacks: that error alone is let pass (after the save).
"""

from __future__ import annotations

import json
import os
from functools import partial
from pathlib import Path
from typing import Any

import lightning as L
from lightning.fabric.loggers import Logger
from lightning.fabric.strategies import FSDPStrategy, ModelParallelStrategy
from litgpt import Config
from litgpt.args import EvalArgs, TrainArgs
from litgpt.data import JSON
from litgpt.finetune import full, lora
from litgpt.model import Block

from lightning_parallel import Hybrid3DFabricStrategy, ZeroFabricStrategy
from lightning_parallel.litgpt.fabric import litgpt_protocol
from lightning_parallel.recipes.finetune_assets import LITGPT_DIR, instruction_pairs

from .common import _value


class Recorder(Logger):
    """Keeps what the script logs, on every rank (Lightning's loggers write on rank 0 only)."""

    def __init__(self) -> None:
        super().__init__()
        self.rows: list[dict[str, Any]] = []

    @property
    def name(self) -> str:
        return "recorder"

    @property
    def version(self) -> int:
        return 0

    def log_metrics(self, metrics: dict[str, Any], step: int | None = None) -> None:
        self.rows.append({k: float(v) for k, v in metrics.items() if k in ("loss", "iter", "step")})

    def log_hyperparams(self, params: Any, *args: Any, **kwargs: Any) -> None:
        pass


def build_strategy(spec: str) -> Any:
    if spec == "fsdp":  # Lightning's FSDPStrategy as litgpt.finetune.full's setup builds it (a GPU only)
        return FSDPStrategy(
            auto_wrap_policy={Block}, activation_checkpointing_policy={Block}, state_dict_type="full",
            limit_all_gathers=True, cpu_offload=False,
        )  # fmt: skip
    if spec == "fsdp2":  # Lightning's ModelParallelStrategy as LitGPT's LoRA script builds it (FSDP2, tp=1)
        shard = partial(lora.parallelize_fn, activation_checkpointing=False)
        return ModelParallelStrategy(parallelize_fn=shard, data_parallel_size=2, tensor_parallel_size=1)
    if spec == "ddp":  # Lightning's own, in one process: the data through a DistributedSampler as under ours
        return "ddp"
    name, _, items = spec.partition(":")
    settings = {k: _value(k, v) for k, v in (item.split("=") for item in items.split(","))} if items else {}
    if name == "hybrid3d":
        return Hybrid3DFabricStrategy(**settings, prepare_model=litgpt_protocol)
    return ZeroFabricStrategy(stage=int(name[-1]), **settings, prepare_model=litgpt_protocol)


def run_case(case: dict, ctx) -> dict:
    spec, world, out = ctx.strategy, ctx.world, ctx.out
    # the sampler's seed is PL_GLOBAL_SEED when Fabric sets the loaders up, before the script seeds: a run before this
    # one in the same launch left its seed there
    os.environ.pop("PL_GLOBAL_SEED", None)
    folder = Path(case["assets"]) / LITGPT_DIR
    data_file = out / "instructions.json"
    rows = [{"instruction": p, "input": "", "output": a} for p, a in instruction_pairs()]
    data_file.write_text(json.dumps(rows))
    recorder = Recorder()
    fabric = L.Fabric(accelerator=ctx.accelerator, devices=world, strategy=build_strategy(spec), precision="32-true")
    fabric._loggers = [recorder]
    dp = case.get("dp", 1)  # the script's "devices": the data-parallel ranks it divides the global batch by
    data = JSON(json_path=data_file, val_split_fraction=0.1, num_workers=0, prompt_style="alpaca")
    global_batch = case.get("global_batch", 4)
    train = TrainArgs(
        save_interval=None,
        log_interval=1,
        global_batch_size=global_batch,
        micro_batch_size=1,
        lr_warmup_steps=1,
        epochs=1,
        max_steps=case.get("steps", 5),
    )
    evals = EvalArgs(interval=10**6, max_new_tokens=2, max_iters=1, initial_validation=False, final_validation=False)
    config = Config.from_file(folder / "model_config.yaml")
    # AdamW with eps 1e-6, as cases/models.py's (see there): at torch's 1e-8 a gradient at float32 rounding level gets a
    # full-size update of pure rounding noise, which says nothing about a layout
    optimizer = {"class_path": "torch.optim.AdamW", "init_args": {"lr": 1e-3, "eps": 1e-6}}
    try:
        fabric.launch(full.main, dp, False, 1337, config, data, folder, out / "run", train, evals, optimizer)
    except ModuleNotFoundError as error:  # the script's last line, on rank 0: save_hyperparameters (LitGPT's CLI)
        if error.name != "jsonargparse":
            raise
    steps, last = [], 0
    for row in recorder.rows:
        if row.get("step", 0) > last:  # the iteration that stepped: the window is the step's micro-batches
            steps.append(row["loss"])
            last = row["step"]
    final = out / "run" / "final" / "lit_model.pth"
    return {"name": case["name"], "losses": steps, "saved": final.exists(), "rows": len(recorder.rows)}
