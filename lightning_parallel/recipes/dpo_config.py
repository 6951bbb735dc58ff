"""The DPO recipe's Hydra schemas (conf/dpo.yaml, conf/data/preference.yaml): the fine-tune recipe's root with a
``dpo`` group and preference data."""

from __future__ import annotations

from dataclasses import dataclass, field

from hydra.core.config_store import ConfigStore

from lightning_parallel.recipes.config import FinetuneRecipeConf, TokenizedDataConf


@dataclass
class DPOConf:
    """``dpo.*``: the loss and the reference."""

    beta: float = 0.1  # the KL weight (TRL's beta)
    loss: str = "sigmoid"  # sigmoid, ipo (length-normalized, as TRL) or robust (with label_smoothing)
    label_smoothing: float = 0.0  # robust: the share of pairs assumed flipped, in [0, 0.5)
    # true: the reference's log-probabilities computed in one pass before training and kept with the pairs
    # (no reference forward in the steps); false: the base with adapters off (peft=lora) or a frozen copy
    precompute_reference: bool = False


@dataclass
class PreferenceDataConf(TokenizedDataConf):
    """``data=preference``: pairs in TRL's preference formats (``prompt`` / ``chosen`` / ``rejected`` as text or as
    conversations; or ``chosen`` / ``rejected`` whole conversations sharing their prompt) from local json, jsonl,
    parquet or csv files, tokenized once by the parent into a token cache; ``global_batch_size`` counts pairs."""

    kind: str = "preference"
    chosen_column: str = "chosen"
    rejected_column: str = "rejected"


@dataclass
class DPORecipeConf(FinetuneRecipeConf):
    """The DPO recipe's root (conf/dpo.yaml): the fine-tune recipe's groups, ``dpo``, margin and accuracy before and
    after training."""

    assets: str = "data/dpo"
    dpo: DPOConf = field(default_factory=DPOConf)


def register_dpo_configs() -> None:
    """Store the preference data's schema and the DPO recipe's root."""
    cs = ConfigStore.instance()
    cs.store(group="data", name="preference_schema", node=PreferenceDataConf)
    cs.store(name="dpo_recipe_schema", node=DPORecipeConf)
