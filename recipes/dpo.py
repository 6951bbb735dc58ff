"""Preference-tune a Hugging Face causal LM with DPO: python recipes/dpo.py [group=option ...] [key=value ...]

    python recipes/dpo.py                                   # tiny Llama + LoRA on a small preference set
    python recipes/dpo.py strategy=zero3 trainer.devices=2 peft=none         # a frozen reference copy, sharded
    python recipes/dpo.py dpo.precompute_reference=true dpo.loss=ipo dpo.beta=0.5
    python recipes/dpo.py model=hf model.path=FOLDER data.path=pairs.jsonl

The defaults make the fine-tune recipe's tiny Llama (a BPE tokenizer with a chat template, fresh weights) and a
small preference set under data/dpo on first use; the held-out reward margin and accuracy are printed before and
after training with the answers to sample_prompts (metrics.json: ``dpo``; samples.json). Config groups: conf/.
"""

from __future__ import annotations

import hydra
from omegaconf import DictConfig

from lightning_parallel.recipes.dpo_config import register_dpo_configs
from lightning_parallel.recipes.model_kinds import register_configs  # the model families found too

register_configs()
register_dpo_configs()


@hydra.main(config_path="../conf", config_name="dpo", version_base="1.3")
def main(cfg: DictConfig) -> None:
    from lightning_parallel.recipes.sweep import run_recipe

    # bad settings and data fail in check_dpo_config, before any worker starts
    run_recipe(cfg, "lightning_parallel.recipes.dpo", "check_dpo_config")


if __name__ == "__main__":
    main()
