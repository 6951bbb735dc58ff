"""Config schemas of the recipes, registered in Hydra's ConfigStore.

Every YAML file under ``conf/<group>/`` starts from a schema of its group here (``model/`` and ``data/``
have one per recipe), so a misspelled key or a value of the wrong type fails when Hydra composes the
config, before anything is launched (``strategy`` has one schema per strategy, in :mod:`.strategy_conf`, so a
key the chosen strategy does not take is refused too). The keys are the stable CLI of the recipes (listed in
docs/recipes.md): ``trainer.devices``, ``trainer.max_steps``, ``strategy.dp|pp|tp|zero_stage|pp_schedule|
microbatches``, ``precision=...``, ``data.global_batch_size``, ``seed``, ``checkpoint.dir``,
``checkpoint.every_n_steps``, ``ckpt_path``, and with ``peft=lora`` ``peft.r|alpha|dropout|target_modules|
base_dtype``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from hydra.core.config_store import ConfigStore
from omegaconf import MISSING

from lightning_parallel.recipes.optimizers import OptimizerConf
from lightning_parallel.recipes.strategy_conf import STRATEGY_SCHEMAS


@dataclass
class PrecisionConf:
    value: str = "32-true"  # Lightning's precision flag, or fp8 (torchao float8 over bf16-mixed: docs/fp8.md)
    recipe: str = "tensorwise"  # fp8 only: tensorwise | rowwise scaling
    fsdp_float8_all_gather: bool = False  # fp8 only: ZeRO-3 gathers the converted weights in float8
    emulate: bool | None = None  # fp8 only: emulated float8 GEMMs (null: on the CPU only)


@dataclass
class TextModelConf:
    """What the GPT recipe reads of every model it trains (``model=gpt_*``, ``model=hf*``, ``model=litgpt*``)."""

    # the model's family (recipes/model_kinds.py): gpt, hf, litgpt, or a registered one; each schema sets its own
    kind: str = ""
    seq_len: int = 64  # tokens per training window
    lr: float = 3e-3
    weight_decay: float = 0.1


@dataclass
class GPTModelConf(TextModelConf):
    kind: str = "gpt"
    vocab_size: int = 256  # byte-level tokens
    n_layer: int = 4
    n_head: int = 4
    d_model: int = 128
    mlp_ratio: int = 4
    dropout: float = 0.0
    warmup_steps: int = 0
    # Mixture-of-Experts (0: dense): moe_experts experts, top-k, in every moe_every-th block (strategy.ep splits them)
    moe_experts: int = 0
    moe_top_k: int = 2
    moe_every: int = 2
    moe_hidden: int | None = None  # each expert's hidden width (null: mlp_ratio * d_model)
    moe_capacity_factor: float | None = None  # null: dropless
    moe_shared_hidden: int = 0  # a shared expert's hidden width (0: none)
    moe_aux_loss_coeff: float = 0.01  # load-balancing loss weight
    moe_z_loss_coeff: float = 0.0  # router z-loss weight


@dataclass
class HFModelConf(TextModelConf):
    """A Hugging Face causal LM (HFCausalLM): from a local ``save_pretrained`` folder or a transformers config."""

    kind: str = "hf"

    path: str | None = None  # a save_pretrained folder: its weights, or its config.json alone (fresh weights)
    config: dict[str, Any] = field(default_factory=dict)  # without path: model_type and the config's fields
    vocab_size: int | None = None  # None: the config's own; the byte-level data needs 256 or more


@dataclass
class LitGPTModelConf(TextModelConf):
    """LitGPT's GPT (LitGPTCausalLM): a litgpt config name or a local litgpt checkpoint folder."""

    kind: str = "litgpt"

    name: str | None = None  # a litgpt config name (litgpt.config.name_to_config), e.g. pythia-14m
    path: str | None = None  # or a litgpt checkpoint folder (model_config.yaml, lit_model.pth)
    config: dict[str, Any] = field(default_factory=dict)  # fields of that config to change (n_layer, block_size)
    vocab_size: int | None = 256  # vocab_size and padded_vocab_size; None: the config's own


