"""Train a GPT from Hydra configs: python recipes/train_gpt.py [group=option ...] [key=value ...]

    python recipes/train_gpt.py                                   # tiny GPT, one process, Python's docs
    python recipes/train_gpt.py strategy=zero3 trainer.devices=2
    python recipes/train_gpt.py strategy=hybrid3d strategy.pp=2 strategy.tp=2 trainer.devices=8
    torchrun --nproc-per-node 4 recipes/train_gpt.py strategy=zero2 trainer.devices=4
    python recipes/train_gpt.py model=hf_llama_tiny peft=lora peft.r=16 strategy=zero3 trainer.devices=2

The config groups live in conf/ (strategy, precision, model, data, trainer, checkpoint, peft, experiment); the
run directory gets metrics.json, logs and, with checkpoint.dir, checkpoints.
"""

from __future__ import annotations

import hydra
from omegaconf import DictConfig

from lightning_parallel.recipes.model_kinds import register_configs  # the model families found too

register_configs()


@hydra.main(config_path="../conf", config_name="train_gpt", version_base="1.3")
def main(cfg: DictConfig) -> None:
    import lightning_parallel  # noqa: F401  (registers the strategy names)
    from lightning_parallel.recipes.auto import resolve_auto
    from lightning_parallel.recipes.gpt import check_config
    from lightning_parallel.recipes.sweep import run_job
    from lightning_parallel.simulate.prelaunch import simulate_pick

    def check(cfg: DictConfig) -> None:
        resolve_auto(cfg, simulate_pick)  # strategy=auto: the planner's layout, written into cfg for the workers
        check_config(cfg)  # bad settings fail here, before any worker starts

    # trainer.devices > 1: this job starts its own workers (also inside a -m sweep); under torchrun it just runs.
    # A refused setting ends a single run with its message; in a -m sweep the job is recorded as failed
    run_job(cfg, check, entry="lightning_parallel.recipes.gpt.train")


if __name__ == "__main__":
    main()
