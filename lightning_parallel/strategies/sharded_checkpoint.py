"""Sharded checkpoint folders for the mesh strategies: what Lightning's save and load calls become
(:mod:`.checkpointing` routes them here).

Lightning builds a checkpoint dict (``state_dict``, ``optimizer_states``, loops, schedulers, callbacks)
and hands it to the strategy. Here the model and optimizer states stay sharded as each rank holds them
and go to torch's distributed checkpoint under layout-independent names (see
:mod:`lightning_parallel.parallel.checkpoint.sharded`); the rest goes to ``meta.pt``. Loading fills the live
model and optimizer of whatever layout runs now, so any layout resumes any other.

Failures are decided by all ranks together: a rank that cannot write (a full disk) or finds a damaged file
or a different model tells the others, and every rank raises the same error at the same point, before any
state is changed; a rank raising alone would leave the others waiting in the next collective.
"""

from __future__ import annotations

import errno
import uuid
from dataclasses import dataclass, field
from typing import Any

import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.api import CheckpointException
from torch.optim import Optimizer

from lightning_parallel.parallel.checkpoint import files as checkpoint_io
from lightning_parallel.parallel.checkpoint import storage
from lightning_parallel.parallel.checkpoint.async_save import AsyncCheckpointer, failures_of
from lightning_parallel.parallel.checkpoint.selection import check_checkpoint, unsaved_keys
from lightning_parallel.parallel.checkpoint.sharded import (
    MODEL,
    install_optimizer_state,
    model_state,
    optimizer_load_targets,
    optimizer_state,
    param_names,
)
from lightning_parallel.parallel.checkpoint.storage import Location
from lightning_parallel.parallel.data.sharding import DataParallelSharding, StateView

LOADED_IN_PLACE = "lightning_parallel_loaded_in_place"  # marks a checkpoint whose states are already loaded


@dataclass
class CheckpointTarget:
    """What a sharded save writes from and a load fills, named by the door that saves (no strategy is read).

    Attributes:
        model: the split model whose states are written or filled in place.
        lightning_module: what is asked which keys it leaves out and whether it loads strictly (the
            LightningModule; under Fabric the model itself).
        optimizers: the torch optimizers over ``model``, in the order they are saved.
        global_rank, world_size: this process's rank and the world's size.
        sharding: the runtime's data-parallel sharding (PowerSGD's state travels with it); None: no optimizers.
        checkpointer: the asynchronous saver (the Trainer's ``async_save`` while fitting); None: saves block.
    """

    model: nn.Module
    lightning_module: Any
    optimizers: list[Optimizer] = field(default_factory=list)
    global_rank: int = 0
    world_size: int = 1
    sharding: DataParallelSharding | None = None
    checkpointer: AsyncCheckpointer | None = None

    @property
    def is_global_zero(self) -> bool:
        return self.global_rank == 0


def _broadcast(obj: Any) -> Any:
    """Rank 0's ``obj`` on every rank (``obj`` itself without a process group)."""
    if not dist.is_initialized():
        return obj
    box = [obj]
    dist.broadcast_object_list(box, 0)
    return box[0]


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def hyperparameters(optimizer: Optimizer) -> dict[str, Any]:
    """What meta.pt keeps of an optimizer: its param groups' settings (the states go to the shards)."""
    return {"param_groups": [{k: v for k, v in g.items() if k != "params"} for g in optimizer.param_groups]}


def save(
    target: CheckpointTarget,
    checkpoint: dict[str, Any],
    filepath: Location,
    views: list[StateView | None],
    order: list[str],
) -> None:
    """Write ``checkpoint`` as a sharded folder at ``filepath`` (collective; atomic; every rank raises
    the same error when one fails, and the temporary folder is removed)."""
    path = storage.local(_broadcast(str(filepath)))
    token = _broadcast(uuid.uuid4().hex[:12])
    model = target.model
    tensors: dict[str, Any] = {MODEL + k: v for k, v in checkpoint.pop("state_dict").items()}
    # save_checkpoint(weights_only=True) leaves the optimizers out of the dict: leave them out of the folder
    optimizers = target.optimizers if checkpoint.pop("optimizer_states", None) is not None else []
    for i, optimizer in enumerate(optimizers):
        tensors.update(optimizer_state(model, optimizer, i, order, views[i]))
    powersgd = target.sharding.powersgd if optimizers else None
    if powersgd is not None:  # Q and the dp-mean error of each matrix (collective over the dp ranks)
        tensors.update(powersgd.state_dict(_first_names(model), target.sharding.group))
    meta = None
    if target.is_global_zero:
        storage.makedirs(storage.parent(path))
        meta = {**checkpoint}
        if optimizers:
            meta["optimizer_states"] = [hyperparameters(o) for o in optimizers]
    checkpointer = target.checkpointer
    if checkpointer is not None:
        return _save_async(target, checkpointer, path, token, tensors, meta, checkpoint.get("global_step", -1))
    _barrier()
    tmp = checkpoint_io.temporary_path(path, token)
    rank, world = target.global_rank, target.world_size
    # three steps, each settled by all ranks (the gathers are the barriers): write, checksum, publish
    _, failure = _attempt(lambda: checkpoint_io.save_sharded(path, tensors, meta, token, target.is_global_zero))
    _settle(target, path, tmp, failure, rank)
    files, failure = _attempt(lambda: checkpoint_io.digests(tmp, checkpoint_io.data_files(tmp)[rank::world]))
    shares = _settle(target, path, tmp, failure, rank, files)
    failure = None
    if target.is_global_zero:
        manifest = {k: v for share in shares for k, v in share.items()}
        _, failure = _attempt(lambda: _seal(tmp, manifest, path, token))
    _settle(target, path, tmp, failure, rank)


