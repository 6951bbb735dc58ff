"""Sharded saves that do not stop training: a host copy is staged, torch's ``async_save`` writes it in a thread.
Pure torch.

The save is :func:`~.files.save_sharded`'s, split in two: the caller's thread stages every tensor this rank holds
into host memory (pinned when it lives on a GPU; the host buffers are reused from one save to the next) and
returns; a writer thread runs DCP's save of the staged copy into the temporary folder, every rank checksums its
share of the files, and rank 0 writes the manifest and renames the folder into place only once every rank's
write finished: a crash during the write leaves the previous checkpoint (and ``last``) as it was, and the
partial folder (``.<name>.partial-<token>``, hidden) is never taken for a checkpoint.

One save is in flight at a time: the next save, a load and teardown first wait for it (:meth:`finish`). The
writer's collectives run on a gloo group of their own: they happen while training issues its collectives on
the main thread (and torch's ``async_save`` needs a CPU backend even where training runs NCCL).
A save at the step of the save in flight (Lightning's ``last.ckpt`` right after ``step=N.ckpt``) writes no
tensors again: rank 0 links the first folder's files into it once the first is complete.
"""

from __future__ import annotations

import threading
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.staging import AsyncStager

try:  # torch 2.11 and 2.13 have both; an older torch cannot stage this way: async_save=True is refused up front
    from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

    STAGING_MISSING: str | None = None
except ImportError as err:  # pragma: no cover (the pinned torch has them)
    DefaultStager = StagingOptions = None  # type: ignore[assignment,misc]
    STAGING_MISSING = (
        f"torch {torch.__version__} has no torch.distributed.checkpoint.staging.StagingOptions/DefaultStager "
        f"({err}); torch 2.11 and 2.13 have them"
    )

from lightning_parallel.parallel.checkpoint import files, storage
from lightning_parallel.parallel.checkpoint.chunks import ChunkedTensor

Failure = tuple[int, "int | None", str]  # (rank, errno, text), as sharded saves report them


class HostStager(AsyncStager):
    """DCP's :class:`DefaultStager` (pinned host buffers on a GPU, kept from one save to the next), taught the
    ZeRO-1/2 :class:`ChunkedTensor` (whose chunks it stages as plain tensors and wraps again). Synchronous:
    training goes on only once the copy is whole, since the optimizer then changes the tensors in place."""

    _synchronize_after_execute = False

    def __init__(self) -> None:
        if STAGING_MISSING:
            raise RuntimeError(f"async_save=True: {STAGING_MISSING}. Use async_save=False (saves then block).")
        on_gpu = torch.cuda.is_available()
        options = StagingOptions(
            use_pinned_memory=on_gpu, use_shared_memory=False, use_async_staging=False, use_non_blocking_copy=on_gpu
        )
        self._stager = DefaultStager(options)

    def stage(self, state_dict: dict[str, Any], **kwargs: Any) -> dict[str, Any]:
        chunked = {k: v for k, v in state_dict.items() if isinstance(v, ChunkedTensor)}
        plain = {k: v for k, v in state_dict.items() if k not in chunked}
        plain["__chunks__"] = {k: [data for _, data in v._chunks] for k, v in chunked.items()}
        staged = self._stager.stage(plain)
        for k, v in chunked.items():
            datas = staged["__chunks__"][k]
            staged[k] = ChunkedTensor(v.shape, [(o, d) for (o, _), d in zip(v._chunks, datas)], v.dtype)
        del staged["__chunks__"]
        return staged

    def synchronize_staging(self) -> None:
        pass

    def close(self) -> None:
        self._stager.close()


def failures_of(err: BaseException, rank: int) -> list[Failure]:
    """(rank, errno, text) of what went wrong: DCP hands every rank every rank's original exception."""
    if isinstance(err, CheckpointException):
        return [(r, getattr(e, "errno", None), f"{type(e).__name__}: {e}") for r, (e, _) in err.failures.items()]
    return [(rank, getattr(err, "errno", None), f"{type(err).__name__}: {err}")]


@dataclass
class _Save:
    path: storage.Location
    token: str
    step: int
    keys: frozenset[str]
    aliases: list[tuple[storage.Location, str]] = field(default_factory=list)  # (path, token): this step again
    lock: threading.Lock = field(default_factory=threading.Lock)  # aliases: asked for here, made by the writer
    sealed: bool = False  # the writer is past the aliases
    manifest: dict[str, list[int]] | None = None  # once published