@dataclass
class PeftConf:
    """Parameter-efficient fine-tuning of ``model=hf*`` (the ``peft`` library's LoRA): ``peft=lora``."""

    method: str = "none"  # none: every weight trains; lora: low-rank adapters train, the base stays frozen
    r: int = 8  # the adapters' rank
    alpha: float = 16.0  # the adapters' output is scaled by alpha / r
    dropout: float = 0.0  # dropout on each adapter's input (0 under tp > 1)
    # module names (or a regex) the adapters go on; null: every linear layer but the output head (peft's
    # "all-linear": the attention and MLP projections)
    target_modules: Any = None
    base_dtype: str | None = None  # the frozen base's dtype (bfloat16: half its bytes); null: as loaded


@dataclass
class VGGModelConf:
    kind: str = "vgg"  # the model's family (recipes/model_kinds.py)
    name: str = "vgg11"  # vgg11 (8 convs) or vgg16 (13 convs); pipeline layers are the convs plus the head
    width: int = 64  # channels of the first convs (the paper's 64); tp must divide it
    num_classes: int = 10
    image_size: int = 32  # a multiple of 32 (five max-pools)
    batch_norm: bool = True
    optimizer: str = "sgd"  # sgd (with momentum) or adamw
    lr: float = 0.05  # the learning rate at lr_reference_batch samples per step
    # linear scaling (Goyal et al., 2017): lr x data.global_batch_size / lr_reference_batch; None: lr as given
    lr_reference_batch: int | None = 128
    momentum: float = 0.9
    weight_decay: float = 5e-4
    warmup_steps: int = 0  # linear warmup to the (scaled) lr: what keeps large scaled rates stable early on
    lr_schedule: str = "cosine"  # after warmup: cosine decay to 0 at trainer.max_steps, or constant


@dataclass
class TextDataConf:
    kind: str = "text"  # "text": bytes of a UTF-8 file; "tokens": a pre-tokenized file of uint16 ids
    path: str | None = None  # None: a corpus built from text that ships with Python
    global_batch_size: int = 32  # samples per optimizer step, whatever the layout
    val_fraction: float = 0.05
    num_workers: int = 0
    # set by the recipe, not by hand: the token cache the parent built (a model folder's tokenizer, data=hf_text/sft)
    cache: str | None = None
    val_cache: str | None = None  # the cache of data.val_path, when given


@dataclass
class TokenizedDataConf(TextDataConf):
    """``data=hf_text`` (documents, EOS between them, cut into model.seq_len blocks) and ``data=sft`` (instruction
    samples: a ``messages`` column through the chat template, or prompt / completion columns; loss on the answers),
    from local json, jsonl, parquet, csv or text files, tokenized once by the parent into a token cache."""

    kind: str = "sft"  # hf_text or sft
    format: str | None = None  # null: from the files' suffixes
    tokenizer: str | None = None  # a tokenizer folder; null: the model folder's own
    # a Jinja chat template file (e.g. chat_template.jinja): renders `messages` instead of the tokenizer's own
    # (a base model's folder often has none); null: the tokenizer's
    chat_template: str | None = None
    packing: bool = False  # sft: several samples per row (no attention across them); false: padded
    val_path: str | None = None  # validation files; null: the last data.val_fraction of the samples
    text_column: str = "text"
    messages_column: str = "messages"
    prompt_column: str = "prompt"
    completion_column: str = "completion"
    sample_by: str = "paragraph"  # text files: line, paragraph or document
    num_proc: int = 1  # processes tokenizing in parallel
    cache_dir: str | None = None  # null: data/token_cache under the working directory


@dataclass
class ImageDataConf:
    kind: str = "generated"  # "generated": a learnable 10-class set built here; "cifar10": a local copy
    path: str | None = None  # cifar10: the cifar-10-batches-py folder (Python version) or its parent
    global_batch_size: int = 64  # samples per optimizer step, whatever the layout
    num_train: int = 10_000  # generated only: images in the train and validation sets
    num_val: int = 1_000
    augment: bool = True  # random crop (4-pixel padding) and horizontal flip on training images
    num_workers: int = 0


@dataclass
class TrainerConf:
    devices: int = 1  # processes per node
    num_nodes: int = 1  # more than 1 needs processes started on every node: hydra/launcher=slurm or torchrun
    accelerator: str = "auto"  # a GPU per process where CUDA is there, else CPU; or cpu, gpu (cuda), mps
    max_steps: int = 200
    log_every_n_steps: int = 10
    val_check_interval: int = 100
    limit_val_batches: int = 8
    gradient_clip_val: float | None = 1.0
    accumulate_grad_batches: int = 1
    enable_progress_bar: bool = True
    logger: str = "csv"  # csv, tensorboard or none
    sync_batchnorm: bool = False  # BatchNorm statistics over the whole dp batch instead of each rank's share