def _save_async(
    target: CheckpointTarget,
    checkpointer: AsyncCheckpointer,
    path: Location,
    token: str,
    tensors: dict,
    meta: Any,
    step: int,
) -> None:
    """``async_save``: training goes on once this rank's pieces are staged on the host; the folder is renamed into
    place when every rank's write is done. A second save of the same step (``last.ckpt``) links the first's files."""
    if checkpointer.alias(path, token, meta, step, set(tensors)):
        return
    finish_async(checkpointer, target.world_size)  # one save in flight: the previous one, complete
    _barrier()
    checkpointer.save(path, token, tensors, meta, step)


def finish_async(checkpointer: AsyncCheckpointer | None, world_size: int, alike: bool = True) -> None:
    """Wait for ``checkpointer``'s save in flight, if any. ``alike`` (collective over the ``world_size`` ranks): every
    rank raises the same error when one failed (or the previous save was); otherwise (teardown) this rank raises
    what it saw."""
    if checkpointer is None or not checkpointer.in_flight:
        return
    path = checkpointer.path
    failures = checkpointer.finish()
    if alike:
        failures = [f for fs in _all_gather(world_size, failures) for f in fs]
    if failures:
        assert path is not None
        raise _save_error(path, failures)


def _seal(tmp: Location, manifest: dict[str, list[int]], path: Location, token: str) -> None:
    checkpoint_io.write_manifest(tmp, manifest)
    checkpoint_io.publish(path, token)


def _attempt(step: Any) -> tuple[Any, BaseException | None]:
    try:
        return step(), None
    except (Exception, CheckpointException) as err:  # DCP's exception is a BaseException
        return None, err


def _settle(
    target: CheckpointTarget, path: Location, tmp: Location, err: BaseException | None, rank: int, result: Any = None
) -> list:
    """Every rank's ``result`` once all ranks are past a step of a save; if one failed, every rank raises
    the same error after rank 0 has removed the temporary folder."""
    results = _all_gather(target.world_size, (failures_of(err, rank) if err is not None else None, result))
    failures = [item for f, _ in results if f is not None for item in f]
    if failures:
        if target.is_global_zero:
            storage.remove(tmp)
        _barrier()
        raise _save_error(path, failures) from err
    return [r for _, r in results]


def _save_error(path: Location, failures: list[tuple[int, int | None, str]]) -> OSError | RuntimeError:
    previous = _previous_checkpoint(path)
    intact = f"the previous checkpoint {previous} is intact" if previous else f"no checkpoint was in {path.parent}"
    full = [r for r, code, _ in failures if code == errno.ENOSPC]
    if full:
        return OSError(
            errno.ENOSPC,
            f"no space left on device while saving checkpoint {path} (rank {full[0]}): free space or change "
            f"checkpoint.dir; {intact}",
        )
    rank, _, text = failures[0]
    return RuntimeError(f"saving checkpoint {path} failed on rank {rank} ({text}); {intact}")


def _previous_checkpoint(path: Location) -> Location | None:
    """The checkpoint a failed save leaves: the one at ``path``, else the newest saved beside it."""
    if checkpoint_io.is_sharded_checkpoint(path) or storage.isfile(path):
        return path
    if storage.has_scheme(path):
        return None  # not looked for beside it
    around = [p for p in path.parent.glob("*") if not p.name.startswith(".") and checkpoint_io.is_sharded_checkpoint(p)]
    return max(around, key=lambda p: p.stat().st_mtime, default=None)


def _first_names(model: nn.Module) -> dict[int, str]:
    return {pid: names[0] for pid, names in param_names(model).items()}


