"""Exact resume: a run restarted from a mid-epoch checkpoint continues with the same batches and the same
random numbers as if it had never stopped.

Lightning restores the model, optimizer, schedulers and loop counters, but a plain ``DataLoader`` restarts
its epoch from the first batch, and every rank's random generators (dropout, augmentation drawn from the
global generators) start wherever the new process seeds them.
Return a :class:`ResumableDataLoader` from ``train_dataloader`` and add :class:`ExactResume` to the
Trainer's callbacks:

    def train_dataloader(self):
        return ResumableDataLoader(dataset, batch_size=8, sampler=DistributedSampler(dataset, ...))

    trainer = Trainer(callbacks=[ExactResume()], ...)
"""

from __future__ import annotations

import random
from collections.abc import Iterator
from typing import Any

import lightning.pytorch as pl
import numpy as np
import torch
import torch.distributed as dist
from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from torch.utils.data import DataLoader, Sampler, SequentialSampler

from lightning_parallel._compat import fit_combined_loader


class ResumableSampler(Sampler):
    """Wraps a sampler so one pass can start after the first ``n`` items (the batches a checkpoint had
    already trained on). ``len`` stays the whole pass: Lightning counts batches from the epoch's start."""

    def __init__(self, sampler: Sampler) -> None:
        self.sampler = sampler
        self.skip = 0  # items to leave out of the next pass only

    def __iter__(self) -> Iterator[Any]:
        skip, self.skip = self.skip, 0
        for i, item in enumerate(self.sampler):
            if i >= skip:
                yield item

    def __len__(self) -> int:
        return len(self.sampler)  # type: ignore[arg-type]

    def set_epoch(self, epoch: int) -> None:
        if hasattr(self.sampler, "set_epoch"):
            self.sampler.set_epoch(epoch)


def _rng_state() -> dict[str, Any]:
    numpy_state = np.random.get_state()
    state = {
        "python": random.getstate(),
        # as plain values: checkpoints load as weights only, and numpy arrays are not among them
        "numpy": (numpy_state[0], numpy_state[1].tolist(), *numpy_state[2:]),
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def _set_rng_state(state: dict[str, Any]) -> None:
    random.setstate(state["python"])
    name, keys, *rest = state["numpy"]
    np.random.set_state((name, np.asarray(keys, dtype=np.uint32), *rest))
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


class ResumableDataLoader(DataLoader):
    """A ``DataLoader`` Lightning can save and restore (its ``state_dict`` protocol): after a mid-epoch
    resume it continues the epoch after the batches already trained on.

    Takes ``DataLoader``'s arguments; the sampler (``sampler=``, default sequential) is wrapped in a
    :class:`ResumableSampler`. :class:`ExactResume` fills in the position when a checkpoint is saved: the
    loader alone cannot tell the batches trained on from those Lightning fetched ahead.
    """

    def __init__(self, dataset: Any, *args: Any, sampler: Sampler | None = None, **kwargs: Any) -> None:
        if sampler is None:
            sampler = SequentialSampler(dataset)
        super().__init__(dataset, *args, sampler=ResumableSampler(sampler), **kwargs)

    def state_dict(self) -> dict[str, Any]:
        return {"batches": None}  # ExactResume writes the trained position over it

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        # Lightning calls this before it first iterates the loader (and sets the sampler's epoch itself)
        if state_dict.get("batches") is None:
            rank_zero_warn(
                "The checkpoint has no training position (it was saved without the ExactResume callback): this "
                "epoch restarts from its first batch. Add lightning_parallel.ExactResume to the callbacks."
            )
            return
        sampler = self.sampler
        assert isinstance(sampler, ResumableSampler)
        sampler.skip = int(state_dict["batches"]) * (self.batch_size or 1)


class ExactResume(pl.Callback):
    """Saves every rank's random-generator states and the training position within the epoch (which a
    :class:`ResumableDataLoader` resumes from), and restores the generators when training starts."""

    def __init__(self) -> None:
        self._rng: list[dict[str, Any]] | None = None

    def state_dict(self) -> dict[str, Any]:
        return {}  # on_save_checkpoint writes the states: Lightning asks for this one before that hook runs

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._rng = state_dict.get("rng")

    def on_save_checkpoint(self, trainer: pl.Trainer, pl_module: pl.LightningModule, checkpoint: dict) -> None:
        # every rank calls this; the checkpoint keeps rank 0's callback state, so it carries all ranks'
        mine = _rng_state()
        everyone: list[Any] = [mine]
        if dist.is_available() and dist.is_initialized():
            everyone = [None] * dist.get_world_size()
            dist.all_gather_object(everyone, mine)
        checkpoint.setdefault("callbacks", {}).setdefault(self.state_key, {})["rng"] = everyone
        # the batches of this epoch the loop has taken (Lightning fetches one more ahead of training)
        loop_state = checkpoint.get("loops", {}).get("fit_loop", {}).get("state_dict", {})
        for state in loop_state.get("combined_loader", []):
            if set(state) == {"batches"}:  # a ResumableDataLoader's
                state["batches"] = trainer.fit_loop.epoch_loop.batch_progress.current.ready

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self._rng is not None:
            if len(self._rng) == trainer.world_size:
                _set_rng_state(self._rng[trainer.global_rank])
            else:
                rank_zero_warn(
                    f"The checkpoint has random states of {len(self._rng)} ranks, this run has "
                    f"{trainer.world_size}: random numbers (dropout) continue from new seeds, not the saved ones."
                )
            self._rng = None
        loop = trainer.fit_loop
        if loop.restarted_mid_epoch and not any(isinstance(dl, ResumableDataLoader) for dl in _train_loaders(trainer)):
            rank_zero_warn(
                "Resuming mid-epoch with a training loader that is not a ResumableDataLoader: the epoch restarts "
                "from its first batch. Return a lightning_parallel.ResumableDataLoader from train_dataloader."
            )


def _train_loaders(trainer: pl.Trainer) -> list[DataLoader]:
    combined = fit_combined_loader(trainer)
    return [dl for dl in (combined.flattened if combined is not None else []) if isinstance(dl, DataLoader)]
