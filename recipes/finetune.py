"""Fine-tune a Hugging Face causal LM with its tokenizer: python recipes/finetune.py [group=option ...] [key=value ...]

    python recipes/finetune.py                                  # tiny Llama + LoRA on a small instruction set
    python recipes/finetune.py data.packing=true strategy=zero2 trainer.devices=2
    python recipes/finetune.py model=hf model.path=FOLDER data.path=chats.jsonl peft=none
    python recipes/finetune.py data=hf_text data.path=docs/ data.tokenizer=TOKENIZER_FOLDER

The defaults make a tiny Llama (a BPE tokenizer with a chat template, fresh weights) and a small instruction set
under data/finetune on first use; the answers to sample_prompts are printed before and after training and saved as
samples.json beside metrics.json (validation loss and perplexity). Config groups: conf/ (those of train_gpt.py).
"""

from __future__ import annotations

import hydra
from omegaconf import DictConfig

from lightning_parallel.recipes.model_kinds import register_configs  # the model families found too

register_configs()


@hydra.main(config_path="../conf", config_name="finetune", version_base="1.3")
def main(cfg: DictConfig) -> None:
    from lightning_parallel.recipes.sweep import run_recipe

    # bad settings and data fail in check_finetune_config, before any worker starts (in a -m sweep: the job is
    # recorded as failed and the sweep goes on)
    run_recipe(cfg, "lightning_parallel.recipes.finetune", "check_finetune_config")


if __name__ == "__main__":
    main()