def _all_gather(world_size: int, obj: Any) -> list[Any]:
    if world_size == 1 or not dist.is_initialized():
        return [obj]
    out: list[Any] = [None] * world_size
    dist.all_gather_object(out, obj)
    return out


def load(target: CheckpointTarget, path: Location, views: list[StateView | None]) -> dict[str, Any]:
    """Fill the live model (and optimizers, when fitting) from a sharded folder; returns the rest of the
    checkpoint for Lightning's loops, schedulers and callbacks."""
    path = storage.local(_broadcast(str(path)))
    model: nn.Module = target.model
    skip = {MODEL + k for k in unsaved_keys(target.lightning_module)}  # the module's choice (a frozen base)
    targets: dict[str, Any] = {k: v for k, v in model_state(model).items() if k not in skip}
    meta, saved = _inspect(target, path, targets)
    check_checkpoint(target.lightning_module, meta)  # every rank alike: the same files, the same module
    installs = []
    # a weights-only folder has no optimizers: Lightning itself says so if fit() needs them
    optimizers = target.optimizers if "optimizer_states" in meta else []
    saved_optimizers = meta.get("optimizer_states", [])
    if optimizers and len(saved_optimizers) != len(optimizers):  # validate/test/predict have none
        raise ValueError(
            f"{path} holds {len(saved_optimizers)} optimizers but configure_optimizers returned "
            f"{len(optimizers)}: resume with the same optimizer setup."
        )
    for i, optimizer in enumerate(optimizers):
        _check_param_groups(path, i, saved_optimizers[i]["param_groups"], optimizer)
        opt_targets, states = optimizer_load_targets(model, optimizer, i, saved, views[i])
        targets.update(opt_targets)
        installs.append((optimizer, states, saved_optimizers[i]["param_groups"]))
    powersgd = target.sharding.powersgd if optimizers else None
    extra = powersgd.load_targets(_first_names(model), saved) if powersgd is not None else {}
    checkpoint_io.load_sharded(path, {**targets, **extra})
    if powersgd is not None:
        powersgd.load_state(_first_names(model), extra)
    for view in views:
        if view is not None:
            view.reload()  # offload: the host copy of this rank's slice is what the optimizer steps
    for optimizer, states, groups in installs:
        install_optimizer_state(optimizer, states)
        for group, saved_group in zip(optimizer.param_groups, groups):
            group.update(saved_group)
    return {**meta, "state_dict": {}, LOADED_IN_PLACE: True}


def _inspect(
    target: CheckpointTarget, path: Location, targets: dict[str, Any]
) -> tuple[dict[str, Any], dict[str, Any]]:
    """meta.pt and the saved tensors, once every rank agrees that the files are whole (each rank checks a
    share of them against the manifest) and hold this model (names and shapes over all ranks' pieces)."""
    failure, meta, saved = None, {}, {}
    try:
        meta = checkpoint_io.read_meta(path)
        saved = checkpoint_io.saved_tensors(path)
        problems = checkpoint_io.check_files(path, target.global_rank, target.world_size)
        if problems:
            failure = ("CorruptCheckpointError", checkpoint_io.damaged_message(path, problems), target.global_rank)
    except Exception as err:  # noqa: BLE001  (the others must hear of any failure, or they wait for this rank)
        failure = (type(err).__name__, str(err), target.global_rank)
    shapes = {k: tuple(v.shape) for k, v in targets.items()}  # global shapes, also of DTensor shards
    results = _all_gather(target.world_size, (failure, shapes))
    failures = [f for f, _ in results if f is not None]
    if failures:
        kind, message, rank = failures[0]
        if kind == "UnsafeCheckpointError":
            raise checkpoint_io.UnsafeCheckpointError(message)
        if kind != "CorruptCheckpointError":
            message = checkpoint_io.damaged_message(path, [f"rank {rank} could not read it ({kind}: {message})"])
        raise checkpoint_io.CorruptCheckpointError(message)
    expected = {k[len(MODEL) :]: v for _, s in results for k, v in s.items()}  # pp: each stage has its own
    found = {k[len(MODEL) :]: tuple(md.size) for k, md in saved.items() if k.startswith(MODEL)}
    strict = getattr(target.lightning_module, "strict_loading", True)
    mismatch = checkpoint_io.model_mismatch(path, expected, found, strict)
    if mismatch:
        raise ValueError(mismatch)
    return meta, saved


def _check_param_groups(path: Location, index: int, saved: list[dict[str, Any]], optimizer: Optimizer) -> None:
    if len(saved) != len(optimizer.param_groups):
        raise ValueError(
            f"{path}: optimizer {index} had {len(saved)} param groups, configure_optimizers now returns "
            f"{len(optimizer.param_groups)}: resume with the same optimizer setup."
        )
