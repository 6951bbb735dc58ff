"""The VGG recipe's ``train(cfg, run_dir)``, what recipes/train_vgg.py runs in each worker process: a
LitVGG with BatchNorm on 32x32 images (a generated 10-class set by default, or CIFAR-10 from a local
folder), trained with the strategy, precision and checkpointing the config picks; it writes ``metrics.json``
(the fields docs/recipes.md lists) with the final validation accuracy.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from omegaconf import DictConfig, OmegaConf
from torch import Tensor
from torch.utils.data import DataLoader, DistributedSampler, Sampler

from lightning_parallel.callbacks.resume import ResumableDataLoader
from lightning_parallel.recipes.common import (
    build_trainer,
    check_run_settings,
    check_strategy_model,
    mesh_dims,
    micro_batch_size,
    resume_path,
    sampler_kwargs,
    skip_worker_check,
    world_size,
)
from lightning_parallel.recipes.config import ImageDataConf
from lightning_parallel.recipes.image_data import (
    CIFAR10_MEAN,
    CIFAR10_STD,
    EpochTaggedSampler,
    ImageSet,
    generated_images,
    load_cifar10,
)
from lightning_parallel.recipes.metrics import parameter_counts, run_metrics, write_metrics
from lightning_parallel.recipes.model_kinds import kind_of, resolve_model_kind
from lightning_parallel.recipes.vgg_model import scaled_lr, vgg_config  # noqa: F401  (their home before the registry)
from lightning_parallel.strategies.checks import as_built

DATA_KINDS = ("generated", "cifar10")


def check_config(cfg: DictConfig) -> None:
    """Everything that can be refused before a worker starts: the settings of the recipe's own keys (the model
    family's, the run's, the data's), then the strategy's one check of the model it will split, built on the meta
    device (:func:`~lightning_parallel.recipes.common.check_strategy_model`)."""
    kind = resolve_model_kind(cfg, recipe="image")
    kind.check(cfg)
    module = kind.meta_module(cfg)
    strategy = check_run_settings(cfg, num_layers=kind.layers(module))  # the convs, then the head
    if (dims := mesh_dims(cfg, strategy)) and kind.check_layout is not None:
        kind.check_layout(cfg, dims)
    check_strategy_model(cfg, strategy, module)
    m, d = cfg.model, cfg.data
    if d.kind not in DATA_KINDS:
        raise ValueError(f"data.kind={d.kind!r} is unknown: use one of {DATA_KINDS} (data=images or data=cifar10).")
    if d.kind == "cifar10":
        if OmegaConf.is_missing(d, "path") or d.path is None:
            raise ValueError(
                "data=cifar10 needs data.path: the cifar-10-batches-py folder of CIFAR-10's python version."
            )
        if m.image_size != 32 or m.num_classes != 10:
            raise ValueError(
                f"CIFAR-10 has 10 classes of 32x32 images, not model.num_classes={m.num_classes} and "
                f"model.image_size={m.image_size}: set both back (model.num_classes=10 model.image_size=32)."
            )
        defaults = ImageDataConf()
        generated_only = [k for k in ("num_train", "num_val") if d[k] != getattr(defaults, k)]
        if generated_only:
            raise ValueError(
                f"data.{generated_only[0]}={d[generated_only[0]]} sizes the generated images; CIFAR-10 has its own "
                "50,000 + 10,000: drop the setting (or use data=images)."
            )
        for split in ("test", "train"):  # a wrong folder or a damaged file fails here, before any worker starts
            load_cifar10(d.path, split)
    elif d.num_train < d.global_batch_size:
        raise ValueError(
            f"data.num_train={d.num_train} is smaller than data.global_batch_size={d.global_batch_size}: "
            "not even one step would run. Raise data.num_train."
        )
    if cfg.trainer.sync_batchnorm and not m.batch_norm:
        raise ValueError("trainer.sync_batchnorm=true with model.batch_norm=false: there is no BatchNorm to sync.")


class ImageData(pl.LightningDataModule):
    """Train and validation images; each dp rank reads its share of every global batch. Augmentation
    depends on (seed, epoch, sample) only, so every layout sees the same augmented batches."""

    def __init__(self, cfg: DictConfig, micro_batch: int) -> None:
        super().__init__()
        self.cfg, self.micro_batch = cfg, micro_batch

    def setup(self, stage: str) -> None:
        d, m, seed = self.cfg.data, self.cfg.model, self.cfg.seed
        if d.kind == "cifar10":
            train, val = load_cifar10(d.path, "train"), load_cifar10(d.path, "test")
            mean, std = CIFAR10_MEAN, CIFAR10_STD
        else:
            train = generated_images(d.num_train, seed=seed, num_classes=m.num_classes, image_size=m.image_size)
            val = generated_images(d.num_val, seed=seed + 1, num_classes=m.num_classes, image_size=m.image_size)
            mean, std = _channel_stats(train[0])
        self.train_set = ImageSet(*train, mean=mean, std=std, augment=d.augment, seed=seed)
        self.val_set = ImageSet(*val, mean=mean, std=std, augment=False, seed=seed)

    def train_dataloader(self) -> DataLoader:
        sampler = EpochTaggedSampler(
            self.train_set, shuffle=True, seed=self.cfg.seed, drop_last=True, **sampler_kwargs(self.trainer)
        )
        return self._loader(self.train_set, sampler, ResumableDataLoader)  # a mid-epoch resume continues the epoch

    def val_dataloader(self) -> DataLoader:
        sampler = DistributedSampler(self.val_set, shuffle=False, drop_last=True, **sampler_kwargs(self.trainer))
        return self._loader(self.val_set, sampler)

    def _loader(self, dataset: ImageSet, sampler: Sampler, loader: type[DataLoader] = DataLoader) -> DataLoader:
        return loader(
            dataset, batch_size=self.micro_batch, sampler=sampler, num_workers=self.cfg.data.num_workers, drop_last=True
        )


def _channel_stats(images: Tensor) -> tuple[tuple[float, ...], tuple[float, ...]]:
    """Per-channel mean and std of uint8 images (N, C, H, W), in 0..1 units."""
    x = images.float().div_(255).transpose(0, 1).flatten(1)  # (C, N*H*W)
    return tuple(x.mean(1).tolist()), tuple(x.std(1).tolist())


def train(cfg: DictConfig, run_dir: Path) -> dict[str, Any]:
    """Train as ``cfg`` says; returns the metrics written to ``run_dir/metrics.json`` (by rank 0)."""
    pl.seed_everything(cfg.seed, verbose=False)
    micro = micro_batch_size(cfg, world_size(cfg))
    model = kind_of(cfg.model).build(cfg)
    with torch.device("meta"):  # the model is built in configure_model: count the same one, allocating nothing
        counts = parameter_counts(as_built(model))
    trainer = build_trainer(cfg, run_dir, **sync_batchnorm_args(cfg))
    skip_worker_check(trainer, model)  # check_config ran the strategy's check on this model before launch
    start = time.perf_counter()
    trainer.fit(model, datamodule=ImageData(cfg, micro), ckpt_path=resume_path(cfg))
    wall = time.perf_counter() - start
    metrics = run_metrics(trainer, cfg, wall, cfg.data.global_batch_size, "samples/s") | counts
    if "val_acc" in trainer.callback_metrics:
        metrics["final_val_accuracy"] = float(trainer.callback_metrics["val_acc"])
    write_metrics(trainer, metrics, run_dir)
    return metrics


def sync_batchnorm_args(cfg: DictConfig) -> dict[str, Any]:
    """Trainer arguments for ``trainer.sync_batchnorm``: statistics over the dp group, on CPU as on GPU."""
    if not cfg.trainer.sync_batchnorm:
        return {}
    from lightning_parallel import DataParallelSyncBatchNorm

    # Lightning's sync_batchnorm=True would use torch's SyncBatchNorm, which cannot run on CPU
    return {"plugins": [DataParallelSyncBatchNorm()]}
