"""LitGPT's own full and LoRA fine-tuning and pretraining scripts (``litgpt.finetune.full``, ``litgpt.finetune.lora``,
``litgpt.pretrain``), unchanged, under this package's Fabric strategies.

    python examples/litgpt_scripts.py --strategy hybrid3d --tp 2 --devices 2 --steps 5
    python examples/litgpt_scripts.py --strategy zero3 --devices 2 --steps 5
    python examples/litgpt_scripts.py --script lora --strategy zero3 --devices 2 --steps 5
    python examples/litgpt_scripts.py --script pretrain --strategy hybrid3d --tp 2 --devices 2 --steps 5

The script's ``setup`` picks Lightning's FSDPStrategy by hand and launches its ``main``; this file is that ``setup``
with our strategy in its place and nothing else changed: ``main`` (loading ``lit_model.pth``, the loop, validation,
``fabric.save``; for LoRA also ``mark_only_lora_as_trainable``, saving ``lit_model.pth.lora`` and ``merge_lora``) is
LitGPT's. LoRA's ``save_hyperparameters`` reads LitGPT's command line (jsonargparse): launched from Python, a stand-in
writes the ``hyperparameters.yaml`` that ``merge_lora`` reads. The model is the tiny LitGPT checkpoint folder this
package's tests make locally; point ``--checkpoint-dir`` at a real one (``litgpt download``) instead. ``--script
pretrain`` trains that folder's config from LitGPT's own initialization on local text
(:class:`~lightning_parallel.litgpt.text_data.TextBlocks`: every ``.txt`` of ``--text-dir``, default a few written
here); its ``save_checkpoint`` ends with LitGPT's
``save_hyperparameters``, which needs LitGPT's CLI extra (jsonargparse).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import lightning as L
from litgpt import Config, Tokenizer, pretrain
from litgpt.args import EvalArgs, TrainArgs
from litgpt.data import JSON
from litgpt.finetune import full, lora

from lightning_parallel import Hybrid3DFabricStrategy, ZeroFabricStrategy
from lightning_parallel.litgpt.fabric import hyperparameters_writer, litgpt_protocol
from lightning_parallel.litgpt.text_data import TextBlocks
from lightning_parallel.recipes.finetune_assets import (
    LITGPT_DIR,
    instruction_pairs,
    make_default_assets,
    write_texts,
)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--script", default="full", choices=["full", "lora", "pretrain"], help="LitGPT's script")
    parser.add_argument("--strategy", default="zero3", help="zero2, zero3 or hybrid3d")
    parser.add_argument("--tp", type=int, default=1, help="hybrid3d: tensor-parallel degree")
    parser.add_argument("--devices", type=int, default=2)
    parser.add_argument("--accelerator", default="cpu")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--checkpoint-dir", type=Path, help="a LitGPT checkpoint folder (default: the tiny one)")
    parser.add_argument("--out-dir", type=Path, default=Path("out/litgpt_scripts"))
    parser.add_argument("--text-dir", type=Path, help="pretrain: a folder of .txt files (default: a few written here)")
    args = parser.parse_args()

    # what the script's setup does, but for the strategy
    if args.strategy == "hybrid3d":
        strategy = Hybrid3DFabricStrategy(tp=args.tp, prepare_model=litgpt_protocol)
    else:
        strategy = ZeroFabricStrategy(stage=int(args.strategy[-1]), prepare_model=litgpt_protocol)
    fabric = L.Fabric(accelerator=args.accelerator, devices=args.devices, strategy=strategy, precision="32-true")
    checkpoint_dir = args.checkpoint_dir or make_default_assets(args.out_dir / "assets")[0].parent / LITGPT_DIR
    dp = args.devices // args.tp  # the scripts' "devices": the data-parallel ranks they divide the global batch by
    config = Config.from_file(checkpoint_dir / "model_config.yaml")
    if args.script == "pretrain":
        run_pretrain(args, fabric, checkpoint_dir, config, dp)
        return
    data_file = args.out_dir / "instructions.json"
    data_file.parent.mkdir(parents=True, exist_ok=True)
    data_file.write_text(json.dumps([{"instruction": p, "input": "", "output": a} for p, a in instruction_pairs()]))
    data = JSON(json_path=data_file, val_split_fraction=0.1, num_workers=0, prompt_style="alpaca")
    train = TrainArgs(
        save_interval=None, log_interval=1, global_batch_size=4, micro_batch_size=1, lr_warmup_steps=1, epochs=1,
        max_steps=args.steps,
    )  # fmt: skip
    evals = EvalArgs(interval=10**6, max_new_tokens=10, max_iters=1, initial_validation=False, final_validation=True)
    if args.script == "lora":
        run_lora(fabric, dp, checkpoint_dir, data, args.out_dir / "run", train, evals)
        return
    # LitGPT's own main, unchanged (its last call, save_hyperparameters, needs LitGPT's CLI extra: jsonargparse)
    fabric.launch(full.main, dp, False, 1337, config, data, checkpoint_dir, args.out_dir / "run", train, evals, "AdamW")


def run_lora(fabric: L.Fabric, dp: int, checkpoint_dir: Path, data: JSON, out: Path, train, evals) -> None:
    """What ``litgpt.finetune.lora.setup`` does after choosing its strategy: the LoRA config, then its ``main``."""
    settings = {"lora_r": 8, "lora_alpha": 16, "lora_dropout": 0.0, "lora_query": True, "lora_value": True}
    config = lora.Config.from_file(checkpoint_dir / "model_config.yaml", **settings)
    lora.save_hyperparameters = hyperparameters_writer(checkpoint_dir=checkpoint_dir, precision="32-true", **settings)
    fabric.launch(lora.main, dp, 1337, config, data, checkpoint_dir, out, train, evals, "AdamW", 1, "32-true")


def run_pretrain(args: argparse.Namespace, fabric: L.Fabric, checkpoint_dir: Path, config: Config, dp: int) -> None:
    """What ``litgpt.pretrain.setup`` does after choosing its strategy: launch its ``main``."""
    text_dir = args.text_dir or write_texts(args.out_dir / "texts")
    seq, micro, global_batch = 32, 1, 4
    # the script stops at max_tokens, counted per process (max_tokens // world_size): give it for all the processes
    tokens = args.steps * (global_batch // (dp * micro)) * micro * seq * args.devices
    train = TrainArgs(
        save_interval=None, log_interval=1, global_batch_size=global_batch, micro_batch_size=micro, lr_warmup_steps=1,
        max_tokens=tokens, max_seq_length=seq, max_norm=1.0, min_lr=1e-4, tie_embeddings=False,
    )  # fmt: skip
    evals = EvalArgs(interval=10**6, max_iters=1)
    out = args.out_dir / "pretrain"
    tokenizer = Tokenizer(checkpoint_dir)
    # LitGPT's own main, unchanged: main(fabric, devices, seed, initial_checkpoint_dir, resume, config, data, out_dir,
    # tokenizer_dir, tokenizer, train, eval, optimizer). save_interval=N writes out/step-*/lit_model.pth folders,
    # from which resume=True goes on (at any layout: test_litgpt_pretrain.py)
    try:
        fabric.launch(
            pretrain.main, dp, 42, None, False, config, TextBlocks(text_dir), out, checkpoint_dir, tokenizer, train,
            evals, "AdamW",
        )  # fmt: skip
    except ModuleNotFoundError as error:  # rank 0, after the final fabric.save: LitGPT's save_hyperparameters
        if error.name != "jsonargparse":
            raise
        print(f"saved {out / 'final' / 'lit_model.pth'}; hyperparameters.yaml needs jsonargparse (LitGPT's CLI extra)")


if __name__ == "__main__":
    main()