@dataclass
class CheckpointConf:
    dir: str | None = None  # None: no periodic checkpoints; else one folder per save (sharded under our strategies)
    every_n_steps: int = 0
    keep_last: int = 3  # step checkpoints kept besides last.ckpt (-1: all); saves are atomic
    async_save: bool = False  # training goes on once the state is staged on the host; written in a thread


@dataclass
class ObservabilityConf:
    """What TrainingMonitor measures besides throughput, memory and model states (logged every log_every_n_steps)."""

    measure_step: int = 2  # the optimizer step counted for FLOPs and communication bytes (late: no one-off work)
    timeline: bool = False  # under pp > 1: the next step's pipeline schedule as run_dir/timeline.json and .png


@dataclass
class RecipeConf:
    """What every recipe's root has; each recipe adds its model and data schemas."""

    strategy: Any = MISSING  # the schema of the strategy picked (recipes/strategy_conf.py): its keys only
    precision: PrecisionConf = MISSING
    trainer: TrainerConf = MISSING
    checkpoint: CheckpointConf = MISSING
    observability: ObservabilityConf = field(default_factory=ObservabilityConf)
    seed: int = 0
    ckpt_path: str | None = None  # a checkpoint to resume from, or "last": the newest in checkpoint.dir
    # the recipe's own launcher starts the workers again after a failure, this many times at most, from the newest
    # checkpoint in checkpoint.dir (under torchrun or SLURM: their --max-restarts or requeue instead)
    max_restarts: int = 0


@dataclass
class GPTRecipeConf(RecipeConf):
    """The GPT recipe's root; conf/train_gpt.yaml picks each group's option."""

    model: TextModelConf = MISSING  # GPTModelConf (model=gpt_*), HFModelConf (model=hf*), LitGPTModelConf
    data: TextDataConf = MISSING
    peft: PeftConf = MISSING  # peft=none (default) or peft=lora
    optimizer: OptimizerConf = field(default_factory=OptimizerConf)  # optimizer=adamw (default), sgd or muon
    sample_tokens: int = 200  # generated at the end of training; 0 for none


@dataclass
class FinetuneRecipeConf(GPTRecipeConf):
    """The fine-tuning recipe's root (conf/finetune.yaml): the GPT recipe's groups, prompts answered before and
    after training."""

    assets: str = "data/finetune"  # where the default tiny model and instruction set are made on first use
    sample_prompts: list[str] = field(default_factory=list)  # answered greedily before and after training
    sample_tokens: int = 24  # new tokens per answer
    temperature: float = 0.0  # 0: greedy; above: sampled


@dataclass
class VGGRecipeConf(RecipeConf):
    """The VGG recipe's root; conf/train_vgg.yaml picks each group's option."""

    model: VGGModelConf = MISSING
    data: ImageDataConf = MISSING


# (group, name) -> schema; a group with two recipes' options has one schema per kind
SCHEMAS = {
    ("precision", "schema"): PrecisionConf,
    ("model", "gpt_schema"): GPTModelConf,
    ("model", "hf_schema"): HFModelConf,
    ("model", "litgpt_schema"): LitGPTModelConf,
    ("model", "vgg_schema"): VGGModelConf,
    ("data", "text_schema"): TextDataConf,
    ("data", "tokenized_schema"): TokenizedDataConf,
    ("data", "images_schema"): ImageDataConf,
    ("trainer", "schema"): TrainerConf,
    ("checkpoint", "schema"): CheckpointConf,
    ("peft", "schema"): PeftConf,
    ("optimizer", "schema"): OptimizerConf,
}


def register_configs() -> None:
    """Store each group's schemas (the YAML files extend one) and the recipes' roots."""
    cs = ConfigStore.instance()
    for (group, name), schema in SCHEMAS.items():
        cs.store(group=group, name=name, node=schema)
    for name, schema in STRATEGY_SCHEMAS.items():
        cs.store(group="strategy", name=f"{name}_schema", node=schema)
    cs.store(name="gpt_recipe_schema", node=GPTRecipeConf)
    cs.store(name="vgg_recipe_schema", node=VGGRecipeConf)
    cs.store(name="finetune_recipe_schema", node=FinetuneRecipeConf)
    from lightning_parallel.strategies.presets import store_strategy_presets

    store_strategy_presets(cs)  # strategy=<preset> for each row of the presets table