class AsyncCheckpointer:
    """One rank's side of asynchronous sharded saves (every rank of the world holds one and calls it alike).

    Args:
        rank, world_size: this process's place in the default group.
        timeout: bounds the writer group's collectives (as the training groups' timeout does).
    """

    def __init__(self, rank: int, world_size: int, timeout: timedelta) -> None:
        self.rank, self.world_size, self.timeout = rank, world_size, timeout
        self._group: dist.ProcessGroup | None = None
        self._stager: HostStager | None = None
        self._writer: ThreadPoolExecutor | None = None
        self._current: _Save | None = None
        self._done: Future | None = None
        self._removals: list[storage.Location] = []
        self._late_failures: list[Failure] = []
        self.staged_saves = 0  # how many saves were staged (tests and benchmarks count them)

    @property
    def in_flight(self) -> bool:
        return self._done is not None

    def save(
        self, path: storage.Location, token: str, tensors: dict[str, Any], meta: dict[str, Any] | None, step: int
    ) -> None:
        """Stage ``tensors`` and start writing them (collective); rank 0 writes ``meta`` now. Call :meth:`finish`
        first: one save is in flight at a time."""
        assert self._done is None, "finish() the save in flight first"
        tmp = files.temporary_path(path, token)
        if self.rank == 0:
            storage.makedirs(tmp)
            files.write_meta(tmp, meta or {})
        self._stager = self._stager or HostStager()
        upload = dcp.async_save(
            tensors,
            storage_writer=storage.storage_writer(tmp),
            process_group=self._writer_group(),
            async_stager=self._stager,
        )
        self.staged_saves += 1
        self._current = _Save(path, token, step, frozenset(tensors))
        self._writer = self._writer or ThreadPoolExecutor(max_workers=1, thread_name_prefix="lp-checkpoint")
        self._done = self._writer.submit(self._complete, self._current, upload)

    def alias(self, path: storage.Location, token: str, meta: dict[str, Any] | None, step: int, keys: set[str]) -> bool:
        """A save of the same state as the one in flight (same step, same tensors) at another ``path``: rank 0
        writes ``meta`` now and links the tensors' files once the first folder is complete. False (nothing done)
        when the save in flight is not of that state."""
        save = self._current
        if self._done is None or save is None or save.step != step or save.keys != frozenset(keys):
            return False
        if self.rank == 0:
            tmp = files.temporary_path(path, token)
            storage.makedirs(tmp)
            files.write_meta(tmp, meta or {})
            with save.lock:
                sealed = save.sealed
                save.aliases.append((path, token))
            if sealed:  # the writer thread is past its aliases: made here (the same decision on every rank)
                self._late_failures += self._make_alias(save, path, token)
        return True

    def remove_later(self, path: storage.Location) -> None:
        """Rank 0: remove ``path`` once the save in flight is complete (its predecessor stays until then)."""
        self._removals.append(path)

    def finish(self) -> list[Failure]:
        """Wait for the save in flight (if any); what went wrong with it on this rank (empty: it is in place).
        Not collective: callers gather the failures when every rank must raise alike."""
        done, self._done, self._current = self._done, None, None
        failures = (done.result() if done is not None else []) + self._late_failures
        self._late_failures = []
        if self.rank == 0 and not failures:
            for path in self._removals:
                storage.remove(path)
            self._removals = []
        return failures

    @property
    def path(self) -> storage.Location | None:
        """Where the save in flight goes (None: none in flight)."""
        return self._current.path if self._current is not None else None

    def close(self) -> list[Failure]:
        """Finish the save in flight and free the writer thread and the host buffers (a later save makes new ones)."""
        failures = self.finish()
        if self._writer is not None:
            self._writer.shutdown(wait=True)
        if self._stager is not None:
            self._stager.close()
        self._writer = self._stager = None
        return failures

    # ----- the writer thread -----

    def _writer_group(self) -> dist.ProcessGroup | None:
        """A gloo group of the whole world for the writer's collectives (built at the first save: collective); also
        at world 1, where DCP would otherwise take the default group, which has no CPU backend under NCCL."""
        if self._group is None and dist.is_initialized():
            self._group = dist.new_group(backend="gloo", timeout=self.timeout)
        return self._group

    def _complete(self, save: _Save, upload: Future) -> list[Failure]:
        tmp = files.temporary_path(save.path, save.token)
        failures: list[Failure] = []
        shares: dict[str, list[int]] = {}
        try:
            upload.result()  # DCP's last step gathers every rank's write: done here means done everywhere
            shares = files.digests(tmp, files.data_files(tmp)[self.rank :: self.world_size])
        except (Exception, CheckpointException) as err:  # the others must hear of it: they wait in the gather below
            failures = failures_of(err, self.rank)
        everyone: list[Any] = [(failures, shares)]
        if self._group is not None:
            everyone = [None] * self.world_size
            dist.all_gather_object(everyone, (failures, shares), group=self._group)
        failures = [f for fs, _ in everyone for f in fs]
        if self.rank != 0:
            return failures
        try:
            if not failures:
                manifest = {k: v for _, share in everyone for k, v in share.items()}
                files.write_manifest(tmp, manifest)
                files.publish(save.path, save.token)
                save.manifest = manifest
        except Exception as err:  # noqa: BLE001
            failures = failures_of(err, 0)
        storage.remove(tmp)  # nothing left of it once published; all of it after a failure
        with save.lock:  # aliases asked for from now on are made by alias() itself
            save.sealed, aliases = True, list(save.aliases)
        return failures + [f for path, token in aliases for f in self._make_alias(save, path, token)]

    def _make_alias(self, save: _Save, path: storage.Location, token: str) -> list[Failure]:
        """Rank 0: the alias folder from the complete save's files, or its temporary folder removed."""
        try:
            if save.manifest is None:
                storage.remove(files.temporary_path(path, token))
                return []
            _link_copy(save.path, path, token, save.manifest)
        except Exception as err:  # noqa: BLE001
            return failures_of(err, 0)
        return []


def _link_copy(source: storage.Location, path: storage.Location, token: str, manifest: dict[str, list[int]]) -> None:
    """Publish at ``path`` the complete folder ``source``'s tensor files (hard links, copies where links fail)
    beside the ``meta.pt`` already in ``path``'s temporary folder."""
    tmp = files.temporary_path(path, token)
    for name in manifest:
        if name == files.META_FILE:
            continue
        storage.link_or_copy(storage.join(source, name), storage.join(tmp, name))
    own = {**manifest, **files.digests(tmp, [files.META_FILE])}
    files.write_manifest(tmp, own)
    files.publish(path, token)
