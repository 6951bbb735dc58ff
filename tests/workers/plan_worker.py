"""One recipe run in this process (started torchrun-style by tests/harness.py), recording per-rank memory.

    python plan_worker.py --recipe gpt|vgg --out DIR [override ...]

Composes conf/train_<recipe>.yaml with the overrides and runs the recipe's own ``train(cfg, run_dir)``, with one
extra callback: the model-state bytes of this rank after the last optimizer step (parallel/memory.py's
``model_state_bytes``, the quantity the recipes' metrics.json reports as ``model_state_bytes`` where it has it).
Writes ``rank<N>.json``: that, the run's ``activation_memory_bytes`` of this rank, and the layout.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
from pathlib import Path

import lightning.pytorch as pl
from hydra import compose, initialize_config_dir

from lightning_parallel.parallel.measure.memory import model_state_bytes
from lightning_parallel.recipes.config import register_configs

CONF = Path(__file__).resolve().parents[2] / "conf"


class ModelStateProbe(pl.Callback):
    """Model-state bytes after the last optimizer step, before the next zero_grad."""

    def __init__(self) -> None:
        self.bytes: dict[str, int] | None = None

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if trainer.global_step == trainer.max_steps:
            opts = [getattr(o, "_optimizer", o) for o in trainer.optimizers]
            self.bytes = model_state_bytes(trainer.strategy.model, opts)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--recipe", choices=("gpt", "vgg"), required=True)
    parser.add_argument("--out", type=Path, required=True)
    args, overrides = parser.parse_known_args()
    rank = int(os.environ["RANK"])
    os.chdir(args.out)  # the default GPT corpus is written under ./data
    register_configs()
    with initialize_config_dir(str(CONF), version_base="1.3"):
        cfg = compose(f"train_{args.recipe}", overrides=overrides)
    recipe = importlib.import_module(f"lightning_parallel.recipes.{args.recipe}")
    probe = ModelStateProbe()
    build_trainer = recipe.build_trainer

    def with_probe(cfg, run_dir, **kwargs):
        return build_trainer(cfg, run_dir, callbacks=[*kwargs.pop("callbacks", []), probe], **kwargs)

    recipe.build_trainer = with_probe
    metrics = recipe.train(cfg, args.out)
    states = metrics.get("model_state_bytes")  # the recipe's own field, once it reports one
    result = {
        "model_state": states[rank]["total"] if states else probe.bytes["total"],
        "model_state_source": "metrics.json" if states else "probe",
        "activation": metrics["activation_memory_bytes"][rank],
        "layout": metrics["layout"],
    }
    (args.out / f"rank{rank}.json").write_text(json.dumps(result))


if __name__ == "__main__":
    main()
