"""Case ``plan`` (tests/test_plan.py, tests/test_plan_memory.py): one recipe run in this process, recording per-rank
memory; several run one after another in one launch through ``--runs-file`` (conftest's Batch).

    run.py plan --opts '{"recipe": "gpt" | "vgg", "overrides": [override, ...]}' --out DIR

Composes conf/train_<recipe>.yaml with the overrides and runs the recipe's own ``train(cfg, run_dir)``, with one
extra callback: the model-state bytes of this rank after the last optimizer step (parallel/measure/memory.py's
``model_state_bytes``, the quantity the recipes' metrics.json reports as ``model_state_bytes`` where it has it).
Its result: that, the run's ``activation_memory_bytes`` of this rank, and the layout.
"""

from __future__ import annotations

import importlib
import os
from pathlib import Path

import lightning.pytorch as pl
from hydra import compose, initialize_config_dir

from lightning_parallel.parallel.measure.memory import model_state_bytes
from lightning_parallel.recipes.config import register_configs

CONF = Path(__file__).resolve().parents[3] / "conf"


class ModelStateProbe(pl.Callback):
    """Model-state bytes after the last optimizer step, before the next zero_grad."""

    def __init__(self) -> None:
        self.bytes: dict[str, int] | None = None

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if trainer.global_step == trainer.max_steps:
            opts = [getattr(o, "_optimizer", o) for o in trainer.optimizers]
            self.bytes = model_state_bytes(trainer.strategy.model, opts)


def run_case(case: dict, ctx) -> dict:
    rank, recipe_name, overrides = ctx.rank, case["recipe"], case["overrides"]
    assert recipe_name in ("gpt", "vgg"), recipe_name
    os.chdir(ctx.out)  # the default GPT corpus is written under ./data
    register_configs()
    with initialize_config_dir(str(CONF), version_base="1.3"):
        cfg = compose(f"train_{recipe_name}", overrides=overrides)
    recipe = importlib.import_module(f"lightning_parallel.recipes.{recipe_name}")
    probe = ModelStateProbe()
    build_trainer = recipe.build_trainer

    def with_probe(cfg, run_dir, **kwargs):
        return build_trainer(cfg, run_dir, callbacks=[*kwargs.pop("callbacks", []), probe], **kwargs)

    recipe.build_trainer = with_probe
    metrics = recipe.train(cfg, ctx.out)
    states = metrics.get("model_state_bytes")  # the recipe's own field, once it reports one
    result = {
        "model_state": states[rank]["total"] if states else probe.bytes["total"],
        "model_state_source": "metrics.json" if states else "probe",
        "activation": metrics["activation_memory_bytes"][rank],
        "layout": metrics["layout"],
    }
    return result
