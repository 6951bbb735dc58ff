"""What the Trainer and Fabric cases share: the tiny GPTs, strategy specs, the dp-sharded data, a quiet Trainer and
the gathered parameters that parity tests compare with one process's."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.strategies import StrategyRegistry
from torch.utils.data import DataLoader, DistributedSampler

import lightning_parallel  # noqa: F401  (registers the strategy names)
from lightning_parallel import Hybrid3DStrategy, MeshStrategy
from lightning_parallel.models import GPTConfig

# tp up to 8 divides it; 2 blocks + embedding + head = 4 pipeline layers (pp up to 4, or 2 x 2 stages)
TINY = GPTConfig(vocab_size=64, seq_len=16, n_layer=2, n_head=8, d_model=32)
# 8 pipeline layers: enough for pp=8, or pp=4 with 2 stages per rank (the world-8 matrix)
DEEP = GPTConfig(vocab_size=64, seq_len=16, n_layer=6, n_head=8, d_model=32)


def build_strategy(spec: str, fabric: bool = False, **extra: object):
    """'zero2' stays a registered name (unless ``extra`` settings come with it); 'hybrid3d:tp=2,zero_stage=1,
    sequence_parallel=1' builds the class from ParallelConfig settings, and 'zero3:activation_checkpointing=full'
    the registered name's class with more. ``fabric``: Fabric's registry and Hybrid3DFabricStrategy."""
    if ":" not in spec and not extra:
        return spec
    name, _, items = spec.partition(":")
    kwargs = {k: _value(k, v) for k, v in (item.split("=") for item in items.split(",") if item)}
    if fabric:
        from lightning.fabric.strategies import STRATEGY_REGISTRY

        from lightning_parallel import Hybrid3DFabricStrategy

        hybrid, registry = Hybrid3DFabricStrategy, STRATEGY_REGISTRY
    else:
        hybrid, registry = Hybrid3DStrategy, StrategyRegistry
    if name == "hybrid3d":
        return hybrid(**kwargs, **extra)
    entry = registry[name]
    return entry["strategy"](**entry["init_params"], **kwargs, **extra)


def _value(key: str, value: str):
    if key in ("sequence_parallel", "overlap_grad_reduce", "compile", "offload"):
        return bool(int(value))
    if value.isdigit():
        return int(value)
    try:
        return float(value)
    except ValueError:
        return value


def batch_ranks(strategy, world: int) -> int:
    """Ranks that see different samples: the mesh's batch role (under Lightning's own strategies, every rank)."""
    return strategy.config.dims(world).role_size("batch") if isinstance(strategy, MeshStrategy) else world


def _flipped(samples: list) -> Any:
    from torch.utils.data import default_collate

    return default_collate(samples[::-1])


class ShardedData(pl.LightningDataModule):
    """Shuffled batches whose union over the dp ranks is the single-process batch, at any world size.

    Lightning's own sampler does the same split; building it here (from the strategy's dp rank) lets the
    single-process reference use the identical permutation.
    """

    def __init__(self, data, micro_batch: int, flip: bool = False) -> None:
        super().__init__()
        self.data, self.micro_batch = data, micro_batch
        self.flip = flip  # each batch's samples in reverse order: the same math, another summation order

    def _loader(self, shuffle: bool) -> DataLoader:
        kwargs = getattr(self.trainer.strategy, "distributed_sampler_kwargs", None) or {
            "num_replicas": 1,
            "rank": 0,
        }
        sampler = DistributedSampler(self.data, shuffle=shuffle, seed=0, **kwargs)
        collate = _flipped if self.flip else None
        return DataLoader(self.data, batch_size=self.micro_batch, sampler=sampler, collate_fn=collate)

    def train_dataloader(self) -> DataLoader:
        return self._loader(shuffle=True)

    def val_dataloader(self) -> DataLoader:
        return self._loader(shuffle=False)

    def test_dataloader(self) -> DataLoader:
        return self._loader(shuffle=False)

    def predict_dataloader(self) -> DataLoader:
        return self._loader(shuffle=False)


def make_trainer(world: int, strategy, **settings: object) -> pl.Trainer:
    """A Trainer on ``world`` CPU processes with nothing the cases do not ask for (no logger, checkpoints,
    progress bar, summary, sanity check or validation; the cases' own samplers); ``settings`` override."""
    quiet = {
        "accelerator": "cpu",
        "logger": False,
        "enable_checkpointing": False,
        "enable_progress_bar": False,
        "enable_model_summary": False,
        "num_sanity_val_steps": 0,
        "limit_val_batches": 0,
        "use_distributed_sampler": False,
    }
    return pl.Trainer(devices=world, strategy=strategy, **{**quiet, **settings})


def save_full_params(trainer: pl.Trainer, model: torch.nn.Module, path: Path) -> None:
    """The parameters gathered in the single-process format (rank 0 writes them)."""
    state = trainer.strategy.full_state_dict() if hasattr(trainer.strategy, "full_state_dict") else model.state_dict()
    if trainer.global_rank == 0:
        torch.save({k: v.detach().cpu() for k, v in state.items()}, path)
