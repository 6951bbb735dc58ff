"""Pieces of a tensor as torch's distributed checkpoint (DCP) reads and writes them. Pure torch.

DCP reshards any saved layout into any other, but only for tensors it can describe as rectangular chunks
of a global tensor: DTensors and plain tensors. ZeRO-1/2's flat buffers hold, per rank, a contiguous
range of each parameter's flattened (local) data: no rectangle. Here such a range is cut into the few
rectangles it consists of (:func:`flat_range_boxes`), and :class:`ChunkedTensor` presents them to DCP as
the chunks of the parameter's global tensor. Hand-written because torch has no such piece.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from torch import Tensor
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex, TensorProperties
from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem, WriteItemType

from lightning_parallel._compat import disabled_torch_function_impl

Box = tuple[tuple[int, ...], tuple[int, ...], int]  # (offsets, sizes, start in the flattened tensor)


def flat_range_boxes(shape: Sequence[int], start: int, end: int) -> list[Box]:
    """The rectangles that elements ``start:end`` of a row-major tensor of ``shape`` make up, in order.

    Each box is contiguous in the flattened tensor: its data is ``flat[box_start : box_start + prod(sizes)]``.
    At most ``2 * len(shape) - 1`` boxes.
    """
    shape = tuple(shape)
    if start >= end:
        return []
    if len(shape) == 0:
        return [((), (), 0)]
    if len(shape) == 1:
        return [((start,), (end - start,), start)]
    inner = math.prod(shape[1:])
    first, first_rest = divmod(start, inner)
    last, last_rest = divmod(end, inner)

    def within_row(row: int, lo: int, hi: int) -> list[Box]:
        return [((row, *off), (1, *size), row * inner + s) for off, size, s in flat_range_boxes(shape[1:], lo, hi)]

    if first == last:
        return within_row(first, first_rest, last_rest)
    boxes: list[Box] = []
    if first_rest:
        boxes += within_row(first, first_rest, inner)
        first += 1
    if last > first:
        boxes.append(((first, *[0] * (len(shape) - 1)), (last - first, *shape[1:]), first * inner))
    if last_rest:
        boxes += within_row(last, 0, last_rest)
    return boxes


class ChunkedTensor(Tensor):
    """A global tensor of which this rank holds some rectangular chunks (views into its own storage).

    It implements DCP's checkpointable protocol (the one DTensor implements): saving writes the chunks,
    loading reads whatever saved pieces overlap them, in place. It supports no other tensor operation.

    Args:
        shape: the global tensor's shape.
        chunks: ``(offsets, data)`` pairs; ``data`` has the chunk's sizes and is read or written in place.
        dtype: the global tensor's dtype (every chunk has it).
    """

    _chunks: list[tuple[tuple[int, ...], Tensor]]

    @staticmethod
    def __new__(cls, shape: Sequence[int], chunks: list[tuple[tuple[int, ...], Tensor]], dtype: torch.dtype):
        self = Tensor._make_wrapper_subclass(cls, tuple(shape), dtype=dtype, device="cpu", requires_grad=False)
        self._chunks = chunks
        return self

    __torch_function__ = disabled_torch_function_impl

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN206
        raise NotImplementedError(f"ChunkedTensor only carries checkpoint chunks; {func} is not supported on it.")

    def __repr__(self) -> str:  # the default repr would run tensor ops
        return f"ChunkedTensor(shape={tuple(self.shape)}, dtype={self.dtype}, chunks={len(self._chunks)})"

    # ----- DCP's checkpointable protocol -----

    def __create_write_items__(self, fqn: str, obj: object) -> list[WriteItem]:
        return [
            WriteItem(
                index=MetadataIndex(fqn, torch.Size(offsets)),
                type=WriteItemType.SHARD,
                tensor_data=TensorWriteData(
                    chunk=ChunkStorageMetadata(offsets=torch.Size(offsets), sizes=data.shape),
                    properties=TensorProperties.create_from_tensor(data),
                    size=self.shape,
                ),
            )
            for offsets, data in self._chunks
        ]

    def __create_chunk_list__(self) -> list[ChunkStorageMetadata]:
        return [ChunkStorageMetadata(offsets=torch.Size(offsets), sizes=data.shape) for offsets, data in self._chunks]

    def __get_tensor_shard__(self, index: MetadataIndex) -> Tensor:
        for offsets, data in self._chunks:
            if torch.Size(offsets) == index.offset:
                return data
        raise ValueError(f"{index.fqn}: no chunk at offset {tuple(index.offset or ())} on this rank.")


def chunked_view(
    flat: Tensor, flat_start: int, local_shape: Sequence[int], local_offsets: Sequence[int], global_shape: Sequence[int]
) -> ChunkedTensor:
    """The part of one tensor that a flat buffer holds, as chunks of the global tensor.

    Args:
        flat: this rank's slice of the flat buffer, covering elements ``flat_start : flat_start + len(flat)``
            of the tensor's local part, flattened.
        flat_start: where ``flat`` begins in the flattened local part.
        local_shape: the local part's shape (the whole tensor, or a tensor-parallel shard of it).
        local_offsets: where the local part sits in the global tensor (zeros for a whole tensor).
        global_shape: the global tensor's shape.
    """
    boxes = flat_range_boxes(local_shape, flat_start, flat_start + flat.numel())
    chunks = [
        (
            tuple(o + g for o, g in zip(offsets, local_offsets)),
            flat[s - flat_start : s - flat_start + math.prod(sizes)].view(sizes),
        )
        for offsets, sizes, s in boxes
    ]
    return ChunkedTensor(global_shape, chunks, flat.dtype)
