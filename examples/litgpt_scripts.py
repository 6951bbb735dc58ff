"""LitGPT's own full and LoRA fine-tuning scripts (``litgpt.finetune.full``, ``litgpt.finetune.lora``), unchanged,
under this package's Fabric strategies.

    python examples/litgpt_scripts.py --strategy hybrid3d --tp 2 --devices 2 --steps 5
    python examples/litgpt_scripts.py --strategy zero3 --devices 2 --steps 5
    python examples/litgpt_scripts.py --script lora --strategy zero3 --devices 2 --steps 5

The script's ``setup`` picks Lightning's FSDPStrategy by hand and launches its ``main``; this file is that ``setup``
with our strategy in its place and nothing else changed: ``main`` (loading ``lit_model.pth``, the loop, validation,
``fabric.save``; for LoRA also ``mark_only_lora_as_trainable``, saving ``lit_model.pth.lora`` and ``merge_lora``) is
LitGPT's. LoRA's ``save_hyperparameters`` reads LitGPT's command line (jsonargparse): launched from Python, a stand-in
writes the ``hyperparameters.yaml`` that ``merge_lora`` reads. The model is the tiny LitGPT checkpoint folder this
package's tests make locally; point ``--checkpoint-dir`` at a real one (``litgpt download``) instead.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import lightning as L
from litgpt import Config
from litgpt.args import EvalArgs, TrainArgs
from litgpt.data import JSON
from litgpt.finetune import full, lora

from lightning_parallel import Hybrid3DFabricStrategy, ZeroFabricStrategy
from lightning_parallel.litgpt.fabric import hyperparameters_writer, litgpt_protocol
from lightning_parallel.recipes.finetune_assets import LITGPT_DIR, instruction_pairs, make_default_assets


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--script", default="full", choices=["full", "lora"], help="LitGPT's finetune/<script>.py")
    parser.add_argument("--strategy", default="zero3", help="zero2, zero3 or hybrid3d")
    parser.add_argument("--tp", type=int, default=1, help="hybrid3d: tensor-parallel degree")
    parser.add_argument("--devices", type=int, default=2)
    parser.add_argument("--accelerator", default="cpu")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--checkpoint-dir", type=Path, help="a LitGPT checkpoint folder (default: the tiny one)")
    parser.add_argument("--out-dir", type=Path, default=Path("out/litgpt_scripts"))
    args = parser.parse_args()

    # what the script's setup does, but for the strategy
    if args.strategy == "hybrid3d":
        strategy = Hybrid3DFabricStrategy(tp=args.tp, prepare_model=litgpt_protocol)
    else:
        strategy = ZeroFabricStrategy(stage=int(args.strategy[-1]), prepare_model=litgpt_protocol)
    fabric = L.Fabric(accelerator=args.accelerator, devices=args.devices, strategy=strategy, precision="32-true")
    checkpoint_dir = args.checkpoint_dir or make_default_assets(args.out_dir / "assets")[0].parent / LITGPT_DIR
    data_file = args.out_dir / "instructions.json"
    data_file.parent.mkdir(parents=True, exist_ok=True)
    data_file.write_text(json.dumps([{"instruction": p, "input": "", "output": a} for p, a in instruction_pairs()]))
    data = JSON(json_path=data_file, val_split_fraction=0.1, num_workers=0, prompt_style="alpaca")
    train = TrainArgs(
        save_interval=None, log_interval=1, global_batch_size=4, micro_batch_size=1, lr_warmup_steps=1, epochs=1,
        max_steps=args.steps,
    )  # fmt: skip
    evals = EvalArgs(interval=10**6, max_new_tokens=10, max_iters=1, initial_validation=False, final_validation=True)
    dp = args.devices // args.tp  # the script's "devices": the data-parallel ranks it divides the global batch by
    if args.script == "lora":
        run_lora(fabric, dp, checkpoint_dir, data, args.out_dir / "run", train, evals)
        return
    config = Config.from_file(checkpoint_dir / "model_config.yaml")
    # LitGPT's own main, unchanged (its last call, save_hyperparameters, needs LitGPT's CLI extra: jsonargparse)
    fabric.launch(full.main, dp, False, 1337, config, data, checkpoint_dir, args.out_dir / "run", train, evals, "AdamW")


def run_lora(fabric: L.Fabric, dp: int, checkpoint_dir: Path, data: JSON, out: Path, train, evals) -> None:
    """What ``litgpt.finetune.lora.setup`` does after choosing its strategy: the LoRA config, then its ``main``."""
    settings = {"lora_r": 8, "lora_alpha": 16, "lora_dropout": 0.0, "lora_query": True, "lora_value": True}
    config = lora.Config.from_file(checkpoint_dir / "model_config.yaml", **settings)
    lora.save_hyperparameters = hyperparameters_writer(checkpoint_dir=checkpoint_dir, precision="32-true", **settings)
    fabric.launch(lora.main, dp, 1337, config, data, checkpoint_dir, out, train, evals, "AdamW", 1, "32-true")


if __name__ == "__main__":
    main()
